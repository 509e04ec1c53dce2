"""Work items handed out by atomic counters (npllama.kernels.workshare)."""
import numba
import numpy as np
import pytest
from numba import njit, prange

from npllama.kernels.threads import using_threads
from npllama.kernels.workshare import _fetch_add, _finish, _load_acquire, _take, _wait, phase_size


@njit(parallel=True)
def _run_phases(n_ranges, n_items, n_phases, taken, seen):
    """Every prange iteration (home range) takes items of each phase and records them; after
    a phase, each one checks that all of the phase's items are finished."""
    ctr = np.zeros(n_phases * phase_size(n_ranges), np.int64)
    for home in prange(n_ranges):
        for ph in range(n_phases):
            base = ph * phase_size(n_ranges)
            done = 0
            while True:
                i = _take(ctr, base, home, n_ranges, n_items)
                if i < 0:
                    break
                _fetch_add(taken[ph], i, 1)
                done += 1
            _finish(ctr, base, n_ranges, done)
            _wait(ctr, base, n_ranges, n_items)
            total = 0
            for i in range(n_items):
                total += _load_acquire(taken[ph], i)
            seen[ph, home] = total


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n_ranges,n_items", [(1, 1), (2, 1), (2, 7), (3, 64), (5, 3)])
def test_every_item_taken_once(threads, n_ranges, n_items):
    """Also with more ranges than threads (iterations then run one after another) and more
    ranges than items: nothing is taken twice, nothing is lost, no wait hangs."""
    n_phases = 20
    taken = np.zeros((n_phases, n_items), np.int64)
    seen = np.zeros((n_phases, n_ranges), np.int64)
    with using_threads(min(threads, numba.config.NUMBA_NUM_THREADS)):
        _run_phases(n_ranges, n_items, n_phases, taken, seen)
    assert (taken == 1).all()
    assert (seen == n_items).all()  # every waiter saw every item finished


@njit
def _take_all(ctr, home, n_ranges, n_items):
    out = []
    while True:
        i = _take(ctr, 0, home, n_ranges, n_items)
        if i < 0:
            return out
        out.append(i)


def test_home_range_first_then_steal():
    """A thread takes its own contiguous range in order, then the others' leftovers."""
    ctr = np.zeros(phase_size(3), np.int64)
    assert _take_all(ctr, 1, 3, 9) == [3, 4, 5, 6, 7, 8, 0, 1, 2]
    assert _take_all(ctr, 0, 3, 9) == []
