"""Arrays on cache lines (npllama.kernels.aligned), and the arrays the engine reads a vector at a time."""
import numpy as np
import pytest
from numba import njit

from npllama.kernels import aligned
from npllama.kernels.aligned import _empty


@pytest.mark.parametrize("shape", [0, 1, 7, (3, 5), (2, 3, 4), (1, 576), (16, 16)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint8, np.int32, np.int64])
def test_empty_and_zeros_start_on_a_cache_line(shape, dtype):
    for make in (aligned.empty, aligned.zeros):
        a = make(shape, dtype)
        assert a.shape == ((shape,) if np.isscalar(shape) else shape) and a.dtype == dtype
        assert a.flags.c_contiguous and a.flags.writeable
        assert a.size == 0 or a.ctypes.data % aligned.LINE == 0  # an empty array has nothing to load
    assert not aligned.zeros(shape, dtype).any()


def test_arrays_made_one_after_another_do_not_overlap():
    arrays = [aligned.empty((3, 7), np.float32) for _ in range(20)]
    for i, a in enumerate(arrays):
        a[:] = i
    for i, a in enumerate(arrays):
        assert (a == i).all()


@njit
def _made_in_compiled_code(n):
    a = _empty((n,), np.float32)
    b = _empty((n,), np.int64)
    c = _empty((1, n), np.uint8)
    a[:] = 1.5
    b[:] = 7
    c[:] = 3
    return a, b, c


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 576])
def test_empty_in_compiled_code(n):
    for _ in range(5):  # whatever the allocator hands out
        a, b, c = _made_in_compiled_code(n)
        assert a.shape == (n,) and b.shape == (n,) and c.shape == (1, n)
        assert a.dtype == np.float32 and b.dtype == np.int64 and c.dtype == np.uint8
        assert n == 0 or all(x.ctypes.data % aligned.LINE == 0 for x in (a, b, c))
        assert (a == 1.5).all() and (b == 7).all() and (c == 3).all()


def test_the_kv_cache_and_the_panel_arena_start_on_cache_lines(tiny_model_path):
    import npllama
    m = npllama.Model(tiny_model_path, activations="int8")
    s = m.session()
    s.feed([1, 2, 3])
    assert s.cache.buffers().ctypes.data % aligned.LINE == 0
    if m.panel_arena.size:
        assert m.panel_arena.ctypes.data % aligned.LINE == 0
