import numpy as np
import pytest

from numba import njit

from npllama.kernels.attention import (_BLOCK, _add_records, _add_values, _add_values_many, _make_add_records,
                                      _make_add_rows, _make_add_rows_many,
                                      _make_score_records, _make_score_rows, _rescale, _score_block, _score_records,
                                      attend, attend_kv)
from npllama.kernels.f16 import bits
from npllama.cache.kvcache import KVCache

RTOL, ATOL = 1e-5, 1e-6


def reference(q, k, v, *, offset=None, mask=None, softcap=0.0, alibi=None, window=0, scale=None, causal=True):
    """Naive float64 attention: repeat KV heads, matmul, mask, softmax, matmul.

    q: (S, H, D); k, v: (KV, KVH, D) -> (S, H, D). Rows with no visible key are zero.
    """
    S, H, D = q.shape
    KV, KVH, _ = k.shape
    offset = KV - S if offset is None else offset
    scale = 1 / np.sqrt(D) if scale is None else scale
    k = np.repeat(k.astype(np.float64), H // KVH, axis=1)  # (KV, H, D)
    v = np.repeat(v.astype(np.float64), H // KVH, axis=1)
    scores = np.einsum("shd,thd->hst", q.astype(np.float64), k) * scale  # (H, S, KV)
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    qpos = offset + np.arange(S)[:, None]  # (S, 1)
    kpos = np.arange(KV)[None, :]  # (1, KV)
    if alibi is not None:
        scores = scores + np.asarray(alibi, np.float64)[:, None, None] * (kpos - qpos)
    visible = kpos <= qpos if causal else np.ones((S, KV), bool)
    if window > 0:
        visible &= kpos > qpos - window
    if mask is not None:
        scores = scores + mask
        visible &= mask > -1e30
    scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = p.sum(axis=-1, keepdims=True)
    p = np.divide(p, total, out=np.zeros_like(p), where=total > 0)
    return np.einsum("hst,thd->shd", p, v)


def make(S, KV, H, KVH, D, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((S, H, D), dtype=np.float32),
            rng.standard_normal((KV, KVH, D), dtype=np.float32),
            rng.standard_normal((KV, KVH, D), dtype=np.float32))


def check(q, k, v, **options):
    got = attend_kv(q, k, v, **options)
    assert got.shape == q.shape and got.dtype == np.float32
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, reference(q, k, v, **options), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S, KV", [(1, 1), (1, 7), (1, 300), (1, 4096), (4, 4096), (5, 12), (12, 12), (33, 70)])
@pytest.mark.parametrize("H, KVH, D", [(9, 3, 64), (8, 8, 40), (4, 2, 128), (6, 3, 48)])
def test_matches_reference(S, KV, H, KVH, D):
    """Head sizes for every path of the block routines: both IR kernels (64, 128), the
    scores' only (48), neither (40)."""
    check(*make(S, KV, H, KVH, D))


@njit(fastmath=True)
def _block_routines(q, kb, vb, pv, s, a):
    _score_block(q, kb, s)
    _add_values(a, pv, vb)


@pytest.mark.parametrize("D", [16, 40, 48, 64, 192, 256])
def test_block_routines_match_numpy(D):
    """A block's scores and weighted values (`_score_block`, `_add_values`, over _score_rows
    and _add_rows where D allows) against float64 NumPy: keys of mixed magnitudes, zero and
    negative weights, an output that already holds a running sum."""
    rng = np.random.default_rng(D)
    q = rng.standard_normal(D).astype(np.float32)
    kb = (rng.standard_normal((_BLOCK, D)) * rng.choice([1e-3, 1.0, 50.0], (_BLOCK, 1))).astype(np.float32)
    vb = rng.standard_normal((_BLOCK, D)).astype(np.float32)
    pv = rng.random(_BLOCK).astype(np.float32)
    pv[:4] = 0.0
    pv[7] = -0.5
    a0 = rng.standard_normal(D).astype(np.float32)
    s, a = np.full(_BLOCK, np.nan, np.float32), a0.copy()
    _block_routines(q, kb, vb, pv, s, a)
    scores = kb.astype(np.float64) @ q.astype(np.float64)
    np.testing.assert_allclose(s, scores, rtol=0, atol=2e-6 * (np.abs(kb) @ np.abs(q)).max())
    values = a0 + pv.astype(np.float64) @ vb.astype(np.float64)
    np.testing.assert_allclose(a, values, rtol=0, atol=2e-6 * (np.abs(a0) + np.abs(pv) @ np.abs(vb)).max())


_SCORES = {keys: _make_score_rows(keys) for keys in (16, 8, 4)}
_ADDS = {cols: _make_add_rows(cols) for cols in (64, 32, 16)}


def _pass_routines(score, add):
    @njit(fastmath=True)
    def run(q, kb, vb, pv, s, a):
        score(q, kb, s)
        add(a, pv, vb)
    return run


_PASSES = {(keys, cols): _pass_routines(_SCORES[keys], _ADDS[cols]) for keys, cols in ((16, 64), (8, 32), (4, 16))}


@pytest.mark.parametrize("D", [64, 128, 256])
def test_block_routines_same_bits_at_every_pass_width(D):
    """`_score_rows` at 16, 8 and 4 keys a pass and `_add_rows` at 64, 32 and 16 columns (the
    module takes 16 and 64 with AVX-512, 4 and 32 without) give the same bits, and float64
    NumPy's sums: a key's dot and a column's weighted sum are grouped the same in each."""
    rng = np.random.default_rng(D)
    q = rng.standard_normal(D).astype(np.float32)
    kb = (rng.standard_normal((_BLOCK, D)) * rng.choice([1e-3, 1.0, 50.0], (_BLOCK, 1))).astype(np.float32)
    vb = rng.standard_normal((_BLOCK, D)).astype(np.float32)
    pv = rng.random(_BLOCK).astype(np.float32)
    pv[5] = -0.5
    a0 = rng.standard_normal(D).astype(np.float32)
    got = []
    for run in _PASSES.values():
        s, a = np.full(_BLOCK, np.nan, np.float32), a0.copy()
        run(q, kb, vb, pv, s, a)
        got.append((s, a))
    for s, a in got[1:]:
        np.testing.assert_array_equal(s.view(np.uint32), got[0][0].view(np.uint32))
        np.testing.assert_array_equal(a.view(np.uint32), got[0][1].view(np.uint32))
    s, a = got[0]
    np.testing.assert_allclose(s, kb.astype(np.float64) @ q, rtol=0, atol=2e-6 * (np.abs(kb) @ np.abs(q)).max())
    np.testing.assert_allclose(a, a0 + pv.astype(np.float64) @ vb, rtol=0,
                               atol=2e-6 * (np.abs(a0) + np.abs(pv) @ np.abs(vb)).max())


@njit(fastmath=True)
def _values_one_by_one(a, pv, vb):
    for r in range(a.shape[0]):
        for g in range(a.shape[1]):
            _add_values(a[r, g], pv[r, g], vb)


@njit(fastmath=True)
def _values_together(a, pv, vb):
    _add_values_many(a, pv, vb)


def _many_routine(many):
    @njit
    def run(a, pv, vb):
        many(a, pv, vb)
    return run


_MANY = {(group, cols): _many_routine(_make_add_rows_many(cols, group))
         for group, cols in ((1, 64), (2, 64), (3, 64), (2, 32), (4, 16))}


@pytest.mark.parametrize("R, G", [(1, 1), (1, 3), (3, 1), (16, 3), (5, 7), (2, 4)])
@pytest.mark.parametrize("D", [40, 64, 128])
def test_values_of_many_rows_same_bits_as_one_at_a_time(R, G, D):
    """`_add_values_many` (prefill's weighted values: rows sharing each value row's loads,
    `_add_rows_many`) gives each (row, head) the bits of `_add_values` alone, at every group
    width (and its rest of rows) and column width, and float64 NumPy's sums; a head size of
    40 takes `_add_values` itself."""
    rng = np.random.default_rng(R * 100 + G * 10 + D)
    vb = rng.standard_normal((_BLOCK, D)).astype(np.float32)
    pv = rng.random((R, G, _BLOCK)).astype(np.float32)
    pv[0, 0, :4] = 0.0
    pv[-1, -1, 3] = -0.5
    a0 = (rng.standard_normal((R, G, D)) * 3).astype(np.float32)
    want = a0.copy()
    _values_one_by_one(want, pv, vb)
    got = a0.copy()
    _values_together(got, pv, vb)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    if D % 64 == 0:
        for many in _MANY.values():
            got = a0.reshape(R * G, D).copy()
            many(got, pv.reshape(R * G, _BLOCK), vb)
            np.testing.assert_array_equal(got.reshape(R, G, D).view(np.uint32), want.view(np.uint32))
    ref = a0 + pv.astype(np.float64) @ vb.astype(np.float64)
    np.testing.assert_allclose(want, ref, rtol=0, atol=2e-6 * (np.abs(a0) + np.abs(pv) @ np.abs(vb)).max())


@njit(fastmath=True)
def _record_routines(q, kv, offs, n, pv, a, s):
    _score_records(q, kv, offs, s)
    _add_records(a, pv, kv, offs + q.shape[1], n)


@njit(fastmath=True)
def _scratch_routines(q, kv, offs, n, pv, a, s):
    """The block routines over the records at offs converted into float32 rows (zeros past n)."""
    G, D = q.shape
    kb, vb = np.zeros((_BLOCK, D), np.float32), np.zeros((_BLOCK, D), np.float32)
    for j in range(n):
        for d in range(D):
            kb[j, d] = kv[offs[j] + d]
            vb[j, d] = kv[offs[j] + D + d]
    for h in range(G):
        _score_block(q[h], kb, s[h])
        _add_values(a[h], pv[h], vb)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("G, D", [(1, 64), (2, 128), (3, 64), (4, 256), (5, 64), (7, 128), (8, 64)])
@pytest.mark.parametrize("n", [1, 17, 32])
def test_record_routines_match_numpy_and_the_block_routines(dtype, G, D, n):
    """`_score_records` and `_add_records` (a lone query's G heads, keys and values read
    straight from scattered records: heads in groups of four and the rest) against float64
    NumPy, and bit for bit against `_score_block` and `_add_values` over the same records
    converted to float32 (the paths a decoding query and a prefill block take); a block of
    n keys, the rest of its weights 0 and its offsets naming a record of infinities and NaN,
    which reads as zeros."""
    rng = np.random.default_rng(G * 1000 + D + n)
    rec = (rng.standard_normal((41, 2, D)) * rng.choice([1e-3, 1.0, 30.0], (41, 1, 1))).astype(dtype)
    rec[40] = np.where(np.arange(D) % 2, np.inf, np.nan)
    offs = rng.permutation(40)[:_BLOCK].astype(np.int64) * 2 * D
    offs[n:] = 40 * 2 * D
    q = rng.standard_normal((G, D)).astype(np.float32)
    pv = rng.random((G, _BLOCK)).astype(np.float32)
    pv[:, n:] = 0.0
    pv[:, 0] = 0.0
    a0 = rng.standard_normal((G, D)).astype(np.float32)
    s, a = np.full((G, _BLOCK), np.nan, np.float32), a0.copy()
    _record_routines(q, bits(rec.reshape(-1)), offs, n, pv, a, s)
    k64, v64 = rec[offs[:n] // (2 * D), 0].astype(np.float64), rec[offs[:n] // (2 * D), 1].astype(np.float64)
    np.testing.assert_allclose(s[:, :n], q.astype(np.float64) @ k64.T, rtol=0,
                               atol=2e-6 * (np.abs(q) @ np.abs(k64).T).max())
    values = a0 + pv[:, :n].astype(np.float64) @ v64
    np.testing.assert_allclose(a, values, rtol=0, atol=2e-6 * (np.abs(a0) + pv[:, :n] @ np.abs(v64)).max())
    s2, a2 = np.full((G, _BLOCK), np.nan, np.float32), a0.copy()
    _scratch_routines(q, rec.reshape(-1).astype(np.float32), offs, n, pv, a2, s2)
    np.testing.assert_array_equal(s[:, :n].view(np.uint32), s2[:, :n].view(np.uint32))
    np.testing.assert_array_equal(a.view(np.uint32), a2.view(np.uint32))


def _records_pass(score, add):
    @njit(fastmath=True)
    def run(q, kv, offs, n, pv, a, s):
        score(q, kv, offs, s)
        add(a, pv, kv, offs + q.shape[1], n)
    return run


_RECORD_PASSES = [_records_pass(_make_score_records(keys), _make_add_records(cols, most))
                  for keys, cols, most in (((8, 8, 8, 4), 16, 4), ((4, 4, 2, 2), 16, 2), ((1, 2, 4, 8), 32, 1))]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("G, D", [(1, 64), (3, 64), (4, 128), (7, 64)])
def test_record_routines_same_bits_at_every_pass_width(dtype, G, D):
    """`_score_records` with passes of 8 keys (4 for four heads; AVX-512's), of 4 and 2
    (AVX2's) and of 1 to 8, and `_add_records` for heads in fours by 16 columns (AVX-512's),
    in pairs (AVX2's) and one by one by 32 columns, give the same bits, and those of
    `_score_block` and `_add_values`."""
    rng = np.random.default_rng(G * 100 + D)
    rec = (rng.standard_normal((40, 2, D)) * rng.choice([1e-3, 1.0, 30.0], (40, 1, 1))).astype(dtype)
    offs = rng.permutation(40)[:_BLOCK].astype(np.int64) * 2 * D
    q = rng.standard_normal((G, D)).astype(np.float32)
    pv = rng.random((G, _BLOCK)).astype(np.float32)
    a0 = rng.standard_normal((G, D)).astype(np.float32)
    got = []
    for run in _RECORD_PASSES:
        s, a = np.full((G, _BLOCK), np.nan, np.float32), a0.copy()
        run(q, bits(rec.reshape(-1)), offs, _BLOCK, pv, a, s)
        got.append((s, a))
    kb, vb = (rec[offs // (2 * D), i].astype(np.float32) for i in range(2))
    for h in range(G):
        s_ref, a_ref = np.full(_BLOCK, np.nan, np.float32), a0[h].copy()
        _block_routines(q[h], kb, vb, pv[h], s_ref, a_ref)
        for s, a in got:
            np.testing.assert_array_equal(s[h].view(np.uint32), s_ref.view(np.uint32))
            np.testing.assert_array_equal(a[h].view(np.uint32), a_ref.view(np.uint32))


@pytest.mark.parametrize("R, G, D, n", [(1, 1, 64, 32), (1, 3, 64, 5), (8, 3, 40, 32), (2, 4, 256, 17),
                                        (3, 1, 48, 0), (1, 5, 16, 1), (16, 5, 64, 20), (17, 8, 24, 32)])
def test_online_softmax_step_matches_numpy(R, G, D, n):
    """`_rescale` (in phases over up to 64 (row, head) pairs at a time, so R G = 80 and 136 take
    two and three batches, the last short; its corrections eight pairs a vector, the last eight
    padded by repeating the last pair) against float64 NumPy: the first n keys of a block folded
    into running maxima (some -inf: no key seen yet) and sums, the running outputs rescaled,
    the scores turned into weights (0 past n); a pair whose keys are all -inf (removed), or a
    block with no key (n = 0), changes nothing but zeroes its weights."""
    rng = np.random.default_rng(R * 1000 + G * 100 + D + n)
    s = rng.normal(0, 4, (R, G, _BLOCK)).astype(np.float32)
    s[rng.random((R, G)) < 0.2] = -np.inf
    m = np.where(rng.random((R, G)) < 0.3, -np.inf, rng.normal(0, 4, (R, G))).astype(np.float32)
    l = np.where(np.isinf(m), 0, rng.random((R, G)) * 5).astype(np.float32)
    acc = np.where(np.isinf(m)[..., None], 0, rng.normal(size=(R, G, D))).astype(np.float32)
    s64, m64, l64, acc64 = s[..., :n].astype(np.float64), m.astype(np.float64), l.astype(np.float64), acc.copy()
    assert _rescale.targetoptions["fastmath"] is False  # fast-math flags would change nn._exp's roundings
    _rescale(s, n, m, l, acc)
    w = np.zeros((R, G, _BLOCK))
    empty = np.isneginf(s64).all(axis=2)  # also every pair where n = 0
    m_new = np.where(empty, m64, np.maximum(m64, s64.max(axis=2, initial=-np.inf)))
    with np.errstate(invalid="ignore"):
        corr = np.where(empty, 1.0, np.exp(m64 - m_new))
        w[..., :n] = np.where(empty[..., None], 0.0, np.exp(s64 - m_new[..., None]))
    np.testing.assert_array_equal(m, m_new.astype(np.float32))
    # float32 exponentials (2 ulp) of float32 differences (each rounded: |x| 6e-8 relative)
    np.testing.assert_allclose(s, w, rtol=3e-6, atol=1e-38)
    np.testing.assert_allclose(acc, acc64 * corr[..., None], rtol=3e-6, atol=1e-38)
    np.testing.assert_allclose(l, l64 * corr + w.sum(axis=2), rtol=5e-6)


def test_vector_exp_is_exp_bit_for_bit():
    """nn._ir_exp (the online softmax's exponentials) gives nn._exp's bits on every lane, over
    the whole range, the clamps' edges, infinities and NaN; both within 2 ulp of np.exp."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic
    from npllama.kernels.nn import _exp, _ir_exp

    v16 = ir.VectorType(ir.FloatType(), 16)

    @intrinsic
    def exp16(typingctx, x, out):
        def codegen(context, builder, sig, args):
            xp, op = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args, args))
            y = _ir_exp(builder, builder.load(builder.bitcast(xp, v16.as_pointer()), align=4))
            builder.store(y, builder.bitcast(op, v16.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(x, out), codegen

    @njit
    def both(x, vec, one):
        for i in range(0, x.shape[0], 16):
            exp16(x[i:i + 16], vec[i:i + 16])
        for i in range(x.shape[0]):
            one[i] = _exp(x[i])

    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(-100, 100, 20000), rng.normal(0, 30, 20000),
                        [np.inf, -np.inf, np.nan, 0.0, -0.0, 88.7, 88.8, 89.0, -87.3, -87.29, -87.31]])
    x = np.concatenate([x, np.zeros(-len(x) % 16)]).astype(np.float32)
    vec, one = np.empty_like(x), np.empty_like(x)
    both(x, vec, one)
    np.testing.assert_array_equal(vec.view(np.uint32)[~np.isnan(x)], one.view(np.uint32)[~np.isnan(x)])
    assert np.isnan(vec[np.isnan(x)]).all() and np.isnan(one[np.isnan(x)]).all()
    inside = (x > -87.0) & (x < 88.0)
    np.testing.assert_allclose(one[inside], np.exp(x[inside].astype(np.float64)), rtol=2.5e-7)


@pytest.mark.parametrize("S, KV", [(1, 1), (1, 9), (7, 7), (33, 33), (5, 600), (600, 600)])
def test_bidirectional(S, KV):
    """causal=False: every query sees every key (an encoder's attention), over several chunks of
    keys and blocks of queries; a mask and a softcap still apply; non-contiguous queries."""
    q, k, v = make(S, KV, 6, 3, 48, seed=S + KV)
    check(q, k, v, causal=False)
    assert S == 1 or not np.allclose(attend_kv(q, k, v, causal=False), reference(q, k, v), atol=1e-3)  # a last query sees all anyway
    mask = np.where(np.random.default_rng(3).random((S, KV)) < 0.3, -np.inf, 0.0).astype(np.float32)
    check(q, k, v, causal=False, mask=mask, softcap=2.0)
    check(np.asfortranarray(q), k, v, causal=False)


def test_bidirectional_refuses_positions():
    q, k, v = make(2, 5, 4, 2, 40)
    for bad in (dict(offset=0), dict(window=2), dict(alibi=np.ones(4, np.float32))):
        with pytest.raises(ValueError, match="causal=False .* takes no offset, window or alibi"):
            attend_kv(q, k, v, causal=False, **bad)


def test_explicit_offset():
    q, k, v = make(3, 20, 9, 3, 64)
    check(q, k, v, offset=4)  # the keys past each query are ignored
    check(q[:1], k, v, offset=10)


def test_reads_cache_buffer_in_place():
    q, k, v = make(5, 12, 9, 3, 64)
    cache = KVCache(1, 3, 64)
    cache.append(0, k, v)
    assert cache.capacity == 16  # rows past kv_len hold garbage and must be ignored
    cache.buffer(0)[12:] = np.nan
    got = attend(q, cache.buffer(0), cache.length)
    np.testing.assert_allclose(got, reference(q, k, v), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S", [1, 6])
def test_non_contiguous_queries(S):
    _, k, v = make(S, 40, 9, 3, 40)
    x = np.random.default_rng(1).standard_normal((40, 9, 2 * S), dtype=np.float32)
    q = x[:, :, ::2].transpose(2, 1, 0)  # (S, 9, 40), odd strides
    assert not q.flags.c_contiguous
    check(q, k, v)


def test_out_argument():
    q, k, v = make(2, 9, 8, 8, 40)
    out = np.full(q.shape, 7.0, np.float32)
    assert attend_kv(q, k, v, out=out) is out
    np.testing.assert_allclose(out, reference(q, k, v), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("S", [1, 4])
def test_mask_with_fully_masked_row(S):
    q, k, v = make(S, 30, 9, 3, 64)
    rng = np.random.default_rng(2)
    mask = rng.standard_normal((S, 30)).astype(np.float32)
    mask[:, ::3] = -np.inf
    mask[:, 1::7] = -1e30
    mask[0] = -np.inf  # row 0 sees nothing
    got = attend_kv(q, k, v, mask=mask)
    assert not np.isnan(got).any()
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got, reference(q, k, v, mask=mask), rtol=RTOL, atol=ATOL)
    mask[0] = -1e30  # a finite fill counts as masked too
    np.testing.assert_array_equal(attend_kv(q, k, v, mask=mask)[0], 0.0)


def test_mask_hiding_whole_decode_chunks():
    q, k, v = make(1, 1000, 9, 3, 64)
    mask = np.zeros((1, 1000), np.float32)
    mask[0, :700] = -np.inf  # the first decode chunks see nothing, the last ones do
    check(q, k, v, mask=mask)


@pytest.mark.parametrize("S", [1, 5])
def test_softcap(S):
    q, k, v = make(S, 50, 9, 3, 64)
    check(3 * q, k, v, softcap=2.5)


@pytest.mark.parametrize("S", [1, 5])
def test_alibi(S):
    q, k, v = make(S, 50, 8, 8, 40)
    slopes = 2.0 ** -np.arange(1, 9, dtype=np.float32)
    check(q, k, v, alibi=slopes)


@pytest.mark.parametrize("S, window", [(1, 1), (1, 16), (1, 600), (7, 4), (7, 100)])
def test_sliding_window(S, window):
    check(*make(S, 600, 9, 3, 64), window=window)


def test_all_options_together():
    q, k, v = make(6, 80, 9, 3, 64)
    mask = np.where(np.random.default_rng(3).random((6, 80)) < 0.2, -np.inf, 0.0).astype(np.float32)
    check(q, k, v, mask=mask, softcap=5.0, alibi=np.linspace(0.01, 0.5, 9), window=30, scale=0.2, offset=70)


@pytest.mark.parametrize("S, KV", [(1, 1), (1, 300), (5, 12), (33, 70)])
def test_float16_buffer_reads_as_its_float32_values(S, KV):
    """A float16 KV buffer attends exactly as the same values stored in float32 (the halves
    convert exactly; the arithmetic is the same), decode and prefill, with every option."""
    q, k, v = make(S, KV, 9, 3, 64)
    kv16 = np.stack((k, v), axis=2).astype(np.float16)
    kv32 = kv16.astype(np.float32)
    mask = np.where(np.random.default_rng(5).random((S, KV)) < 0.2, -np.inf, 0.0).astype(np.float32)
    for options in ({}, {"mask": mask, "softcap": 5.0, "alibi": np.linspace(0.01, 0.5, 9), "window": 30}):
        got = attend(q, kv16, KV, **options)
        np.testing.assert_allclose(got, attend(q, kv32, KV, **options), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got, reference(q, kv32[:, :, 0], kv32[:, :, 1], **options), rtol=RTOL, atol=ATOL)


def test_zero_queries_and_empty_cache():
    q, k, v = make(0, 5, 9, 3, 64)
    assert attend_kv(q, k, v).shape == (0, 9, 64)
    q, k, v = make(1, 0, 9, 3, 64)
    np.testing.assert_array_equal(attend_kv(q, k, v, offset=0), 0.0)


def test_validation_errors():
    q, k, v = make(2, 8, 9, 3, 64)
    kv = np.stack((k, v), axis=2)
    with pytest.raises(ValueError, match=r"H=9.*KVH=2"):
        attend(q, np.zeros((8, 2, 2, 64), np.float32), 8)
    with pytest.raises(ValueError, match="D=64.*D=32"):
        attend(q, np.zeros((8, 3, 2, 32), np.float32), 8)
    with pytest.raises(ValueError, match="C-contiguous float32 or float16"):
        attend(q, kv.astype(np.float64), 8)
    with pytest.raises(ValueError, match=r"kv_len must be in \[0, capacity=8\], got 9"):
        attend(q, kv, 9)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        attend(q, kv, 1)
    with pytest.raises(ValueError, match=r"mask must have shape \(S, kv_len\)=\(2, 8\)"):
        attend(q, kv, 8, mask=np.zeros((2, 7), np.float32))
    with pytest.raises(ValueError, match=r"alibi must have shape \(H,\)=\(9,\)"):
        attend(q, kv, 8, alibi=np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="q must be 3-D"):
        attend(q[0], kv, 8)
    with pytest.raises(ValueError, match="out must be"):
        attend(q, kv, 8, out=np.zeros((2, 9, 64), np.float64))
