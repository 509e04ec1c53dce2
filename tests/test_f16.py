"""float16 storage from compiled code (npllama.kernels.f16): conversions against NumPy's."""
import numpy as np
import pytest
from numba import njit

from npllama.kernels.f16 import _f32_to_half_soft, _ld, _ld_row, _st, bits


@njit
def _store_all(x, out):
    for i in range(x.shape[0]):
        _st(out, i, x[i])


@njit
def _load_all(a, out):
    for i in range(a.shape[0]):
        out[i] = _ld(a, i)


@njit
def _load_rows(a, out):
    for r in range(a.shape[0]):
        _ld_row(a[r], out[r])


@njit
def _soft_all(x, out):
    for i in range(x.shape[0]):
        out[i] = _f32_to_half_soft(x[i])


def _hard_cases():
    """float32 values around every float16 boundary: ties, subnormals, overflow, specials."""
    half = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h32 = half[np.isfinite(half)].astype(np.float32)
    with np.errstate(over="ignore"):  # the spacing above 65504 is inf: those "ties" are inf
        ulp = np.abs(np.spacing(half[np.isfinite(half)]).astype(np.float32))
    ties = h32 + ulp / 2  # exactly halfway to the next float16: round to even
    near = np.concatenate([np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))])
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.996, 65520.0, 1e10, -1e10,
                        2.0 ** -25, 2.0 ** -25 * 1.0000001, 2.0 ** -26, 1e-40, -1e-45, 3.4e38], np.float32)
    rand = np.random.default_rng(0).integers(0, 1 << 32, 200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    return np.concatenate([h32, ties, near, special, rand])


def _same_floats(got, want):
    """float32 bit equality, except that NaNs only need to be NaNs."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))


def _same_halves(got_bits, want):
    """Bit equality, except that NaNs only need to be NaNs."""
    got = got_bits.view(np.float16)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got_bits[~nan], want[~nan].view(np.uint16))


@pytest.mark.parametrize("convert", [_soft_all, _store_all], ids=["soft", "store"])
def test_rounds_as_numpy(convert):
    """The integer conversion, and _st into a uint16 row (the hardware conversion where there
    is one, else the integer one)."""
    x = _hard_cases()
    out = np.empty(x.shape, np.uint16)
    convert(x, out)
    with np.errstate(over="ignore"):
        _same_halves(out, x.astype(np.float16))


def test_store_into_float32_rows_keeps_the_bits():
    x = _hard_cases()
    f32 = np.empty(x.shape, np.float32)
    _store_all(x, f32)
    np.testing.assert_array_equal(f32.view(np.uint32), x.view(np.uint32))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_load_is_exact(dtype):
    a = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(dtype)
    out = np.empty(a.shape, np.float32)
    _load_all(bits(a), out)
    _same_floats(out, a.astype(np.float32))


def test_bits_views_halves_only():
    a16, a32 = np.zeros(4, np.float16), np.zeros(4, np.float32)
    assert bits(a16).dtype == np.uint16 and np.shares_memory(bits(a16), a16)
    assert bits(a32) is a32


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n", [1, 7, 16, 17, 64, 100])
def test_load_row_is_exact(dtype, n):
    """_ld_row converts whole rows (the vector conversion for float16 rows where the hardware
    has one, 16 at a time plus the rest): every float16 value, rows of lengths that are and are
    not multiples of 16, and rows that are strided views (the element by element path)."""
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    a = np.resize(every, (-(-every.size // n), n)).astype(dtype)
    out = np.full(a.shape, -1.0, np.float32)
    _load_rows(bits(a), out)
    _same_floats(out, a.astype(np.float32))
    strided = a[::3, ::2]
    out = np.full(strided.shape, -1.0, np.float32)
    _load_rows(bits(strided), out)
    _same_floats(out, strided.astype(np.float32))
