"""The fused decode step: one token through every layer in a single compiled call.

Decoding one token is a chain of ~12 small kernels per layer. Called one by one from Python,
their wrappers (argument checks, dispatch) cost as much as the arithmetic on a small model.
`DecodePlan` gathers the per-layer weights once, as tuples of zero-copy views indexed by layer
inside compiled code, and `_decode_step` runs embedding, all layers, the output norm and the
output head without returning to Python. It writes the new key and value rows straight into
the KV cache buffers; the caller commits them to the cache afterwards.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from numba import njit, prange

from .attention import _MIN_CHUNK, _NO_ALIBI, _NO_MASK, _TASKS_PER_THREAD, _decode_kernel
from .kernels import _rmsnorm_row, _rope_row, _swiglu_row
from .quants import _Q4_0, _Q4_1, _Q8_0, _deq_row, _dot_row_q4_0, _dot_row_q4_1, _dot_row_q8_0, _matvec
from .quants_int8 import (_dot_row_q4_0_i8, _dot_row_q4_1_i8, _dot_row_q8_0_i8, _has_i8, _matvec_i8,
                          _quantize_x_q8)

_WQ, _WK, _WV, _WO, _WG, _WU, _WD = range(7)
_FM = {"contract", "arcp", "nsz", "reassoc"}


class DecodePlan:
    """Per-layer weights of a model, arranged for `_decode_step` (built once per model)."""

    def __init__(self, model, *, int8: bool = False):
        self.int8 = int8  # quantize activations to int8 blocks for the integer-dot kernels
        layers = model.layers
        cfg = model.config

        def weights(attr):
            return tuple(np.ascontiguousarray(getattr(L, attr).data) for L in layers)

        def stack(attr, width):
            rows = [getattr(L, attr) for L in layers]
            if rows[0] is None:
                return np.zeros((len(layers), 0), np.float32)
            return np.ascontiguousarray(np.stack(rows), dtype=np.float32).reshape(len(layers), width)

        q_dim, kv_dim = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
        self.w = tuple(weights(a) for a in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down"))
        # codes[layer, i]: quant type of weight i (_WQ.._WD) in that layer
        self.codes = np.array([[int(getattr(L, a).qtype) for a in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
                               for L in layers], dtype=np.int64)
        self.attn_norm = stack("attn_norm", cfg.n_embd)  # (n_layer, n_embd)
        self.ffn_norm = stack("ffn_norm", cfg.n_embd)    # (n_layer, n_embd)
        self.bq = stack("bq", q_dim)                     # (n_layer, q_dim) or (n_layer, 0)
        self.bk = stack("bk", kv_dim)
        self.bv = stack("bv", kv_dim)
        self.model = model

    def step(self, token: int, pos: int, cache) -> np.ndarray:
        """Logits (n_vocab,) of `token` at `pos` (== cache.length); writes row `pos` of every
        layer's K and V and commits it."""
        m, cfg = self.model, self.model.config
        cache.ensure_capacity(pos + 1)
        n_chunks = max(1, min(-(-_TASKS_PER_THREAD * numba.get_num_threads() // cfg.n_head_kv),
                              (pos + 1) // _MIN_CHUNK))
        chunk = max(1, -(-(pos + 1) // n_chunks))
        logits = np.empty(cfg.n_vocab, np.float32)
        _decode_step(token, pos, chunk, m.token_embd.data, int(m.token_embd.qtype), *self.w, self.codes,
                     self.attn_norm, self.ffn_norm, self.bq, self.bk, self.bv, cache.buffers(),
                     m.rope.cos, m.rope.sin, m.rope.neox, np.float32(cfg.rms_eps),
                     np.float32(1.0 / math.sqrt(cfg.head_dim)), cfg.n_head, m.output_norm,
                     m.output.data, int(m.output.qtype), self.int8, logits)
        cache.commit(1)
        return logits


@njit(cache=True)
def _has_row_dot(code):
    return code == _Q4_1 or code == _Q8_0 or code == _Q4_0


@njit(cache=True)
def _block_sums(x):
    """Sums of x over its 32-element blocks (the Q4_1 min term needs them)."""
    nb = x.shape[0] // 32
    out = np.empty(nb, np.float32)
    for b in range(nb):
        acc = np.float32(0.0)
        for j in range(32):
            acc += x[b * 32 + j]
        out[b] = acc
    return out


@njit(cache=True)
def _row_dot(code, row, x, xsum):
    nb = x.shape[0] // 32
    if code == _Q4_1:
        return _dot_row_q4_1(row, x, xsum, nb)
    if code == _Q8_0:
        return _dot_row_q8_0(row, x, nb)
    return _dot_row_q4_0(row, x, nb)


@njit(cache=True)
def _row_dot_i8(code, row, qs, d, s):
    nb = qs.shape[0] // 32
    if code == _Q4_1:
        return _dot_row_q4_1_i8(row, qs, d, s, nb)
    if code == _Q8_0:
        return _dot_row_q8_0_i8(row, qs, d, nb)
    return _dot_row_q4_0_i8(row, qs, d, s, nb)


@njit(cache=True)
def _dot(code, row, x, xsum, int8, qs, d, s):
    """One weight row with the activation: int8 dot when enabled, float32 dot otherwise."""
    if int8:
        return _row_dot_i8(code, row, qs, d, s)
    return _row_dot(code, row, x, xsum)


@njit(cache=True)
def _prepare(x, int8, qs, d, s):
    """Block sums of x (float32 path), and its int8 form when enabled."""
    if int8:
        _quantize_x_q8(x, qs, d, s)
    return _block_sums(x)


@njit(cache=True)
def _project(code, w, x, out, int8, qs, d, s):
    """out = W x, by the int8 kernel (quantizing x) when enabled and available."""
    if int8 and _has_i8(code):
        _quantize_x_q8(x, qs, d, s)
        _matvec_i8(code, w, x, qs, d, s, out)
    else:
        _matvec(code, w, x, out)


@njit(parallel=True, cache=True)
def _qkv(cq, wq, ck, wk, cv, wv, x, q, k, v, int8, qs, d, s):
    """q, k, v = Wq x, Wk x, Wv x in one parallel region over all their rows."""
    if not (_has_row_dot(cq) and _has_row_dot(ck) and _has_row_dot(cv)):
        _project(cq, wq, x, q, int8, qs, d, s)
        _project(ck, wk, x, k, int8, qs, d, s)
        _project(cv, wv, x, v, int8, qs, d, s)
        return
    xsum = _prepare(x, int8, qs, d, s)
    nq, nk = wq.shape[0], wk.shape[0]
    for r in prange(nq + 2 * nk):
        if r < nq:
            q[r] = _dot(cq, wq[r], x, xsum, int8, qs, d, s)
        elif r < nq + nk:
            k[r - nq] = _dot(ck, wk[r - nq], x, xsum, int8, qs, d, s)
        else:
            v[r - nq - nk] = _dot(cv, wv[r - nq - nk], x, xsum, int8, qs, d, s)


@njit(parallel=True, cache=True, fastmath=_FM)
def _gate_up(cg, wg, cu, wu, x, out, int8, qs, d, s):
    """out = silu(Wg x) * (Wu x) in one parallel region (or three kernels for other types)."""
    if not (_has_row_dot(cg) and _has_row_dot(cu)):
        up = np.empty_like(out)
        _project(cg, wg, x, out, int8, qs, d, s)
        _project(cu, wu, x, up, int8, qs, d, s)
        _swiglu_row(out, up, out)
        return
    xsum = _prepare(x, int8, qs, d, s)
    for r in prange(wg.shape[0]):
        g = _dot(cg, wg[r], x, xsum, int8, qs, d, s)
        out[r] = g / (np.float32(1.0) + np.exp(-g)) * _dot(cu, wu[r], x, xsum, int8, qs, d, s)


@njit(cache=True)
def _decode_step(token, pos, chunk, embd, embd_code, wq, wk, wv, wo, wg, wu, wd, codes,
                 attn_norm, ffn_norm, bq, bk, bv, kvs, cos, sin, neox, eps, scale, H,
                 out_norm, out_w, out_code, int8, logits):
    n_layer, n_embd = attn_norm.shape
    KVH, D = kvs[0].shape[1], kvs[0].shape[3]
    n_ff = wg[0].shape[0]
    # the small per-token steps (norms, rope, swiglu) run serially: a parallel region costs
    # more than they do
    x = np.empty(n_embd, np.float32)            # residual stream
    h = np.empty(n_embd, np.float32)            # normed input of a block
    tmp = np.empty(n_embd, np.float32)
    q = np.empty((1, H, D), np.float32)
    k = np.empty((1, KVH, D), np.float32)
    v = np.empty((1, KVH, D), np.float32)
    att = np.empty((1, H, D), np.float32)
    gate = np.empty(n_ff, np.float32)
    # int8 forms of the activations that feed products (used when int8 is on): values, block
    # scales, block sums; sized for the largest input (n_ff or n_head * head_dim)
    n_max = max(n_embd, n_ff, H * D)
    qs = np.empty(n_max, np.int8)
    dq = np.empty(n_max // 32, np.float32)
    sq = np.empty(n_max // 32, np.float32)
    _deq_row(embd_code, embd[token], x)
    for li in range(n_layer):
        kv = kvs[li]
        _rmsnorm_row(x, attn_norm[li], eps, h)
        _qkv(codes[li, _WQ], wq[li], codes[li, _WK], wk[li], codes[li, _WV], wv[li], h,
             q.reshape(H * D), k.reshape(KVH * D), v.reshape(KVH * D),
             int8, qs[:n_embd], dq[:n_embd // 32], sq[:n_embd // 32])
        if bq.shape[1]:
            q.reshape(H * D)[:] += bq[li]
            k.reshape(KVH * D)[:] += bk[li]
            v.reshape(KVH * D)[:] += bv[li]
        _rope_row(q[0], pos, cos, sin, neox)
        _rope_row(k[0], pos, cos, sin, neox)
        kv[pos, :, 0, :] = k[0]
        kv[pos, :, 1, :] = v[0]
        _decode_kernel(q, kv, 0, pos + 1, pos, 0, chunk, scale, np.float32(0.0), _NO_MASK, False,
                       _NO_ALIBI, False, att)
        _project(codes[li, _WO], wo[li], att.reshape(H * D), tmp, int8,
                 qs[:H * D], dq[:H * D // 32], sq[:H * D // 32])
        x += tmp
        _rmsnorm_row(x, ffn_norm[li], eps, h)
        _gate_up(codes[li, _WG], wg[li], codes[li, _WU], wu[li], h, gate,
                 int8, qs[:n_embd], dq[:n_embd // 32], sq[:n_embd // 32])
        _project(codes[li, _WD], wd[li], gate, tmp, int8, qs[:n_ff], dq[:n_ff // 32], sq[:n_ff // 32])
        x += tmp
    _rmsnorm_row(x, out_norm, eps, h)
    _project(out_code, out_w, h, logits, int8, qs[:n_embd], dq[:n_embd // 32], sq[:n_embd // 32])
