"""Small elementwise and normalisation kernels of the transformer block: RMSNorm, SwiGLU and RoPE.

Each kernel is a private `@njit` function over contiguous float32 arrays; the public wrappers
check shapes and dtypes and raise `ValueError` naming the offending value.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .errors import ContextOverflowError

_FM = {"contract", "arcp", "nsz", "reassoc"}  # never nnan/ninf: infinities must survive


@njit(cache=True, fastmath=_FM)
def _rmsnorm_row(x, w, eps, out):
    # x, w, out: (n,)
    n = x.shape[0]
    acc = 0.0
    for i in range(n):
        acc += np.float64(x[i]) * x[i]
    r = np.float32(1.0 / np.sqrt(acc / n + eps))
    for i in range(n):
        out[i] = (x[i] * r) * w[i]


@njit(parallel=True, cache=True, fastmath=_FM)
def _rmsnorm(x, w, eps, out):
    # x, out: (S, n); w: (n,)
    for s in prange(x.shape[0]):
        _rmsnorm_row(x[s], w, eps, out[s])


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """`x / sqrt(mean(x**2) + eps) * w` over the last axis of `x` ((n,) or (S, n))."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1])
    if w.shape != (x2.shape[1],):
        raise ValueError(f"rmsnorm: weight has shape {w.shape} but x has {x2.shape[1]} features")
    res = np.empty_like(x2) if out is None else out.reshape(x2.shape)
    _rmsnorm(x2, np.ascontiguousarray(w, dtype=np.float32), float(eps), res)
    return res.reshape(np.shape(x))


@njit(cache=True, fastmath=_FM)
def _swiglu_row(gate, up, out):
    # gate, up, out: (n,); out = silu(gate) * up
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g / (np.float32(1.0) + np.exp(-g)) * up[i]


@njit(parallel=True, cache=True, fastmath=_FM)
def _swiglu(gate, up, out):
    # gate, up, out: (S, n)
    for s in prange(gate.shape[0]):
        _swiglu_row(gate[s], up[s], out[s])


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`silu(gate) * up`, elementwise, for (n,) or (S, n) inputs of equal shape."""
    if np.shape(gate) != np.shape(up):
        raise ValueError(f"swiglu: gate has shape {np.shape(gate)} but up has {np.shape(up)}")
    shape = np.shape(gate)
    g = np.ascontiguousarray(gate, dtype=np.float32).reshape(-1, shape[-1])
    u = np.ascontiguousarray(up, dtype=np.float32).reshape(g.shape)
    res = np.empty_like(g) if out is None else out.reshape(g.shape)
    _swiglu(g, u, res)
    return res.reshape(shape)


class RopeTable:
    """cos and sin of every (position, frequency) pair, computed once in float64, stored as float32.

    `cos`, `sin`: (n_ctx, rope_dim // 2). Frequency i is `base ** (-2i / rope_dim)`, divided by
    `freq_factors[i]` when the model ships them (Llama 3's `rope_freqs`); linear scaling divides
    the position by `scale`. `neox` selects the pairing: NeoX halves (x[i], x[i + d/2]) when True,
    adjacent pairs (x[2i], x[2i+1]) as llama GGUFs store them when False.
    """

    def __init__(self, n_ctx: int, rope_dim: int, base: float, *, neox: bool = False,
                 scale: float = 1.0, freq_factors: np.ndarray | None = None):
        if rope_dim <= 0 or rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
        inv = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if freq_factors is not None:
            if np.shape(freq_factors) != inv.shape:
                raise ValueError(f"rope freq factors have shape {np.shape(freq_factors)}, need {inv.shape}")
            inv = inv / np.asarray(freq_factors, dtype=np.float64)
        ang = np.outer(np.arange(n_ctx, dtype=np.float64) / scale, inv)
        self.n_ctx, self.rope_dim, self.neox = n_ctx, rope_dim, neox
        self.cos = np.cos(ang).astype(np.float32)  # (n_ctx, rope_dim // 2)
        self.sin = np.sin(ang).astype(np.float32)  # (n_ctx, rope_dim // 2)

    def check(self, positions: np.ndarray) -> None:
        """Raise ContextOverflowError if any position lies outside [0, n_ctx)."""
        if len(positions) and (positions.min() < 0 or positions.max() >= self.n_ctx):
            bad = int(positions.max()) if positions.max() >= self.n_ctx else int(positions.min())
            raise ContextOverflowError(
                f"position {bad} is outside the model's context of {self.n_ctx} tokens "
                f"(valid positions are 0..{self.n_ctx - 1}); shorten the input, or truncate "
                f"or reset the session")

    def apply(self, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Rotate x (S, H, D) in place by the angles of `positions` (S,) and return it."""
        positions = np.asarray(positions, dtype=np.int64)
        if x.ndim != 3 or x.shape[0] != positions.shape[0] or x.shape[2] < self.rope_dim:
            raise ValueError(f"rope: x has shape {x.shape}; need (S, H, D >= {self.rope_dim}) "
                             f"with S = {positions.shape[0]} positions")
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            raise ValueError("rope: x must be a C-contiguous float32 array (it is rotated in place)")
        self.check(positions)
        _rope(x, positions, self.cos, self.sin, self.neox)
        return x


@njit(cache=True, fastmath=_FM)
def _rope_row(x, p, cos, sin, neox):
    # x: (H, D) of one token at position p, rotated in place; cos, sin: (n_ctx, rope_dim // 2)
    half = cos.shape[1]
    for h in range(x.shape[0]):
        for i in range(half):
            c = cos[p, i]
            sn = sin[p, i]
            if neox:
                a = x[h, i]
                b = x[h, i + half]
                x[h, i] = a * c - b * sn
                x[h, i + half] = a * sn + b * c
            else:
                a = x[h, 2 * i]
                b = x[h, 2 * i + 1]
                x[h, 2 * i] = a * c - b * sn
                x[h, 2 * i + 1] = a * sn + b * c


@njit(parallel=True, cache=True, fastmath=_FM)
def _rope(x, positions, cos, sin, neox):
    # x: (S, H, D) rotated in place
    for s in prange(x.shape[0]):
        _rope_row(x[s], positions[s], cos, sin, neox)
