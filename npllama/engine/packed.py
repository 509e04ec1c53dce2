"""The packed pass's layers in one compiled call.

`batch.forward_batch` runs the block (block.py's description) over the packed tokens of many
sequences. Through `block.run_layers` and `PanelOps` that is ~14 kernel calls a layer from
Python, ~420 a pass on a 30-layer model: for a decode pass of 16 sequences their wrappers and
the Python between them took ~3 ms of a 20 ms pass. `_layers` makes the same kernel calls,
in the same order on the same arrays, from compiled code, so a token gets the same bits
either way. The weights are addressed through the fused decode step's table
(decode.DecodePlan: panels in the model's panel arena, the architecture's optional pieces as
stacked arrays), so it serves models whose every layer product has panels; the others take
`block.run_layers`.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ..kernels.f16 import bits
from ..kernels.paged_attention import _paged_kernel, _write_records
from ..kernels.panels import (_gate_up_panels, _matmul_panels, _qkv_panels, _quantize_parallel, empty_rows,
                              quantize_threads)
from ..kernels.rows import _rmsnorm_rows, _rope_rows
from .decode import _weight

__all__ = ["fits", "run_layers"]


def fits(model) -> bool:
    """Whether `run_layers` serves `model`: no mixture of experts, every layer product on panels."""
    return not model.config.n_expert and bool(model.decode_plan.table[:-1, :, 4].all())


def run_layers(model, x: np.ndarray, positions: np.ndarray, pool, slots: np.ndarray, tables: np.ndarray,
               blocks, end: int) -> np.ndarray:
    """`block.run_layers` for packed tokens x (T, n_embd) at `positions`, in place, for a
    model that `fits`: their keys and values go to the records `slots` of every layer of
    `pool` (a KVPool), and attention reads the sequences' pages through `tables` in the query
    blocks `blocks` (paged_attention.plan_blocks); `end`: one past the last position."""
    plan, cfg = model.decode_plan, model.config
    T = x.shape[0]
    cos, sin = model.ropes.tables(end)
    n_ff = int(plan.table[0, 4, 2])
    forms = [empty_rows(T, n, plan.int8) for n in (cfg.n_embd, cfg.q_dim, n_ff)]
    kvs = bits(pool.slots())
    kvs = kvs.reshape(kvs.shape[0], -1, pool.page_size, *kvs.shape[2:])  # (layers, pages, page size, KVH, 2, D)
    _layers(x, positions, slots, tables, *blocks, plan.buffer, plan.panels, plan.table, plan.attn_norm,
            plan.ffn_norm, plan.bq, plan.bk, plan.bv, plan.q_norm, plan.k_norm, plan.post_attn, plan.post_ffn,
            plan.lcfg, plan.act, kvs, cos, sin, cfg.rope_neox, plan.eps, plan.scale, cfg.n_head, *forms,
            quantize_threads(T))
    return x


@njit(cache=True)
def _quantize(h, xr, nt):
    """h's rows into the activation form xr (as many rows), in `nt` threads (panels._quantize)."""
    _quantize_parallel(h, xr, nt)
    return xr


@njit(cache=True)
def _product(buffer, panels, entry, xr, out):
    """out (T, rows) = h @ W.T for the weight of a DecodePlan.table entry, h quantized in xr."""
    _matmul_panels(entry[0], _weight(buffer, panels, entry), entry[2], xr, out)


@njit(cache=True)
def _add_normed(x, r, post, li, eps):
    """x += r, or x += rmsnorm(r) by post[li] where the architecture has post-norms."""
    if post.shape[1]:
        n = np.empty_like(r)
        _rmsnorm_rows(r, post[li], eps, n)
        x += n
    else:
        x += r


@njit(cache=True)
def _layers(x, positions, slots, tables, blk_seq, blk_row, blk_pos, blk_len, buffer, panels, table, attn_norm,
            ffn_norm, bq, bk, bv, q_norm, k_norm, post_attn, post_ffn, lcfg, act, kvs, cos, sin, neox, eps, scale,
            H, xe, xa, xf, nt):
    """Every layer of block.run_layers with PanelOps' kernels (see the module's docstring).
    kvs: (layers, pages, page size, KVH, 2, D); xe, xa, xf: room for the activation forms
    (panels.empty_rows) of T rows of n_embd, H * D and n_ff values; nt: threads to quantize
    them in."""
    T, n_embd = x.shape
    n_layer = attn_norm.shape[0]
    KVH, D = kvs.shape[3], kvs.shape[5]
    n_rec = kvs.shape[1] * kvs.shape[2]
    h = np.empty_like(x)
    for li in range(n_layer):
        e = table[li]
        _rmsnorm_rows(x, attn_norm[li], eps, h)
        xr = _quantize(h, xe, nt)
        q = np.empty((T, e[0, 2]), np.float32)
        k = np.empty((T, e[1, 2]), np.float32)
        v = np.empty((T, e[2, 2]), np.float32)
        _qkv_panels(e[0, 0], _weight(buffer, panels, e[0]), e[1, 0], _weight(buffer, panels, e[1]), e[2, 0],
                    _weight(buffer, panels, e[2]), xr, q, k, v)
        if bq.shape[1]:
            q += bq[li]
            k += bk[li]
            v += bv[li]
        q3, k3, v3 = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
        if q_norm.shape[1]:
            qn, kn = np.empty_like(q3), np.empty_like(k3)
            _rmsnorm_rows(q.reshape(T * H, D), q_norm[li], eps, qn.reshape(T * H, D))
            _rmsnorm_rows(k.reshape(T * KVH, D), k_norm[li], eps, kn.reshape(T * KVH, D))
            q3, k3 = qn, kn
        if lcfg[li, 0] >= 0:
            _rope_rows(q3, positions, cos[lcfg[li, 0]], sin[lcfg[li, 0]], neox)
            _rope_rows(k3, positions, cos[lcfg[li, 0]], sin[lcfg[li, 0]], neox)
        kv = kvs[li]
        _write_records(kv.reshape(n_rec, KVH, 2, D), slots, k3, v3)
        a = np.empty_like(q3)
        _paged_kernel(q3, kv, tables, blk_seq, blk_row, blk_pos, blk_len, scale, lcfg[li, 1], a)
        o = np.empty((T, e[3, 2]), np.float32)
        _product(buffer, panels, e[3], _quantize(a.reshape(T, H * D), xa, nt), o)
        _add_normed(x, o, post_attn, li, eps)
        _rmsnorm_rows(x, ffn_norm[li], eps, h)
        f = np.empty((T, e[4, 2]), np.float32)
        _gate_up_panels(e[4, 0], _weight(buffer, panels, e[4]), e[5, 0], _weight(buffer, panels, e[5]),
                        _quantize(h, xe, nt), f, act)
        d = np.empty((T, e[6, 2]), np.float32)
        _product(buffer, panels, e[6], _quantize(f, xf, nt), d)
        _add_normed(x, d, post_ffn, li, eps)
