"""Small elementwise and normalisation kernels of the transformer block: RMSNorm, LayerNorm,
SwiGLU / GeGLU, GELU and RoPE, and the float32 exponential they and attention use.

Each kernel is a private `@njit` function over contiguous float32 arrays; the public wrappers
check shapes and dtypes and raise `ValueError` naming the offending value.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..errors import ContextOverflowError

_FM = {"contract", "arcp", "nsz", "reassoc"}  # never nnan/ninf: infinities must survive


@intrinsic
def _pow2(typingctx, n):
    """2.0**n as float32 for an integer n in -126..127: n + 127 put in the exponent bits."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        e = builder.add(context.cast(builder, args[0], sig.args[0], types.int32), ir.Constant(i32, 127))
        return builder.bitcast(builder.shl(e, ir.Constant(i32, 23)), ir.FloatType())

    return types.float32(n), codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)              # ln 2 = _LN2_HI + _LN2_LO, _LN2_HI exact in 9 bits:
_LN2_LO = np.float32(-2.1219444005469057e-4)   # n * _LN2_HI is exact for |n| <= 128


@njit(cache=True, fastmath=False, error_model="numpy")
def _exp(x):
    """exp(x) in float32 that LLVM can vectorize (np.exp is a scalar libm call in Numba
    without SVML): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor series to r^7
    (truncation below 1e-8 relative), times 2^n as two factors (each in _pow2's range).
    Strict IEEE arithmetic even inside fast-math callers, which LLVM inlines it into: they
    must not merge the factors of 2^n or the two parts of n ln2.
    Within 2 ulp of np.exp; 0 below -87.3 (where exp(x) is subnormal) and for -inf, inf
    from 88.73 on, NaN for NaN."""
    xc = min(max(x, np.float32(-87.3)), np.float32(88.8))
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    n_lo = np.int32(n) >> 1
    y = ((p * r) * r + r + np.float32(1.0)) * _pow2(n_lo) * _pow2(np.int32(n) - n_lo)
    return np.float32(0.0) if x < np.float32(-87.3) else y


def _ir_exp(builder, x):
    """`_exp` of every lane of the float vector x as LLVM IR, bit for bit (the same operations
    in the same order, no fast-math flags; NaN stays NaN, -inf and x < -87.3 give 0)."""
    n = x.type.count
    vf, vi = ir.VectorType(ir.FloatType(), n), ir.VectorType(ir.IntType(32), n)
    c = lambda v: ir.Constant(vf, [float(np.float32(v))] * n)  # noqa: E731
    ci = lambda v: ir.Constant(vi, [v] * n)  # noqa: E731
    low = builder.fcmp_ordered("<", x, c(-87.3))
    xc = builder.select(low, c(-87.3), x)
    xc = builder.select(builder.fcmp_ordered(">", xc, c(88.8)), c(88.8), xc)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vf, [vf]), f"llvm.floor.v{n}f32")
    t = builder.call(floor, [builder.fadd(builder.fmul(xc, c(_LOG2E)), c(0.5))])
    r = builder.fsub(builder.fsub(xc, builder.fmul(t, c(_LN2_HI))), builder.fmul(t, c(_LN2_LO)))
    p = c(1.0 / 5040.0)
    for k in (1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5):
        p = builder.fadd(builder.fmul(p, r), c(k))
    e = builder.fptosi(t, vi)
    e_lo = builder.ashr(e, ci(1))
    pow2 = lambda k: builder.bitcast(builder.shl(builder.add(k, ci(127)), ci(23)), vf)  # noqa: E731
    y = builder.fadd(builder.fadd(builder.fmul(builder.fmul(p, r), r), r), c(1.0))
    y = builder.fmul(builder.fmul(y, pow2(e_lo)), pow2(builder.sub(e, e_lo)))
    return builder.select(low, c(0.0), y)


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
def _layernorm_row(x, w, b, eps, out):
    # x, w, b, out: (n,); out may be x. Mean and variance summed in float64, as rmsnorm's square.
    n = x.shape[0]
    acc = 0.0
    for i in range(n):
        acc += np.float64(x[i])
    mean = acc / n
    acc = 0.0
    for i in range(n):
        d = np.float64(x[i]) - mean
        acc += d * d
    r = np.float32(1.0 / np.sqrt(acc / n + eps))
    m = np.float32(mean)
    for i in range(n):
        out[i] = ((x[i] - m) * r) * w[i] + b[i]


@njit(parallel=True, cache=True, fastmath=_FM)
def _layernorm(x, w, b, eps, out):
    # x, out: (S, n); w, b: (n,)
    for s in prange(x.shape[0]):
        _layernorm_row(x[s], w, b, eps, out[s])


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """`(x - mean(x)) / sqrt(var(x) + eps) * w + b` over the last axis of `x` ((n,) or (S, n)),
    the biased variance as torch's LayerNorm has it. `out` may be `x` (normed in place)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1])
    n = x2.shape[1]
    if np.shape(w) != (n,) or np.shape(b) != (n,):
        raise ValueError(f"layernorm: weight has shape {np.shape(w)} and bias {np.shape(b)} but x has {n} "
                         f"features; both need ({n},)")
    if out is not None and (out.shape != np.shape(x) or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"layernorm: out must be a C-contiguous float32 array of x's shape {np.shape(x)}")
    res = np.empty_like(x2) if out is None else out.reshape(x2.shape)
    _layernorm(x2, np.ascontiguousarray(w, dtype=np.float32), np.ascontiguousarray(b, dtype=np.float32),
               float(eps), res)
    return out if out is not None else res.reshape(np.shape(x))


_SQRT1_2 = 0.7071067811865476


@njit(parallel=True, cache=True, fastmath=_FM)
def _gelu(x, out):
    # x, out: (S, n); out may be x. erf in float64, then rounded: GELU as torch computes it
    for s in prange(x.shape[0]):
        for i in range(x.shape[1]):
            v = np.float64(x[s, i])
            out[s, i] = np.float32(0.5 * v * (1.0 + math.erf(v * _SQRT1_2)))


def gelu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """GELU with the exact error function, `x/2 (1 + erf(x / sqrt(2)))` (BERT's "gelu"),
    elementwise over (n,) or (S, n). `out` may be `x` (in place)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, np.shape(x)[-1])
    if out is not None and (out.shape != np.shape(x) or out.dtype != np.float32 or not out.flags.c_contiguous):
        raise ValueError(f"gelu: out must be a C-contiguous float32 array of x's shape {np.shape(x)}")
    res = np.empty_like(x2) if out is None else out.reshape(x2.shape)
    _gelu(x2, res)
    return out if out is not None else res.reshape(np.shape(x))


ACTS = {"silu": 0, "gelu_tanh": 1}  # FFN activations by name -> the code the kernels take
_GELU_C = np.float32(2.0 * 0.7978845608028654)  # 2 sqrt(2 / pi)
_GELU_A = np.float32(0.044715)


@njit(cache=True, fastmath=_FM, error_model="numpy", inline="always")
def _glu1(g, u, act):
    """act(g) * u for one element, act a code of ACTS: silu(g) = g / (1 + exp(-g)), and
    gelu_tanh(g) = g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
                 = g / (1 + exp(-2 sqrt(2/pi) (g + 0.044715 g^3)))."""
    z = _GELU_C * (g + _GELU_A * g * g * g) if act == 1 else g
    return g / (np.float32(1.0) + _exp(-z)) * u


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _swiglu_row(gate, up, out):
    # gate, up, out: (n,); out = silu(gate) * up (no division check: the loop vectorizes)
    for i in range(gate.shape[0]):
        out[i] = _glu1(gate[i], up[i], 0)


@njit(cache=True, fastmath=_FM, error_model="numpy")
def _geglu_row(gate, up, out):
    # gate, up, out: (n,); out = gelu_tanh(gate) * up
    for i in range(gate.shape[0]):
        out[i] = _glu1(gate[i], up[i], 1)


@njit(cache=True)
def _glu_row(gate, up, out, act):
    """out = act(gate) * up for an activation code of ACTS."""
    if act == 1:
        _geglu_row(gate, up, out)
    else:
        _swiglu_row(gate, up, out)


@njit(parallel=True, cache=True, fastmath=_FM)
def _glu(gate, up, out, act):
    # gate, up, out: (S, n)
    for s in prange(gate.shape[0]):
        _glu_row(gate[s], up[s], out[s], act)


def glu(gate: np.ndarray, up: np.ndarray, act: str = "silu", out: np.ndarray | None = None) -> np.ndarray:
    """`act(gate) * up`, elementwise, for (n,) or (S, n) inputs of equal shape; `act` is
    "silu" (SwiGLU) or "gelu_tanh" (GeGLU, GELU with the tanh approximation)."""
    if act not in ACTS:
        raise ValueError(f"glu: activation must be one of {', '.join(ACTS)}, got {act!r}")
    if np.shape(gate) != np.shape(up):
        raise ValueError(f"glu: gate has shape {np.shape(gate)} but up has {np.shape(up)}")
    shape = np.shape(gate)
    g = np.ascontiguousarray(gate, dtype=np.float32).reshape(-1, shape[-1])
    u = np.ascontiguousarray(up, dtype=np.float32).reshape(g.shape)
    res = np.empty_like(g) if out is None else out.reshape(g.shape)
    _glu(g, u, res, ACTS[act])
    return res.reshape(shape)


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """`silu(gate) * up`, elementwise, for (n,) or (S, n) inputs of equal shape."""
    return glu(gate, up, "silu", out)


def check_positions(start: int, end: int, n_ctx: int) -> None:
    """Raise ContextOverflowError unless positions start..end-1 lie in [0, n_ctx)."""
    if start < end and (start < 0 or end > n_ctx):
        bad = end - 1 if end > n_ctx else start
        raise ContextOverflowError(
            f"position {bad} is outside the model's context of {n_ctx} tokens "
            f"(valid positions are 0..{n_ctx - 1}); shorten the input, or truncate "
            f"or reset the session")


class RopeTable:
    """cos and sin of every (position, frequency) pair, computed once in float64, stored as float32.

    `cos`, `sin`: (n_ctx, rope_dim // 2). Frequency i is `base ** (-2i / rope_dim)`, divided by
    `freq_factors[i]` when the model ships them (Llama 3's `rope_freqs`, LongRoPE's factors);
    linear scaling divides the position by `scale`; cos and sin are multiplied by `mscale`
    (LongRoPE's attention factor). `neox` selects the pairing: NeoX halves (x[i], x[i + d/2]) when True,
    adjacent pairs (x[2i], x[2i+1]) as llama GGUFs store them when False.
    """

    def __init__(self, n_ctx: int, rope_dim: int, base: float, *, neox: bool = False,
                 scale: float = 1.0, freq_factors: np.ndarray | None = None, mscale: float = 1.0):
        if rope_dim <= 0 or rope_dim % 2:
            raise ValueError(f"rope_dim must be a positive even number, got {rope_dim}")
        inv = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
        if freq_factors is not None:
            if np.shape(freq_factors) != inv.shape:
                raise ValueError(f"rope freq factors have shape {np.shape(freq_factors)}, need {inv.shape}")
            inv = inv / np.asarray(freq_factors, dtype=np.float64)
        ang = np.outer(np.arange(n_ctx, dtype=np.float64) / scale, inv)
        self.n_ctx, self.rope_dim, self.neox = n_ctx, rope_dim, neox
        self.cos = (np.cos(ang) * mscale).astype(np.float32)  # (n_ctx, rope_dim // 2)
        self.sin = (np.sin(ang) * mscale).astype(np.float32)  # (n_ctx, rope_dim // 2)

    def check(self, positions: np.ndarray) -> None:
        """Raise ContextOverflowError if any position lies outside [0, n_ctx)."""
        if len(positions):
            self.check_range(int(positions.min()), int(positions.max()) + 1)

    def check_range(self, start: int, end: int) -> None:
        """Raise ContextOverflowError unless positions start..end-1 lie in [0, n_ctx)."""
        check_positions(start, end, self.n_ctx)

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
    # x: (H, D) of one token at position p, rotated in place; cos, sin: (n_ctx, rope_dim // 2).
    # The layout's branch outside the loops: inside them it kept the NeoX loop from
    # vectorizing (a token's q and k took 321 ns, 100 now; the same operations, so the same bits)
    half = cos.shape[1]
    c = cos[p]
    sn = sin[p]
    if neox:
        for h in range(x.shape[0]):
            for i in range(half):
                a = x[h, i]
                b = x[h, i + half]
                x[h, i] = a * c[i] - b * sn[i]
                x[h, i + half] = a * sn[i] + b * c[i]
    else:
        for h in range(x.shape[0]):
            for i in range(half):
                a = x[h, 2 * i]
                b = x[h, 2 * i + 1]
                x[h, 2 * i] = a * c[i] - b * sn[i]
                x[h, 2 * i + 1] = a * sn[i] + b * c[i]


@njit(parallel=True, cache=True, fastmath=_FM)
def _rope(x, positions, cos, sin, neox):
    # x: (S, H, D) rotated in place
    for s in prange(x.shape[0]):
        _rope_row(x[s], positions[s], cos, sin, neox)
