"""RMSNorm, LayerNorm, SwiGLU, GELU, RoPE and the float32 exponential against NumPy references."""
import math

import numpy as np
import pytest
from numba import njit

from npllama import ContextOverflowError
from npllama.kernels.nn import _FM, RopeTable, _exp, gelu, glu, layernorm, rmsnorm, swiglu

rng = np.random.default_rng(0)


def ref_rmsnorm(x, w, eps):
    x = x.astype(np.float64)
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w).astype(np.float32)


@pytest.mark.parametrize("shape", [(1,), (7,), (576,), (1, 576), (5, 33)])
def test_rmsnorm(shape):
    x = rng.standard_normal(shape).astype(np.float32)
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    np.testing.assert_allclose(rmsnorm(x, w, 1e-5), ref_rmsnorm(x, w, 1e-5), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 1e-2])
def test_rmsnorm_eps_where_it_matters(eps):
    """Inputs so small (mean square 1e-8) that eps sets the scale: a kernel that dropped eps, or
    used another, would be off by orders of magnitude."""
    x = (rng.standard_normal((3, 64)) * 1e-4).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    got = rmsnorm(x, w, eps)
    np.testing.assert_allclose(got, ref_rmsnorm(x, w, eps), rtol=1e-5, atol=1e-9)
    for other in (0.0, eps * 10):
        assert not np.allclose(got, ref_rmsnorm(x, w, other), rtol=1e-2, atol=0)
    np.testing.assert_allclose(rmsnorm(np.zeros(8, np.float32), np.ones(8, np.float32), eps), 0.0)  # 0/sqrt(eps)


def test_rmsnorm_non_contiguous_and_bad_weight():
    x = rng.standard_normal((6, 40)).astype(np.float32)[::2, ::2]
    w = rng.standard_normal(20).astype(np.float32)
    np.testing.assert_allclose(rmsnorm(x, w, 1e-6), ref_rmsnorm(x, w, 1e-6), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weight has shape"):
        rmsnorm(x, np.ones(3, np.float32), 1e-6)


@njit(fastmath=_FM, error_model="numpy")
def _exp_loop(x, out):
    # a fast-math caller whose loop LLVM vectorizes, as the kernels call _exp
    for i in range(x.shape[0]):
        out[i] = _exp(x[i])


def test_exp_within_two_ulp_over_the_float32_range():
    x = np.concatenate([np.linspace(-87.3, 88.72, 400_001, dtype=np.float32),
                        rng.uniform(-20, 20, 10_001).astype(np.float32), np.float32([0, -0.0, 1e-30, -1e-30])])
    out = np.empty_like(x)
    _exp_loop(x, out)
    ref = np.exp(x.astype(np.float64))
    ulps = np.abs(out - ref) / np.spacing(ref.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2, (ulps.max(), x[ulps.argmax()])
    strided = np.empty(len(x[::3]), np.float32)
    _exp_loop(x[::3], strided)  # non-contiguous input: the same values
    np.testing.assert_array_equal(strided, out[::3])


def test_exp_limits():
    x = np.float32([-np.inf, -1e30, -100, -87.5, 88.8, 100, 3e38, np.inf, np.nan])
    out = np.empty_like(x)
    _exp_loop(x, out)
    np.testing.assert_array_equal(out, np.float32([0, 0, 0, 0, np.inf, np.inf, np.inf, np.inf, np.nan]))


@pytest.mark.parametrize("shape", [(1,), (9,), (3, 1536)])
def test_glu_gelu_tanh(shape):
    """GeGLU against the tanh-approximated GELU written out in float64 (torch's
    gelu(approximate="tanh")), including large |g| where tanh saturates."""
    g = (rng.standard_normal(shape) * 6).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    g64 = g.astype(np.float64)
    ref = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64 ** 3))) * u
    np.testing.assert_allclose(glu(g, u, "gelu_tanh"), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(glu(g.T, u.T, "gelu_tanh"), ref.T, rtol=1e-5, atol=1e-6)  # non-contiguous
    np.testing.assert_allclose(glu(g, u, "silu"), swiglu(g, u))
    with pytest.raises(ValueError, match="activation must be one of"):
        glu(g, u, "relu")


@pytest.mark.parametrize("shape", [(1,), (9,), (3, 1536)])
def test_swiglu(shape):
    g = (rng.standard_normal(shape) * 4).astype(np.float32)
    u = rng.standard_normal(shape).astype(np.float32)
    ref = g / (1 + np.exp(-g.astype(np.float64))) * u
    np.testing.assert_allclose(swiglu(g, u), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(swiglu(g.T, u.T), ref.T, rtol=1e-5, atol=1e-6)  # non-contiguous when 2-D
    with pytest.raises(ValueError, match="gate has shape"):
        swiglu(g, u[..., :1] if shape[-1] > 1 else np.ones(2, np.float32))


def ref_rope(x, positions, base, rope_dim, neox, factors=None, mscale=1.0):
    """Rotate with complex numbers (scaled by `mscale`); pairs picked by the convention."""
    x = x.astype(np.float64).copy()
    inv = base ** (-np.arange(0, rope_dim, 2) / rope_dim)
    if factors is not None:
        inv = inv / factors
    ang = positions[:, None] * inv[None, :]  # (S, rope_dim/2)
    rot = mscale * np.exp(1j * ang)[:, None, :]
    half = rope_dim // 2
    if neox:
        z = (x[..., :half] + 1j * x[..., half:rope_dim]) * rot
        x[..., :half], x[..., half:rope_dim] = z.real, z.imag
    else:
        z = (x[..., 0:rope_dim:2] + 1j * x[..., 1:rope_dim:2]) * rot
        x[..., 0:rope_dim:2], x[..., 1:rope_dim:2] = z.real, z.imag
    return x.astype(np.float32)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("S,H,D,rope_dim", [(1, 1, 2, 2), (5, 9, 64, 64), (3, 2, 40, 32)])
def test_rope_both_conventions(neox, S, H, D, rope_dim):
    table = RopeTable(4096, rope_dim, 10000.0, neox=neox)
    x = rng.standard_normal((S, H, D)).astype(np.float32)
    positions = np.array([0, 7, 4095, 100, 2][:S])
    expect = ref_rope(x, positions.astype(np.float64), 10000.0, rope_dim, neox)
    np.testing.assert_allclose(table.apply(x.copy(), positions), expect, rtol=1e-4, atol=2e-5)


def test_rope_conventions_differ():
    x = rng.standard_normal((1, 1, 8)).astype(np.float32)
    a = RopeTable(16, 8, 10000.0, neox=False).apply(x.copy(), np.array([3]))
    b = RopeTable(16, 8, 10000.0, neox=True).apply(x.copy(), np.array([3]))
    assert not np.allclose(a, b)


def test_rope_freq_factors():
    factors = np.linspace(1, 8, 4)
    table = RopeTable(64, 8, 500000.0, freq_factors=factors)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    positions = np.array([5, 63])
    expect = ref_rope(x, positions.astype(np.float64), 500000.0, 8, False, factors)
    np.testing.assert_allclose(table.apply(x.copy(), positions), expect, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("scale", [2.0, 4.0, 8.0])
def test_rope_linear_scaling(neox, scale):
    """Linear scaling: position p rotates as p / scale would unscaled (positions past the
    original context land inside it)."""
    table = RopeTable(4096, 16, 10000.0, neox=neox, scale=scale)
    x = rng.standard_normal((4, 3, 20)).astype(np.float32)
    positions = np.array([1, 5, 999, 4095])
    got = table.apply(x.copy(), positions)
    np.testing.assert_allclose(got, ref_rope(x, positions / scale, 10000.0, 16, neox), rtol=1e-4, atol=2e-5)
    assert not np.allclose(got, ref_rope(x, positions.astype(np.float64), 10000.0, 16, neox), atol=1e-2)
    np.testing.assert_array_equal(got[..., 16:], x[..., 16:])  # dims past rope_dim untouched


def test_rope_mscale_scales_the_rotated_dims():
    table = RopeTable(64, 8, 10000.0, scale=2.0, mscale=1.3)
    x = rng.standard_normal((2, 2, 12)).astype(np.float32)
    positions = np.array([3, 50])
    got = table.apply(x.copy(), positions)
    np.testing.assert_allclose(got, ref_rope(x, positions / 2.0, 10000.0, 8, False, mscale=1.3), rtol=1e-4, atol=2e-5)


def test_rope_tables_are_float32_from_float64_math():
    t = RopeTable(8192, 64, 100000.0)
    assert t.cos.dtype == np.float32 and t.cos.shape == (8192, 32)
    exact = np.cos(8191 * 100000.0 ** (-np.arange(0, 64, 2) / 64))
    np.testing.assert_array_equal(t.cos[8191], exact.astype(np.float32))


def test_rope_position_past_context():
    t = RopeTable(16, 8, 10000.0)
    with pytest.raises(ContextOverflowError, match="position 16 .* context of 16"):
        t.apply(np.zeros((2, 1, 8), np.float32), np.array([15, 16]))
    with pytest.raises(ValueError, match="C-contiguous"):
        t.apply(np.zeros((2, 1, 8), np.float32)[:, :, ::1].transpose(0, 1, 2)[::-1], np.array([0, 1]))


def ref_layernorm(x, w, b, eps):
    x = x.astype(np.float64)
    d = x - x.mean(-1, keepdims=True)
    return (d / np.sqrt((d * d).mean(-1, keepdims=True) + eps) * w + b).astype(np.float32)


@pytest.mark.parametrize("shape", [(1,), (7,), (384,), (1, 384), (5, 33)])
def test_layernorm(shape):
    """Rows offset far from 0 (where a one-pass E[x^2] - E[x]^2 would lose the variance)."""
    x = (rng.standard_normal(shape) * 2 + 50).astype(np.float32)
    w, b = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(layernorm(x, w, b, 1e-12), ref_layernorm(x, w, b, 1e-12), rtol=1e-4, atol=2e-5)


def test_layernorm_eps_in_place_non_contiguous_and_bad_shapes():
    x = (rng.standard_normal((3, 64)) * 1e-4).astype(np.float32)  # variance 1e-8: eps sets the scale
    w, b = rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32)
    for eps in (1e-6, 1e-2):
        got = layernorm(x, w, b, eps)
        np.testing.assert_allclose(got, ref_layernorm(x, w, b, eps), rtol=1e-5, atol=1e-6)
        assert not np.allclose(got, ref_layernorm(x, w, b, eps * 10), rtol=1e-2, atol=0)
    y = x.copy()
    assert layernorm(y, w, b, 1e-5, out=y) is y
    np.testing.assert_allclose(y, ref_layernorm(x, w, b, 1e-5), rtol=1e-5, atol=1e-6)
    strided = rng.standard_normal((6, 40)).astype(np.float32)[::2, ::2]
    w20, b20 = w[:20], b[:20]
    np.testing.assert_allclose(layernorm(strided, w20, b20, 1e-5), ref_layernorm(strided, w20, b20, 1e-5),
                               rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"weight has shape \(3,\) and bias \(20,\) .* need \(20,\)"):
        layernorm(strided, np.ones(3, np.float32), b20, 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        layernorm(x, w, b, 1e-5, out=np.empty((3, 63), np.float32))


@pytest.mark.parametrize("shape", [(1,), (9,), (1, 1536), (5, 33)])
def test_gelu_erf(shape):
    """GELU with erf (torch's default, BERT's "gelu") in float64, over large |x| too; the tanh
    approximation differs from it by more than the tolerance."""
    x = (rng.standard_normal(shape) * 4).astype(np.float32)
    x64 = x.astype(np.float64)
    ref = 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2)))
    got = gelu(x)
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)
    tanh = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64 ** 3)))
    if x.size > 5:
        assert np.abs(got - tanh).max() > 1e-5
    y = x.copy()
    assert gelu(y, out=y) is y and np.array_equal(y, got)


def test_gelu_non_contiguous():
    x = rng.standard_normal((4, 30)).astype(np.float32)[:, ::3]
    x64 = x.astype(np.float64)
    np.testing.assert_allclose(gelu(x), 0.5 * x64 * (1 + np.vectorize(math.erf)(x64 / math.sqrt(2))),
                               rtol=1e-6, atol=1e-7)
