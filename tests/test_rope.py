"""A model's RoPE tables (npllama.kernels.rope.Ropes): built for the positions reached, grown by
doubling up to the context, one table per entry of ModelConfig.ropes, and LongRoPE's choice
of factors by a call's last position; values against a float64 NumPy reference."""
from types import SimpleNamespace

import numpy as np
import pytest

from npllama import ContextOverflowError
from npllama.arch import Rope
from npllama.kernels.rope import Ropes


def reference(positions, dim, base, linear=1.0, factors=None, mscale=1.0):
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    if factors is not None:
        inv = inv / np.asarray(factors, np.float64)
    ang = np.outer(np.asarray(positions, np.float64) / linear, inv)
    return np.cos(ang) * mscale, np.sin(ang) * mscale


def config(ropes, n_ctx=8192, dim=8):
    return SimpleNamespace(ropes=tuple(ropes), rope_dim=dim, n_ctx=n_ctx, rope_neox=True)


def test_tables_per_rope_grow_by_doubling_up_to_the_context():
    r = Ropes(config([Rope(1e6, linear=8.0), Rope(1e4)], n_ctx=3000), {})
    cos, sin = r.tables(10)
    assert cos.shape == sin.shape == (2, 1024, 4) and r.capacity == 1024
    for i, (base, linear) in enumerate(((1e6, 8.0), (1e4, 1.0))):
        c, s = reference(np.arange(1024), 8, base, linear)
        np.testing.assert_allclose(cos[i], c, atol=1e-6)
        np.testing.assert_allclose(sin[i], s, atol=1e-6)
    cos, _ = r.tables(1025)
    assert r.capacity == 2048 and cos.shape == (2, 2048, 4)
    cos, _ = r.tables(3000)
    assert r.capacity == 3000  # capped at the context
    np.testing.assert_allclose(cos[1, 2999], reference([2999], 8, 1e4)[0][0], atol=1e-5)
    with pytest.raises(ContextOverflowError, match="position 3000 is outside the model's context of 3000"):
        r.tables(3001)
    with pytest.raises(ContextOverflowError):
        r.check(np.array([5, 3000]))


def test_longrope_uses_the_long_factors_once_a_call_passes_the_original_context():
    short, long = np.float32([1, 1.5, 2, 4]), np.float32([2, 3, 5, 9])
    rope = Rope(1e4, factors="s", long_factors="l", orig_ctx=16, mscale=1.25)
    r = Ropes(config([rope]), {"s": short, "l": long})
    for end, factors in ((1, short), (16, short), (17, long), (500, long)):
        cos, sin = r.tables(end)
        c, s = reference(np.arange(cos.shape[1]), 8, 1e4, factors=factors, mscale=1.25)
        np.testing.assert_allclose(cos[0], c, atol=1e-5)
        np.testing.assert_allclose(sin[0], s, atol=1e-5)


def test_tables_from_many_threads_always_cover_the_positions_asked_for():
    """Sessions of one model on several threads: a table handed out covers the positions its
    caller asked for even while another thread grows the tables."""
    from concurrent.futures import ThreadPoolExecutor
    r = Ropes(config([Rope(1e4)], n_ctx=1 << 16), {})
    ends = list(range(1, 1 << 16, 997)) * 2

    def ask(end):
        cos, sin = r.tables(end)
        return cos.shape[1] >= end and sin.shape[1] >= end

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(ask, ends))
