"""A growable, interleaved key/value cache for one sequence.

Each layer owns one preallocated buffer in which the key and the value of one position and
KV head sit next to each other, so that attention streams one contiguous region:

    buffer(layer): (capacity, n_kv_heads, 2, head_dim)   [:, :, 0, :] = K, [:, :, 1, :] = V

The layers' buffers are the slices of one array, buffers(): (n_layers, capacity, ...).

Every layer keeps its own fill count. A forward pass appends to layer 0, then layer 1, and
so on, so while a pass is under way the early layers hold more positions than the late ones;
`length` is the number of positions stored in every layer (the minimum over layers) and
`layer_length(layer)` the count of one layer. Layers may run ahead of one another by any
amount, as long as they all catch up before `length` is relied on.

Storage is float32 or float16; kernels read a float16 cache through `npllama.f16.bits`.

All layers share one capacity. When an append needs more room, capacity grows to the larger
of twice the old capacity and the next power of two that holds the request (so a cache
built with capacity 0 goes 0 -> 1 -> 2 -> 4 ...), and the filled rows are copied once into
the new array. Appends write only the new rows, in place. A capacity that does not fit in the
memory available is refused before it is allocated (`memory.check_fits`); growth asks
for just the positions needed when doubling would not fit.

The buffer a cache leaves behind when it is freed is kept for the next cache of the same shape
(`memory.Spares`, 64 MiB in all), unless a view of it is still held: first writes into fresh
memory are slow (memory.py). One it outgrows is not (it would add to a long session's peak).
A new cache's buffer, like np.empty's, holds old values beyond `length`, which nothing reads.
"""
from __future__ import annotations

import sys

import numpy as np

from ..kernels import aligned
from . import memory

_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))
_SPARES = memory.Spares(64 << 20)


class _Probe:
    """sys.getrefcount of the memory of a buffer that only its owner's attribute references
    (`_unshared`). A buffer is a view that starts on a cache line (aligned.empty), and every
    view of it references the array that owns the memory (its `base`), which is counted."""

    def __init__(self):
        self._buf = aligned.empty(0)

    def refs(self) -> int:
        return sys.getrefcount(self._buf.base)


_UNSHARED_REFS = _Probe().refs()


def _is_index(value, low: int, high: int | None = None) -> bool:
    """Whether `value` is an integer (not a bool) with low <= value (< high when given)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        return False
    return low <= value and (high is None or value < high)


class KVCache:
    """Interleaved per-layer key/value storage that grows by doubling.

    Args:
        n_layers: number of transformer layers (>= 1).
        n_kv_heads: key/value heads per layer (>= 1).
        head_dim: size of one head (>= 1).
        capacity: positions to preallocate; 0 allocates lazily on the first append.
        dtype: storage dtype, float32 or float16 (half the memory and half the bytes attention
            reads; values are rounded to float16 as they are written, and attention still
            computes in float32).
    """

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, capacity: int = 0,
                 dtype=np.float32):
        for name, value, low in (("n_layers", n_layers, 1), ("n_kv_heads", n_kv_heads, 1),
                                 ("head_dim", head_dim, 1), ("capacity", capacity, 0)):
            if not _is_index(value, low):
                raise ValueError(f"KVCache: {name} must be an integer >= {low}, got {value!r}")
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"KVCache: dtype must be one of {[str(d) for d in _DTYPES]}, got {dtype}")
        self.n_layers = int(n_layers)
        self.n_kv_heads = int(n_kv_heads)
        self.head_dim = int(head_dim)
        self.dtype = dtype
        self._capacity = int(capacity)
        # layer l's (capacity, n_kv_heads, 2, head_dim) buffer is self._buf[l]
        self._buf = self._alloc(self._capacity)
        self._lens = [0] * self.n_layers

    def _empty(self, capacity: int) -> KVCache:
        """An empty cache of this one's kind and shape."""
        return KVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype)

    def _nbytes(self, capacity: int) -> int:
        return self.n_layers * capacity * self.n_kv_heads * 2 * self.head_dim * self.dtype.itemsize

    def _alloc(self, capacity: int) -> np.ndarray:
        shape = (self.n_layers, capacity, self.n_kv_heads, 2, self.head_dim)
        spare = _SPARES.take(shape, self.dtype)
        if spare is not None:
            return spare
        memory.check_fits(self._nbytes(capacity), f"a {self.dtype} KV cache of {capacity} positions ({self.n_layers} "
                   f"layers x {self.n_kv_heads} KV heads x {self.head_dim})",
                   "use a shorter context" + (", or a float16 KV cache" if self.dtype == np.float32 else ""))
        return aligned.empty(shape, self.dtype)  # records on cache lines, as the kernels read them

    def _unshared(self) -> bool:
        """Whether nothing but this cache references its buffer (no view of it is held)."""
        return sys.getrefcount(self._buf.base) == _UNSHARED_REFS

    def __del__(self):
        # at interpreter exit this module's globals (sys, _SPARES) may be gone first: nothing to keep then
        if sys is not None and _SPARES is not None and "_buf" in self.__dict__ and self._unshared():
            _SPARES.put(self._buf)

    @property
    def capacity(self) -> int:
        """Positions allocated in every layer."""
        return self._capacity

    @property
    def length(self) -> int:
        """Positions stored in every layer (the minimum of the per-layer counts)."""
        return min(self._lens)

    @property
    def nbytes(self) -> int:
        """Bytes allocated by all layer buffers together."""
        return self._buf.nbytes

    def _check_layer(self, layer) -> int:
        if not _is_index(layer, 0, self.n_layers):
            raise ValueError(f"KVCache: layer must be an integer in [0, {self.n_layers}), got {layer!r}")
        return int(layer)

    def layer_length(self, layer: int) -> int:
        """Positions stored in one layer."""
        return self._lens[self._check_layer(layer)]

    def buffer(self, layer: int) -> np.ndarray:
        """The raw interleaved buffer of one layer, (capacity, n_kv_heads, 2, head_dim).

        Only the first `layer_length(layer)` rows hold data. The array is replaced when the
        cache grows, so fetch it again after an append rather than keeping it.
        """
        return self._buf[self._check_layer(layer)]

    def ensure_capacity(self, n: int) -> None:
        """Make room for at least `n` positions per layer, growing as `append` would."""
        if not _is_index(n, 0):
            raise ValueError(f"KVCache.ensure_capacity: n must be an integer >= 0, got {n!r}")
        n = int(n)
        if n <= self._capacity:
            return
        new_cap = max(2 * self._capacity, 1 << (n - 1).bit_length())
        avail = memory.available_bytes()
        if avail is not None and self._nbytes(new_cap) > avail:
            new_cap = n  # doubling would not fit: just what was asked for (which `_alloc` checks)
        new = self._alloc(new_cap)
        for layer, filled in enumerate(self._lens):
            new[layer, :filled] = self._buf[layer, :filled]
        self._buf = new
        self._capacity = new_cap

    def append(self, layer: int, k: np.ndarray, v: np.ndarray) -> int:
        """Store keys and values for the next positions of one layer.

        Args:
            layer: layer index.
            k, v: (seq, n_kv_heads, head_dim) arrays of any float dtype and any strides;
                they are cast to the cache dtype as they are written.

        Returns:
            The new number of positions stored in that layer.
        """
        layer = self._check_layer(layer)
        k = np.asarray(k)
        v = np.asarray(v)
        want = ("seq", self.n_kv_heads, self.head_dim)
        for name, a in (("k", k), ("v", v)):
            if a.ndim != 3 or a.shape[1:] != want[1:]:
                raise ValueError(f"KVCache.append: {name} must have shape (seq, n_kv_heads={self.n_kv_heads}, "
                                 f"head_dim={self.head_dim}), got {a.shape}")
            if not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"KVCache.append: {name} must be a float array, got dtype {a.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"KVCache.append: k and v shapes differ: k {k.shape}, v {v.shape}")
        return self._store(layer, k, v)

    def _store(self, layer: int, k, v) -> int:
        """Write checked keys and values (seq, n_kv_heads, head_dim) after layer's last position."""
        pos = self._lens[layer]
        end = pos + k.shape[0]
        self.ensure_capacity(end)
        buf = self._buf[layer]
        buf[pos:end, :, 0, :] = k
        buf[pos:end, :, 1, :] = v
        self._lens[layer] = end
        return end

    def buffers(self) -> np.ndarray:
        """All layers' raw buffers, (n_layers, capacity, n_kv_heads, 2, head_dim), for a fused
        kernel that writes the next position in place."""
        return self._buf

    def commit(self, n: int = 1) -> None:
        """Count `n` more positions as stored in every layer: a fused kernel has written rows
        length .. length+n-1 of every layer buffer in place (after `ensure_capacity`)."""
        end = self.length + n
        if len(set(self._lens)) != 1 or end > self._capacity:
            raise ValueError(f"KVCache.commit: layers hold {sorted(set(self._lens))} positions and capacity "
                             f"is {self._capacity}; cannot commit {n} more")
        self._lens = [end] * self.n_layers

    def get(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Zero-copy views (k, v) of one layer, each (layer_length, n_kv_heads, head_dim)."""
        layer = self._check_layer(layer)
        filled = self._buf[layer, :self._lens[layer]]
        return filled[:, :, 0, :], filled[:, :, 1, :]

    def fork(self) -> KVCache:
        """An independent copy (same capacity, same contents) that shares no memory with this one."""
        other = self._empty(self._capacity)
        for layer, filled in enumerate(self._lens):
            other._buf[layer, :filled] = self._buf[layer, :filled]
        other._lens = list(self._lens)
        return other

    def truncate(self, n: int) -> None:
        """Keep only the first `n` positions of every layer, 0 <= n <= length."""
        if not _is_index(n, 0, self.length + 1):
            raise ValueError(f"KVCache.truncate: n must be an integer in [0, length={self.length}], got {n!r}")
        self._lens = [int(n)] * self.n_layers

    def reset(self) -> None:
        """Forget every position; the capacity stays allocated."""
        self._lens = [0] * self.n_layers

    def __repr__(self) -> str:
        return (f"KVCache(n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"length={self.length}, capacity={self._capacity}, dtype={self.dtype})")
