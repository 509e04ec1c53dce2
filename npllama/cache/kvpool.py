"""A paged key/value pool shared by many sequences: the storage behind batched decoding.

Each layer owns ONE preallocated buffer of pages, interleaved like `KVCache` (the key and the
value of a position and KV head side by side):

    buffer(layer): (n_pages, page_size, n_kv_heads, 2, head_dim)   [..., 0, :] = K, [..., 1, :] = V

A sequence (`PoolSeq`) owns a page table, a list of page ids: position p of the sequence lives
at page `pages[p // page_size]`, row `p % page_size`, in every layer. Its length (= its
position: there is no second counter) is the number of token ids it holds.

Writing is a scatter through the table, in place: `write(layer, slots, k, v)` assigns into a
flat *view* of the layer buffer (`flat[slots, :, 0, :] = k`, an index on the left of `=`), never
into a gathered temporary (`flat[slots].copy(...)`-style code writes into a copy and leaves
the pool unchanged).

Pages are reference counted. `fork(seq)` shares every page of `seq` with the new sequence;
before a shared page is written it is copied (copy on write), so no sequence ever writes
through another's table. Freed pages go back to a free list and are reused. When a request
needs more pages than are free (after evicting unused prefix-cache pages), `reserve` raises
`PoolExhaustedError` naming pages needed and free, and changes nothing: nothing is ever
overwritten silently.

The prefix cache (`pool.prefix`) remembers full pages of token prefixes that were computed
(keyed by the token ids of every page up to and including that one), so that a later prompt
starting with the same tokens shares those pages instead of computing them again.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

from ..kernels.paged_attention import write_records
from .memory import check_fits, zeros

_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


class PoolExhaustedError(RuntimeError):
    """The KV pool has fewer free pages than a request needs (nothing was written)."""

    def __init__(self, needed: int, free: int, detail: str = ""):
        self.needed, self.free = int(needed), int(free)
        super().__init__(
            f"KV pool exhausted{' (' + detail + ')' if detail else ''}: needs {self.needed} pages but only "
            f"{self.free} are free; free finished sequences, lower the batch size, or build a larger "
            f"pool (KVPool.for_model(..., n_pages=...))")


def _is_int(value, low: int) -> bool:
    return (not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, np.integer))
            and value >= low)


class PoolSeq:
    """One sequence in a `KVPool`: its page table and the token ids its pages hold.

    `length` (also `pos`) is the number of positions stored, i.e. `len(tokens)`; it only
    changes through the pool (`commit`, `truncate`, `free`).
    """

    __slots__ = ("pool", "id", "pages", "_tokens", "freed")

    def __init__(self, pool: "KVPool", sid: int, pages: list[int], tokens: list[int]):
        self.pool = pool
        self.id = sid
        self.pages: list[int] = pages        # page table: position p -> pages[p // page_size]
        self._tokens: list[int] = tokens     # ids whose keys and values are stored
        self.freed = False

    @property
    def length(self) -> int:
        """Positions stored (the position of the next token)."""
        return len(self._tokens)

    pos = length

    @property
    def tokens(self) -> list[int]:
        """A copy of the token ids stored (len(tokens) == length)."""
        return list(self._tokens)

    @property
    def page_table(self) -> np.ndarray:
        """The page ids as an int32 array."""
        return np.asarray(self.pages, dtype=np.int32)

    def slot(self, p: int) -> tuple[int, int]:
        """(page, row) of position p."""
        ps = self.pool.page_size
        return self.pages[p // ps], p % ps

    def __repr__(self) -> str:
        return f"PoolSeq(id={self.id}, length={self.length}, pages={self.pages})"


class KVPool:
    """Preallocated paged KV storage for many sequences.

    Args:
        n_layers, n_kv_heads, head_dim: the model's shape (see `for_model`).
        n_pages: pages per layer (>= 1).
        page_size: positions per page (>= 1).
        dtype: float32 (default) or float16 storage; attention always accumulates in float32.
    """

    device = "cpu"  # where the pages are (backends.cuda.model.DeviceKVPool: "cuda")

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, n_pages: int,
                 page_size: int = 16, dtype=np.float32):
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim),
                            ("n_pages", n_pages), ("page_size", page_size)):
            if not _is_int(value, 1):
                raise ValueError(f"KVPool: {name} must be an integer >= 1, got {value!r}")
        dtype = np.dtype(dtype)
        if dtype not in _DTYPES:
            raise ValueError(f"KVPool: dtype must be float32 or float16, got {dtype}")
        self.n_layers, self.n_kv_heads, self.head_dim = int(n_layers), int(n_kv_heads), int(head_dim)
        self.n_pages, self.page_size, self.dtype = int(n_pages), int(page_size), dtype
        self._all = self._alloc((self.n_layers, self.n_pages, self.page_size, self.n_kv_heads, 2, self.head_dim))
        self._bufs = tuple(self._all)  # each layer's view
        # flat views (n_pages * page_size, KVH, 2, D) of the same memory, for slot scatters
        self._flat = tuple(b.reshape(-1, self.n_kv_heads, 2, self.head_dim) for b in self._bufs)
        assert self.device != "cpu" or all(np.shares_memory(f, b) for f, b in zip(self._flat, self._bufs))
        self._refs = np.zeros(self.n_pages, np.int32)
        self._free = list(range(self.n_pages - 1, -1, -1))  # a stack: pop() gives low ids first
        self._ids = itertools.count()
        self.prefix = PrefixCache(self)

    def _alloc(self, shape) -> np.ndarray:
        """Every layer's pages, zeroed (the system's default pages: memory.zeros), after checking
        that they fit in memory."""
        check_fits(math.prod(shape) * self.dtype.itemsize,
                   f"a {self.dtype} KV pool of {self.n_pages} pages x {self.page_size} positions ({self.n_layers} "
                   f"layers x {self.n_kv_heads} KV heads x {self.head_dim})",
                   "use fewer pages (fewer or shorter sequences)"
                   + (", or float16" if self.dtype == np.float32 else ""))
        return zeros(shape, self.dtype)

    @classmethod
    def for_model(cls, model, n_pages: int | None = None, *, tokens: int | None = None,
                  page_size: int = 16, dtype=None) -> "KVPool":
        """A pool shaped for `model` and on its device (`model.new_pool`): `n_pages` pages, or
        enough pages for `tokens` positions, storing `dtype` (by default the model's `kv_dtype`)."""
        dtype = model.kv_dtype if dtype is None else dtype
        if n_pages is None:
            if tokens is None:
                raise ValueError("KVPool.for_model: give n_pages or tokens")
            n_pages = max(1, -(-int(tokens) // page_size))
        return model.new_pool(n_pages, page_size, dtype)

    # ---- inspection -----------------------------------------------------------------------
    def buffer(self, layer: int) -> np.ndarray:
        """The layer's page buffer (n_pages, page_size, KVH, 2, D), read and written in place."""
        return self._bufs[layer]

    def buffers(self) -> tuple[np.ndarray, ...]:
        return self._bufs

    def slots(self) -> np.ndarray:
        """Every layer's records by flat slot id (page * page_size + row), (n_layers, n_pages *
        page_size, KVH, 2, D): one array for a fused kernel that reads and writes all layers."""
        return self._all.reshape(self.n_layers, -1, self.n_kv_heads, 2, self.head_dim)

    @property
    def n_free(self) -> int:
        """Pages on the free list."""
        return len(self._free)

    @property
    def n_available(self) -> int:
        """Free pages plus prefix-cache pages no sequence uses (evicted on demand)."""
        return len(self._free) + self.prefix.n_evictable

    def refcount(self, page: int) -> int:
        return int(self._refs[page])

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one cached position takes over all layers (K and V)."""
        return self.n_layers * self.n_kv_heads * 2 * self.head_dim * self.dtype.itemsize

    def pages_for(self, n_tokens: int) -> int:
        return -(-int(n_tokens) // self.page_size)

    # ---- sequences ------------------------------------------------------------------------
    def new_seq(self) -> PoolSeq:
        """An empty sequence (no pages yet)."""
        return PoolSeq(self, next(self._ids), [], [])

    def _check(self, seq: PoolSeq) -> None:
        if not isinstance(seq, PoolSeq) or seq.pool is not self:
            raise ValueError(f"{seq!r} is not a sequence of this pool")
        if seq.freed:
            raise ValueError(f"{seq!r} was freed; make a new sequence")

    def _drop_stale(self, seq: PoolSeq) -> None:
        """Release pages past the last stored position (reserved for a pass that failed)."""
        keep = self.pages_for(seq.length)
        if len(seq.pages) > keep:
            self._release(seq.pages[keep:])
            del seq.pages[keep:]

    def fork(self, seq: PoolSeq) -> PoolSeq:
        """A new sequence with the same contents that shares every page (copy on write)."""
        self._check(seq)
        self._drop_stale(seq)
        for p in seq.pages:
            self._refs[p] += 1
        return PoolSeq(self, next(self._ids), list(seq.pages), list(seq._tokens))

    def free(self, seq: PoolSeq) -> None:
        """Give back the sequence's pages (shared pages stay with their other owners)."""
        if seq.freed:
            return
        self._check(seq)
        self._release(seq.pages)
        seq.pages = []
        seq._tokens = []
        seq.freed = True

    def truncate(self, seq: PoolSeq, n: int) -> None:
        """Keep only the first `n` positions of `seq` (pages past them are released)."""
        self._check(seq)
        if not _is_int(n, 0) or n > seq.length:
            raise ValueError(f"KVPool.truncate: n must be an integer in [0, {seq.length}], got {n!r}")
        del seq._tokens[n:]
        self._drop_stale(seq)

    def _release(self, pages) -> None:
        for p in pages:
            self._refs[p] -= 1
            assert self._refs[p] >= 0, f"page {p} released more often than referenced"
            if self._refs[p] == 0:
                self._free.append(p)

    def _take(self) -> int:
        p = self._free.pop()
        self._refs[p] = 1
        return p

    def _ensure_free(self, needed: int, detail: str) -> None:
        if needed > len(self._free):
            self.prefix.evict(needed - len(self._free))
        if needed > len(self._free):
            raise PoolExhaustedError(needed, len(self._free), detail)

    # ---- writing --------------------------------------------------------------------------
    def reserve(self, seqs, counts) -> list[np.ndarray]:
        """Make room for `counts[i]` new positions after the end of `seqs[i]`, all or nothing.

        Pages that will be written and are shared (refcount > 1) are copied first (copy on
        write); missing pages come from the free list (evicting unused prefix-cache pages if
        needed). Returns, per sequence, the int64 flat slot ids (page * page_size + row) of
        its new positions, for `write`. Raises PoolExhaustedError, changing nothing, when the
        pool cannot hold them all.
        """
        seqs, counts = list(seqs), [int(c) for c in counts]
        if len(seqs) != len(counts):
            raise ValueError(f"reserve: {len(seqs)} sequences but {len(counts)} counts")
        if len({id(s) for s in seqs}) != len(seqs):
            raise ValueError("reserve: a sequence appears twice in one batch")
        ps = self.page_size
        plans, needed = [], 0
        for seq, n in zip(seqs, counts):
            self._check(seq)
            if n < 0:
                raise ValueError(f"reserve: counts must be >= 0, got {n}")
            start, end = seq.length, seq.length + n
            cow, new = [], 0
            for pi in range(start // ps, self.pages_for(end)):
                if pi < len(seq.pages):
                    if self._refs[seq.pages[pi]] > 1:
                        cow.append(pi)
                else:
                    new += 1
            plans.append((cow, new))
            needed += len(cow) + new
        if needed:
            self._ensure_free(needed, f"{len(seqs)} sequence(s) adding {sum(counts)} positions")
        out = []
        for seq, n, (cow, new) in zip(seqs, counts, plans):
            for pi in cow:  # copy on write: the copy gets this sequence's rows, the original stays
                old = seq.pages[pi]
                if self._refs[old] == 1:  # its other owners copied it earlier in this batch
                    continue
                fresh = self._take()
                for buf in self._bufs:
                    buf[fresh] = buf[old]  # index on the left: written into the pool
                self._release([old])
                seq.pages[pi] = fresh
            for _ in range(new):
                seq.pages.append(self._take())
            pos = np.arange(seq.length, seq.length + n, dtype=np.int64)
            table = np.asarray(seq.pages, dtype=np.int64)
            out.append(table[pos // ps] * ps + pos % ps if n else np.zeros(0, np.int64))
        return out

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Scatter keys and values (T, KVH, D) into flat slots (T,) of one layer, in place
        (cast to the pool dtype). The slots must come from `reserve`."""
        write_records(self._flat[layer], slots, k, v)  # in place, into the pool's memory

    def commit(self, seq: PoolSeq, ids) -> None:
        """Count the positions written by `write` as stored: `ids` are their token ids."""
        self._check(seq)
        ids = [int(i) for i in ids]
        if len(seq.pages) * self.page_size < seq.length + len(ids):
            raise ValueError(f"commit: {seq!r} has pages for {len(seq.pages) * self.page_size} "
                             f"positions, cannot hold {seq.length + len(ids)}; reserve first")
        seq._tokens.extend(ids)

    def append(self, seq: PoolSeq, layer_kv, ids) -> None:
        """Reserve, write every layer's (k, v) and commit: for tests and simple callers.
        `layer_kv` is a sequence of (k, v) pairs, one per layer, each (n, KVH, D)."""
        ids = list(ids)
        (slots,) = self.reserve([seq], [len(ids)])
        for li, (k, v) in enumerate(layer_kv):
            self.write(li, slots, k, v)
        self.commit(seq, ids)

    def gather(self, seq: PoolSeq, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies (k, v), each (length, KVH, D), of one layer of `seq` (for inspection)."""
        self._check(seq)
        pos = np.arange(seq.length)
        table = np.asarray(seq.pages, dtype=np.int64)
        slots = table[pos // self.page_size] * self.page_size + pos % self.page_size
        rows = self._flat[layer][slots]  # a read: a gathered copy, on purpose
        return rows[:, :, 0, :], rows[:, :, 1, :]

    def tables(self, seqs) -> np.ndarray:
        """The page tables of `seqs` as a (len(seqs), max pages) int32 array, padded with -1."""
        width = max((len(s.pages) for s in seqs), default=0)
        out = np.full((len(seqs), max(width, 1)), -1, np.int32)
        for i, s in enumerate(seqs):
            out[i, :len(s.pages)] = s.pages
        return out

    def __repr__(self) -> str:
        return (f"KVPool(n_layers={self.n_layers}, n_kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"n_pages={self.n_pages}, page_size={self.page_size}, dtype={self.dtype}, "
                f"free={self.n_free})")


class _Node:
    __slots__ = ("id", "page", "key", "children", "used")

    def __init__(self, nid, page, key, used):
        self.id, self.page, self.key, self.children, self.used = nid, page, key, 0, used


class PrefixCache:
    """Full pages of computed token prefixes, shared by reference count.

    A page is keyed by (key of the page before it, token ids of this page): a chain, so the
    key names the whole prefix exactly (no hash collisions: the dict compares the tuples).
    The cache holds one reference to each page it remembers; pages only it holds are evicted,
    least recently used leaves first, when the pool runs out of free pages.
    """

    def __init__(self, pool: KVPool):
        self.pool = pool
        self._nodes: dict[tuple, _Node] = {}
        self._by_id: dict[int, _Node] = {}
        self._ids = itertools.count(1)
        self._clock = itertools.count()

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def n_evictable(self) -> int:
        """Pages held only by the cache (a held page's ancestors are held by the same holder,
        so every such page can be evicted, leaves first)."""
        return sum(1 for n in self._nodes.values() if self.pool._refs[n.page] == 1)

    def _walk(self, tokens, n_pages):
        ps, parent = self.pool.page_size, 0
        for i in range(n_pages):
            key = (parent, tuple(tokens[i * ps:(i + 1) * ps]))
            node = self._nodes.get(key)
            yield i, key, node
            if node is None:
                return
            parent = node.id

    def match(self, tokens, limit: int | None = None) -> int:
        """How many leading full pages of `tokens` the cache holds (at most `limit`)."""
        n = len(tokens) // self.pool.page_size if limit is None else limit
        count = 0
        for _, _, node in self._walk(tokens, n):
            if node is None:
                break
            count += 1
        return count

    def attach(self, seq: PoolSeq, tokens) -> int:
        """Give the empty `seq` the cached pages of the longest cached page-aligned prefix of
        `tokens`, leaving at least one token to compute. Returns the positions attached."""
        pool = self.pool
        pool._check(seq)
        if seq.length or seq.pages:
            raise ValueError("PrefixCache.attach: the sequence must be empty")
        tokens = [int(t) for t in tokens]
        now = next(self._clock)
        for _, _, node in self._walk(tokens, (len(tokens) - 1) // pool.page_size):
            if node is None:
                break
            node.used = now
            pool._refs[node.page] += 1
            seq.pages.append(node.page)
        n = len(seq.pages) * pool.page_size
        seq._tokens.extend(tokens[:n])
        return n

    def publish(self, seq: PoolSeq, n_tokens: int | None = None) -> int:
        """Remember the full pages of the first `n_tokens` (default: all) positions of `seq`.
        Returns how many pages the cache holds for that prefix afterwards."""
        pool = self.pool
        pool._check(seq)
        n = seq.length if n_tokens is None else min(int(n_tokens), seq.length)
        tokens = seq._tokens
        now = next(self._clock)
        parent, count = 0, 0
        for i in range(n // pool.page_size):
            key = (parent, tuple(tokens[i * pool.page_size:(i + 1) * pool.page_size]))
            node = self._nodes.get(key)
            if node is None:
                node = _Node(next(self._ids), seq.pages[i], key, now)
                self._nodes[key] = node
                self._by_id[node.id] = node
                pool._refs[node.page] += 1
                if parent:
                    self._by_id[parent].children += 1
            node.used = now
            parent, count = node.id, count + 1
        return count

    def evict(self, n: int) -> int:
        """Free up to `n` pages that only the cache holds, least recently used leaves first."""
        freed = 0
        refs = self.pool._refs
        while freed < n:
            leaves = [nd for nd in self._nodes.values() if nd.children == 0 and refs[nd.page] == 1]
            if not leaves:
                break
            leaves.sort(key=lambda nd: nd.used)
            for nd in leaves[:n - freed]:
                del self._nodes[nd.key]
                del self._by_id[nd.id]
                if nd.key[0]:
                    self._by_id[nd.key[0]].children -= 1
                self.pool._release([nd.page])
                freed += 1
        return freed

    def clear(self) -> None:
        """Forget every cached prefix (pages still used by sequences stay with them)."""
        for nd in list(self._nodes.values()):
            self.pool._release([nd.page])
        self._nodes.clear()
        self._by_id.clear()
