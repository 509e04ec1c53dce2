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
from numba import njit

from .attention import _MIN_CHUNK, _NO_ALIBI, _NO_MASK, _TASKS_PER_THREAD, _decode_kernel
from .kernels import _rmsnorm_row, _rope_row, _swiglu_row
from .quants import _deq_row, _matvec
from .quants_int8 import _has_i8, _matvec_i8, _quantize_x_q8

_WQ, _WK, _WV, _WO, _WG, _WU, _WD = range(7)


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
def _project(code, w, x, out, int8, qs, d, s):
    """out = W x, by the int8 kernel (quantizing x into qs, d, s) when enabled and available.
    Quantizing costs well under a microsecond, so it is simply done for every product."""
    if int8 and _has_i8(code):
        _quantize_x_q8(x, qs, d, s)
        _matvec_i8(code, w, x, qs, d, s, out)
    else:
        _matvec(code, w, x, out)


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
    up = np.empty(n_ff, np.float32)
    # int8 forms (values, block scales, block sums) of the activations that feed products,
    # used when int8 is on: the normed h (n_embd), the attention output (H*D), the FFN's (n_ff)
    qe, de, se = np.empty(n_embd, np.int8), np.empty(n_embd // 32, np.float32), np.empty(n_embd // 32, np.float32)
    qa, da, sa = np.empty(H * D, np.int8), np.empty(H * D // 32, np.float32), np.empty(H * D // 32, np.float32)
    qf, df, sf = np.empty(n_ff, np.int8), np.empty(n_ff // 32, np.float32), np.empty(n_ff // 32, np.float32)
    _deq_row(embd_code, embd[token], x)
    for li in range(n_layer):
        kv = kvs[li]
        _rmsnorm_row(x, attn_norm[li], eps, h)
        _project(codes[li, _WQ], wq[li], h, q.reshape(H * D), int8, qe, de, se)
        _project(codes[li, _WK], wk[li], h, k.reshape(KVH * D), int8, qe, de, se)
        _project(codes[li, _WV], wv[li], h, v.reshape(KVH * D), int8, qe, de, se)
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
        _project(codes[li, _WO], wo[li], att.reshape(H * D), tmp, int8, qa, da, sa)
        x += tmp
        _rmsnorm_row(x, ffn_norm[li], eps, h)
        _project(codes[li, _WG], wg[li], h, gate, int8, qe, de, se)
        _project(codes[li, _WU], wu[li], h, up, int8, qe, de, se)
        _swiglu_row(gate, up, gate)
        _project(codes[li, _WD], wd[li], gate, tmp, int8, qf, df, sf)
        x += tmp
    _rmsnorm_row(x, out_norm, eps, h)
    _project(out_code, out_w, h, logits, int8, qe, de, se)
