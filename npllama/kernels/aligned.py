"""Arrays that start on a cache line (64 bytes).

NumPy's allocations start at 16 bytes (its large ones at a page plus malloc's 16-byte header)
and Numba's at 32. A 64-byte vector load or store (AVX-512) from an address that is not a
multiple of 64 touches two cache lines and costs two of the core's loads or stores. The
kernels read their hot arrays a whole vector at a time: the panel arena, a KV buffer's
records, attention's blocks of keys and values, the activations. On an Intel Xeon with
AVX-512 (two threads) a prefill's attention over 2,048 positions took 27.6-29.3 ms with its
float32 scratch on cache lines and 28.8-40.5 ms without (fresh processes): which blocks
straddled two lines depended on where the allocator put them.

* ``empty(shape, dtype)`` / ``zeros(shape, dtype)``: NumPy's, on a cache line (Python level);
* ``_empty(shape, dtype)``: np.empty's, on a cache line (njit level; `shape` a tuple).
"""
from __future__ import annotations

import numpy as np
from numba import literal_unroll, njit

__all__ = ["LINE", "empty", "zeros"]

LINE = 64  # bytes


def _take(raw: np.ndarray, shape, dtype) -> np.ndarray:
    """The part of the byte array `raw` (LINE bytes longer than needed) from its first cache
    line, as an array of `shape` and `dtype`."""
    at = -raw.ctypes.data % LINE
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return raw[at:at + n].view(dtype).reshape(shape)


def empty(shape, dtype=np.float32) -> np.ndarray:
    """np.empty(shape, dtype) starting on a cache line."""
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    return _take(np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + LINE, np.uint8), shape, dtype)


def zeros(shape, dtype=np.float32) -> np.ndarray:
    """np.zeros(shape, dtype) starting on a cache line (from calloc: untouched pages stay unmapped)."""
    dtype = np.dtype(dtype)
    shape = (shape,) if np.isscalar(shape) else tuple(shape)
    return _take(np.zeros(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + LINE, np.uint8), shape, dtype)


@njit(cache=True)
def _empty(shape, dtype):
    """An uninitialized array of `shape` (a tuple) and `dtype` starting on a cache line."""
    n = 1
    for s in literal_unroll(shape):
        n *= s
    buf = np.empty(n + LINE, dtype)  # LINE elements more: at least LINE bytes
    at = (-buf.ctypes.data % LINE) // buf.itemsize
    return buf[at:at + n].reshape(shape)
