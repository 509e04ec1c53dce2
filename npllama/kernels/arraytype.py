"""Numba's type of a plain NumPy array, found without importing `numpy.ma`.

A kernel's first call with an array of a new kind (dimensions, layout, dtype) has Numba type
the array in Python, and its `_typeof_ndarray` first asks whether the array is a
`numpy.ma.MaskedArray`: NumPy imports `numpy.ma` at that first mention, 0.014-0.015 s of
every fresh process (~3.5% of a short `npllama run`), for a module that nothing else in it
uses. An array whose type is exactly `numpy.ndarray` is not a masked array, so `install`
registers, for `numpy.ndarray`, a function that types such an array from the same four facts
Numba's does (dtype, dimensions, layout, whether it is read-only) and hands any other (a
subclass, masked arrays among them, or a dtype Numba does not take) to Numba's own, errors
and all. It goes in only where Numba's function reads the names it reads in the Numba this
was written against (`_NUMBA_NAMES`), so a Numba whose typing of arrays changed keeps its
own. Tests compare the two on arrays of many dtypes, layouts and numbers of dimensions.
"""
from __future__ import annotations

import warnings

import numpy as np
from numba.core import errors, types
from numba.core.typing.typeof import typeof_impl
from numba.np import numpy_support

# the global and attribute names Numba's `_typeof_ndarray` reads (Numba 0.68's)
_NUMBA_NAMES = ("isinstance", "np", "ma", "MaskedArray", "errors", "NumbaTypeError", "numpy_support", "from_dtype",
                "dtype", "NumbaNotImplementedError", "NumbaValueError", "map_layout", "flags", "writeable", "types",
                "Array", "ndim")

_numba_typeof_ndarray = typeof_impl.dispatch(np.ndarray)


def _typeof_ndarray(val, c):
    """Numba's type of `val` (an ndarray or a subclass's instance) as an argument."""
    if type(val) is not np.ndarray:  # a subclass (a masked array among them): Numba's rules
        return _numba_typeof_ndarray(val, c)
    try:
        dtype = numpy_support.from_dtype(val.dtype)
    except errors.NumbaNotImplementedError:
        return _numba_typeof_ndarray(val, c)  # Numba's own error for a dtype it does not take
    return types.Array(dtype, val.ndim, numpy_support.map_layout(val), readonly=not val.flags.writeable)


def matches(numba_function) -> bool:
    """Whether `numba_function` reads the names Numba's typing of an array reads here."""
    code = getattr(numba_function, "__code__", None)
    return code is not None and code.co_names == _NUMBA_NAMES


def install() -> bool:
    """Type plain arrays without `numpy.ma` from now on (once); False, with one warning, where
    this Numba's typing of arrays is not the one `_typeof_ndarray` repeats (Numba's then stays)."""
    if typeof_impl.dispatch(np.ndarray) is _typeof_ndarray:
        return True
    if not matches(_numba_typeof_ndarray):
        warnings.warn("npllama: this Numba types arrays otherwise than npllama's shortcut was written for; "
                      "Numba's own typing is used", RuntimeWarning, stacklevel=2)
        return False
    typeof_impl.register(np.ndarray, _typeof_ndarray)
    return True
