"""Causal attention of a packed variable-length batch over a paged KV pool.

The batch is *packed*: the new tokens of B sequences are concatenated into one (T, H, D) query
array, and every token carries the sequence it belongs to and its absolute position. A query
token of sequence b at position p attends to the keys at positions 0..p of sequence b only,
read through b's page table straight from the pool buffer

    kv: (n_pages, page_size, KVH, 2, D)   position t of b -> kv[table[b, t // page_size], t % page_size]

so no per-sequence copy of K/V is ever gathered, and no mask is needed: which keys a token
sees follows from (sequence, position), so there is nothing to pad and nothing to broadcast.

Work is split into (query block, KV head) tasks that run in parallel, or, from _WHOLE_BLOCKS
blocks on, one task per query block with all its KV heads (a block of records read for all
of them together). A query block is up to _ROWS consecutive tokens of one sequence at
consecutive positions (a prefill chunk), which share every K/V row read; a decoding sequence
is a block of one. Each task runs the online softmax (running max, running sum, running
output; flash attention) over the keys its block sees, in chunks at multiples of
attention._CHUNK merged in order, all query heads of a KV-head group at once (grouped-query
attention without repeating KV heads), accumulating in float32. A float16 pool is stored as raw uint16 bits
and converted to float32 on read; `write_records` stores new keys and values into it. A
prefill block converts each block of keys and values into float32 scratch once for all its
rows; a decoding query (a block of one) reads them straight from the records, each record
once for all the heads of its KV head (`_fold_row`: in int8 decode steps 3,000 tokens deep
0.87x the time, the same bits).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange
from numba.extending import overload

from .attention import (_BLOCK, _CHUNK, _FASTMATH, _ROWS, _add_records, _add_values_many, _chunk_span, _merge_head,
                        _records_fit, _rescale, _score_block, _score_records)
from . import linking
from .aligned import _empty
from .f16 import _ld_row, _st, bits
from .quants import _touch_lines

__all__ = ["paged_attend", "plan_blocks", "write_records"]


@njit(cache=True)
def _write_records(kv, slots, k, v):
    """kv[slots[t], g] = (k[t, g], v[t, g]) for every token t and KV head g, converted to the
    buffer's storage (float32, or float16 bits rounded as NumPy's astype)."""
    for t in range(slots.shape[0]):
        s = slots[t]
        for g in range(k.shape[1]):
            for d in range(k.shape[2]):
                _st(kv[s, g, 0], d, k[t, g, d])
                _st(kv[s, g, 1], d, v[t, g, d])


def write_records(kv: np.ndarray, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
    """Store keys and values k, v (T, KVH, D), any strides, into the records `slots` (T,) of
    a layer buffer kv (n_records, KVH, 2, D), float32 or float16, in place. The slots must be
    distinct records of kv (the pool's `reserve` gives them)."""
    if kv.ndim != 4 or kv.shape[2] != 2 or k.shape != v.shape or k.ndim != 3 or k.shape[1:] != kv.shape[1::2]:
        raise ValueError(f"write_records: k and v must be (T, KVH={kv.shape[1]}, D={kv.shape[-1]}) for records "
                         f"{kv.shape}, got {k.shape} and {v.shape}")
    slots = np.asarray(slots, dtype=np.int64)
    if slots.shape != k.shape[:1] or (len(slots) and (slots.min() < 0 or slots.max() >= kv.shape[0])):
        raise ValueError(f"write_records: slots must be {k.shape[0]} records of the {kv.shape[0]}")
    _write_records(bits(kv), slots, np.asarray(k, np.float32), np.asarray(v, np.float32))


@njit(fastmath=_FASTMATH, cache=True, inline="always")
def _scale_and_mask(sr, lo, hi, scale):
    """Scores sr (G, _BLOCK) of a row that sees the block's keys lo..hi-1: scaled, the others
    removed (-inf)."""
    neg_inf = np.float32(-np.inf)
    for gh in range(sr.shape[0]):
        for j in range(_BLOCK):
            sr[gh, j] = sr[gh, j] * scale if lo <= j < hi else neg_inf


@njit(fastmath=_FASTMATH, cache=True)
def _fold_rows(q, kv, table, i0, pos0, g, first, scale, b0, n, m, l, acc, s, kb, vb, offs):
    """Fold the block of keys b0..b0+n-1 of KV head g into the running states m, l (R, G) and
    acc (R, G, D) of query rows i0..i0+R-1 (`_paged_block`): the block's keys and values
    converted into the float32 scratch kb, vb once for every row and head (offs unused)."""
    R, G = m.shape
    D = q.shape[2]
    ps = kv.shape[1]
    h0 = g * G
    p, o = b0 // ps, b0 % ps  # key b0 + j's page and offset, stepped (no division a key)
    for j in range(n):
        rec = kv[table[p], o, g]  # (2, D) view: read through the page table
        _ld_row(rec[0], kb[j])
        _ld_row(rec[1], vb[j])
        o += 1
        if o == ps:
            p, o = p + 1, 0
    for j in range(n, _BLOCK):  # past the block's end: finite, and weighted 0 by _rescale
        for d in range(D):
            kb[j, d] = 0.0
            vb[j, d] = 0.0
    for r in range(R):
        for gh in range(G):
            _score_block(q[i0 + r, h0 + gh], kb, s[r, gh])
        # the row sees keys b0+lo .. b0+hi-1
        _scale_and_mask(s[r], max(0, min(_BLOCK, first + r - b0)), max(0, min(n, pos0 + r - b0 + 1)), scale)
    _rescale(s, n, m, l, acc)
    _add_values_many(acc, s, vb)


def _fold_row(q, kv, table, i0, pos0, g, first, scale, b0, n, m, l, acc, s, kb, vb, offs):  # pragma: no cover
    raise NotImplementedError  # replaced by the overload in compiled code


@overload(_fold_row)
def _fold_row_overload(q, kv, table, i0, pos0, g, first, scale, b0, n, m, l, acc, s, kb, vb, offs):
    """`_fold_rows` for one query row, its head size a multiple of 64: the scores and
    weighted values of the row's G heads straight from the block's records
    (attention._score_records, _add_records: each record's key and value read and converted
    once, for every head; the sums of `_fold_rows`, so the same bits), where the records'
    storage allows (`_records_fit`), else `_fold_rows`."""
    if not _records_fit(kv):
        return _fold_rows.py_func

    def fold(q, kv, table, i0, pos0, g, first, scale, b0, n, m, l, acc, s, kb, vb, offs):
        G = m.shape[1]
        D = q.shape[2]
        ps, KVH = kv.shape[1], kv.shape[2]
        p, o = b0 // ps, b0 % ps
        for j in range(n):  # where key b0 + j's row starts in the buffer
            offs[j] = ((table[p] * ps + o) * KVH + g) * 2 * D
            o += 1
            if o == ps:
                p, o = p + 1, 0
        for j in range(n, _BLOCK):  # past the block's end: a row of the block (its weight is 0)
            offs[j] = offs[n - 1]
        _score_records(q[i0, g * G:(g + 1) * G], kv, offs, s[0])
        _scale_and_mask(s[0], max(0, min(_BLOCK, first - b0)), max(0, min(n, pos0 - b0 + 1)), scale)
        _rescale(s, n, m, l, acc)
        for j in range(_BLOCK):  # the value rows follow the keys
            offs[j] += D
        _add_records(acc[0], s[0], kv, offs, n)

    return fold


@njit(fastmath=_FASTMATH, cache=True)
def _paged_block(q, kv, table, i0, pos0, g0, scale, window, k0, k1, m, l, acc, s, kb, vb, offs):
    """Fold the keys k0..k1-1 (k0 a multiple of _BLOCK) of one sequence that query rows
    i0..i0+R-1 (positions pos0..pos0+R-1) see into their running states, for the G query
    heads of each of the NG KV heads g0..g0+NG-1: a block of keys at a time for all of them,
    so that the heads' parts of a record are read together. With window > 0, a row at
    position p sees only the keys t with p - t < window.

    q: (T, H, D); kv: (n_pages, ps, KVH, 2, D); table: (n_table,) page ids of the sequence.
    m, l: (NG, R, G); acc: (NG, R, G, D); s: (R, G, _BLOCK) scratch; kb, vb (_BLOCK, D):
    float32 scratch for a block's keys and values of one KV head (as attention._accumulate:
    each block converted once, four keys scored and four values added at a time); offs
    (_BLOCK,) int64 scratch. A lone row whose head size is a multiple of 64 reads the
    records directly (`_fold_row`). A (row, head)'s arithmetic does not depend on NG, R or
    the chunk's neighbours.
    """
    NG, R, G = m.shape
    D = q.shape[2]
    ps = kv.shape[1]
    t_end = pos0 + R  # the last row sees keys 0..pos0+R-1
    first = pos0 - window + 1 if window > 0 else -t_end  # row r sees keys first + r .. pos0 + r
    # blocks of keys from multiples of _BLOCK: a row's sums are grouped the same in any task
    end = min(k1, t_end)
    for b0 in range(max(k0, max(0, first) // _BLOCK * _BLOCK), end, _BLOCK):
        n = min(_BLOCK, end - b0)
        # load the next block's records now (every head's part: the other heads' tasks read
        # the rest), in memory order. A head at a time the reads stride through the records,
        # which the hardware does not fetch ahead, and a decode step's keys and values come
        # from memory (the weights it streamed evicted them): a 512-key chunk of 3 KV heads
        # took 80-90 us so, 57-66 with this, 38-42 with its records in cache
        t, stop = b0 + _BLOCK, min(b0 + 2 * _BLOCK, end)
        while t < stop:  # a run of records a page
            o = t % ps
            k = min(stop - t, ps - o)
            _touch_lines(kv[table[t // ps], o:o + k])
            t += k
        for gi in range(NG):
            if R == 1 and D % 64 == 0:
                _fold_row(q, kv, table, i0, pos0, g0 + gi, first, scale, b0, n, m[gi], l[gi], acc[gi], s, kb, vb,
                          offs)
            else:
                _fold_rows(q, kv, table, i0, pos0, g0 + gi, first, scale, b0, n, m[gi], l[gi], acc[gi], s, kb, vb,
                           offs)


_WHOLE_BLOCKS = 8  # query blocks from which a task of the paged kernel takes all KV heads of its block


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _paged_kernel(q, kv, tables, blk_seq, blk_row, blk_pos, blk_len, scale, window, out):
    """One task per (query block, KV head), or per query block with every KV head from
    _WHOLE_BLOCKS blocks on (a record's heads read together); the keys in chunks at multiples
    of _CHUNK, merged per query row (attention.py's docstring). The tasks do not change the
    results.

    q, out: (T, H, D); kv: (n_pages, ps, KVH, 2, D) float32 or uint16 (float16 bits);
    tables: (B, n_table) int32; block k covers query rows blk_row[k] .. + blk_len[k] - 1 of
    sequence blk_seq[k], at positions blk_pos[k] ...
    """
    per = _task_heads(kv.shape[2], blk_seq.shape[0])
    for task in prange(blk_seq.shape[0] * per):
        _paged_task(task, per, q, kv, tables, blk_seq, blk_row, blk_pos, blk_len, scale, window, out)


@njit(cache=True)
def _task_heads(KVH, nb):
    """Tasks per query block of the paged kernel's `nb` blocks: one per KV head, or one with
    every KV head from _WHOLE_BLOCKS blocks on."""
    return KVH if nb < _WHOLE_BLOCKS else 1


@linking.out_of_line
@njit(fastmath=_FASTMATH, cache=True)
def _paged_task(task, per, q, kv, tables, blk_seq, blk_row, blk_pos, blk_len, scale, window, out):
    """Task `task` of the paged kernel (`per` tasks a block, `_task_heads`): its query
    block's rows of out for its KV heads."""
    H = q.shape[1]
    D = q.shape[2]
    G = H // kv.shape[2]
    NG = kv.shape[2] // per  # KV heads per task
    k = task // per
    g0 = (task - k * per) * NG
    R = blk_len[k]
    i0 = blk_row[k]
    pos0 = blk_pos[k]
    c0, n_chunks = _chunk_span(max(0, pos0 - window + 1) if window > 0 else 0, pos0 + R)
    m = np.full((n_chunks, NG, R, G), -np.inf, dtype=np.float32)
    l = np.zeros((n_chunks, NG, R, G), dtype=np.float32)
    # the scratch on cache lines (npllama.aligned): the blocks are read a vector at a time
    acc = _empty((n_chunks, NG, R, G, D), np.float32)
    acc[:] = 0.0
    s = _empty((R, G, _BLOCK), np.float32)
    kb = _empty((_BLOCK, D), np.float32)
    vb = _empty((_BLOCK, D), np.float32)
    offs = np.empty(_BLOCK, dtype=np.int64)
    for c in range(n_chunks):
        _paged_block(q, kv, tables[blk_seq[k]], i0, pos0, g0, scale, window, (c0 + c) * _CHUNK,
                     (c0 + c + 1) * _CHUNK, m[c], l[c], acc[c], s, kb, vb, offs)
    for gi in range(NG):
        g = g0 + gi
        for r in range(R):
            _merge_head(m[:, gi, r], l[:, gi, r], acc[:, gi, r], out[i0 + r, g * G:(g + 1) * G])


def plan_blocks(seq_of_token: np.ndarray, positions: np.ndarray, rows: int = _ROWS):
    """Split packed tokens into query blocks: runs of up to `rows` consecutive tokens of the
    same sequence at consecutive positions. Returns (blk_seq, blk_row, blk_pos, blk_len),
    int64 arrays, the longest blocks (most keys) first so the parallel tasks balance."""
    seq_of_token = np.asarray(seq_of_token, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    T = len(seq_of_token)
    starts = []
    i = 0
    while i < T:
        j = i + 1
        while (j < T and j - i < rows and seq_of_token[j] == seq_of_token[i]
               and positions[j] == positions[j - 1] + 1):
            j += 1
        starts.append((i, j - i))
        i = j
    blk_row = np.array([a for a, _ in starts], dtype=np.int64)
    blk_len = np.array([n for _, n in starts], dtype=np.int64)
    blk_seq = seq_of_token[blk_row] if T else np.zeros(0, np.int64)
    blk_pos = positions[blk_row] if T else np.zeros(0, np.int64)
    # interleave long and short blocks: numba's static schedule gives each thread a
    # contiguous range of tasks
    order = np.argsort(-(blk_pos + blk_len), kind="stable")
    fold = np.empty_like(order)
    fold[0::2] = order[:(len(order) + 1) // 2]
    fold[1::2] = order[(len(order) + 1) // 2:][::-1]
    return blk_seq[fold], blk_row[fold], blk_pos[fold], blk_len[fold]


def paged_attend(q: np.ndarray, kv: np.ndarray, tables: np.ndarray, seq_of_token: np.ndarray,
                 positions: np.ndarray, *, scale: float | None = None, window: int = 0, blocks=None,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Attention of packed queries over a paged KV layer buffer.

    Args:
        q: (T, H, D) queries (converted to contiguous float32 if needed).
        kv: (n_pages, page_size, KVH, 2, D) C-contiguous float32 or float16 pool buffer,
            read in place through the page tables.
        tables: (B, n) int32 page tables, row b the pages of sequence b.
        seq_of_token: (T,) sequence index (row of `tables`) of each query token.
        positions: (T,) absolute position of each query token; its keys (positions
            0..position of its own sequence) must already be written.
        scale: score scale, default 1 / sqrt(D).
        window: when > 0, a query at position p sees only keys t with p - t < window.
        blocks: a precomputed `plan_blocks(seq_of_token, positions)` (shared by all layers).

    Returns (T, H, D) float32.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    if q.ndim != 3:
        raise ValueError(f"paged_attend: q must be (T, H, D), got {q.shape}")
    T, H, D = q.shape
    if not isinstance(kv, np.ndarray) or kv.ndim != 5 or kv.shape[3] != 2 or kv.shape[4] != D:
        raise ValueError(f"paged_attend: kv must be (n_pages, page_size, KVH, 2, D={D}), got "
                         f"{getattr(kv, 'shape', type(kv).__name__)}")
    if not kv.flags.c_contiguous or kv.dtype not in (np.float32, np.float16):
        raise ValueError(f"paged_attend: kv must be C-contiguous float32 or float16, got {kv.dtype}")
    KVH = kv.shape[2]
    if H % KVH:
        raise ValueError(f"paged_attend: H={H} is not a multiple of KVH={KVH}")
    tables = np.ascontiguousarray(tables, dtype=np.int32)
    seq_of_token = np.asarray(seq_of_token, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    if tables.ndim != 2 or seq_of_token.shape != (T,) or positions.shape != (T,):
        raise ValueError("paged_attend: tables must be (B, n), seq_of_token and positions (T,)")
    if T and (seq_of_token.min() < 0 or seq_of_token.max() >= len(tables) or positions.min() < 0):
        raise ValueError("paged_attend: a token names a sequence outside tables or a negative position")
    if T:
        need = positions // kv.shape[1]
        pages = tables[seq_of_token, np.minimum(need, tables.shape[1] - 1)]
        if (need >= tables.shape[1]).any() or (pages < 0).any() or (pages >= kv.shape[0]).any():
            raise ValueError("paged_attend: a position lies past its sequence's page table")
    if out is None:
        out = np.empty((T, H, D), np.float32)
    if T == 0:
        return out
    if blocks is None:
        blocks = plan_blocks(seq_of_token, positions)
    kv_arg = kv.view(np.uint16) if kv.dtype == np.float16 else kv
    scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"paged_attend: window must be an integer >= 0, got {window!r}")
    _paged_kernel(q, kv_arg, tables, *blocks, scale, int(window), out)
    return out
