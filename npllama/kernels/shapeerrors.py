"""Numba's slice-assignment shape error, raised without compiling its message's formatting.

Numba 0.68 raises a shape mismatch in a slice assignment (`a[i:j] = b`) with both shapes in
its message, and compiles that message's formatting (integers to strings and a join, Numba's
unicode code) the first time a process lowers such an assignment, once per pair of numbers of
dimensions: on a fresh machine 2.3 s of the fused decode step's compile, and 3.9 s of Gemma 3's
tokenizer's first call, for an error that npllama's kernels never raise (their wrappers check
shapes first). `install` has Numba's CPU target give the message it gives targets without
strings ("cannot assign slice from input of different size"), whose code compiles in no time.
It goes in only where Numba's CPU overload is registered as this was written against
(Numba 0.68's `ol_raise_with_shape_context_cpu`); elsewhere Numba's own stays. The overload
lives in `numba.np.arrayobj`, which Numba imports when a compile first refreshes its CPU
context, and which a process that only loads cached kernels never imports (cacheload's
docstring): the replacement is made there, after that refresh, not at npllama's import.
"""
from __future__ import annotations

import sys
import warnings

from numba.core import cpu
from numba.core.typing import templates

INSTALLED = False
_REFUSED: list[bool] = []  # this Numba's overload was not the expected one (warned about once)


def _templates(arrayobj) -> list:
    """The overload templates of Numba's CPU target for `raise_with_shape_context`."""
    stub = getattr(arrayobj, "raise_with_shape_context", None)
    ours = getattr(arrayobj, "ol_raise_with_shape_context_cpu", None)
    found = []
    for func, fnty in templates.builtin_registry.globals:
        if func is stub and ours is not None:
            found += [t for t in getattr(fnty, "templates", ()) if getattr(t, "_overload_func", None) is ours]
    return found


def replace() -> bool:
    """Numba's plain shape-mismatch message on the CPU from now on (numba.np.arrayobj imported);
    False, with one warning, where this Numba's overload is not the one this replaces."""
    global INSTALLED
    if INSTALLED:
        return True
    from numba.np import arrayobj
    plain = getattr(arrayobj, "ol_raise_with_shape_context_generic", None)
    found = _templates(arrayobj)
    if plain is None or len(found) != 1:
        if not _REFUSED:
            _REFUSED.append(True)
            warnings.warn("npllama: this Numba raises slice-shape errors otherwise than npllama expects; their "
                          "message's formatting is compiled as Numba does (a first compile takes longer)",
                          RuntimeWarning, stacklevel=2)
        return False
    found[0]._overload_func = staticmethod(plain)
    INSTALLED = True
    return True


def install() -> bool:
    """`replace` now where numba.np.arrayobj is imported, else after the CPU context's first
    refresh (the first compile's); False where this Numba's CPU context has no refresh."""
    if INSTALLED or "numba.np.arrayobj" in sys.modules:
        return replace()
    cls = cpu.CPUContext
    if getattr(cls, "refresh", None) is None or getattr(cls.refresh, "_npllama", False):
        return getattr(cls, "refresh", None) is not None
    own = cls.__dict__.get("refresh")  # None: the base class's, looked up at each call

    def refresh(self):
        if own is not None:
            own(self)
        else:
            super(cls, self).refresh()
        if not (INSTALLED or _REFUSED):
            replace()

    refresh._npllama = True
    cls.refresh = refresh
    return True
