"""The CUDA backend's kernels in Numba's CUDA simulator, each against a NumPy reference
(odd shapes, a length of 1, non-contiguous input). `make test` runs this directory in its own
pytest process with NUMBA_ENABLE_CUDASIM=1 (tests/conftest.py skips it otherwise)."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf import quants as gq

from npllama.arch.weights import QWeight
from npllama.backends.cuda import kernels as K
from npllama.backends.cuda import simulated
from npllama.backends.cuda.model import upload
from tinygguf import random_blocks

assert simulated(), "run with NUMBA_ENABLE_CUDASIM=1"
RNG = np.random.default_rng(0)
K_QUANTS = (QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K)


def weight(qtype, rows, cols):
    """A random weight of `qtype`, and its exact float64 values (gguf's dequantize)."""
    w = RNG.standard_normal((rows, cols)).astype(np.float32)
    if qtype == QT.F32:
        return QWeight("w", w.view(np.uint8).reshape(rows, -1), qtype, rows, cols), w.astype(np.float64)
    if qtype == QT.F16:
        h = w.astype(np.float16)
        return QWeight("w", h.view(np.uint8).reshape(rows, -1), qtype, rows, cols), h.astype(np.float64)
    if qtype in K_QUANTS:  # gguf cannot quantize to them: random blocks, with sane float16 scales
        raw = random_blocks(qtype, rows * (cols // 256), RNG, high=0.1).reshape(rows, -1)
        return QWeight("w", raw, qtype, rows, cols), gq.dequantize(raw, qtype).astype(np.float64)
    raw = gq.quantize(w, qtype)
    return QWeight("w", raw, qtype, rows, cols), gq.dequantize(raw, qtype).astype(np.float64)


# Every type the CPU reads (BF16 is read as float rows, as F16). K-quant rows are whole
# super-blocks of 256.
@pytest.mark.parametrize("qtype,rows,cols", [
    (qtype, rows, cols)
    for qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
                  QT.F16, QT.F32)
    for rows, cols in ((1, 32), (7, 96), (3, 512)) if qtype not in K_QUANTS or cols % 256 == 0])
def test_matvec_and_dequantize(qtype, rows, cols):
    """The mat-vec of one activation row and of 11 (two blocks of rows of x, the second short):
    each row's bits the same either way, whatever its neighbours."""
    w, ref = weight(qtype, rows, cols)
    d = upload(w, np)
    x = RNG.standard_normal((11, 2 * cols)).astype(np.float32)[:, ::2]  # non-contiguous
    out = K.matvec(d.kind, d.scales, d.quants, x, np.empty((11, rows), np.float32), rows, cols)
    np.testing.assert_allclose(out, x.astype(np.float64) @ ref.T, rtol=1e-5, atol=1e-4)
    for s in (0, 10):
        one = K.matvec(d.kind, d.scales, d.quants, x[s:s + 1], np.empty((1, rows), np.float32), rows, cols)
        np.testing.assert_array_equal(one[0], out[s])
    full = K.dequantize(d.kind, d.scales, d.quants, np.empty((rows, cols), np.float32), rows, cols)
    np.testing.assert_array_equal(full, ref.astype(np.float32))


@pytest.mark.parametrize("qtype,groups", [(QT.Q4_1, (3, 5)), (QT.Q6_K, (4,))])
def test_matvec_of_a_fused_group(qtype, groups):
    """A fused group's weights in one mat-vec (`groups`: their row boundaries): each weight's
    products come out as one contiguous (S, its rows), bit for bit those of the weight alone,
    for one row of x and for nine (two blocks of rows of x)."""
    rows, cols = 7, 256
    w, _ = weight(qtype, rows, cols)
    d = upload(w, np)
    edges = [0, *groups, rows]
    for S in (1, 9):
        x = RNG.standard_normal((S, cols)).astype(np.float32)
        out = K.matvec(d.kind, d.scales, d.quants, x, np.empty(S * rows, np.float32), rows, cols, groups=groups)
        for a, b in zip(edges[:-1], edges[1:]):
            alone = K.matvec(d.kind, np.ascontiguousarray(d.scales[a:b]), np.ascontiguousarray(d.quants[a:b]), x,
                             np.empty((S, b - a), np.float32), b - a, cols)
            np.testing.assert_array_equal(out[S * a:S * b].reshape(S, b - a), alone)


@pytest.mark.parametrize("S", [1, 9])
def test_matvec_adds_to_out(S):
    """add=True (a product into the residual stream): out += the products, bit for bit the
    products stored alone and then added to out's values; one weight only."""
    w, _ = weight(QT.Q4_1, 5, 64)
    d = upload(w, np)
    x = RNG.standard_normal((S, 64)).astype(np.float32)
    out = RNG.standard_normal((S, 5)).astype(np.float32)
    want = out + K.matvec(d.kind, d.scales, d.quants, x, np.empty((S, 5), np.float32), 5, 64)
    assert K.matvec(d.kind, d.scales, d.quants, x, out, 5, 64, add=True) is out
    np.testing.assert_array_equal(out, want)
    with pytest.raises(ValueError, match="do not fit"):
        K.matvec(d.kind, d.scales, d.quants, x, np.empty(S * 5, np.float32), 5, 64, groups=(2,), add=True)


@pytest.mark.parametrize("act", [K.ACT_SILU, K.ACT_GELU_TANH])
@pytest.mark.parametrize("qtype,n_ff,S", [(QT.Q4_0, 1, 1), (QT.Q8_0, 21, 9), (QT.Q5_K, 3, 2)])
def test_matvec_with_the_glu(act, qtype, n_ff, S):
    """A fused gate/up group's mat-vec with the GLU in the same launch (n_ff 21: a block's rows
    of W past the last pair; S 9: two blocks of rows of x) gives, bit for bit, the GLU kernel's
    result on the group's two products; and the GLU of float64 products to rounding."""
    cols = 256
    w, ref = weight(qtype, 2 * n_ff, cols)
    d = upload(w, np)
    x = RNG.standard_normal((S, cols)).astype(np.float32)
    got = K.matvec(d.kind, d.scales, d.quants, x, np.empty((S, n_ff), np.float32), 2 * n_ff, cols, groups=(n_ff,),
                   act=act)
    both = K.matvec(d.kind, d.scales, d.quants, x, np.empty(S * 2 * n_ff, np.float32), 2 * n_ff, cols, groups=(n_ff,))
    g, u = both[:S * n_ff], both[S * n_ff:]
    np.testing.assert_array_equal(got.reshape(-1), K.glu(g, u, np.empty_like(g), act))
    want = glu_ref(x @ ref[:n_ff].T, x @ ref[n_ff:].T, act)
    # (1e-37: where every value underflows float32 to 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * np.abs(want).max() + 1e-37)
    with pytest.raises(ValueError, match="do not fit"):
        K.matvec(d.kind, d.scales, d.quants, x, np.empty((S, n_ff), np.float32), 2 * n_ff, cols, act=act)


def rmsnorm_ref(x, w, eps=1e-5):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize("S,n", [(1, 1), (3, 37), (2, 64)])
def test_rmsnorm(S, n):
    x = RNG.standard_normal((S, 2 * n)).astype(np.float32)[:, ::2]
    w = RNG.standard_normal(n).astype(np.float32)
    out = K.rmsnorm(x, w, 1e-5, np.empty((S, n), np.float32))
    np.testing.assert_allclose(out, rmsnorm_ref(x, w), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("S,H,KVH,D", [(1, 1, 1, 1), (3, 4, 2, 24)])
def test_head_norms(S, H, KVH, D):
    """q's heads by wq and k's by wk in one launch: each as `rmsnorm` gives it, bit for bit."""
    q = RNG.standard_normal((S, H, 2 * D)).astype(np.float32)[:, :, ::2]  # non-contiguous
    k = RNG.standard_normal((S, KVH, D)).astype(np.float32)
    wq, wk = RNG.standard_normal(D).astype(np.float32), RNG.standard_normal(D).astype(np.float32)
    oq, ok = K.head_norms(q, k, wq, wk, 1e-5, np.empty((S, H, D), np.float32), np.empty((S, KVH, D), np.float32))
    for out, x, w in ((oq, q, wq), (ok, k, wk)):
        np.testing.assert_allclose(out, rmsnorm_ref(x, w), rtol=2e-6, atol=1e-6)
        flat = np.ascontiguousarray(x).reshape(-1, D)
        np.testing.assert_array_equal(out.reshape(-1, D), K.rmsnorm(flat, w, 1e-5, np.empty_like(flat)))


@pytest.mark.parametrize("S,n", [(1, 1), (3, 37)])
def test_add_rmsnorm(S, n):
    """x += rmsnorm(y) in one launch: the norm's bits added to x's."""
    x = RNG.standard_normal((S, n)).astype(np.float32)
    y = RNG.standard_normal((S, 2 * n)).astype(np.float32)[:, ::2]  # non-contiguous
    w = RNG.standard_normal(n).astype(np.float32)
    x0 = x.copy()
    want = x + K.rmsnorm(y, w, 1e-5, np.empty((S, n), np.float32))
    assert K.add_rmsnorm(x, y, w, 1e-5) is x
    np.testing.assert_array_equal(x, want)
    np.testing.assert_allclose(x, x0 + rmsnorm_ref(y, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("S,H,KVH,D,half", [(1, 1, 1, 2, 1), (3, 3, 2, 8, 4), (2, 2, 1, 10, 3)])
def test_rope_store(neox, S, H, KVH, D, half):
    """q and k (their own head counts) rotated in one launch, each as NumPy rotates it (half 3
    of D 10: a partial rotary, its last 4 dimensions as they were), and the rotated keys and
    the values written into the records at `slots`, the other records untouched."""
    angles = np.arange(16)[:, None] * 0.3 / (1 + np.arange(half))[None, :]
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    q = RNG.standard_normal((S, H, D)).astype(np.float32)
    k = RNG.standard_normal((S, KVH, D)).astype(np.float32)
    v = RNG.standard_normal((S, KVH, 2 * D)).astype(np.float32)[:, :, ::2]  # non-contiguous
    kv = RNG.standard_normal((7, KVH, 2, D)).astype(np.float16)
    before = kv.copy()
    positions, slots = np.array([5, 9, 15][:S], np.int64), np.array([6, 0, 3][:S], np.int64)
    gq, gk = q.copy(), k.copy()
    K.rope_store(gq, gk, v, kv, slots, positions, cos, sin, neox)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    for out, x in ((gq, q), (gk, k)):
        r = x[..., :2 * half]
        a, b = (r[..., :half], r[..., half:]) if neox else (r[..., 0::2], r[..., 1::2])
        ra, rb = a * c - b * s, a * s + b * c
        rot = np.concatenate([ra, rb], -1) if neox else np.stack([ra, rb], -1).reshape(r.shape)
        np.testing.assert_allclose(out, np.concatenate([rot, x[..., 2 * half:]], -1), rtol=1e-6, atol=1e-6)
    before[slots, :, 0] = gk
    before[slots, :, 1] = v
    np.testing.assert_array_equal(kv, before)


def glu_ref(g, u, act):
    g64 = g.astype(np.float64)
    z = np.sqrt(2 / np.pi) * 2 * (g64 + 0.044715 * g64 ** 3) if act == K.ACT_GELU_TANH else g64
    with np.errstate(over="ignore"):  # exp's inf gives the limit, 0
        return g64 / (1 + np.exp(-z)) * u


@pytest.mark.parametrize("act", [K.ACT_SILU, K.ACT_GELU_TANH])
@pytest.mark.parametrize("n", [1, 45])
def test_glu(act, n):
    g = RNG.standard_normal(n).astype(np.float32) * 3
    u = RNG.standard_normal(n).astype(np.float32)
    out = K.glu(g, u, np.empty(n, np.float32), act)
    np.testing.assert_allclose(out, glu_ref(g, u, act), rtol=1e-5, atol=1e-6)


def attention_ref(q, keys_of, positions, window, scale, group):
    """float64 attention of queries q (S, H, D) at `positions`; keys_of(s) gives query s's
    sequence's records (positions, KVH, 2, D)."""
    S, H, D = q.shape
    out = np.zeros((S, H, D))
    for s in range(S):
        p = positions[s]
        kv = keys_of(s)
        keys = [t for t in range(p + 1) if window == 0 or t > p - window]
        for h in range(H):
            k = kv[keys, h // group, 0].astype(np.float64)
            v = kv[keys, h // group, 1].astype(np.float64)
            sc = k @ q[s, h].astype(np.float64) * scale
            p_ = np.exp(sc - sc.max())
            out[s, h] = p_ @ v / p_.sum()
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("S,kv_len,window,extra", [(1, 1, 0, 0), (4, 9, 0, 0), (3, 70, 5, 0),
                                                   (1, 70, 0, 2), (2, 5, 3, 1)])
def test_attention(dtype, S, kv_len, window, extra):
    """A session's cache: queries at the last S of kv_len positions of one buffer, given as a
    single page; `extra` splits past the keys (a CUDA graph launches the splits of the cache's
    whole capacity) change nothing."""
    H, KVH, D = 4, 2, 8
    kv = RNG.standard_normal((kv_len + 3, KVH, 2, D)).astype(dtype)
    kv[kv_len:] = np.nan  # rows past the last position are never read
    q = RNG.standard_normal((S, H, 2 * D)).astype(np.float32)[:, :, ::2]  # non-contiguous
    positions = np.arange(kv_len - S, kv_len, dtype=np.int64)
    splits = -(-kv_len // K.SPLIT) + extra
    out = K.attention(q, kv[None], np.zeros((1, 1), np.int32), np.zeros(S, np.int64), positions, splits, window,
                      0.35, np.empty((S, H, D), np.float32), np)
    np.testing.assert_allclose(out, attention_ref(q, lambda s: kv, positions, window, 0.35, H // KVH),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,page_size,window", [(np.float16, 1, 0), (np.float32, 4, 0), (np.float16, 16, 6)])
def test_paged_attention(dtype, page_size, window):
    """Queries of three sequences (70, 5 and 1 positions, their queries in mixed order) over a
    pool's pages in shuffled order, a sequence's table padded with -1; unused pages hold NaN."""
    H, KVH, D = 4, 2, 8
    lengths = [70, 5, 1]
    need = [-(-n // page_size) for n in lengths]
    n_pages = sum(need) + 2
    order = RNG.permutation(n_pages)
    tables = np.full((3, max(need)), -1, np.int32)
    pages = np.full((n_pages, page_size, KVH, 2, D), np.nan, dtype)
    seq_kv = []
    for b, n in enumerate(lengths):
        tables[b, :need[b]] = order[sum(need[:b]):sum(need[:b + 1])]
        kv = RNG.standard_normal((n, KVH, 2, D)).astype(dtype)
        for t in range(n):
            pages[tables[b, t // page_size], t % page_size] = kv[t]
        seq_kv.append(kv)
    seq_of = np.array([1, 0, 2, 0], np.int64)
    positions = np.array([4, 69, 0, 33], np.int64)
    q = RNG.standard_normal((4, H, D)).astype(np.float32)
    out = K.attention(q, pages, tables, seq_of, positions, -(-70 // K.SPLIT), window, 0.25,
                      np.empty((4, H, D), np.float32), np)
    ref = attention_ref(q, lambda s: seq_kv[seq_of[s]], positions, window, 0.25, H // KVH)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("S", [1, 3])
def test_store_kv(dtype, S):
    KVH, D = 2, 8
    kv = RNG.standard_normal((9, KVH, 2, D)).astype(dtype)
    before = kv.copy()
    k = RNG.standard_normal((S, KVH, 2 * D)).astype(np.float32)[:, :, ::2]  # non-contiguous
    v = RNG.standard_normal((S, KVH, D)).astype(np.float32)
    slots = np.array([6, 2, 7][:S], np.int64)
    K.store_kv(kv, k, v, slots)
    before[slots, :, 0] = k
    before[slots, :, 1] = v
    np.testing.assert_array_equal(kv, before)


def test_a_gpus_block_shapes(monkeypatch):
    """The kernels with a GPU's block shapes (32 lanes a row or head, 4 rows of W a block: 2
    pairs of a GLU mat-vec), which the simulator otherwise shrinks to 4 lanes and 32 rows to
    run fast; its kernels read these names at run time. Each case is a test above."""
    for name, value in (("LANES", 32), ("ROWS_PER_BLOCK", 4), ("_PAIRS", 2), ("_MATVEC_THREADS", 128)):
        monkeypatch.setattr(K, name, value)
    test_matvec_of_a_fused_group(QT.Q4_1, (3, 5))
    test_matvec_with_the_glu(K.ACT_GELU_TANH, QT.Q8_0, 5, 9)
    test_matvec_adds_to_out(9)
    test_head_norms(2, 3, 1, 40)
    test_add_rmsnorm(3, 37)
    test_rope_store(True, 2, 2, 1, 10, 3)
    test_paged_attention(np.float16, 16, 6)
