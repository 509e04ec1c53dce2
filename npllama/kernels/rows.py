"""Products and small kernels over a few to a few hundred activation rows: the prefill's and
the batched path's for weights without panels (engine/ops.py's PanelOps), and `matmul_rows`
where a model has products not on whole blocks.

The row kernels read every weight once per call: each parallel task dequantizes _TILE (4)
weight rows (quants._deq_row_vec: vector code for the common types) into a scratch that stays
in L1 and dots them with all T activation rows (four at a time, sixteen running sums), so the
dequantization is paid once per weight row and the T products run at the FMA rate; with at most
_FEW (3) rows, rows of the types with a direct dot (all quantized types but the floats) are
dotted straight from their blocks by the decode kernels' dots. Measured on 2 cores with
SmolLM2-135M Q4_1, this beats the tiled-dequant + BLAS path (`quants.matmul`) at every T from 2
to 512: dequantizing whole weights into memory costs more than the BLAS products gain.
`PanelOps` (engine/ops.py) computes the block's pieces of such weights by these kernels.
Their first argument is the type mask (qtypes.TypeMask) of the types whose code they hold:
the model's for PanelOps, the weight's group for `matmul_rows`.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .nn import _glu1, _rmsnorm_row, _rope_row
from .qtypes import kernel_types
from .quants import _FAST, _block_sums as _row_block_sums, _deq_row_vec, _dot_row, _has_dot

_FEW = 3          # up to this many rows, types with a direct dot dot the weight blocks directly
_TILE = 4         # weight rows dequantized together in _matmul_rows


@njit(cache=True)
def _block_sums(x):
    """(T, n // 32) sums of each row of x over its 32-element blocks (the minimum terms of the
    direct dots), by the decode step's kernel (quants._block_sums), so that a row's products
    take the same bits here as there. (A loop of its own, without fast-math flags of its own,
    took those of its first caller, and Numba cached whichever that was.)"""
    T, n = x.shape
    out = np.empty((T, n // 32), np.float32)
    for t in range(T):
        _row_block_sums(x[t], out[t])
    return out


@njit(fastmath=_FAST, cache=True)
def _tile(mask, code, data, r0, x, xsum, out, o0, w):
    """out[t, o0 + i] = dot(W[r0 + i], x[t]) for the (up to) _TILE weight rows from r0, by the
    code of the types of `mask` (a qtypes.TypeMask; quants.py's NaN for another type).

    With at most _FEW activation rows, rows of a type with a direct dot (`quants._has_dot`:
    Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and the K-quants) are dotted straight from their blocks (the
    decode kernels' dots; the row stays in L1 for the next activation row).
    Otherwise the rows are dequantized into the scratch `w` (_TILE, n) and dotted with four
    activation rows at a time (sixteen running sums: every load of a weight or of x feeds four
    FMAs, and a long row's scratch is read T / 4 times): every dequantized value is used T
    times. A last group of fewer than four rows repeats the last row, so every row's sums run
    in the same loop whatever T is.
    """
    T, n = x.shape
    nr = min(_TILE, data.shape[0] - r0)
    if T <= _FEW and _has_dot(code):
        for i in range(nr):
            row = data[r0 + i]
            for t in range(T):
                out[t, o0 + i] = _dot_row(mask, code, row, x[t], xsum[t])
        return
    for i in range(nr):
        _deq_row_vec(mask, code, data[r0 + i], w[i])
    for i in range(nr, _TILE):
        w[i, :] = 0.0
    w0 = w[0]
    w1 = w[1]
    w2 = w[2]
    w3 = w[3]
    for t in range(0, T, 4):
        xa, xb, xc, xd = x[t], x[min(t + 1, T - 1)], x[min(t + 2, T - 1)], x[min(t + 3, T - 1)]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        b0 = b1 = b2 = b3 = np.float32(0.0)
        c0 = c1 = c2 = c3 = np.float32(0.0)
        d0 = d1 = d2 = d3 = np.float32(0.0)
        for j in range(n):
            u0, u1, u2, u3 = w0[j], w1[j], w2[j], w3[j]
            v = xa[j]
            a0 += u0 * v
            a1 += u1 * v
            a2 += u2 * v
            a3 += u3 * v
            v = xb[j]
            b0 += u0 * v
            b1 += u1 * v
            b2 += u2 * v
            b3 += u3 * v
            v = xc[j]
            c0 += u0 * v
            c1 += u1 * v
            c2 += u2 * v
            c3 += u3 * v
            v = xd[j]
            d0 += u0 * v
            d1 += u1 * v
            d2 += u2 * v
            d3 += u3 * v
        for i, sums in enumerate(((a0, b0, c0, d0), (a1, b1, c1, d1), (a2, b2, c2, d2), (a3, b3, c3, d3))):
            if i < nr:
                for k in range(min(4, T - t)):
                    out[t + k, o0 + i] = sums[k]


@njit(parallel=True, fastmath=_FAST, cache=True)
def _matmul_rows(mask, code, data, x, out):
    """out = x @ W.T for a GGUF weight W (rows, row_bytes) and a few rows x (T, n): one task
    per _TILE weight rows, so every weight byte is read once per call."""
    xsum = _block_sums(x)
    n_tiles = (data.shape[0] + _TILE - 1) // _TILE
    for c in prange(n_tiles):
        w = np.empty((_TILE, x.shape[1]), np.float32)
        _tile(mask, code, data, c * _TILE, x, xsum, out, c * _TILE, w)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _qkv_rows(mask, cq, wq, ck, wk, cv, wv, x, q, k, v):
    """q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T in one parallel region over all their tiles."""
    xsum = _block_sums(x)
    tq = (wq.shape[0] + _TILE - 1) // _TILE
    tk = (wk.shape[0] + _TILE - 1) // _TILE
    tv = (wv.shape[0] + _TILE - 1) // _TILE
    for c in prange(tq + tk + tv):
        w = np.empty((_TILE, x.shape[1]), np.float32)
        if c < tq:
            _tile(mask, cq, wq, c * _TILE, x, xsum, q, c * _TILE, w)
        elif c < tq + tk:
            _tile(mask, ck, wk, (c - tq) * _TILE, x, xsum, k, (c - tq) * _TILE, w)
        else:
            _tile(mask, cv, wv, (c - tq - tk) * _TILE, x, xsum, v, (c - tq - tk) * _TILE, w)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _gate_up_rows(mask, cg, wg, cu, wu, x, out, act):
    """out = act(x @ Wg.T) * (x @ Wu.T) in one parallel region (the GLU fused per tile; act:
    a code of kernels.ACTS)."""
    T = x.shape[0]
    xsum = _block_sums(x)
    n_tiles = (wg.shape[0] + _TILE - 1) // _TILE
    for c in prange(n_tiles):
        w = np.empty((_TILE, x.shape[1]), np.float32)
        g = np.empty((T, _TILE), np.float32)
        u = np.empty((T, _TILE), np.float32)
        r0 = c * _TILE
        _tile(mask, cg, wg, r0, x, xsum, g, 0, w)
        _tile(mask, cu, wu, r0, x, xsum, u, 0, w)
        n = min(_TILE, wg.shape[0] - r0)
        for t in range(T):  # elementwise: a row slice per token would cost more than the GLU
            for i in range(n):
                out[t, r0 + i] = _glu1(g[t, i], u[t, i], act)


@njit(cache=True)
def _rmsnorm_rows(x, w, eps, out):
    """RMSNorm of each row, serially: for a few rows a parallel region costs more than the work."""
    for t in range(x.shape[0]):
        _rmsnorm_row(x[t], w, eps, out[t])


@njit(cache=True)
def _rope_rows(x, positions, cos, sin, neox):
    """RoPE of each token (T, heads, D) at its own position, in place, serially."""
    for t in range(x.shape[0]):
        _rope_row(x[t], positions[t], cos, sin, neox)


def _small(w) -> bool:
    """Whether products with `w` can use the few-rows kernels (whole 32-element blocks)."""
    return w.cols % 32 == 0


def matmul_rows(w, x: np.ndarray) -> np.ndarray:
    """x @ W.T for a model weight `w` (a QWeight) and a few activation rows x (T, n), reading
    the weight once (see `_tile`); the decode kernels for T == 1."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[0] == 1 or not _small(w):
        return w @ x
    out = np.empty((x.shape[0], w.rows), np.float32)
    _matmul_rows(kernel_types([w.qtype]), int(w.qtype), w.data, x, out)
    return out
