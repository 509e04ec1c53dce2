"""Numba types a plain array through npllama's function as its own function types it, without
importing numpy.ma; anything else goes to Numba's own (kernels/arraytype.py)."""
import numba
import numpy as np
import pytest
from numba.core import errors
from numba.core.typing.typeof import Purpose, _TypeofContext, typeof_impl

from npllama.kernels import arraytype

pytestmark = pytest.mark.timeout(300)

DTYPES = [np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.float16,
          np.float32, np.float64, np.complex64, np.complex128, "M8[ns]", "m8[s]", "U3", "S2",
          np.dtype([("a", np.float32), ("b", np.int64)]), object]


def _arrays(dtype):
    base = np.zeros((4, 6, 2), dtype)
    readonly = np.zeros((3, 5), dtype)
    readonly.setflags(write=False)
    yield from (np.zeros((), dtype), np.zeros(1, dtype), np.zeros(0, dtype), np.zeros(7, dtype), base, base[0],
                base.T, base[:, ::2], base[::2, 1, :], np.asfortranarray(base[:, :, 0]), base[:, :, 0].T[::-1],
                readonly, readonly.T, np.zeros((1, 1), dtype))
    if not np.dtype(dtype).hasobject:
        yield np.frombuffer(bytes(np.dtype(dtype).itemsize * 5), dtype)  # read-only, over a bytes object


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_plain_arrays_get_numbas_own_types(dtype):
    c = _TypeofContext(Purpose.argument)
    for a in _arrays(dtype):
        assert arraytype._typeof_ndarray(a, c) == arraytype._numba_typeof_ndarray(a, c), (a.shape, a.strides)
        assert numba.typeof(a) == arraytype._numba_typeof_ndarray(a, c)


def test_other_arrays_go_to_numbas_own():
    masked = np.ma.masked_array(np.arange(4.0), mask=[0, 1, 0, 0])
    with pytest.raises(errors.NumbaTypeError, match="MaskedArray"):
        numba.typeof(masked)
    c = _TypeofContext(Purpose.argument)
    subclass = type("Sub", (np.ndarray,), {})
    for sub in (np.zeros(3, [("a", np.float32)]).view(np.recarray), np.arange(6.0).view(subclass)):
        assert arraytype._typeof_ndarray(sub, c) == arraytype._numba_typeof_ndarray(sub, c)
    for dtype in ("V3", ">f4", ">i8"):  # dtypes Numba does not take: its own error
        unsupported = np.zeros(2, dtype)
        with pytest.raises(errors.NumbaValueError) as want:
            arraytype._numba_typeof_ndarray(unsupported, c)
        with pytest.raises(errors.NumbaValueError) as got:
            numba.typeof(unsupported)
        assert str(got.value) == str(want.value)


def test_installed_only_over_the_numba_function_it_repeats(monkeypatch):
    assert typeof_impl.dispatch(np.ndarray) is arraytype._typeof_ndarray
    assert arraytype.install()  # again: the same
    assert arraytype.matches(arraytype._numba_typeof_ndarray)
    assert not arraytype.matches(lambda val, c: None)
    assert not arraytype.matches(np.add)  # no code object
    changed = arraytype._numba_typeof_ndarray
    monkeypatch.setattr(arraytype, "_numba_typeof_ndarray", lambda val, c: changed(val, c))
    typeof_impl.register(np.ndarray, arraytype._numba_typeof_ndarray)
    try:
        with pytest.warns(RuntimeWarning, match="Numba's own typing"):
            assert not arraytype.install()  # a Numba whose function reads other names keeps it
        assert typeof_impl.dispatch(np.ndarray) is arraytype._numba_typeof_ndarray
    finally:
        typeof_impl.register(np.ndarray, arraytype._typeof_ndarray)


@pytest.mark.model
def test_a_reply_imports_no_numpy_ma(reply_modules):
    assert "numpy" in reply_modules and "numpy.ma" not in reply_modules
