"""Numba's slice-assignment shape error, raised without compiling its message's formatting.

Numba 0.68 raises a shape mismatch in a slice assignment (`a[i:j] = b`) with both shapes in
its message, and compiles that message's formatting (integers to strings and a join, Numba's
unicode code) the first time a process lowers such an assignment, once per pair of numbers of
dimensions: on a fresh machine 2.3 s of the fused decode step's compile, and 3.9 s of Gemma 3's
tokenizer's first call, for an error that npllama's kernels never raise (their wrappers check
shapes first). `install` has Numba's CPU target give the message it gives targets without
strings ("cannot assign slice from input of different size"), whose code compiles in no time.
It goes in only where Numba's CPU overload is registered as this was written against
(Numba 0.68's `ol_raise_with_shape_context_cpu`); elsewhere Numba's own stays.
"""
from __future__ import annotations

import warnings

from numba.core.typing import templates
from numba.np import arrayobj

INSTALLED = False


def _templates() -> list:
    """The overload templates of Numba's CPU target for `raise_with_shape_context`."""
    stub = getattr(arrayobj, "raise_with_shape_context", None)
    cpu = getattr(arrayobj, "ol_raise_with_shape_context_cpu", None)
    found = []
    for func, fnty in templates.builtin_registry.globals:
        if func is stub and cpu is not None:
            found += [t for t in getattr(fnty, "templates", ()) if getattr(t, "_overload_func", None) is cpu]
    return found


def install() -> bool:
    """Numba's plain shape-mismatch message on the CPU from now on (once); False, with one
    warning, where this Numba's overload is not the one this replaces."""
    global INSTALLED
    if INSTALLED:
        return True
    plain = getattr(arrayobj, "ol_raise_with_shape_context_generic", None)
    found = _templates()
    if plain is None or len(found) != 1:
        warnings.warn("npllama: this Numba raises slice-shape errors otherwise than npllama expects; their "
                      "message's formatting is compiled as Numba does (a first compile takes longer)",
                      RuntimeWarning, stacklevel=2)
        return False
    found[0]._overload_func = staticmethod(plain)
    INSTALLED = True
    return True
