"""npllama.kernels.quants.dequantize against gguf.quants.dequantize: bit-exact for every supported type."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
import gguf.quants

from npllama.kernels import quants
from npllama.kernels.qtypes import type_mask

# Byte offsets of the float16 scale fields (d, m, dmin) inside one block of each quantized type.
SCALE_OFFSETS = {
    QT.Q8_0: (0,), QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)


def random_blocks(qtype, rows, blocks, rng, scale_bits=None):
    """(rows, blocks * type_size) random uint8 block data of ``qtype``.

    Float types get raw random bits (NaN and inf included: their conversion is exact). The
    float16 scale fields of quantized types get ``scale_bits(rng, shape)`` (default: any
    finite float16, subnormals included), so no NaN propagation order is being tested.
    """
    _, type_size = GGML_QUANT_SIZES[qtype]
    data = rng.integers(0, 256, (rows, blocks, type_size), dtype=np.uint8)
    if scale_bits is None:
        scale_bits = finite_f16_bits
    for o in SCALE_OFFSETS.get(qtype, ()):
        data[:, :, o:o + 2] = scale_bits(rng, (rows, blocks)).view(np.uint8).reshape(rows, blocks, 2)
    return data.reshape(rows, blocks * type_size)


def finite_f16_bits(rng, shape):
    bits = rng.integers(0, 0x7C00, shape, dtype=np.uint16)  # exponent < 31: finite
    return bits | (rng.integers(0, 2, shape, dtype=np.uint16) << 15)


def assert_bit_exact(got, ref):
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_bit_exact(qtype, threads):
    rng = np.random.default_rng(int(qtype))
    for rows in (1, 3, 7):
        for blocks in (1, 3):
            data = random_blocks(qtype, rows, blocks, rng)
            assert_bit_exact(quants.dequantize(data, qtype), gguf.quants.dequantize(data, qtype))


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_row_functions(qtype):
    """The registry's njit row function dequantizes one row like gguf does."""
    data = random_blocks(qtype, 1, 5, np.random.default_rng(1))
    dst = np.empty(quants.row_elems(qtype, data.shape[1]), np.float32)
    quants._REGISTRY[qtype].row_fn(data[0], dst)
    assert_bit_exact(dst, gguf.quants.dequantize(data[0], qtype))


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_vector_row_dequantizers(qtype):
    """quants._deq_row_vec, which the prefill's row kernels dequantize their weight rows with:
    vector code for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K, _deq_row for the
    others; bit for bit gguf's, for rows of one block and of several (scales of any finite
    float16, subnormals and both signs included)."""
    rng = np.random.default_rng(int(qtype) + 500)
    for blocks in (1, 3):
        data = random_blocks(qtype, 5, blocks, rng)
        out = np.full((5, quants.row_elems(qtype, data.shape[1])), np.nan, np.float32)
        for r in range(5):
            quants._deq_row_vec(type_mask([qtype]), int(qtype), data[r], out[r])
        assert_bit_exact(out, gguf.quants.dequantize(data, qtype))


def test_many_blocks_and_leading_dims():
    rng = np.random.default_rng(2)
    for qtype in (QT.Q4_1, QT.Q6_K, QT.F16):
        data = random_blocks(qtype, 6, 37, rng).reshape(2, 3, -1)
        got = quants.dequantize(data, qtype)
        assert got.shape[:2] == (2, 3)
        assert_bit_exact(got, gguf.quants.dequantize(data, qtype))
        # one long row is split into work items internally; results must not change
        flat = data.reshape(-1)
        assert_bit_exact(quants.dequantize(flat, qtype), gguf.quants.dequantize(flat, qtype))


def test_every_float16_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    assert_bit_exact(quants.dequantize(bits.view(np.uint8), QT.F16), bits.view(np.float16).astype(np.float32))


def test_float_arrays_from_gguf_reader():
    """GGUFReader hands F32/F16 tensors out as float32/float16 arrays, not bytes."""
    x = np.random.default_rng(3).normal(size=(5, 12)).astype(np.float32)
    assert_bit_exact(quants.dequantize(x, QT.F32), x)
    assert_bit_exact(quants.dequantize(x.astype(np.float16), QT.F16), x.astype(np.float16).astype(np.float32))
    assert_bit_exact(quants.dequantize(x[0], int(QT.F32)), x[0])  # int type codes are accepted


def test_non_contiguous_input_is_copied():
    """Non-contiguous data (e.g. every other row, a column slice) is made contiguous first."""
    rng = np.random.default_rng(4)
    data = random_blocks(QT.Q4_K, 8, 2, rng)
    ref_rows = gguf.quants.dequantize(data, QT.Q4_K)
    assert_bit_exact(quants.dequantize(data[::2], QT.Q4_K), ref_rows[::2])
    type_size = GGML_QUANT_SIZES[QT.Q4_K][1]
    assert_bit_exact(quants.dequantize(data[:, type_size:], QT.Q4_K), ref_rows[:, 256:])


def test_read_only_input():
    data = random_blocks(QT.Q8_0, 3, 2, np.random.default_rng(5))
    data.setflags(write=False)
    assert_bit_exact(quants.dequantize(data, QT.Q8_0), gguf.quants.dequantize(data, QT.Q8_0))


def test_empty():
    assert quants.dequantize(np.zeros((0, 36), np.uint8), QT.F32).shape == (0, 9)
    assert quants.dequantize(np.zeros((2, 0), np.uint8), QT.Q4_0).shape == (2, 0)


def test_bad_row_size():
    with pytest.raises(ValueError, match=r"Q4_1 rows of 30 bytes.*20-byte blocks"):
        quants.dequantize(np.zeros((2, 30), np.uint8), QT.Q4_1)
    with pytest.raises(ValueError, match="at least one dimension"):
        quants.dequantize(np.uint8(0), QT.Q8_0)


def test_unsupported_type():
    with pytest.raises(ValueError, match=r"IQ2_XXS is not supported.*Q4_1"):
        quants.dequantize(np.zeros((1, 66), np.uint8), QT.IQ2_XXS)
    with pytest.raises(ValueError, match=r"unknown quantization type 999.*Q8_0"):
        quants.dequantize(np.zeros((1, 34), np.uint8), 999)


def test_row_size_helpers():
    assert quants.row_bytes(QT.Q4_1, 576) == 18 * 20
    assert quants.row_elems(QT.Q4_1, 18 * 20) == 576
    assert quants.row_bytes(QT.Q6_K, 512) == 420
    assert quants.row_elems(QT.F16, 10) == 5
    with pytest.raises(ValueError, match="32-element blocks"):
        quants.row_bytes(QT.Q8_0, 33)
    with pytest.raises(ValueError, match="34-byte blocks"):
        quants.row_elems(QT.Q8_0, 35)
    assert set(quants.SUPPORTED_TYPES) == {
        QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
        QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}


def test_exact_kernels_never_inherit_fastmath():
    """Numba compiles a function that leaves fastmath unset with the flags of the first
    fast-math caller (the fused decode step, say), and caches that version: the kernels that
    must be exact set fastmath=False themselves."""
    from npllama.kernels import quants_int8
    exact = [quants._deq_row, quants._deq_row_vec, quants._dequantize_rows, quants._f16_at, quants._k_scale_min,
             quants_int8._quantize_x_q8]
    exact += [s.row_fn for s in quants._REGISTRY.values()]
    for fn in exact:
        assert fn.targetoptions.get("fastmath") is False, fn.py_func.__name__
