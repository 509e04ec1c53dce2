"""The fused decode step: one token through every layer in a single compiled call and a
single parallel region.

Decoding one token is a chain of ~12 small kernels per layer. Called one by one from Python,
their wrappers cost as much as the arithmetic on a small model; launched one by one as
parallel kernels, the fork/join of ~270 parallel regions per token costs about as much again.
`_decode_step` runs embedding, all layers, the output norm and the output head in one
``prange`` over the threads: every thread runs `_worker`, which does the small per-token
work itself and takes its share of each product and of attention as work items from atomic
counters (npllama.workshare).

The weights are addressed as (type, byte offset, rows, row bytes, buffer) entries into the
model's panels (kernels/panels.py, the layout the prefill and the batched pass read too, so a
product gives the same bits in all three), for the types that have them, or else into the
model file's memory map (`DecodePlan.table`, `DecodePlan.panels`), rather than
as tuples of arrays: a tuple indexed by layer inside compiled code becomes a branch per
layer at every use, which made compiling a 30-layer step take minutes. The new key and
value rows are written straight into the KV cache's array; the caller commits them
afterwards. The cache is addressed through a page table: a session's cache is one page
(`DecodePlan.step`), a KV pool sequence its pages (`DecodePlan.step_paged`, for a request
decoding alone in the continuous batching).

The step holds the product and dequantization code of the types of the model's weights only,
by group (`DecodePlan.mask`, a kernels.qtypes.TypeMask, its first argument): Numba types the
mask as its literal value, so a model of one quantization compiles its own, smaller step
(each mask a version of its own, in Numba's cache too).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange
from numba.extending import overload

from ..kernels import aligned, cacheload, linking
from ..kernels.aligned import _empty
from ..kernels.attention import _BLOCK, _CHUNK, _chunk_span, _decode_chunk, _merge_chunks
from ..kernels.paged_attention import _paged_block
from ..kernels.f16 import _st, bits
from ..kernels.nn import ACTS, _glu1, _glu_row, _rmsnorm_row, _rope_row
from ..kernels.panels import PANEL, _panel_dots_one, _quantize_into
from ..kernels.quants import _block_sums, _deq_row, _rows_f32
from ..kernels.quants_int8 import _has_i8, _rows_i8
from ..kernels.workshare import _finish, _take, _wait, phase_size
from . import block

_MATRICES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # the products of a layer, in order
_STEPS = len(_MATRICES)
_ATT = _STEPS  # the attention's counters follow the products'
# Work items (chunks of keys) a step's attention is split into per thread. Every thread
# merges every chunk's state, half of them written by another core: 2 per thread decoded
# 3-4% faster than 4 (same-process A/B, at 128 and at 1000 tokens of context), as fast as 1,
# and still lets a thread take over part of a late one's share.
_CHUNKS_PER_THREAD = 2


def _entry(buffer: np.ndarray, data: np.ndarray, w, in_panels: bool = False) -> list[int]:
    """[type code, byte offset in `buffer`, rows, row bytes, 0] of the QWeight `w` whose
    rows `data` are a view on `buffer`; with `in_panels`, `data` are w's panels and the entry
    [type code, byte offset, rows, bytes per panel, 1]."""
    lo = buffer.__array_interface__["data"][0]
    start = data.__array_interface__["data"][0]
    if not (data.flags.c_contiguous and lo <= start and start + data.nbytes <= lo + buffer.nbytes):
        raise ValueError(f"weight {w.name} is not a contiguous view of the "
                         f"{'panel arena' if in_panels else 'model file'}")
    return [int(w.qtype), start - lo, w.rows if in_panels else data.shape[0], data.shape[1], int(in_panels)]


class DecodePlan:
    """A model's weights arranged for `_decode_step` (built once per model)."""

    def __init__(self, model, *, int8: bool = False):
        # the products' activations: int8 blocks (int8 mode), else int24 ones (the exact
        # mode: three planes of int8 digits), for the panels' integer dots
        self.int8 = int8
        # the types whose code the step holds: those of the model's weights, by group
        self.mask = block.kernel_mask(model)
        layers = model.layers
        cfg = model.config

        def stack(attr, width):
            rows = [getattr(L, attr) for L in layers]
            if rows[0] is None:
                return np.zeros((len(layers), 0), np.float32)
            return np.ascontiguousarray(np.stack(rows), dtype=np.float32).reshape(len(layers), width)

        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.buffer = model.file.buffer
        # the products of weights with panels read the panels (model.panel_arena), as the
        # prefill and the batched pass do
        self.panels = model.panel_arena

        def entry(w, *pair):  # the panels where w (and the weight it pairs with) have them
            if all(model.panels(v) is not None for v in (w, *pair)):
                return _entry(self.panels, model.panels(w), w, True)
            return _entry(self.buffer, w.data, w)

        # table[layer, step]: the weight of product `step` (_MATRICES order) of that layer;
        # table[n_layer, 0]: the output head; table[n_layer, 1]: the token embedding (read
        # from the file: its rows are looked up, not dotted)
        table = np.zeros((cfg.n_layer + 1, _STEPS, 5), np.int64)
        for li, L in enumerate(layers):
            table[li] = [entry(L.wq), entry(L.wk), entry(L.wv), entry(L.wo), entry(L.w_gate, L.w_up),
                         entry(L.w_up, L.w_gate), entry(L.w_down)]
        table[cfg.n_layer, 0] = entry(model.output)
        table[cfg.n_layer, 1] = _entry(self.buffer, model.token_embd.data, model.token_embd)
        self.table = table
        self.attn_norm = stack("attn_norm", cfg.n_embd)  # (n_layer, n_embd)
        self.ffn_norm = stack("ffn_norm", cfg.n_embd)    # (n_layer, n_embd)
        self.bq = stack("bq", q_dim)                     # (n_layer, q_dim) or (n_layer, 0)
        self.bk = stack("bk", kv_dim)
        self.bv = stack("bv", kv_dim)
        self.q_norm = stack("q_norm", cfg.head_dim)       # (n_layer, head_dim) or (n_layer, 0)
        self.k_norm = stack("k_norm", cfg.head_dim)
        self.post_attn = stack("post_attn_norm", cfg.n_embd)  # (n_layer, n_embd) or (n_layer, 0)
        self.post_ffn = stack("post_ffn_norm", cfg.n_embd)
        # per layer: [RoPE table (-1: none), sliding window (0: none)]
        self.lcfg = np.array([cfg.layer_rope, cfg.layer_window], np.int64).T.copy()
        self.act = ACTS[cfg.act]  # the FFN's GLU activation
        self.embd_scale = np.float32(cfg.embd_scale)
        self.model = model
        self.eps = np.float32(cfg.rms_eps)
        self.scale = np.float32(cfg.attn_scale)
        # offs[s]:offs[s + 1]: the results of product s of a layer in a row of the shared results
        self.offs = np.concatenate([[0], np.cumsum(table[0, :, 2])]).astype(np.int64)
        self._scratch = None  # the steps' working memory, for up to self._scratch_threads threads
        self._scratch_threads = 0
        self._scratch_chunks = 0
        # steps from several Python threads take turns (the parallel region runs without the
        # GIL, and every step uses all the threads it is given anyway)
        self._lock = threading.Lock()
        self._helper = None  # a process compiling the step for this plan (`load`), until a step waits for it

    def step(self, token: int, pos: int, cache, threads: int) -> np.ndarray:
        """Logits (n_vocab,) of `token` at `pos` (== cache.length); writes row `pos` of every
        layer's K and V and commits it.

        Runs `threads` workers without touching Numba's thread setting (numba.get/set_num_threads
        cost tens of microseconds per token from Python, with the CPU caches flushed by the
        weights): the region gets min(threads, that setting) threads, normally every CPU, and
        its work sharing gives the same result with fewer threads than workers."""
        cache.ensure_capacity(pos + 1)
        kvs = cache.buffers()
        logits = self._run(token, pos, kvs, _WHOLE, kvs.shape[1], threads)
        cache.commit(1)
        return logits

    def step_paged(self, token: int, pool, seq, threads: int) -> np.ndarray:
        """`step` for a sequence of a KV pool (`cache.kvpool`): logits of `token` at position
        seq.length, its keys and values written into the sequence's pages (a shared page is
        copied first), and the token committed."""
        pos = seq.length
        pool.reserve([seq], [1])
        logits = self._run(token, pos, pool.slots(), np.asarray(seq.pages, np.int64), pool.page_size, threads)
        pool.commit(seq, [token])
        return logits

    def load(self, cache, threads: int, helper: bool = True) -> None:
        """Load the step's machine code for `cache` from the kernel cache without running a
        step. A prompt's prefill calls this before it fills the cache: loading a kernel maps
        ~50 MiB of LLVM's code back for a moment (kernels/codepages.py), which would otherwise
        come on top of a long prompt's whole cache at its first decoded token. Where the cache
        does not have it, a helper process compiles it while the prompt compiles and runs its
        own kernels, and the first step waits for it (engine/precompile.py); without one
        (`helper` False, or none could start) it is compiled now."""
        kvs = cache.buffers()
        with self._lock:
            args = self._arguments(0, cache.length, kvs, _WHOLE, kvs.shape[1], threads,
                                   np.empty(self.model.config.n_vocab, np.float32))
            sig = tuple(_decode_step.typeof_pyval(a) for a in args)
            if self._helper is not None or cacheload.load_cached(_decode_step, sig):
                return
            if helper:
                from . import precompile
                self._helper = precompile.start(self.model, "decode")
            if self._helper is None:
                _decode_step.compile(sig)

    def _run(self, token, pos, kvs, pages, ps, threads) -> np.ndarray:
        logits = np.empty(self.model.config.n_vocab, np.float32)
        with self._lock:  # the steps of a model's sessions share its working memory
            if self._helper is not None:  # its step loads from the cache below (compiled here where it failed)
                helper, self._helper = self._helper, None
                helper.wait()
            _decode_step(*self._arguments(token, pos, kvs, pages, ps, threads, logits))
        return block.softcap(logits, self.model.config.softcap)

    def _arguments(self, token, pos, kvs, pages, ps, threads, logits) -> tuple:
        """`_decode_step`'s arguments for a step at `pos` that writes `logits`; the caller
        holds the lock that guards the working memory among them."""
        m, cfg = self.model, self.model.config
        # attention work items: chunks of keys, at least half a block each (a sliding layer
        # splits its window into as many, some of them empty when the window is short)
        if self.int8:  # a chunk per multiple of _CHUNK (_fixed_chunks)
            n_chunks = pos // _CHUNK + 1
        else:
            n_chunks = max(1, min(_CHUNKS_PER_THREAD * threads, (pos + 1) // (_BLOCK // 2)))
        cos, sin = m.ropes.tables(pos + 1)
        return (self.mask, token, pos, n_chunks, self.buffer, self.panels, self.table, self.attn_norm, self.ffn_norm,
                self.bq, self.bk, self.bv, self.q_norm, self.k_norm, self.post_attn, self.post_ffn,
                self.lcfg, self.act, self.embd_scale, bits(kvs), pages, ps, cos, sin, cfg.rope_neox,
                self.eps, self.scale, cfg.n_head, m.output_norm, logits, threads, self.offs,
                *self._scratch_for(threads, n_chunks))

    def _scratch_for(self, threads: int, n_chunks: int) -> tuple:
        """The step's working memory for `threads` workers and `n_chunks` attention chunks,
        allocated once (again only for more threads, or twice the chunks when more are
        needed): the shared results, the attention chunks' states, the work counters and
        each worker's private float32 and int8 arrays (see `_private`)."""
        if threads > self._scratch_threads or n_chunks > self._scratch_chunks:
            cfg = self.model.config
            G, D, KVH = cfg.n_head // cfg.n_head_kv, cfg.head_dim, cfg.n_head_kv
            threads = max(threads, self._scratch_threads)
            chunks = max(_CHUNKS_PER_THREAD * threads, n_chunks, 2 * self._scratch_chunks)
            n_ff = int(self.table[0, 4, 2])  # the gate product's rows
            n_f32, n_i8 = _private_sizes(cfg.n_embd, cfg.n_head * D, n_ff, KVH, G, D, 1 if self.int8 else 3)
            # on cache lines (npllama.aligned): `_private` cuts the arenas' rows at whole lines
            self._scratch = (
                aligned.empty((cfg.n_layer, int(self.offs[-1])), np.float32),         # res
                np.empty(cfg.n_layer * chunks * KVH * G, np.float32),                 # part_m
                np.empty(cfg.n_layer * chunks * KVH * G, np.float32),                 # part_l
                aligned.empty(cfg.n_layer * chunks * KVH * G * D, np.float32),        # part_acc
                np.empty(_slot(cfg.n_layer + 1, 0, threads), np.int64),               # ctr
                aligned.empty((threads, n_f32), np.float32),
                # the int8 arena: flat for int8 activations, (3, L) for int24 ones (`_form`)
                aligned.empty((threads, n_i8) if self.int8 else (threads, 3, -(-n_i8 // 3)), np.int8),
                np.empty((threads, _STEPS), np.int64),
            )
            self._scratch_threads = threads
            self._scratch_chunks = chunks
        return self._scratch


_WHOLE = np.zeros(1, np.int64)  # a session's cache as one page: position p is record p
# Weight bytes per work item of a product at least (rows are never split; a range whose weight is
# smaller gets one item). Items of 16 KB cost a share of every item's time: in steps interleaved
# in one process (128 keys of context, 12 rounds, against the 16 KB items), items of 128 KB of
# equal size made int8 steps 7-25% faster (SmolLM2 Q4_1 0.75x, Q4_K_M 0.93x; items of 128 KB
# cut unevenly: Q6_K 0.74x, Gemma 3 0.96x, Q4_1 at 1,000 keys 0.96x) and float32 ones 2%
# (Q4_1 0.98x, Q4_K_M 0.98x). The bits do not change: a row's dot is the same in any item.
_ITEM_BYTES = 131072
# and at most this many items per range: Gemma 3's 262k-row output head (178 MB) made 11-16k items
# of 16 KB a step, each taken by an atomic and set up anew, and its int8 step took 9.3-12.9 ms
# where in items of at most 1/256 of a range it takes 7.6-9.9
_RANGE_ITEMS = 256


@njit(cache=True)
def _item_rows(w, nr):
    """Rows (or panels) of weight ``w`` per work item, for ``nr`` ranges: items of about equal
    size, at least _ITEM_BYTES each where the weight has that many bytes (else about one item
    a range), at most _RANGE_ITEMS a range, so that the ranges' item counts differ by at most
    one."""
    units, unit_bytes = w.shape
    items = min(_RANGE_ITEMS, max(1, units * unit_bytes // (nr * _ITEM_BYTES)))  # per range
    return max(1, -(-units // (nr * items)))


@njit(cache=True)
def _prepare(x, xsum, xq):
    """The forms of an activation x that the products read: its quantized blocks xq (int8 or
    int24, `_form`), and its block sums xsum (for the float32 dots of weights without panels)."""
    _block_sums(x, xsum)
    _quantize_into(x.reshape(1, x.shape[0]), xq)


def _gguf_rows(mask, code, w, r0, r1, x, xsum, xq, row, out):
    """out[r] = dot(row r of the GGUF weight w, x) for r in r0..r1-1: by the int8 row dots
    (quants_int8) where x's form xq is int8 and the type has them, else by the float32 ones
    (quants; row: float32 scratch as long as x, for types they dequantize first)."""
    if xq[0].ndim == 2 and _has_i8(code):
        _rows_i8(mask, code, w, r0, r1, xq[0][0], xq[1][0], xq[2][0], out)
    else:
        _rows_f32(mask, code, w, r0, r1, x, xsum, row, out)


@overload(_gguf_rows)
def _gguf_rows_jit(mask, code, w, r0, r1, x, xsum, xq, row, out):
    if xq[0].ndim == 2:  # int8 forms: the function itself compiles
        return _gguf_rows
    return lambda mask, code, w, r0, r1, x, xsum, xq, row, out: _rows_f32(mask, code, w, r0, r1, x, xsum, row, out)


@njit(cache=True)
def _rows(mask, code, w, panels, r0, r1, x, xsum, xq, row, tmp, out):
    """out[r] = dot(row r of w, x) for r in r0..r1-1, x in its forms (`_prepare`); with
    ``panels``, w is a weight's panels and r0..r1 are panels, whose rows the panel kernel
    computes (tmp: (1, 16)), else w is GGUF rows (`_gguf_rows`). The kernels hold the code
    of the types of ``mask`` only (`DecodePlan.mask`)."""
    if panels:
        for p in range(r0, r1):
            _panel_dots_one(mask, code, w[p], xq, tmp)
            for i in range(min(PANEL, out.shape[0] - p * PANEL)):
                out[p * PANEL + i] = tmp[0, i]
    else:
        _gguf_rows(mask, code, w, r0, r1, x, xsum, xq, row, out)


@njit(cache=True)
def _weight(buffer, panels, entry):
    """The uint8 view of the weight of a DecodePlan.table entry: (rows, row bytes) of the file,
    or (panels, bytes per panel) of the panel arena."""
    if entry[4]:
        n = (entry[2] + PANEL - 1) // PANEL
        return panels[entry[1]:entry[1] + n * entry[3]].reshape(n, entry[3])
    return buffer[entry[1]:entry[1] + entry[2] * entry[3]].reshape(entry[2], entry[3])


@linking.out_of_line
@njit(cache=True)
def _product(ctr, slot, home, nr, mask, code, w, pan, x, xsum, xq, row, tmp, out, pair, code2, w2, out2, act):
    """Take items of ``out = W x`` from the phase at ``slot`` (``nr`` ranges, this thread's
    is ``home``) until none is left, and publish them. Returns the number of items. With
    ``pan``, w (and w2) are panels (`_rows`).

    With ``pair``, an item also computes the same rows of ``out2 = W2 x`` and then turns them
    into ``out = act(out) * out2``: the FFN's gate and up products finished by their GLU
    (act: a code of kernels.ACTS)."""
    units, rows = w.shape[0], out.shape[0]
    per = _item_rows(w, nr)
    n_items = (units + per - 1) // per
    done = 0
    while True:
        i = _take(ctr, slot, home, nr, n_items)
        if i < 0:
            break
        u0, u1 = i * per, min(units, (i + 1) * per)
        for half in range(2 if pair else 1):
            c, wh, o = (code, w, out) if half == 0 else (code2, w2, out2)
            _rows(mask, c, wh, pan, u0, u1, x, xsum, xq, row, tmp, o)  # one call site: one copy of the kernels
        if pair:  # the GLU as the prefill's products compute it: the panels' strict arithmetic, or the rows'
            if pan:
                for r in range(u0 * PANEL, min(rows, u1 * PANEL)):
                    out[r] = _glu1(out[r], out2[r], act)
            else:
                _glu_row(out[u0:u1], out2[u0:u1], out[u0:u1], act)
        done += 1
    _finish(ctr, slot, nr, done)
    return n_items


@njit(cache=True)
def _unit_at(entries, n, off):
    """The panel boundary nearest byte `off` of the first n entries' panels, which lie one after
    another in the arena, counted in panels from the first's first."""
    base = 0
    for s in range(n):
        e = entries[s]
        units = (e[2] + PANEL - 1) // PANEL
        if off < units * e[3]:
            return base + (off + e[3] // 2) // e[3]
        off -= units * e[3]
        base += units
    return base


@njit(cache=True)
def _adjacent(entries, n):
    """Whether the first n entries are panels, each right after the one before in the arena."""
    for s in range(n):
        if entries[s, 4] != 1:
            return False
        if s and entries[s, 1] != entries[s - 1, 1] + (entries[s - 1, 2] + PANEL - 1) // PANEL * entries[s - 1, 3]:
            return False
    return True


@linking.out_of_line
@njit(cache=True)
def _product_run(ctr, slot, home, nr, mask, entries, n, buffer, panels, x, xsum, xq, row, tmp, res, offs):
    """`_product` over the first n products of a layer whose panels lie one after another in
    the arena (`_adjacent`; q, k and v, of one input), as one phase: items of about equal
    bytes over the whole run, so that each thread's range is one stretch of memory (product s
    writes res[offs[s]:offs[s + 1]]). Returns the number of items."""
    total = 0
    for s in range(n):
        total += (entries[s, 2] + PANEL - 1) // PANEL * entries[s, 3]
    n_items = nr * min(_RANGE_ITEMS, max(1, total // (nr * _ITEM_BYTES)))
    done = 0
    while True:
        i = _take(ctr, slot, home, nr, n_items)
        if i < 0:
            break
        u0, u1 = _unit_at(entries, n, i * total // n_items), _unit_at(entries, n, (i + 1) * total // n_items)
        base = 0
        for s in range(n):
            e = entries[s]
            units = (e[2] + PANEL - 1) // PANEL
            a, b = max(u0, base), min(u1, base + units)
            if a < b:
                _rows(mask, e[0], _weight(buffer, panels, e), e[4] == 1, a - base, b - base, x, xsum, xq, row,
                      tmp, res[offs[s]:offs[s + 1]])
            base += units
        done += 1
    _finish(ctr, slot, nr, done)
    return n_items


@njit(cache=True)
def _slot(li, step, nr):
    """First counter of the phase of a step of layer li (the output head: layer n_layer,
    step 0), for ``nr`` ranges per phase."""
    return (li * (_STEPS + 1) + step) * phase_size(nr)


_LINE = 64  # bytes: each private array starts on a cache line of its own


@njit(cache=True)
def _private_lengths(n_embd, q_dim, n_ff, KVH, G, D, P):
    """Lengths of one worker's private arrays, in the order `_private` cuts them, for
    activations of P planes (int8 1, int24 3): float32 (x, h, row, xsum, de, se, ie, da, sa,
    ia, df, sf, if, q, k, v, s, tmp; ie, ia and if hold int32: each plane's integer sums of
    each half block), int8 (qe, qa, qf: the planes)."""
    width = max(n_embd, q_dim, n_ff)
    f32 = (n_embd, width, width, width // 32, n_embd // 32, n_embd // 32, P * (n_embd // 16), q_dim // 32,
           q_dim // 32, P * (q_dim // 16), n_ff // 32, n_ff // 32, P * (n_ff // 16), KVH * G * D, KVH * D, KVH * D,
           KVH * G * _BLOCK, PANEL)
    return f32, (P * n_embd, P * q_dim, P * n_ff)


@njit(cache=True)
def _private_sizes(n_embd, q_dim, n_ff, KVH, G, D, P):
    """(float32, int8) elements of one worker's private arrays (`_private`), each rounded up
    to whole cache lines."""
    f32, i8 = _private_lengths(n_embd, q_dim, n_ff, KVH, G, D, P)
    n_f32 = 0
    for n in f32:
        n_f32 += -(-n * 4 // _LINE) * _LINE // 4
    n_i8 = 0
    for n in i8:
        n_i8 += -(-n // _LINE) * _LINE
    return n_f32, n_i8


@njit(cache=True)
def _cut(arena, at, n):
    """arena[at:at + n] and the offset of the next whole cache line after it."""
    line = _LINE // arena.itemsize
    return arena[at:at + n], at + -(-n // line) * line


def _form(i8, q, d, s, i, n):
    """The form of an activation of n values that the products read, made of its private
    arrays (flat: values, block scales, block sums, half blocks' integer sums in float32's
    room): int8 (as panels.quantize_rows, for one row) where the worker's int8 arena `i8` is
    flat, int24 (panels.quantize_rows_i24: three planes) where it is (3, L)."""
    planes = () if i8.ndim == 1 else (3,)
    return (q.reshape((1, *planes, n)), d.reshape(1, n // 32), s.reshape(1, n // 32),
            i.view(np.int32).reshape((1, *planes, n // 16)))


@overload(_form)
def _form_jit(i8, q, d, s, i, n):
    if i8.ndim == 1:
        return lambda i8, q, d, s, i, n: (q.reshape(1, n), d.reshape(1, n // 32), s.reshape(1, n // 32),
                                          i.view(np.int32).reshape(1, n // 16))
    return lambda i8, q, d, s, i, n: (q.reshape(1, 3, n), d.reshape(1, n // 32), s.reshape(1, n // 32),
                                      i.view(np.int32).reshape(1, 3, n // 16))


@njit(cache=True)
def _private(f32, i8, n_embd, q_dim, n_ff, KVH, G, D):
    """One worker's private arrays, cut from its rows of the scratch arenas (float32 `f32`,
    int8 `i8`, flat for int8 activations or (3, L) for int24 ones, sized by `_private_sizes`):
    the residual stream x, the products' input h, a row to dequantize weights into, h's block
    sums, the forms (`_form`) of the normed x, of the attention output and of the FFN's, the
    query, key and value, attention's scores and a panel's (1, 16) results."""
    P = 1 if i8.ndim == 1 else 3
    n, m = _private_lengths(n_embd, q_dim, n_ff, KVH, G, D, P)
    x, at = _cut(f32, 0, n[0])
    h, at = _cut(f32, at, n[1])
    row, at = _cut(f32, at, n[2])
    xsum, at = _cut(f32, at, n[3])
    de, at = _cut(f32, at, n[4])
    se, at = _cut(f32, at, n[5])
    ie, at = _cut(f32, at, n[6])
    da, at = _cut(f32, at, n[7])
    sa, at = _cut(f32, at, n[8])
    ia, at = _cut(f32, at, n[9])
    df, at = _cut(f32, at, n[10])
    sf, at = _cut(f32, at, n[11])
    if_, at = _cut(f32, at, n[12])
    q, at = _cut(f32, at, n[13])
    k, at = _cut(f32, at, n[14])
    v, at = _cut(f32, at, n[15])
    s, at = _cut(f32, at, n[16])
    tmp, at = _cut(f32, at, n[17])
    flat = i8.reshape(i8.size)
    qe, at = _cut(flat, 0, m[0])
    qa, at = _cut(flat, at, m[1])
    qf, at = _cut(flat, at, m[2])
    return (x, h, row, xsum, _form(i8, qe, de, se, ie, n_embd), _form(i8, qa, da, sa, ia, q_dim),
            _form(i8, qf, df, sf, if_, n_ff), q.reshape(KVH, G, D), k.reshape(KVH, D), v.reshape(KVH, D),
            s.reshape(KVH, G, _BLOCK), tmp.reshape(1, PANEL))


@linking.out_of_line  # compiled once, called by the parallel region
@njit(cache=True)
def _worker(mask, ctr, home, nr, token, pos, buffer, panels, table, attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm,
            post_attn, post_ffn, lcfg, act, embd_scale, kvs, pages, ps, cos, sin, neox, eps, scale, H, out_norm,
            logits, res, offs, part_m, part_l, part_acc, f32, i8, n_items):
    """One thread's share of a decode step. Every thread keeps its own copy of the residual
    stream and of the small per-token values (norms, RoPE, quantized activations), computed
    identically from the shared results; the products (the FFN's gate and up together, with
    their SwiGLU) and attention are shared out.

    res[li, offs[s]:offs[s + 1]]: the result of product s of layer li. A layer's steps run in
    one loop around one call of each product routine (few inlined copies of the product
    kernels keep compile time down); the private work before a product depends on the step.
    q, k and v run as one phase where their panels lie one after another in the arena, as the
    model packs them (`_product_run`: each thread then reads one stretch of memory, where it
    started a stream in each of the three; decode steps 0.97-0.98x the time in int8 mode). The
    architecture's flags (ModelConfig, as DecodePlan lays them out) choose the optional
    pieces: q/k norms, post-norms, per-layer RoPE table and window, the GLU's activation,
    the embedding scale."""
    n_layer, n_embd = attn_norm.shape
    KVH, D = kvs.shape[2], kvs.shape[4]
    q_dim, n_ff = H * D, offs[5] - offs[4]
    x, h, row, xsum, xe, xa, xf, q, k, v, s, tmp = _private(f32, i8, n_embd, q_dim, n_ff, KVH, H // KVH, D)
    he, ha, hf = h[:n_embd], h[:q_dim], h[:n_ff]
    embd = table[n_layer, 1]
    _deq_row(mask, embd[0], _weight(buffer, panels, embd)[token], x)
    if embd_scale != 1:
        x *= embd_scale
    for li in range(n_layer + 1):
        for step in range(_STEPS if li < n_layer else 1):
            if step == 5:  # the up product runs with the gate product (step 4)
                continue
            entry = table[li, step]
            if li == n_layer:  # the output head
                _rmsnorm_row(x, out_norm, eps, he)
                _prepare(he, xsum, xe)
                out = logits
                up, out_up = entry, out  # unused: no pair
            else:
                if step == 0:
                    _rmsnorm_row(x, attn_norm[li], eps, he)
                    _prepare(he, xsum, xe)
                elif step == 3:
                    _attention(ctr, home, nr, li, pos, res[li], offs, n_items, q, k, v, bq, bk, bv, q_norm, k_norm,
                               lcfg[li], eps, kvs[li], pages, ps, cos, sin, neox, scale, part_m[li], part_l[li],
                               part_acc[li], s, ha, i8)
                    _prepare(ha, xsum, xa)
                elif step == 4:
                    _wait(ctr, _slot(li, 3, nr), nr, n_items[3])
                    _residual(x, res[li, offs[3]:offs[4]], post_attn, li, eps, he)
                    _rmsnorm_row(x, ffn_norm[li], eps, he)
                    _prepare(he, xsum, xe)
                elif step == 6:
                    _wait(ctr, _slot(li, 4, nr), nr, n_items[4])
                    hf[:] = res[li, offs[4]:offs[5]]  # SwiGLU(gate, up), done by the items
                    _prepare(hf, xsum, xf)
                out = res[li, offs[step]:offs[step + 1]]
                up, out_up = table[li, 5], res[li, offs[5]:offs[6]]  # the pair of step 4
            if step == 3:
                xin, xq = ha, xa
            elif step == 6:
                xin, xq = hf, xf
            else:
                xin, xq = he, xe
            if step < 3 and li < n_layer and _adjacent(table[li], 3):  # q, k and v as one run
                n_items[step] = _product_run(ctr, _slot(li, 0, nr), home, nr, mask, table[li], 3, buffer, panels,
                                             he, xsum, xe, row, tmp, res[li], offs) if step == 0 else 0
            else:
                n_items[step] = _product(ctr, _slot(li, step, nr), home, nr, mask, entry[0],
                                         _weight(buffer, panels, entry), entry[4] == 1, xin, xsum, xq, row, tmp, out,
                                         li < n_layer and step == 4, up[0], _weight(buffer, panels, up), out_up, act)
        if li < n_layer:
            _wait(ctr, _slot(li, 6, nr), nr, n_items[6])
            _residual(x, res[li, offs[6]:offs[7]], post_ffn, li, eps, he)
    _wait(ctr, _slot(n_layer, 0, nr), nr, n_items[0])


@njit(cache=True)
def _residual(x, r, post, li, eps, tmp):
    """x += r, or x += rmsnorm(r) by post[li] when the architecture has post-norms (post
    is (n_layer, n_embd), else (n_layer, 0)); tmp: scratch as long as x."""
    if post.shape[1]:
        _rmsnorm_row(r, post[li], eps, tmp[:x.shape[0]])
        x += tmp[:x.shape[0]]
    else:
        x += r


@linking.out_of_line
@njit(cache=True)
def _attention(ctr, home, nr, li, pos, res, offs, n_items, q, k, v, bq, bk, bv, q_norm, k_norm, lcfg, eps, kv, pages,
               ps, cos, sin, neox, scale, part_m, part_l, part_acc, s, out, i8):
    """A thread's part of layer li's attention: wait for q, k, v; norm and RoPE them
    (privately) as the layer says and write the new key and value rows; take chunks of the
    keys the query sees (its window's, in a sliding layer) as items; merge every head's
    chunks into out (H * D): `_attention_items`, by the mode that the worker's int8 arena
    `i8` tells.

    q: (KVH, G, D) scratch for the query; k, v: (KVH, D); lcfg: the layer's [RoPE
    table or -1, window or 0]; position p's record is kv[pages[p // ps] * ps + p % ps] (a
    session's cache: one page of its whole capacity); part_m, part_l: (n_chunks, KVH, G) and
    part_acc (n_chunks, KVH, G, D): the chunks' running states (int8 mode: room for at least
    pos // _CHUNK + 1 chunks)."""
    KVH, G, D = q.shape
    for step in range(3):
        _wait(ctr, _slot(li, step, nr), nr, n_items[step])
    q.reshape(KVH * G * D)[:] = res[offs[0]:offs[1]]
    k.reshape(KVH * D)[:] = res[offs[1]:offs[2]]
    v.reshape(KVH * D)[:] = res[offs[2]:offs[3]]
    if bq.shape[1]:
        q.reshape(KVH * G * D)[:] += bq[li]
        k.reshape(KVH * D)[:] += bk[li]
        v.reshape(KVH * D)[:] += bv[li]
    if q_norm.shape[1]:
        q2 = q.reshape(KVH * G, D)
        for h in range(KVH * G):
            _rmsnorm_row(q2[h], q_norm[li], eps, q2[h])
        for g in range(KVH):
            _rmsnorm_row(k[g], k_norm[li], eps, k[g])
    if lcfg[0] >= 0:
        _rope_row(q.reshape(KVH * G, D), pos, cos[lcfg[0]], sin[lcfg[0]], neox)
        _rope_row(k, pos, cos[lcfg[0]], sin[lcfg[0]], neox)
    # every thread writes the same new row, before any of its own reads of it
    at = pages[pos // ps] * ps + pos % ps
    for g in range(KVH):
        for d in range(D):
            _st(kv[at, g, 0], d, k[g, d])
            _st(kv[at, g, 1], d, v[g, d])
    lo = max(0, pos + 1 - lcfg[1]) if lcfg[1] > 0 else 0  # the first key the query sees
    _attention_items(i8, ctr, home, nr, _slot(li, _ATT, nr), pos, lo, q, kv, pages, ps, lcfg[1], scale, part_m,
                     part_l, part_acc, s, out)


def _attention_items(i8, ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc, s,
                     out):
    """A thread's share of a layer's attention items, then the merge (`_attention`): in the
    exact mode (int24 planes: `i8` is (3, L)) the chunks split the keys evenly and an item takes
    every KV head of its chunk (`_even_chunks`); in int8 mode (`i8` flat) the chunks sit at
    multiples of attention._CHUNK and are folded by the batched pass's routine
    (`_fixed_chunks`), so that a token's attention has the bits of a batched pass's. Chosen
    as the step compiles (the overload below): a step holds one mode's code, not both (the
    int8 mode's was 0.57 MB of the exact step's 1.45)."""
    if i8.ndim == 1:
        _fixed_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc, out)
    else:
        _even_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, scale, part_m, part_l, part_acc, s, out)


@overload(_attention_items)
def _attention_items_jit(i8, ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc,
                         s, out):
    if i8.ndim == 1:
        return (lambda i8, ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc, s,
                out: _fixed_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l,
                                   part_acc, out))
    return (lambda i8, ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc, s,
            out: _even_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, scale, part_m, part_l, part_acc, s,
                              out))


@linking.out_of_line
@njit(cache=True)
def _even_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, scale, part_m, part_l, part_acc, s, out):
    """The exact mode's attention items (`_attention_items`): n_chunks chunks of the keys lo..pos
    split evenly, each with every KV head, folded by the decode kernel (`_decode_chunk`);
    then merged in order (`_merge_chunks`)."""
    KVH, G, D = q.shape
    n_chunks = part_m.shape[0]
    q *= scale
    chunk = -(-(pos + 1 - lo) // n_chunks)
    done = 0
    while True:
        c = _take(ctr, slot, home, nr, n_chunks)
        if c < 0:
            break
        part_m[c] = -np.inf
        part_l[c] = 0.0
        part_acc[c] = 0.0
        t, t1 = lo + c * chunk, min(pos + 1, lo + (c + 1) * chunk)
        while t < t1:  # the chunk's keys, a run of consecutive records per page
            end = min(t1, (t // ps + 1) * ps)
            at = pages[t // ps] * ps + t % ps
            _decode_chunk(q, kv, at, at + end - t, part_m[c], part_l[c], part_acc[c], s)
            t = end
        done += 1
    _finish(ctr, slot, nr, done)
    _wait(ctr, slot, nr, n_chunks)
    _merge_chunks(part_m, part_l, part_acc, out.reshape(KVH, G, D))


@linking.out_of_line
@njit(cache=True)
def _fixed_chunks(ctr, home, nr, slot, pos, lo, q, kv, pages, ps, window, scale, part_m, part_l, part_acc, out):
    """int8 mode's attention items (`_attention_items`): the chunks at multiples of _CHUNK from the
    one holding key lo, each with every KV head (from twice as many chunks as threads on:
    the heads' parts of a record read together) or else with one (fewer chunks share out
    unevenly: at 600 keys one thread folded the whole first chunk while the other waited),
    folded from a fresh state by the batched pass's `_paged_block` as a query block of one
    row; then merged in order (`_merge_chunks`)."""
    KVH, G, D = q.shape
    c0, n_chunks = _chunk_span(lo, pos + 1)
    per = KVH if n_chunks < 2 * nr else 1  # items per chunk
    NG = KVH // per  # KV heads per item
    kv5 = kv.reshape(kv.shape[0] // ps, ps, KVH, 2, D)
    q1 = q.reshape(1, KVH * G, D)
    m = np.empty((NG, 1, G), np.float32)
    l = np.empty((NG, 1, G), np.float32)
    # the scratch on cache lines (npllama.aligned): the blocks are read a vector at a time
    acc = _empty((NG, 1, G, D), np.float32)
    s = _empty((1, G, _BLOCK), np.float32)
    kb = _empty((_BLOCK, D), np.float32)
    vb = _empty((_BLOCK, D), np.float32)
    offs = np.empty(_BLOCK, np.int64)
    done = 0
    while True:
        i = _take(ctr, slot, home, nr, n_chunks * per)
        if i < 0:
            break
        c = i // per
        g0 = (i - c * per) * NG
        m[:] = -np.inf
        l[:] = 0.0
        acc[:] = 0.0
        _paged_block(q1, kv5, pages, 0, pos, g0, scale, window, (c0 + c) * _CHUNK, (c0 + c + 1) * _CHUNK, m, l,
                     acc, s, kb, vb, offs)
        for gi in range(NG):
            part_m[c, g0 + gi] = m[gi, 0]
            part_l[c, g0 + gi] = l[gi, 0]
            part_acc[c, g0 + gi] = acc[gi, 0]
        done += 1
    _finish(ctr, slot, nr, done)
    _wait(ctr, slot, nr, n_chunks * per)
    _merge_chunks(part_m[:n_chunks], part_l[:n_chunks], part_acc[:n_chunks], out.reshape(KVH, G, D))


@njit(parallel=True, cache=True)
def _decode_step(mask, token, pos, n_chunks, buffer, panels, table, attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm,
                 post_attn, post_ffn, lcfg, act, embd_scale, kvs, pages, ps, cos, sin, neox, eps, scale, H, out_norm,
                 logits, n_threads, offs, res, part_m, part_l, part_acc, ctr, f32, i8, n_items):
    """One token through every layer in one parallel region: each thread runs `_worker`, and
    the products and attention are shared out as work items (see npllama.workshare).

    offs: where each product's results sit in a row of res (`DecodePlan.offs`). The working
    memory is the caller's (`DecodePlan._scratch_for`), reused from step to step: res
    (n_layer, offs[-1]), the shared results, one set per layer (a fast thread may run layers
    ahead of one still reading the previous layer's results); part_m, part_l and part_acc,
    room for the attention chunks' states (flat: at least n_layer x n_chunks x KVH x G, x D
    for part_acc); ctr, the work counters (zeroed here); f32, i8 and n_items, one row per
    thread (i8: (threads, L) for int8 activations, (threads, 3, L) for int24's planes)."""
    n_layer = attn_norm.shape[0]
    KVH, D = kvs.shape[2], kvs.shape[4]
    G = H // KVH
    n_part = n_layer * n_chunks * KVH * G
    pm = part_m[:n_part].reshape(n_layer, n_chunks, KVH, G)
    pl = part_l[:n_part].reshape(n_layer, n_chunks, KVH, G)
    pa = part_acc[:n_part * D].reshape(n_layer, n_chunks, KVH, G, D)
    ctr[:_slot(n_layer + 1, 0, n_threads)] = 0
    for t in prange(n_threads):
        home = np.int64(t)  # prange's index is unsigned in the parallel region: one signature of _worker
        _worker(mask, ctr, home, n_threads, token, pos, buffer, panels, table, attn_norm, ffn_norm, bq, bk, bv, q_norm,
                k_norm, post_attn, post_ffn, lcfg, act, embd_scale, kvs, pages, ps, cos, sin, neox, eps, scale, H,
                out_norm, logits, res, offs, pm, pl, pa, f32[home], i8[home], n_items[home])
