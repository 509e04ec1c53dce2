"""The packed pass's layers in one compiled call and one parallel region.

`batch.forward_batch` runs the block (block.py's description) over the packed tokens of many
sequences. Through `block.run_layers` and `PanelOps` that is 14 kernel calls a layer from
Python, 423 a pass on a 30-layer model, ~9 of them parallel regions: for a decode pass of 16
sequences the Python between the kernels took ~3 ms of a 20 ms pass, and each region's
fork and join more (two threads ran such a pass only 1.4-1.8x as fast as one).

`_layers` runs every layer in one ``prange`` over the threads, as the fused decode step
(decode.py) runs a token: each thread runs `_worker`, which takes the items of each phase of
a layer from atomic counters (npllama.workshare) and waits for the phase's last item before
the next. The items are per token (norms, quantized activations, biases, RoPE, the pool's
writes), per panel of 16 weight rows (the products, by `panels._panel_rows` as
`_matmul_panels` computes them) and per attention task (`paged_attention._paged_task`, as the
paged kernel's). Each computes what block.run_layers computes for it, by the same routines,
so a token gets the same bits either way (tests compare them). The weights are addressed
through the fused decode step's table (decode.DecodePlan: panels in the model's panel arena,
the architecture's optional pieces as stacked arrays, the type mask of the panel kernels'
code), so it serves models whose every layer product has panels; the others take
`block.run_layers`.

A session's prompt runs here too (`Transformer._forward`): a KVCache's buffers are the
records of one page as long as its capacity, read through a page table of one entry. On an
Intel Xeon with two threads, prompts of 8 to 56 tokens took 0.46-0.87x the time that
block.run_layers' kernel calls took, and prompts of 128 to 400 tokens 0.80-0.95x.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ..kernels import linking
from ..kernels.aligned import _empty
from ..kernels.f16 import bits
from ..kernels.nn import _rmsnorm_row, _rope_row
from ..kernels.paged_attention import _paged_task, _task_heads, _write_records
from ..kernels.panels import PANEL, _glu_store, _panel_rows, _quantize_into, _store, empty_rows, weight_bytes
from ..kernels.workshare import _finish, _take, _wait, phase_size
from .decode import _residual, _weight

__all__ = ["fits", "run_layers"]


def fits(model) -> bool:
    """Whether `run_layers` serves `model`: no mixture of experts, every layer product on panels."""
    return not model.config.n_expert and bool(model.decode_plan.table[:-1, :, 4].all())


def run_layers(model, x: np.ndarray, positions: np.ndarray, records: np.ndarray, page_size: int,
               slots: np.ndarray, tables: np.ndarray, blocks, end: int, threads: int) -> np.ndarray:
    """`block.run_layers` for packed tokens x (T, n_embd) at `positions`, in place, for a
    model that `fits`: their keys and values go to the records `slots` of every layer of
    `records` (n_layers, records, KVH, 2, D), float32 or float16, as a KVPool's `slots()`
    holds them: pages of `page_size` records, or a session's KVCache `buffers()` as one page
    of its capacity), and attention reads the sequences' pages through `tables` in the query
    blocks `blocks` (paged_attention.plan_blocks); `end`: one past the last position.
    `threads` workers share the work (the region runs them on at most Numba's threads; with
    fewer, the work sharing still finishes, with the same results)."""
    plan, cfg = model.decode_plan, model.config
    T = x.shape[0]
    cos, sin = model.ropes.tables(end)
    n_ff = int(plan.table[0, 4, 2])
    forms = [empty_rows(T, n, plan.int8) for n in (cfg.n_embd, cfg.q_dim, n_ff)]
    kvs = bits(records)
    kvs = kvs.reshape(kvs.shape[0], -1, page_size, *kvs.shape[2:])  # (layers, pages, page size, KVH, 2, D)
    _layers(plan.mask, x, positions, slots, tables, *blocks, plan.buffer, plan.panels, plan.table, plan.attn_norm,
            plan.ffn_norm, plan.bq, plan.bk, plan.bv, plan.q_norm, plan.k_norm, plan.post_attn, plan.post_ffn,
            plan.lcfg, plan.act, kvs, cos, sin, cfg.rope_neox, plan.eps, plan.scale, cfg.n_head, *forms,
            threads)
    return x


_PHASES = 10  # the work phases of a layer (`_worker`)


@njit(parallel=True, cache=True)
def _layers(mask, x, positions, slots, tables, blk_seq, blk_row, blk_pos, blk_len, buffer, panels, table, attn_norm,
            ffn_norm, bq, bk, bv, q_norm, k_norm, post_attn, post_ffn, lcfg, act, kvs, cos, sin, neox, eps, scale,
            H, xe, xa, xf, nt):
    """Every layer of block.run_layers with PanelOps' kernels (the module's docstring), in one
    parallel region of `nt` threads: each runs `_worker`, taking the items of each phase.
    kvs: (layers, pages, page size, KVH, 2, D); xe, xa, xf: room for the activation forms
    (panels.empty_rows) of T rows of n_embd, H * D and n_ff values; mask: the types whose
    code the panel kernels hold (DecodePlan.mask)."""
    T, n_embd = x.shape
    n_layer = attn_norm.shape[0]
    KVH, D = kvs.shape[3], kvs.shape[5]
    e = table[0]
    # the activations on cache lines (npllama.aligned), as their rows are read a vector at a time
    h = _empty((T, n_embd), np.float32)
    q = _empty((T, e[0, 2]), np.float32)
    k = _empty((T, e[1, 2]), np.float32)
    v = _empty((T, e[2, 2]), np.float32)
    qn = _empty((T, H, D), np.float32)  # q and k after their norms (q_norm), else unused
    kn = _empty((T, KVH, D), np.float32)
    a = _empty((T, H, D), np.float32)
    o = _empty((T, e[3, 2]), np.float32)
    f = _empty((T, e[4, 2]), np.float32)
    d = _empty((T, e[6, 2]), np.float32)
    ctr = np.empty((n_layer * _PHASES + 1) * phase_size(nt), np.int64)
    for i in range(ctr.shape[0]):  # a loop, which stays serial (np.zeros would be a region of its own)
        ctr[i] = 0
    for t in prange(nt):
        home = np.int64(t)  # prange's index is unsigned in the parallel region: one signature of _worker
        _worker(mask, home, nt, ctr, x, positions, slots, tables, blk_seq, blk_row, blk_pos, blk_len, buffer, panels,
                table, attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm, post_attn, post_ffn, lcfg, act, kvs, cos,
                sin, neox, eps, scale, xe, xa, xf, h, q, k, v, qn, kn, a, o, f, d)


@linking.out_of_line  # compiled once, called by the parallel region
@njit(cache=True)
def _worker(mask, home, nt, ctr, x, positions, slots, tables, blk_seq, blk_row, blk_pos, blk_len, buffer, panels, table,
            attn_norm, ffn_norm, bq, bk, bv, q_norm, k_norm, post_attn, post_ffn, lcfg, act, kvs, cos, sin, neox,
            eps, scale, xe, xa, xf, h, q, k, v, qn, kn, a, o, f, d):
    """One thread's part of `_layers`. A layer is ten phases, each a list of items that the
    threads take (npllama.workshare) and then wait for: per token, the residual of the
    previous layer's FFN, the norm and the quantized input; the q/k/v panels; per token, the
    biases, q/k norms, RoPE and the pool's writes; the attention tasks of the paged kernel;
    per token, the quantized attention output; the o panels; per token, the residual, the
    FFN's norm and quantized input; the gate/up panels with their GLU; per token, the
    quantized GLU; the down panels. Each item computes what block.run_layers computes for
    it, by the same routines, so the bits are the same."""
    T = x.shape[0]
    H, D = a.shape[1], a.shape[2]
    KVH = kvs.shape[3]
    n_layer = attn_norm.shape[0]
    n_rec = kvs.shape[1] * kvs.shape[2]
    # the products' table entries as int64, not literals: Numba compiles a callee once for
    # each literal it is called with, and each of _panel_phase's compiled versions would
    # carry its own copy of the panel kernels' code (inlined, `panels._panel_rows`)
    i64 = np.int64
    tmp = _empty((T, PANEL), np.float32)
    tmp2 = _empty((T, PANEL), np.float32)
    wb = _empty((weight_bytes(T, max(xe[0].shape[-1], xa[0].shape[-1], xf[0].shape[-1])),), np.uint8)
    q3, k3, v3 = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
    per = _task_heads(KVH, blk_seq.shape[0])
    for li in range(n_layer + 1):
        at = li * _PHASES * phase_size(nt)
        step = phase_size(nt)
        last = li == n_layer
        w = ffn_norm[0] if last else attn_norm[li]
        _token_rows(ctr, at, home, nt, x, d, post_ffn, li - 1, li > 0, w, not last, eps, h, xe)
        if last:
            break
        e = table[li]
        _panel_phase(mask, ctr, at + step, home, nt, buffer, panels, e, i64(0), i64(3), xe, q, k, v, tmp, tmp2, wb,
                     act)
        qr, kr = (qn, kn) if q_norm.shape[1] else (q3, k3)
        _token_qkv(ctr, at + 2 * step, home, nt, li, q3, k3, v3, qr, kr, bq, bk, bv, q_norm, k_norm, lcfg, positions,
                   cos, sin, neox, eps, kvs[li].reshape(n_rec, KVH, 2, D), slots)
        n = blk_seq.shape[0] * per
        done = 0
        while True:
            i = _take(ctr, at + 3 * step, home, nt, n)
            if i < 0:
                break
            _paged_task(i, per, qr, kvs[li], tables, blk_seq, blk_row, blk_pos, blk_len, scale, lcfg[li, 1], a)
            done += 1
        _finish(ctr, at + 3 * step, nt, done)
        _wait(ctr, at + 3 * step, nt, n)
        _quantize_phase(ctr, at + 4 * step, home, nt, a.reshape(T, H * D), xa)
        _panel_phase(mask, ctr, at + 5 * step, home, nt, buffer, panels, e, i64(3), i64(4), xa, o, o, o, tmp, tmp2,
                     wb, act)
        _token_rows(ctr, at + 6 * step, home, nt, x, o, post_attn, li, True, ffn_norm[li], True, eps, h, xe)
        _panel_phase(mask, ctr, at + 7 * step, home, nt, buffer, panels, e, i64(4), i64(5), xe, f, f, f, tmp, tmp2,
                     wb, act)
        _quantize_phase(ctr, at + 8 * step, home, nt, f, xf)
        _panel_phase(mask, ctr, at + 9 * step, home, nt, buffer, panels, e, i64(6), i64(7), xf, d, d, d, tmp, tmp2,
                     wb, act)


@njit(cache=True)
def _row_form(xr, t):
    """Row t of the activation form xr, as a form of one row."""
    return (xr[0][t:t + 1], xr[1][t:t + 1], xr[2][t:t + 1], xr[3][t:t + 1])


@linking.out_of_line
@njit(cache=True)
def _token_rows(ctr, slot, home, nt, x, r, post, li, add, w, norm, eps, h, xr):
    """Per token t (the items): x[t] += r[t], or its norm by post[li] where the architecture
    has post-norms (with `add`); then (with `norm`) h[t] = rmsnorm(x[t]) by w, quantized into
    row t of xr."""
    T = x.shape[0]
    n = np.empty(x.shape[1], np.float32)
    done = 0
    while True:
        t = _take(ctr, slot, home, nt, T)
        if t < 0:
            break
        if add:
            _residual(x[t], r[t], post, li, eps, n)
        if norm:
            _rmsnorm_row(x[t], w, eps, h[t])
            _quantize_into(h[t:t + 1], _row_form(xr, t))
        done += 1
    _finish(ctr, slot, nt, done)
    _wait(ctr, slot, nt, T)


@linking.out_of_line
@njit(cache=True)
def _quantize_phase(ctr, slot, home, nt, src, xr):
    """Per token t (the items): row t of src quantized into row t of xr."""
    T = src.shape[0]
    done = 0
    while True:
        t = _take(ctr, slot, home, nt, T)
        if t < 0:
            break
        _quantize_into(src[t:t + 1], _row_form(xr, t))
        done += 1
    _finish(ctr, slot, nt, done)
    _wait(ctr, slot, nt, T)


@linking.out_of_line
@njit(cache=True)
def _token_qkv(ctr, slot, home, nt, li, q, k, v, qr, kr, bq, bk, bv, q_norm, k_norm, lcfg, positions, cos, sin, neox,
               eps, kv, slots):
    """Per token t (the items): q/k/v's biases, q/k's norms per head into qr, kr (else qr, kr
    are q, k), RoPE, and the key and value written into the pool's record slots[t] (kv:
    (records, KVH, 2, D))."""
    T, KVH, D = k.shape
    done = 0
    while True:
        t = _take(ctr, slot, home, nt, T)
        if t < 0:
            break
        if bq.shape[1]:
            q[t].reshape(q.shape[1] * D)[:] += bq[li]
            k[t].reshape(KVH * D)[:] += bk[li]
            v[t].reshape(KVH * D)[:] += bv[li]
        if q_norm.shape[1]:
            for hh in range(q.shape[1]):
                _rmsnorm_row(q[t, hh], q_norm[li], eps, qr[t, hh])
            for g in range(KVH):
                _rmsnorm_row(k[t, g], k_norm[li], eps, kr[t, g])
        if lcfg[li, 0] >= 0:
            _rope_row(qr[t], positions[t], cos[lcfg[li, 0]], sin[lcfg[li, 0]], neox)
            _rope_row(kr[t], positions[t], cos[lcfg[li, 0]], sin[lcfg[li, 0]], neox)
        _write_records(kv, slots[t:t + 1], kr[t:t + 1], v[t:t + 1])
        done += 1
    _finish(ctr, slot, nt, done)
    _wait(ctr, slot, nt, T)


@linking.out_of_line
@njit(cache=True)
def _panel_phase(mask, ctr, slot, home, nt, buffer, panels, e, s0, s1, xr, out0, out1, out2, tmp, tmp2, wb, act):
    """The panels of products s0..s1-1 of a layer's table entries e (q, k and v: 0..2, into
    out0, out1, out2; o: 3; down: 6) as items, or (s0 == 4) the gate panels with their up
    panels, into out0 = act(gate) * up as `_gate_up_panels`."""
    n = 0
    for j in range(s0, s1):
        n += (e[j, 2] + PANEL - 1) // PANEL
    done = 0
    while True:
        i = _take(ctr, slot, home, nt, n)
        if i < 0:
            break
        j, p = s0, i
        while p >= (e[j, 2] + PANEL - 1) // PANEL:
            p -= (e[j, 2] + PANEL - 1) // PANEL
            j += 1
        out = out0 if j == s0 else (out1 if j == s0 + 1 else out2)
        for s in range(2 if s0 == 4 else 1):  # the gate's panel, then the up's; one call site: it is inlined
            _panel_rows(mask, e[j + s, 0], _weight(buffer, panels, e[j + s]), p, xr, tmp if s == 0 else tmp2, wb)
        if s0 == 4:
            _glu_store(tmp, tmp2, out, p, act)
        else:
            _store(tmp, out, p, e[j, 2])
        done += 1
    _finish(ctr, slot, nt, done)
    _wait(ctr, slot, nt, n)
