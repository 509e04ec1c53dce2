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

`install` renames every linked-in copy in an npllama library, before LLVM optimizes it, to a
name of that library's own (`localize`): its calls resolve to its own machine code, which
depends on its source and its callees' alone. The copies keep their linkage, so LLVM inlines
as it did (internal copies, inlined more, made the decode step's compile 25% longer). The
cache keys on this (`cachestamp`'s stamps count `INSTALLED`), so code linked the old way is
never loaded beside it.
"""
from __future__ import annotations

import hashlib
import warnings

import llvmlite.binding as ll
from numba.core import codegen

INSTALLED = False
_OWN = "7npllama"   # in the mangled names of npllama's functions (_ZN7npllama7kernels...)


def localize(module) -> int:
    """Rename every `linkonce_odr` function defined in `module` (an llvmlite ModuleRef: a
    library's final module, its callees' copies linked in) to `name.<tag>`, the tag a digest of
    the names of the module's own (external) functions, where any function it defines is
    npllama's; the number renamed."""
    defined = [f for f in module.functions if not f.is_declaration]
    if not any(_OWN in f.name for f in defined):
        return 0
    own = sorted(f.name for f in defined if f.linkage == ll.Linkage.external)
    tag = hashlib.sha256("\0".join([module.name, *own]).encode()).hexdigest()[:16]
    copies = [f for f in defined if f.linkage == ll.Linkage.linkonce_odr]
    for f in copies:
        f.name = f"{f.name}.{tag}"
    return len(copies)


def _library_class():
    return getattr(codegen.JITCPUCodegen, "_library_class", None)


def install() -> bool:
    """Localize npllama libraries' linked-in copies from now on (once); False, with one
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
        localize(self._final_module)
        original(self)

    cls._optimize_final_module = _optimize_final_module
    INSTALLED = True
    return True
