"""npllama.kernels.panels: products of many rows on weight panels, against gguf's
dequantization and a float64 dot with the activations (int8: their dequantized int8 blocks;
int24: the activations themselves, which they keep to float32's rounding), for every
instruction set the micro-kernel can be compiled for on this machine."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
import gguf.quants
from numba import njit

from npllama.kernels import cpu, panels as P
from npllama.kernels.nn import ACTS
from npllama.kernels.qtypes import type_mask
from test_quants import SCALE_OFFSETS
from test_quants_int8 import full_range_weight, ref_quantize, runnable_isas

TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
MODES = [True, False]  # int8 activations, int24 ones (the exact mode)
# "amx": with 48 rows or more the tiles of 16 by AMX, the rest by the vpdpbusd kernel (`_panel_dots_many`)
ISAS = runnable_isas() + (["amx"] if P.AMX else [])
_KERNELS = {}


def mode_id(int8):
    return "int8" if int8 else "int24"


def cols(qtype, blocks):
    """Columns of `blocks` GGUF blocks (the K-quants': super-blocks of 256)."""
    return GGML_QUANT_SIZES[qtype][0] * blocks


def panel_kernel(isa, one_row=False):
    """njit (mask, code, pw, rows, xr, out): `_matmul_panels` with the micro-kernels of `isa`
    (serial, not cached; `one_row`: the kernel for one activation row; "amx": AMX's tiles of
    16 rows where there are enough rows, then the vpdpbusd kernel's)."""
    if (isa, one_row) not in _KERNELS:
        if isa == "amx":
            dots = P._panel_dots_many
        else:
            kernel = P._make_panel_dots(isa, one_row)

            @njit
            def dots(mask, code, panel, xr, tmp, wb):
                kernel(mask, code, panel, xr, tmp)
        W = P.PANEL

        @njit
        def run(mask, code, pw, rows, xr, out):
            T = xr[0].shape[0]
            tmp = np.empty((T, W), np.float32)
            wb = np.empty(16 * xr[0].shape[-1], np.uint8)
            for p in range(pw.shape[0]):
                dots(mask, code, pw[p], xr, tmp, wb)
                for t in range(T):
                    for i in range(min(W, rows - p * W)):
                        out[t, p * W + i] = tmp[t, i]
        _KERNELS[isa, one_row] = run
    return _KERNELS[isa, one_row]


def reference(data, qtype, rows, x, int8):
    """float64 x' @ W.T: W from gguf's dequantization, x' = x (int24's reference: x itself)
    or (int8) the dequantized int8 blocks of x; and |x'| @ |W|.T, the scale of the rounding."""
    w = gguf.quants.dequantize(data, qtype).reshape(rows, -1).astype(np.float64)
    if int8:
        x = np.stack([np.asarray(ref_quantize(r)[0], np.float64) * np.repeat(ref_quantize(r)[1], 32) for r in x])
    x = np.asarray(x, np.float64)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def assert_close(out, data, qtype, rows, x, int8):
    ref, mag = reference(data, qtype, rows, x, int8)
    assert out.shape == ref.shape
    np.testing.assert_array_less(np.abs(out - ref), 2e-6 * mag + 1e-30)


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_every_isa(isa, qtype, int8):
    """int8 and int24 activations with each instruction set, a block of outliers (x100) in row 0;
    one activation row also by the kernel for one row (the decode step's)."""
    rng = np.random.default_rng(int(qtype))
    for rows, blocks, T in ((1, 1, 1), (16, 1, 4), (17, 2, 5), (37, 3, 9), (5, 18, 3), (33, 7, 13), (20, 2, 29),
                            (40, 9, 1), (3, 1, 16), (18, 5, 70)):
        data = full_range_weight(qtype, rows, blocks, rng)
        x = rng.normal(size=(T, cols(qtype, blocks))).astype(np.float32)
        x[0, :32] *= 100.0
        for one_row in (False, True) if T == 1 else (False,):
            out = np.full((T, rows), np.nan, np.float32)
            panel_kernel(isa, one_row)(type_mask([qtype]), int(qtype), P.pack_panels(data, qtype), rows,
                                       P.activation_rows(x, int8), out)
            assert_close(out, data, qtype, rows, x, int8)


def handmade_rows(digits, d):
    """Activation rows (xq, xd, xs, xi) with every value of row t's plane p equal to
    digits[t][p] (int8: one plane; int24: three) and scale d, and the float64 x they stand for."""
    q = np.asarray(digits, np.int64)[:, :, None] * np.ones(d.shape[1] * 32, np.int64)
    T, planes, n = q.shape
    value = (q * (256 ** np.arange(planes - 1, -1, -1))[:, None]).sum(1)  # 65536 q1 + 256 q2 + q3
    xq = q.astype(np.int8) if planes == 3 else q[:, 0].astype(np.int8)
    xi = q.reshape(T, planes, n // 16, 16).sum(-1).astype(np.int32)
    xs = (d * value.reshape(T, -1, 32).sum(-1)).astype(np.float32)
    x = value * np.repeat(d.astype(np.float64), 32, axis=1)
    return (xq, d, xs, xi if planes == 3 else xi[:, 0]), x


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_largest_integer_sums_every_isa(isa, qtype, int8):
    """Every quant at its largest (all bytes 0xFF; Q8_0 0x7F) or other extremes (0x00, 0x80)
    against activations whose every digit is at an end of its range (int8: +-127; int24's
    planes: +-126, then 127 or -128): the largest integer sums, which no instruction set may
    saturate or wrap (AVX2 adds vpmaddubsw's i16 pair sums in i16 before widening them)."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = 2
    data = np.zeros((3, blocks, size), np.uint8)
    data[0], data[1], data[2] = (0x7F if qtype == QT.Q8_0 else 0xFF), 0x00, 0x80
    for i, o in enumerate(SCALE_OFFSETS[qtype]):
        data[..., o:o + 2] = np.array([0.5 if i == 0 else -0.25], np.float16).view(np.uint8)
    data = data.reshape(3, -1)
    digits = [[127], [-127], [127], [-127]] if int8 else [[126, 127, 127], [-126, -128, -128], [126, -128, -128],
                                                           [-126, 127, 127]]
    d = np.array([[0.5], [0.25], [2.0 ** -10], [3.0]], np.float32) * np.ones((1, cols(qtype, blocks) // 32), np.float32)
    xr, x = handmade_rows(digits * 16, np.tile(d, (16, 1)))  # 64 rows: AMX's tiles (P._AMX_ROWS)
    pw, w = P.pack_panels(data, qtype), gguf.quants.dequantize(data, qtype).reshape(3, -1).astype(np.float64)
    assert np.isfinite(w).all()
    # all 64 rows, then each row alone: in a tile of one, and by the kernel for one row
    for rows, one_row in ((slice(0, 64), False), *((slice(t, t + 1), one) for t in range(4) for one in (False, True))):
        out = np.full((rows.stop - rows.start, 3), np.nan, np.float32)
        panel_kernel(isa, one_row)(type_mask([qtype]), int(qtype), pw, 3, tuple(a[rows] for a in xr), out)
        np.testing.assert_array_less(np.abs(out - x[rows] @ w.T), 2e-6 * (np.abs(x[rows]) @ np.abs(w).T) + 1e-30)


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_matmul_panels(qtype, int8):
    """The compiled, parallel product; odd shapes, one row, non-contiguous input, and (50
    rows) AMX's tiles where the CPU has them, with the scratch each thread makes once."""
    rng = np.random.default_rng(3)
    for rows, blocks, T in ((1, 1, 1), (3, 2, 1), (40, 5, 6), (64, 18, 17), (40, 3, 50)):
        data = full_range_weight(qtype, rows, blocks, rng)
        pw = P.pack_panels(data, qtype)
        assert pw.shape == ((rows + 15) // 16, cols(qtype, blocks) // 32 * P._KINDS[P._CODES[int(qtype)]][3])
        x = rng.normal(size=(T, 2 * cols(qtype, blocks))).astype(np.float32)[:, ::2]  # not contiguous
        out = P.matmul_panels(pw, qtype, rows, x, int8=int8)
        assert_close(out, data, qtype, rows, x, int8)
        np.testing.assert_array_equal(out, P.matmul_panels(pw, qtype, rows, np.ascontiguousarray(x), int8=int8))


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_do_not_depend_on_their_neighbours(qtype, int8):
    """A row's products are the same bits alone, anywhere in a tile, or in a tail (every count
    of rows up to 21)."""
    rng = np.random.default_rng(5)
    rows, blocks = 24, 4
    data = full_range_weight(qtype, rows, blocks, rng)
    pw = P.pack_panels(data, qtype)
    x = rng.normal(size=(21, cols(qtype, blocks))).astype(np.float32)  # tiles of 4, then a row
    together = P.matmul_panels(pw, qtype, rows, x, int8=int8)
    for t in range(len(x)):
        np.testing.assert_array_equal(P.matmul_panels(pw, qtype, rows, x[t:t + 1], int8=int8)[0], together[t])
        np.testing.assert_array_equal(P.matmul_panels(pw, qtype, rows, x[:t + 1], int8=int8), together[:t + 1])
    for a, b in ((3, 10), (2, 14), (1, 6), (4, 20), (5, 21)):
        np.testing.assert_array_equal(P.matmul_panels(pw, qtype, rows, x[a:b], int8=int8), together[a:b])


@pytest.mark.skipif(not P.AMX, reason="no AMX-INT8 on this CPU (or Linux did not grant this process its tiles)")
@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_amx_tiles_are_the_vpdpbusd_kernels_bits(qtype, int8):
    """AMX's kernel computes the tiles of 16 rows, the same bits as the vpdpbusd kernel, and
    leaves the rows after them as they were."""
    rng = np.random.default_rng(7)
    rows, blocks, T = 16, 3, 37
    data = full_range_weight(qtype, rows, blocks, rng)
    pw = P.pack_panels(data, qtype)
    xr = P.activation_rows(rng.normal(size=(T, cols(qtype, blocks))).astype(np.float32), int8)
    amx = P._panel_dots_amx

    @njit
    def run(mask, code, panel, xr, tmp, wb):
        amx(mask, code, panel, xr, tmp, wb)

    out = np.full((T, 16), np.nan, np.float32)
    run(type_mask([qtype]), int(qtype), pw[0], xr, out, np.empty(16 * xr[0].shape[-1], np.uint8))
    ref = np.empty((T, 16), np.float32)
    panel_kernel(P.DOT_ISA)(type_mask([qtype]), int(qtype), pw, rows, xr, ref)
    np.testing.assert_array_equal(out[:32], ref[:32])
    assert np.isnan(out[32:]).all()


def test_amx_needs_its_features():
    assert not cpu.amx_ready({"avx512vnni", "avx512vl", "avx512bw", "amx-tile"})


def test_quantize_rows_as_the_decode_step():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(3, 96)).astype(np.float32)
    x[1, 40] = 1e6
    x[2, :32] = 0.0
    xq, xd, xs, xi = P.quantize_rows(x)
    for t in range(3):
        qs, d, s = ref_quantize(x[t])
        np.testing.assert_array_equal(xq[t], qs)
        np.testing.assert_array_equal(xd[t], d)
        np.testing.assert_array_equal(xs[t], s)
        np.testing.assert_array_equal(xi[t], qs.reshape(-1, 16).astype(np.int64).sum(1))  # half blocks


def test_quantize_rows_i24_against_numpy():
    """Digits in -128..127 that make q = rint(x / d), d = max|x| / (126 * 65536) per block (x
    within 2^-22 of its block's largest |x|), the planes' half-block sums and d sum q; a zero
    block, a block so small that 1 / d overflows, an inf and a NaN as the int8 quantizer."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(4, 160)).astype(np.float32)
    x[0, 3] = 3e5
    x[1, :32] = 0.0
    x[1, 32:64] = 1e-44  # 1 / d overflows
    x[2, 70] = np.inf
    x[3, 100] = np.nan
    xq, xd, xs, xi = P.quantize_rows_i24(x)
    assert xq.shape == (4, 3, 160) and xd.shape == xs.shape == (4, 5) and xi.shape == (4, 3, 10)
    blocks = x.reshape(4, 5, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    d = (amax / (126 * 65536)).astype(np.float32)
    np.testing.assert_array_equal(xd, d)
    q = xq.astype(np.int64)
    big = (q[:, 0] * 65536 + q[:, 1] * 256 + q[:, 2]).reshape(4, 5, 32)
    fine = np.isfinite(amax) & (amax > 1e-30)
    with np.errstate(divide="ignore", invalid="ignore"):  # float32 products, as the kernel's
        want = np.rint(x.reshape(4, 5, 32) * (np.float32(1) / d[..., None]))
    np.testing.assert_array_equal(big[fine], want[fine].astype(np.int64))
    assert (np.abs(big[fine] * d[fine][:, None] - blocks[fine]) <= 2 ** -22 * amax[fine][:, None]).all()
    assert (big[~fine] == 0).all()
    np.testing.assert_array_equal(xi, q.reshape(4, 3, 10, 16).sum(-1))
    np.testing.assert_allclose(xs[fine], d[fine] * big.sum(-1)[fine], rtol=1e-6)
    assert xs[1, 0] == 0 and xs[1, 1] == 0 and np.isnan(xs[2, 2]) and np.isnan(xs[3, 3])


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
@pytest.mark.parametrize("row", [2, 4])
def test_a_nan_row_stays_in_its_row(int8, row):
    """Row 2 is in a tile of 4, row 4 the tail's."""
    rng = np.random.default_rng(2)
    data = full_range_weight(QT.Q4_1, 20, 2, rng)
    x = rng.normal(size=(5, 64)).astype(np.float32)
    x[row, 7] = np.nan
    out = P.matmul_panels(P.pack_panels(data, QT.Q4_1), QT.Q4_1, 20, x, int8=int8)
    assert np.isnan(out[row]).all()
    assert np.isfinite(np.delete(out, row, axis=0)).all()


@pytest.mark.parametrize("int8", MODES, ids=mode_id)
def test_fused_products(int8):
    """q/k/v in one region and the GLU fused per panel, against the single products."""
    rng = np.random.default_rng(4)
    T, blocks = 6, 3
    ws = {n: (full_range_weight(t, r, blocks, rng), t, r)
          for n, t, r in (("q", QT.Q4_1, 40), ("k", QT.Q8_0, 16), ("v", QT.Q4_0, 9), ("g", QT.Q4_1, 33),
                          ("u", QT.Q8_0, 33))}
    pw = {n: P.pack_panels(d, t) for n, (d, t, r) in ws.items()}
    x = rng.normal(size=(T, 32 * blocks)).astype(np.float32)
    xr = P.activation_rows(x, int8)
    single = {n: P.matmul_panels(pw[n], t, r, x, int8=int8) for n, (d, t, r) in ws.items()}
    q, k, v = (np.empty((T, ws[n][2]), np.float32) for n in "qkv")
    P._qkv_panels(type_mask([QT.Q4_1]), int(QT.Q4_1), pw["q"], int(QT.Q8_0), pw["k"], int(QT.Q4_0), pw["v"], xr,
                  q, k, v)
    for n, a in zip("qkv", (q, k, v)):
        np.testing.assert_array_equal(a, single[n])
    out = np.empty((T, 33), np.float32)
    P._gate_up_panels(type_mask([QT.Q4_1]), int(QT.Q4_1), pw["g"], int(QT.Q8_0), pw["u"], xr, out, ACTS["silu"])
    g = single["g"].astype(np.float64)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * single["u"], rtol=1e-5, atol=1e-6)


def test_errors():
    rng = np.random.default_rng(0)
    data = full_range_weight(QT.Q4_1, 4, 2, rng)
    with pytest.raises(ValueError, match="no panel kernels for type"):
        P.pack_panels(data, QT.Q3_K)
    with pytest.raises(ValueError, match="uint8 array of shape"):
        P.pack_panels(data[:, :30], QT.Q4_1)
    pw = P.pack_panels(data, QT.Q4_1)
    with pytest.raises(ValueError, match="do not hold a q4_1 weight"):
        P.matmul_panels(pw, QT.Q4_1, 4, np.zeros((2, 96), np.float32))
    for int8 in MODES:
        with pytest.raises(ValueError, match="multiple of 32"):
            P.matmul_panels(pw, QT.Q4_1, 4, np.zeros((2, 60), np.float32), int8=int8)
    assert P.has_panels(QT.Q8_0) and P.has_panels(QT.Q6_K) and not P.has_panels(QT.Q3_K)
    assert P.panel_shape(QT.Q4_1, 4, 64) == pw.shape == (1, 2 * 320)
    out = np.zeros(pw.shape, np.uint8)
    assert P.pack_panels(data, QT.Q4_1, out=out) is out
    np.testing.assert_array_equal(out, pw)
    for bad in (np.zeros((1, 639), np.uint8), np.zeros(pw.shape, np.int8), np.zeros((1, 1280), np.uint8)[:, ::2]):
        with pytest.raises(ValueError, match="out must be a C-contiguous uint8 array of shape"):
            P.pack_panels(data, QT.Q4_1, out=bad)
    with pytest.raises(ValueError, match="no panel kernels for type"):
        P.panel_shape(QT.Q2_K, 4, 256)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_store_against_numpy(act):
    """`_glu_store` (the packed pass's GLU of a panel) against the formulas in float64: every
    row of the panel's columns, the last panel's that exist only, one row, and nothing
    outside the panel's columns written."""
    rng = np.random.default_rng(11)
    for T, cols, p in ((5, 48, 1), (1, 16, 0), (3, 37, 2)):
        g = (rng.normal(size=(T, 16)) * 4).astype(np.float32)
        u = rng.normal(size=(T, 16)).astype(np.float32)
        out = np.full((T, cols), np.nan, np.float32)
        P._glu_store(g, u, out, p, ACTS[act])
        w = min(16, cols - 16 * p)
        x = g[:, :w].astype(np.float64)
        if act == "silu":
            ref = x / (1 + np.exp(-x)) * u[:, :w]
        else:
            ref = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))) * u[:, :w]
        np.testing.assert_allclose(out[:, 16 * p:16 * p + w], ref, rtol=2e-6, atol=1e-7)
        assert np.isnan(np.delete(out, np.s_[16 * p:16 * p + w], axis=1)).all()
