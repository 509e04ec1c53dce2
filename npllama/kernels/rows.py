"""Products and small kernels over a few to a few hundred activation rows: the batched
path's (batch.forward_batch) and prefill's products (Model.forward's `matmul_rows`).

The row kernels read every weight once per call: each parallel task dequantizes _TILE (4)
weight rows into a scratch that stays in L1 and dots them with all T activation rows (two at
a time, eight running sums), so the dequantization is paid once per weight row and the T
products run at the FMA rate; with at most _FEW (3) rows, rows of the types with a direct
dot (all quantized types but the floats) are dotted straight from their blocks by the decode
kernels' dots. Measured on 2 cores with SmolLM2-135M Q4_1, this beats the tiled-dequant +
BLAS path (`quants.matmul`) at every T from 2 to 512: dequantizing whole weights into memory
costs more than the BLAS products gain. The exact prefill's `RowOps` (engine/ops.py) is
the block's pieces computed by these kernels.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .f16 import _half_bits_to_f32
from .nn import _glu1, _rmsnorm_row, _rope_row
from .quants import _FAST, _Q4_0, _Q4_1, _Q8_0, _deq_row, _dot_row, _has_dot

_FEW = 3          # up to this many rows, types with a direct dot dot the weight blocks directly
_TILE = 4         # weight rows dequantized together in _matmul_rows


@njit(fastmath=_FAST, cache=True, inline="always")
def _half_at(src, o):
    """The float16 at byte offset o of uint8 `src`, as float32 (hardware conversion)."""
    return _half_bits_to_f32(np.uint32(src[o]) | (np.uint32(src[o + 1]) << 8))


@njit(fastmath=_FAST, cache=True)
def _deq_row_fast(code, src, dst, half):
    """Dequantize one row; `half` (= 16, passed at run time) keeps LLVM from unrolling the
    block's inner loop, so it is vectorised along the block instead of across blocks."""
    nb = dst.shape[0] // 32
    if code == _Q4_1:
        for b in range(nb):
            o = b * 20
            y = b * 32
            d = _half_at(src, o)
            m = _half_at(src, o + 2)
            for j in range(half):
                q = np.int32(src[o + 4 + j])
                dst[y + j] = d * np.float32(q & 15) + m
                dst[y + half + j] = d * np.float32(q >> 4) + m
    elif code == _Q4_0:
        for b in range(nb):
            o = b * 18
            y = b * 32
            d = _half_at(src, o)
            for j in range(half):
                q = np.int32(src[o + 2 + j])
                dst[y + j] = d * np.float32((q & 15) - 8)
                dst[y + half + j] = d * np.float32((q >> 4) - 8)
    elif code == _Q8_0:
        qs = src.view(np.int8)
        for b in range(nb):
            o = b * 34
            y = b * 32
            d = _half_at(src, o)
            for j in range(2 * half):
                dst[y + j] = np.float32(qs[o + 2 + j]) * d
    else:
        _deq_row(code, src, dst)


@njit(cache=True)
def _block_sums(x):
    """(T, n // 32) sums of each row of x over its 32-element blocks (Q4_1's offset term)."""
    T, n = x.shape
    nb = n // 32
    out = np.empty((T, nb), np.float32)
    for t in range(T):
        for b in range(nb):
            acc = np.float32(0.0)
            for j in range(32):
                acc += x[t, b * 32 + j]
            out[t, b] = acc
    return out


@njit(fastmath=_FAST, cache=True)
def _tile(code, data, r0, x, xsum, out, o0, w, half):
    """out[t, o0 + i] = dot(W[r0 + i], x[t]) for the (up to) _TILE weight rows from r0.

    With at most _FEW activation rows, rows of a type with a direct dot (`quants._has_dot`:
    Q4_0/Q4_1/Q8_0, Q5_0/Q5_1 and the K-quants) are dotted straight from their blocks (the
    decode kernels' dots; the row stays in L1 for the next activation row).
    Otherwise the rows are dequantized into the scratch `w` (_TILE, n) and dotted with two
    activation rows at a time (eight running sums): every dequantized value is used T times.
    """
    T, n = x.shape
    nr = min(_TILE, data.shape[0] - r0)
    if T <= _FEW and _has_dot(code):
        for i in range(nr):
            row = data[r0 + i]
            for t in range(T):
                out[t, o0 + i] = _dot_row(code, row, x[t], xsum[t])
        return
    for i in range(nr):
        _deq_row_fast(code, data[r0 + i], w[i], half)
    for i in range(nr, _TILE):
        w[i, :] = 0.0
    w0 = w[0]
    w1 = w[1]
    w2 = w[2]
    w3 = w[3]
    t = 0
    while t < T:
        xa = x[t]
        xb = x[t + 1] if t + 1 < T else x[t]
        a0 = a1 = a2 = a3 = np.float32(0.0)
        b0 = b1 = b2 = b3 = np.float32(0.0)
        for j in range(n):
            u = xa[j]
            v = xb[j]
            a0 += w0[j] * u
            a1 += w1[j] * u
            a2 += w2[j] * u
            a3 += w3[j] * u
            b0 += w0[j] * v
            b1 += w1[j] * v
            b2 += w2[j] * v
            b3 += w3[j] * v
        for i, (a, b) in enumerate(((a0, b0), (a1, b1), (a2, b2), (a3, b3))):
            if i < nr:
                out[t, o0 + i] = a
                if t + 1 < T:
                    out[t + 1, o0 + i] = b
        t += 2


@njit(parallel=True, fastmath=_FAST, cache=True)
def _matmul_rows(code, data, x, out, half):
    """out = x @ W.T for a GGUF weight W (rows, row_bytes) and a few rows x (T, n): one task
    per _TILE weight rows, so every weight byte is read once per call."""
    xsum = _block_sums(x)
    n_tiles = (data.shape[0] + _TILE - 1) // _TILE
    for c in prange(n_tiles):
        w = np.empty((_TILE, x.shape[1]), np.float32)
        _tile(code, data, c * _TILE, x, xsum, out, c * _TILE, w, half)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _qkv_rows(cq, wq, ck, wk, cv, wv, x, q, k, v, half):
    """q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T in one parallel region over all their tiles."""
    xsum = _block_sums(x)
    tq = (wq.shape[0] + _TILE - 1) // _TILE
    tk = (wk.shape[0] + _TILE - 1) // _TILE
    tv = (wv.shape[0] + _TILE - 1) // _TILE
    for c in prange(tq + tk + tv):
        w = np.empty((_TILE, x.shape[1]), np.float32)
        if c < tq:
            _tile(cq, wq, c * _TILE, x, xsum, q, c * _TILE, w, half)
        elif c < tq + tk:
            _tile(ck, wk, (c - tq) * _TILE, x, xsum, k, (c - tq) * _TILE, w, half)
        else:
            _tile(cv, wv, (c - tq - tk) * _TILE, x, xsum, v, (c - tq - tk) * _TILE, w, half)


@njit(parallel=True, fastmath=_FAST, cache=True)
def _gate_up_rows(cg, wg, cu, wu, x, out, half, act):
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
        _tile(cg, wg, r0, x, xsum, g, 0, w, half)
        _tile(cu, wu, r0, x, xsum, u, 0, w, half)
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
    _matmul_rows(int(w.qtype), w.data, x, out, 16)
    return out
