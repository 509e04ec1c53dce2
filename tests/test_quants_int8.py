"""npllama.kernels.quants_int8: int8-activation decode products, against NumPy references of the same
integer math, for every instruction set the kernels can be compiled for on this machine."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
import gguf.quants
from numba import njit

from npllama.kernels import cpu, quants
from npllama.kernels import quants_int8 as qi
from npllama.kernels.qtypes import type_mask
from npllama.kernels.threads import using_threads
from test_products import small_scale_bits, weight
from test_quants import SCALE_OFFSETS, random_blocks

INT8_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1]
# types whose int8 dots are checked against ref_scaled_int8 (the K-quants: rows of 256-element super-blocks)
FIVE_TYPES = [QT.Q5_0, QT.Q5_1]
K_TYPES = [QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K]
NEW_TYPES = FIVE_TYPES + K_TYPES


# ---------------------------------------------------------------------------------------
# NumPy references
# ---------------------------------------------------------------------------------------

def ref_quantize(x):
    """(qs, d, s) of float32 x, as documented for _quantize_x_q8, in NumPy float32."""
    xb = np.asarray(x, np.float32).reshape(-1, 32)
    a = np.abs(xb)
    amax = np.where(np.isnan(a).any(axis=1), np.float32(np.nan), np.max(np.where(np.isnan(a), 0, a), axis=1))
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        idd = np.where(d > 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
        ok = (d < np.inf) & (idd < np.inf)
        q = np.where(ok[:, None], np.rint(xb * np.where(ok, idd, 0)[:, None]), 0).astype(np.float32)
        s = (d * q.sum(axis=1, dtype=np.int64).astype(np.float32)).astype(np.float32)
    return q.astype(np.int8).reshape(-1), d, s


def ref_blocks(data, qtype):
    """Integer quants (rows, nb, 32) int64 and float32 d, m (rows, nb) of Q8_0/Q4_0/Q4_1 data."""
    _, size = GGML_QUANT_SIZES[qtype]
    blk = np.ascontiguousarray(data).reshape(data.shape[0], -1, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = np.zeros_like(d)
    if qtype == QT.Q8_0:
        return blk[..., 2:].copy().view(np.int8).astype(np.int64), d, m
    nib = blk[..., -16:].astype(np.int64)
    q = np.concatenate([nib & 15, nib >> 4], axis=-1)
    if qtype == QT.Q4_0:
        return q - 8, d, m
    m = blk[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    return q, d, m


def ref_int8_product(data, qtype, qs, d, s):
    """(value, error scale) per row: the exact integer block sums, then float64
    sum_b (d_w d_x as float32) isum_b + (m_w s_x as float32)."""
    w, dw, mw = ref_blocks(data, qtype)
    isum = (w * qs.reshape(-1, 32).astype(np.int64)).sum(axis=-1)            # exact
    iabs = (np.abs(w) * np.abs(qs.reshape(-1, 32).astype(np.int64))).sum(axis=-1)
    scale = (dw * d).astype(np.float32).astype(np.float64)                    # float32 as the kernel
    mterm = (mw * s).astype(np.float32).astype(np.float64) if qtype == QT.Q4_1 else np.zeros(dw.shape)
    value = (scale * isum).sum(axis=-1) + mterm.sum(axis=-1)
    bound = (np.abs(scale) * iabs).sum(axis=-1) + np.abs(mterm).sum(axis=-1)
    return value, bound


def _with_scales(data, qtype, d, m):
    """gguf's dequantization of ``data`` with every block's float16 d set to ``d`` and its
    dmin/m (where it has one) to ``m``: with (1, 0) the exact integer weights sc * q (sc: the
    sub-block's integer scale; q with its bias), with (0, 1) the integer minimums, negated for
    the K-quants (w = d sc q - dmin min) and as they are for Q5_1 (w = d q + m)."""
    _, size = GGML_QUANT_SIZES[qtype]
    blk = np.ascontiguousarray(data).reshape(data.shape[0], -1, size).copy()
    for o, v in zip(SCALE_OFFSETS[qtype], (d, m)):
        blk[..., o:o + 2] = np.array([v], np.float16).view(np.uint8)
    return gguf.quants.dequantize(blk.reshape(data.shape[0], -1), qtype).astype(np.int64)


def ref_scaled_int8(data, qtype, qs, d, s):
    """(value, error scale) per row, for any block type: per block b of 32 elements of x, the
    exact integer sums of the weights' integers (sc * q, as _with_scales gives them) and of
    their minimums times x's quants, then in float64 d_w d_x isum_b + dmin_w d_x msum_b."""
    rows = data.shape[0]
    _, size = GGML_QUANT_SIZES[qtype]
    offs = SCALE_OFFSETS[qtype]
    blk = np.ascontiguousarray(data).reshape(rows, -1, size)
    per = (qs.shape[0] // 32) // blk.shape[1]  # x blocks per weight block
    f16 = lambda o: np.repeat(blk[..., o:o + 2].copy().view(np.float16)[..., 0].astype(np.float64), per, axis=1)  # noqa: E731
    dw = f16(offs[0])
    mw = f16(offs[1]) if len(offs) > 1 else np.zeros_like(dw)
    xq = qs.reshape(-1, 32).astype(np.int64)
    w1 = _with_scales(data, qtype, 1.0, 0.0).reshape(rows, -1, 32)
    m1 = (_with_scales(data, qtype, 0.0, 1.0).reshape(rows, -1, 32) if len(offs) > 1 else np.zeros_like(w1))
    isum, msum = (w1 * xq).sum(axis=-1), (m1 * xq).sum(axis=-1)
    iabs, mabs = (np.abs(w1) * np.abs(xq)).sum(axis=-1), (np.abs(m1) * np.abs(xq)).sum(axis=-1)
    dx = d.astype(np.float64)
    value = (dw * dx * isum + mw * dx * msum).sum(axis=-1)
    bound = (np.abs(dw * dx) * iabs + np.abs(mw * dx) * mabs).sum(axis=-1)
    return value, bound


def assert_int8_close(y, data, qtype, qs, d, s):
    """y agrees with the reference up to float32 rounding of the scaling and the summation."""
    ref = ref_int8_product if qtype in INT8_TYPES else ref_scaled_int8
    value, bound = ref(data, qtype, qs, d, s)
    assert y.dtype == np.float32 and y.shape == value.shape
    err = np.abs(y.astype(np.float64) - value)
    # worst case of float32 rounding: a few ulp of the magnitude per sequential addition
    tol = 1.2e-7 * (qs.shape[0] // 32 + 16) * bound + 1e-30
    assert np.all(err <= tol), np.max(err / (bound + 1e-30))


# ---------------------------------------------------------------------------------------
# Quantization of x
# ---------------------------------------------------------------------------------------

def test_quantize_matches_reference():
    rng = np.random.default_rng(0)
    x = rng.normal(size=32 * 40).astype(np.float32) * np.repeat(10.0 ** rng.uniform(-30, 30, 40), 32).astype(np.float32)
    x[32:64] = 0.0                                       # all-zero block: d = 0
    x[64:96] = rng.integers(-9, 10, 32) / 2.0            # d = 1 below: q = rint(x), with ties
    x[64] = 127.0
    x[96:128] = np.float32(1e-38) * rng.normal(size=32)  # 1/d overflows: q = 0
    x[130] = -np.float32(3e38)                           # near the float32 limit
    x[161] = np.inf
    x[200] = np.nan
    x[230] = -np.inf
    qs, d, s = qi.quantize_x(x)
    rq, rd, rs = ref_quantize(x)
    np.testing.assert_array_equal(qs, rq)
    np.testing.assert_array_equal(d, rd)   # exact (NaN where NaN)
    np.testing.assert_array_equal(s, rs)
    assert qs.dtype == np.int8 and d.dtype == np.float32 and s.dtype == np.float32
    assert np.all(np.abs(qs.astype(np.int64)) <= 127)
    assert d[1] == 0 and not qs[32:64].any() and s[1] == 0
    np.testing.assert_array_equal(qs[64:96], np.rint(x[64:96]).astype(np.int8))  # half to even
    assert set(np.abs(x[65:96]) % 1) == {0.0, 0.5}
    assert not qs[96:128].any()
    assert np.isinf(d[5]) and np.isnan(s[5]) and not qs[160:192].any()
    assert np.isnan(d[6]) and np.isnan(s[6]) and not qs[192:224].any()


def test_quantize_round_trip():
    """|x - d q| <= d / 2 per element: the quantization error of x."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=32 * 50).astype(np.float32)
    qs, d, s = qi.quantize_x(x)
    deq = qs.reshape(-1, 32).astype(np.float64) * d[:, None]
    assert np.all(np.abs(deq - x.reshape(-1, 32)) <= 0.5001 * d[:, None])
    np.testing.assert_allclose(s, deq.sum(axis=1), rtol=1e-6, atol=1e-6)
    assert np.all(np.abs(qs.reshape(-1, 32)).max(axis=1) == 127)


def test_quantize_input_checks():
    with pytest.raises(ValueError, match="multiple of 32"):
        qi.quantize_x(np.zeros(33, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        qi.quantize_x(np.zeros((2, 32), np.float32))


# ---------------------------------------------------------------------------------------
# Row dots, for every instruction set this CPU can run
# ---------------------------------------------------------------------------------------

def runnable_isas():
    f = cpu.target_features()
    isas = ["generic"]
    if "avx2" in f:
        isas.append("avx2")
    if "avxvnni" in f or {"avx512vnni", "avx512vl"} <= f:
        isas.append("vnni256")
    if {"avx512vnni", "avx512vl", "avx512bw"} <= f:
        isas.append("vnni512")
    return isas


_ROW_KERNELS = {}


def row_kernels(isa, group=4, n_acc=2, hadd=None):
    """njit (data, qs, d, s, out) loops over the rows with the dots of ``isa`` (not cached)."""
    key = (isa, group, n_acc, hadd)
    if key not in _ROW_KERNELS:
        d8, d40, d41, d50, d51 = qi._make_row_dots(isa, group, n_acc, hadd)
        k4, k5, k6, k3, k2 = qi._make_k_dots(isa)

        @njit
        def q8_0(data, qs, d, s, out):
            for r in range(data.shape[0]):
                out[r] = d8(data[r], qs, d, qs.shape[0] // 32)

        @njit
        def q4_0(data, qs, d, s, out):
            for r in range(data.shape[0]):
                out[r] = d40(data[r], qs, d, s, qs.shape[0] // 32)

        @njit
        def q4_1(data, qs, d, s, out):
            for r in range(data.shape[0]):
                out[r] = d41(data[r], qs, d, s, qs.shape[0] // 32)

        @njit
        def q5_0(data, qs, d, s, out):
            for r in range(data.shape[0]):
                out[r] = d50(data[r], qs, d, s, qs.shape[0] // 32)

        @njit
        def q5_1(data, qs, d, s, out):
            for r in range(data.shape[0]):
                out[r] = d51(data[r], qs, d, s, qs.shape[0] // 32)

        def k_rows(dot):
            @njit
            def rows(data, qs, d, s, out):
                for r in range(data.shape[0]):
                    out[r] = dot(data[r], qs, d, s, qs.shape[0] // 256)
            return rows

        _ROW_KERNELS[key] = {QT.Q8_0: q8_0, QT.Q4_0: q4_0, QT.Q4_1: q4_1, QT.Q5_0: q5_0, QT.Q5_1: q5_1,
                             QT.Q4_K: k_rows(k4), QT.Q5_K: k_rows(k5), QT.Q6_K: k_rows(k6), QT.Q3_K: k_rows(k3),
                             QT.Q2_K: k_rows(k2)}
    return _ROW_KERNELS[key]


def full_range_weight(qtype, rows, blocks, rng):
    """Random block data with every quant value (Q8_0: -128 included) and realistic scales."""
    return random_blocks(qtype, rows, blocks, rng, scale_bits=small_scale_bits)


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_row_dots_every_isa(isa, qtype):
    rng = np.random.default_rng(int(qtype))
    kernels = row_kernels(isa)
    for blocks in (1, 2, 3, 4, 5, 7, 8, 9, 18, 48):        # every tail of the groups of 4
        data = full_range_weight(qtype, 5, blocks, rng)
        x = rng.normal(size=32 * blocks).astype(np.float32)
        x[:32] *= 100.0
        qs, d, s = qi.quantize_x(x)
        out = np.full(5, np.nan, np.float32)
        kernels[qtype](data, qs, d, s, out)
        assert_int8_close(out, data, qtype, qs, d, s)


def block_elems(qtype):
    return GGML_QUANT_SIZES[qtype][0]


@pytest.mark.parametrize("isa", runnable_isas())
@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_row_dots_every_isa(isa, qtype):
    """Q5_0, Q5_1 and the K-quants against the exact integer reference of the same quantized x:
    rows of one block (256 elements for the K-quants) and several, 5 rows, x with one block of
    outliers."""
    rng = np.random.default_rng(int(qtype) + 20)
    kernels = row_kernels(isa)
    for blocks in ((1, 2, 3, 4, 5, 9, 18) if qtype in FIVE_TYPES else (1, 2, 3, 6)):
        data = full_range_weight(qtype, 5, blocks, rng)
        x = rng.normal(size=block_elems(qtype) * blocks).astype(np.float32)
        x[32:64] *= 100.0
        qs, d, s = qi.quantize_x(x)
        out = np.full(5, np.nan, np.float32)
        kernels[qtype](data, qs, d, s, out)
        assert_int8_close(out, data, qtype, qs, d, s)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_row_dot_extremes(qtype):
    """All weight bytes 0xFF, 0x00 or 0x80 (every quant and scale at an extreme) with x at +-127:
    the largest integer sums, no saturation or wrap in any instruction set."""
    _, size = GGML_QUANT_SIZES[qtype]
    data = np.zeros((3, 2, size), np.uint8)
    data[0], data[1], data[2] = 0xFF, 0x00, 0x80
    for i, o in enumerate(SCALE_OFFSETS[qtype]):
        data[..., o:o + 2] = np.array([0.5 if i == 0 else -0.25], np.float16).view(np.uint8)
    data = data.reshape(3, -1)
    n = 2 * block_elems(qtype)
    alternating = np.where(np.arange(n) % 2, -127.0, 127.0).astype(np.float32)
    for x in (np.full(n, 127.0, np.float32), np.full(n, -127.0, np.float32), alternating):
        qs, d, s = qi.quantize_x(x)
        for isa in runnable_isas():
            out = np.empty(3, np.float32)
            row_kernels(isa)[qtype](data, qs, d, s, out)
            assert_int8_close(out, data, qtype, qs, d, s)


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_row_dot_extremes(qtype):
    """Largest integer sums: all quants at their extremes, x at +-127 (no saturation in
    vpmaddubsw pairs, no wrap in i16 products)."""
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = 6
    data = np.zeros((4, blocks, size), np.uint8)
    data[..., 0:2] = np.array([0.5], np.float16).view(np.uint8)
    if qtype == QT.Q4_1:
        data[..., 2:4] = np.array([-0.25], np.float16).view(np.uint8)
    q0 = size - (16 if qtype != QT.Q8_0 else 32)
    data[0, :, q0:] = 0xFF                       # Q8_0: -1;  Q4: 15
    data[1, :, q0:] = 0x80                       # Q8_0: -128; Q4: 0 / 8
    data[2, :, q0:] = 0x7F if qtype == QT.Q8_0 else 0xFF
    data[3, :, q0:] = np.uint8(0x88)             # Q4: 8 and 8 (Q4_0: 0)
    data = data.reshape(4, -1)
    alternating = np.where(np.arange(32 * blocks) % 2, -127.0, 127.0).astype(np.float32)
    for x in (np.full(32 * blocks, 127.0, np.float32), np.full(32 * blocks, -127.0, np.float32), alternating):
        for isa in runnable_isas():
            qs, d, s = qi.quantize_x(x)
            out = np.empty(4, np.float32)
            row_kernels(isa)[qtype](data, qs, d, s, out)
            assert_int8_close(out, data, qtype, qs, d, s)


@pytest.mark.parametrize("group, n_acc, hadd", [(1, 1, None), (2, 1, None), (8, 4, None), (4, 2, False),
                                                (8, 2, False)])
def test_row_dot_layouts(group, n_acc, hadd):
    """The group size, the accumulator count and the use of vphaddd change only the float
    summation order."""
    rng = np.random.default_rng(3)
    isa = runnable_isas()[-1]
    for qtype in INT8_TYPES:
        for blocks in (1, 3, 8, 15):
            data = full_range_weight(qtype, 3, blocks, rng)
            qs, d, s = qi.quantize_x(rng.normal(size=32 * blocks).astype(np.float32))
            out = np.empty(3, np.float32)
            row_kernels(isa, group, n_acc, hadd)[qtype](data, qs, d, s, out)
            assert_int8_close(out, data, qtype, qs, d, s)


def test_module_dots_are_the_selected_isa():
    assert qi.DOT_ISA == qi._dot_isa(cpu.target_features()) == runnable_isas()[-1]
    assert qi.VNNI == qi.DOT_ISA.startswith("vnni")

    @njit
    def dot41(row, qs, d, s):
        return qi._dot_row_q4_1_i8(row, qs, d, s, qs.shape[0] // 32)

    @njit
    def dot40(row, qs, d, s):
        return qi._dot_row_q4_0_i8(row, qs, d, s, qs.shape[0] // 32)

    @njit
    def dot8(row, qs, d):
        return qi._dot_row_q8_0_i8(row, qs, d, qs.shape[0] // 32)

    rng = np.random.default_rng(4)
    qs, d, s = qi.quantize_x(rng.normal(size=32 * 11).astype(np.float32))
    for qtype, call in ((QT.Q4_1, lambda r: dot41(r, qs, d, s)), (QT.Q4_0, lambda r: dot40(r, qs, d, s)),
                        (QT.Q8_0, lambda r: dot8(r, qs, d))):
        data = full_range_weight(qtype, 2, 11, rng)
        out = np.array([call(data[0]), call(data[1])], np.float32)
        assert_int8_close(out, data, qtype, qs, d, s)


# ---------------------------------------------------------------------------------------
# Row-parallel kernels, the dispatcher and matmul_int8
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_matvec_kernels(qtype, rows, threads):
    rng = np.random.default_rng(rows * 10 + int(qtype))
    for blocks in (1, 6, 18):
        data = full_range_weight(qtype, rows, blocks, rng)
        x = rng.normal(size=32 * blocks).astype(np.float32)
        qs, d, s = qi.quantize_x(x)
        out = np.full(rows, np.nan, np.float32)
        qi._matvec_i8(type_mask([qtype]), int(qtype), data, x, qs, d, s, out)
        assert_int8_close(out, data, qtype, qs, d, s)
        # the other entry points: the same math, but each compilation may order the float
        # sums its own way (fastmath reassociation), so up to rounding
        assert_int8_close(qi.matmul_int8(data, qtype, x), data, qtype, qs, d, s)
        # the fused decode step's serial row-range product
        out3 = np.full(rows, np.nan, np.float32)
        qi._rows_i8(type_mask([qtype]), int(qtype), data, rows // 2, rows, qs, d, s, out3)
        assert np.isnan(out3[:rows // 2]).all()
        assert_int8_close(out3[rows // 2:], data[rows // 2:], qtype, qs, d, s)


def test_one_thread_matches_two():
    rng = np.random.default_rng(5)
    for qtype in INT8_TYPES:
        data = full_range_weight(qtype, 37, 9, rng)
        x = rng.normal(size=32 * 9).astype(np.float32)
        with using_threads(1):
            y1 = qi.matmul_int8(data, qtype, x)
        np.testing.assert_array_equal(y1, qi.matmul_int8(data, qtype, x))  # rows are independent


@pytest.mark.parametrize("qtype", INT8_TYPES, ids=lambda t: t.name)
def test_close_to_float_product(qtype):
    """Sanity: the int8 product is within 1% (of the output norm) of the exact product of the
    dequantized weight for Gaussian activations (measured: 0.4-0.6%), 2% with a few outlier
    features 20x larger, as real activations have (measured: ~1%)."""
    rng = np.random.default_rng(6)
    for rows, cols in ((64, 576), (40, 1536)):
        for outliers, limit in ((False, 0.01), (True, 0.02)):
            w32 = rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32)
            data = gguf.quants.quantize(w32, qtype)
            x = rng.normal(size=cols).astype(np.float32)
            if outliers:
                x[rng.choice(cols, 5, replace=False)] *= 20.0
            ref = gguf.quants.dequantize(data, qtype).astype(np.float64) @ x.astype(np.float64)
            y = qi.matmul_int8(data, qtype, x)
            assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < limit
            y32 = quants.matmul(data, qtype, x)
            assert np.linalg.norm(y - y32) / np.linalg.norm(ref) < limit


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_new_matvec_kernels(qtype, rows, threads):
    """_matvec_i8, matmul_int8 and the decode step's _rows_i8 on Q5_0, Q5_1 and the K-quants."""
    rng = np.random.default_rng(rows * 10 + int(qtype))
    for blocks in (1, 3):
        data = full_range_weight(qtype, rows, blocks, rng)
        x = rng.normal(size=block_elems(qtype) * blocks).astype(np.float32)
        qs, d, s = qi.quantize_x(x)
        out = np.full(rows, np.nan, np.float32)
        qi._matvec_i8(type_mask([qtype]), int(qtype), data, x, qs, d, s, out)
        assert_int8_close(out, data, qtype, qs, d, s)
        assert_int8_close(qi.matmul_int8(data, qtype, x), data, qtype, qs, d, s)
        out3 = np.full(rows, np.nan, np.float32)
        qi._rows_i8(type_mask([qtype]), int(qtype), data, rows // 2, rows, qs, d, s, out3)
        assert np.isnan(out3[:rows // 2]).all()
        assert_int8_close(out3[rows // 2:], data[rows // 2:], qtype, qs, d, s)


@pytest.mark.parametrize("qtype", NEW_TYPES, ids=lambda t: t.name)
def test_new_types_close_to_float_product(qtype):
    """Sanity: on weights with realistic scales and Gaussian x, the int8 product is within 1.5%
    (of the output norm) of the float32 product."""
    rng = np.random.default_rng(16)
    data = full_range_weight(qtype, 64, 1536 // block_elems(qtype), rng)
    x = rng.normal(size=1536).astype(np.float32)
    ref = quants.matmul(data, qtype, x).astype(np.float64)
    y = qi.matmul_int8(data, qtype, x)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 0.015


@pytest.mark.parametrize("qtype", [QT.BF16, QT.F16, QT.F32], ids=lambda t: t.name)
def test_other_types_fall_back(qtype, threads):
    """Types without an int8 kernel: the float32 kernel on x, bit-identical with quants.matmul."""
    rng = np.random.default_rng(7)
    blocks = 8
    data = weight(qtype, 6, rng, blocks=blocks)
    x = rng.normal(size=quants.row_elems(qtype, data.shape[1])).astype(np.float32)
    ref = quants.matmul(data, qtype, x)
    np.testing.assert_array_equal(qi.matmul_int8(data, qtype, x), ref)
    assert not qi._has_i8(int(qtype))
    if x.shape[0] % 32 == 0:
        qs, d, s = qi.quantize_x(x)
    else:
        qs, d, s = np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.float32)
    out = np.empty(6, np.float32)
    qi._matvec_i8(type_mask([qtype]), int(qtype), data, x, qs, d, s, out)
    np.testing.assert_array_equal(out, ref)


def test_has_i8():
    assert all(qi._has_i8(int(t)) for t in INT8_TYPES + NEW_TYPES)
    assert set(qi.INT8_TYPES) == set(INT8_TYPES + NEW_TYPES)
    assert not any(qi._has_i8(int(t)) for t in (QT.F32, QT.F16, QT.BF16))


def test_wrapper_conversions_and_out():
    rng = np.random.default_rng(8)
    data = full_range_weight(QT.Q4_1, 7, 3, rng)
    big = rng.normal(size=3 * 96)
    x_strided = big[::3]                          # float64, stride 3
    ref = qi.matmul_int8(data, QT.Q4_1, np.ascontiguousarray(x_strided, np.float32))
    np.testing.assert_array_equal(qi.matmul_int8(data, QT.Q4_1, x_strided), ref)
    np.testing.assert_array_equal(qi.matmul_int8(np.asfortranarray(data), QT.Q4_1, x_strided), ref)
    out = np.full(7, np.nan, np.float32)
    assert qi.matmul_int8(data, QT.Q4_1, x_strided, out=out) is out
    np.testing.assert_array_equal(out, ref)
    ro = data.copy()
    ro.setflags(write=False)   # another specialization: equal up to float summation order
    qs, d, s = qi.quantize_x(x_strided.astype(np.float32))
    assert_int8_close(qi.matmul_int8(ro, QT.Q4_1, x_strided), ro, QT.Q4_1, qs, d, s)
    np.testing.assert_allclose(qi.matmul_int8(ro, QT.Q4_1, x_strided), ref, rtol=1e-5, atol=1e-6)


def test_wrapper_errors():
    data = full_range_weight(QT.Q4_1, 4, 3, np.random.default_rng(9))
    x = np.zeros(96, np.float32)
    with pytest.raises(ValueError, match=r"x has 95 features.*Q4_1 weight rows have 96 elements"):
        qi.matmul_int8(data, QT.Q4_1, np.zeros(95, np.float32))
    with pytest.raises(ValueError, match=r"x must have shape \(n,\)"):
        qi.matmul_int8(data, QT.Q4_1, np.zeros((1, 96), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        qi.matmul_int8(data[0], QT.Q4_1, x)
    with pytest.raises(ValueError, match="not supported"):
        qi.matmul_int8(data, QT.IQ4_NL, x)
    with pytest.raises(ValueError, match="whole number"):
        qi.matmul_int8(data[:, :19], QT.Q4_1, x)
    for bad in (np.empty(5, np.float32), np.empty(4, np.float64), np.empty((4, 2), np.float32)[:, 0], [0.0] * 4):
        with pytest.raises(ValueError, match=r"C-contiguous float32 array of shape \(4,\)"):
            qi.matmul_int8(data, QT.Q4_1, x, out=bad)


def test_wrapper_empty_shapes():
    np.testing.assert_array_equal(qi.matmul_int8(np.zeros((3, 0), np.uint8), QT.Q4_1, np.zeros(0, np.float32)),
                                  np.zeros(3, np.float32))
    assert qi.matmul_int8(np.zeros((0, 20), np.uint8), QT.Q4_1, np.zeros(32, np.float32)).shape == (0,)


# ---------------------------------------------------------------------------------------
# Instruction selection: the ISA follows numba's target, not the host
# ---------------------------------------------------------------------------------------

def test_dot_isa_selection():
    assert qi._dot_isa({"avx2", "avx512vnni", "avx512vl", "avx512bw"}) == "vnni512"
    assert qi._dot_isa({"avx2", "avx512vnni", "avx512vl"}) == "vnni256"
    assert qi._dot_isa({"avx2", "avxvnni"}) == "vnni256"
    assert qi._dot_isa({"avx2", "fma", "f16c"}) == "avx2"
    assert qi._dot_isa({"sse4.2"}) == "generic"
    assert qi._dot_isa(set()) == "generic"


def keep_own_ir():
    """From now on, let each Numba code library that compiles keep its own LLVM IR (`own_ir`):
    its functions as lowered and optimized one by one, before the libraries it calls are linked
    in. The linked module (what `inspect_llvm` shows) cannot show whether the source holds x86
    code: the JIT compiles each module in place and links callees' modules as compiled, and
    x86's atomic expansion rewrites an `atomicrmw sub` compared with zero as an x86 intrinsic,
    so Numba's NRT_decref, linked into every kernel from the runtime library, calls
    llvm.x86.atomic.sub.cc.i64 there on any x86 host."""
    from numba.core import codegen
    library_class = codegen.JITCPUCodegen._library_class
    finalize = library_class.finalize

    def keep_then_finalize(self):
        self.own_ir = str(self._final_module)
        finalize(self)

    library_class.finalize = keep_then_finalize


def aarch64_objects() -> tuple[int, int, int, list[str]]:
    """Compile every npllama kernel this process compiled (each signature of each njit function
    of npllama.kernels.* and npllama.engine.*), with all the libraries linked into it (its
    callees, overloads, parallel regions, Numba's runtime), for AArch64 with NEON, after checking
    that none of their IR (`keep_own_ir`, installed before the first compile) uses an x86
    intrinsic. Returns (kernels, libraries, functions compiled, the kernels' names)."""
    import llvmlite.binding as llvm
    from numba.core.registry import CPUDispatcher
    dispatchers = {id(v): v for name, module in list(sys.modules.items())
                   if name.startswith(("npllama.kernels.", "npllama.engine.")) for v in vars(module).values()
                   if isinstance(v, CPUDispatcher)}
    kernels = [(d.__name__, cres.library) for d in dispatchers.values() for cres in d.overloads.values()]
    libraries, todo = {}, [library for _, library in kernels]
    while todo:
        library = todo.pop()
        if id(library) not in libraries:
            libraries[id(library)] = library
            todo.extend(library._linking_libraries)
    missing = [library.name for library in libraries.values() if not hasattr(library, "own_ir")]
    assert not missing, f"compiled before keep_own_ir or loaded from a cache: {missing}"
    x86 = {library.name: sorted(set(re.findall(r"llvm\.x86\.[\w.]+", library.own_ir)))
           for library in libraries.values() if "llvm.x86." in library.own_ir}
    assert not x86, f"x86 intrinsics in the portable path: {x86}"
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    triple = "aarch64-unknown-linux-gnu"
    tm = llvm.Target.from_triple(triple).create_target_machine(cpu="generic", features="+neon", opt=2)
    functions = 0
    for library in libraries.values():
        # no x86 CPU or features may steer the AArch64 back end
        module = llvm.parse_assembly(re.sub(r'\s"target-(?:cpu|features)"="[^"]*"', "", library.own_ir))
        module.triple, module.data_layout = triple, str(tm.target_data)
        module.verify()
        assert tm.emit_object(module), library.name
        functions += sum(not f.is_declaration for f in module.functions)
    return len(kernels), len(libraries), functions, sorted({name for name, _ in kernels})


# The portable target's extra run: the panel products and the decode step's work sharing, with
# workshare's x86 gate as platform.machine() sets it on ARM (no pause in the spin-wait), then
# every kernel compiled for AArch64.
_PORTABLE_RUN = """
from npllama.kernels import panels, workshare
data = t.full_range_weight(QT.Q4_0, 20, 2, rng)
x = rng.normal(size=(3, 64)).astype(np.float32)
out = panels.matmul_panels(panels.pack_panels(data, QT.Q4_0), QT.Q4_0, 20, x)
for row, xt in zip(out, x):
    np.testing.assert_allclose(row, qi.matmul_int8(data, QT.Q4_0, xt), rtol=1e-5, atol=1e-5)
workshare._X86 = False
ctr = np.zeros(workshare.phase_size(2), np.int64)
taken = [workshare._take(ctr, 0, 1, 2, 5) for _ in range(6)]
assert taken == [2, 3, 4, 0, 1, -1], taken
workshare._finish(ctr, 0, 2, 5)
workshare._wait(ctr, 0, 2, 5)
kernels, libraries, functions, names = t.aarch64_objects()
print("aarch64", kernels, libraries, functions, ",".join(names))
"""


@pytest.mark.slow
@pytest.mark.skipif(cpu.target_features() == set() or "avx2" not in cpu.target_features(),
                    reason="needs an x86 host with AVX2")
@pytest.mark.parametrize("drop, isa", [(("avx512", "vnni"), "avx2"),
                                       (("avx512", "vnni", "avx2", "f16c", "amx"), "generic")])
def test_non_vnni_target_in_subprocess(tmp_path, drop, isa):
    """With NUMBA_CPU_FEATURES lacking VNNI (and AVX2, F16C), the module picks the fallback and
    its cached kernels compile for that target and give the reference results (as do the
    float32 direct dots of Q5_0/Q5_1 and the K-quants, whose mask and byte-vector IR is lowered
    differently without AVX-512). So does paged attention over a float16 pool: a decoding
    query reads the records directly where F16C converts them, else through float32 scratch,
    with the session kernels' bits either way.

    The generic target (no AMX either) is the portable path that ARM64 machines get: there
    the panel products and the work-sharing counters run too, and then every kernel compiled
    in the process, with all it links in, holds no x86 intrinsic and compiles for AArch64."""
    import llvmlite.binding as llvm
    feats = llvm.get_host_cpu_features()
    flat = ",".join(("-" if (not v or any(k.startswith(p) or p in k for p in drop)) else "+") + k
                    for k, v in feats.items())
    env = dict(os.environ, NUMBA_CPU_FEATURES=flat, NUMBA_CPU_NAME="generic", NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.path.dirname(os.path.abspath(__file__))]))
    portable = isa == "generic"
    code = f"""
import numpy as np
from gguf import GGMLQuantizationType as QT
from npllama.kernels import quants_int8 as qi
from npllama.kernels import quants
import test_quants_int8 as t
from test_products import assert_close
{"t.keep_own_ir()" if portable else ""}
assert qi.DOT_ISA == {isa!r}, qi.DOT_ISA
rng = np.random.default_rng(0)
for qtype in t.INT8_TYPES + t.NEW_TYPES:
    for blocks in (1, 7, 18):
        data = t.full_range_weight(qtype, 9, blocks, rng)
        x = rng.normal(size=t.block_elems(qtype) * blocks).astype(np.float32)
        qs, d, s = qi.quantize_x(x)
        t.assert_int8_close(qi.matmul_int8(data, qtype, x), data, qtype, qs, d, s)
        if qtype in t.NEW_TYPES:  # and the float32 direct dots, compiled for this target too
            assert_close(quants.matmul(data, qtype, x), data, qtype, x)
from npllama.kernels.attention import attend
from npllama.kernels.paged_attention import paged_attend
kv = rng.standard_normal((12, 16, 2, 2, 64)).astype(np.float16)
tables = rng.permutation(12).astype(np.int32)[None]
q = rng.standard_normal((1, 6, 64)).astype(np.float32)
seq = np.ascontiguousarray(kv[tables[0]].reshape(-1, 2, 2, 64))
assert np.array_equal(paged_attend(q, kv, tables, np.zeros(1, np.int64), np.array([170])), attend(q, seq, 171))
print("ok", qi.DOT_ISA, quants._HW_F16)
""" + (_PORTABLE_RUN if portable else "")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[:2] == ["ok", isa]
    if portable:
        tag, kernels, _, functions, names = r.stdout.split()[-5:]
        assert tag == "aarch64" and int(kernels) >= 30 and int(functions) >= 100, r.stdout
        expected = {"_matvec_i8", "_rows_i8", "_matvec", "_paged_kernel", "_matmul_panels", "_wait"}
        assert expected <= set(names.split(",")), names
