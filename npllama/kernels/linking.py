"""Each kernel runs its own copies of the functions it calls, whatever else is loaded.

Numba links a callee into its caller's module as a `linkonce_odr` copy (so that LLVM may
inline it), and LLVM optimizes that copy again with its caller. A call that is not inlined
then goes through the JIT's global symbol table, where the first loaded definition of a name
wins, and that may be another kernel's copy, optimized in another module. With fast-math
contraction (`a * c - b * s` may become either of two FMAs) the copies can differ in the last
bit: measured here, `nn._rope` gave other bits in a process that had loaded `rows._rope_rows`
(whose copy of `nn._rope_row` came first) than in one that had not. A kernel's bits then
depended on what the process had compiled or loaded before it, and the exact paths' bit-for-bit
agreement held on a fresh cache only.

`install` makes every linked-in copy in an npllama library `internal` before LLVM optimizes
the library: its calls resolve inside its own machine code, which depends on its source and
its callees' alone. The cache keys on this (`cachestamp`'s stamps count `INSTALLED`), so code
linked the old way is never loaded beside it.
"""
from __future__ import annotations

import warnings

import llvmlite.binding as ll
from numba.core import codegen

INSTALLED = False
_OWN = "7npllama"   # in the mangled names of npllama's functions (_ZN7npllama7kernels...)


def internalize(module) -> int:
    """Give every `linkonce_odr` function defined in `module` (an llvmlite ModuleRef: a library's
    final module, its callees' copies linked in) internal linkage, where any function it defines
    is npllama's; the number changed."""
    linked = [f for f in module.functions if not f.is_declaration]
    if not any(_OWN in f.name for f in linked):
        return 0
    n = 0
    for f in linked:
        if f.linkage == ll.Linkage.linkonce_odr:
            f.linkage = "internal"
            n += 1
    return n


def _library_class():
    return getattr(codegen.JITCPUCodegen, "_library_class", None)


def install() -> bool:
    """Internalize npllama libraries' linked-in copies from now on (once); False, with one
    warning, where this Numba's code library lacks the step it hooks (`_optimize_final_module`,
    which reads `_final_module`)."""
    global INSTALLED
    cls = _library_class()
    original = getattr(cls, "_optimize_final_module", None)
    if original is None or not hasattr(ll, "Linkage"):
        warnings.warn("npllama: this Numba's code library is not the one npllama was written for; a kernel's "
                      "last bits may depend on the kernels loaded before it", RuntimeWarning, stacklevel=2)
        return False
    if INSTALLED:
        return True

    def _optimize_final_module(self):
        internalize(self._final_module)
        original(self)

    cls._optimize_final_module = _optimize_final_module
    INSTALLED = True
    return True
