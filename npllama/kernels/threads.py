"""Thread-count control shared by every entry point: the default is the number of physical
cores, and a per-call override is restored afterwards (Numba's setting is process-global)."""
from __future__ import annotations

import contextlib
import os

import numba
from threadpoolctl import ThreadpoolController


def physical_cores() -> int:
    """Physical cores visible to this process (logical CPUs / threads per core, at least 1)."""
    logical = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list") as f:
            text = f.read().strip()
        per_core = sum(int(b) - int(a) + 1 if "-" in part else 1
                       for part in text.split(",") for a, _, b in [part.partition("-")])
    except (OSError, ValueError):
        per_core = 1
    return max(1, min(logical // max(per_core, 1), numba.config.NUMBA_NUM_THREADS))


def check_threads(n: int | None) -> int | None:
    """Validate a thread count (None means the default)."""
    if n is None:
        return None
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= numba.config.NUMBA_NUM_THREADS:
        raise ValueError(f"threads must be an integer from 1 to {numba.config.NUMBA_NUM_THREADS}, got {n!r}")
    return n


def threads_from_environment(threads: int | None = None) -> int:
    """The thread count for a worker in a data pipeline: `threads` if given, else
    $NPLLAMA_NUM_THREADS, else $OMP_NUM_THREADS (Ray sets it from a task's num_cpus, the Dask
    nanny to 1), else the physical cores of this process's CPU affinity. A variable's count is
    capped at the threads Numba has; a variable that is not a positive integer is an error."""
    if threads is not None:
        return check_threads(threads)
    for name in ("NPLLAMA_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        first = value.split(",")[0].strip()  # OpenMP allows a list, one count per nesting level
        if not first.isdigit() or int(first) < 1:
            raise ValueError(f"${name} must be a positive integer (a thread count), got {value!r}; "
                             f"fix or unset it, or pass threads=")
        return min(int(first), numba.config.NUMBA_NUM_THREADS)
    return physical_cores()


@contextlib.contextmanager
def using_threads(n: int):
    """Run the body with `n` Numba threads, restoring the previous count afterwards."""
    prev = numba.get_num_threads()
    if n == prev:  # the common case: nothing to set or restore
        yield
        return
    numba.set_num_threads(n)
    try:
        yield
    finally:
        numba.set_num_threads(prev)


_blas = None


@contextlib.contextmanager
def single_threaded_blas():
    """Limit BLAS to one thread in the body. OpenBLAS's worker threads keep spinning after each
    call and stall the Numba kernels that follow by milliseconds; measured on 2 cores, prefill
    with single-threaded BLAS is about 10x faster than with OpenBLAS's default threads."""
    global _blas
    if _blas is None:
        _blas = ThreadpoolController()
    with _blas.limit(limits=1, user_api="blas"):
        yield
