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

A few large functions are called rather than copied (`out_of_line`): the workers that the fused
decode step and the packed layers run on every thread, and the phases those run (attention,
the products, the per-token work). Linked in, such a worker is optimized
and emitted again inside the parallel region that calls it, and that region again inside its
kernel: the decode step's compile spent most of its minute re-optimizing code compiled once
already. Called, it is compiled once, and a caller's machine code refers to its symbol (which
also settles whose copy runs: there is one). A cached caller then needs its callee loaded
first, under the name it was compiled against: `calls_of` tells what a library calls, the
cache saves it with the entry, and loading the entry loads the callee first (`cacheload`),
mapping the saved name to the callee's address where a later compile named it otherwise
(Numba's mangled names count the process's compiles). This needs npllama's cache loading, so
it is switched on only beside it (`install_out_of_line`).
"""
from __future__ import annotations

import hashlib
import importlib
import warnings

import llvmlite.binding as ll
from numba.core import codegen

INSTALLED = False
OUT_OF_LINE = False  # `out_of_line` functions are called, not linked in (`install_out_of_line`)
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


_out_of_line: list = []  # the dispatchers `out_of_line` registered


def out_of_line(dispatcher):
    """Decorator for a jitted function: its callers call its own machine code rather than link
    in a copy (the module's docstring). For large functions whose calls are few beside their
    work (once a thread, a layer or a phase), where inlining gains nothing worth its compile."""
    _out_of_line.append(dispatcher)
    return dispatcher


def _callee(library) -> tuple | None:
    """(dispatcher, argument types, symbol) of the `out_of_line` function whose code library
    `library` is; None for any other library."""
    for dispatcher in _out_of_line:
        for args, cres in list(dispatcher.overloads.items()):
            if cres.library is library:
                return dispatcher, args, cres.fndesc.mangled_name
    return None


def calls_of(library) -> list[tuple]:
    """The `out_of_line` functions that `library`'s code calls by symbol (`_callee`'s triples)."""
    return list(getattr(library, "_npllama_calls", ()))


def find(module: str, qualname: str):
    """The `out_of_line` dispatcher of `module`'s function `qualname`, importing `module` (one
    of npllama's) where it is not yet; None where there is none."""
    if not module.startswith("npllama."):
        return None
    importlib.import_module(module)
    for dispatcher in _out_of_line:
        if (dispatcher.py_func.__module__, dispatcher.py_func.__qualname__) == (module, qualname):
            return dispatcher
    return None


def install_out_of_line() -> bool:
    """Call `out_of_line` functions rather than link them in, from now on (once; the module's
    docstring): what `add_linking_library` is handed of theirs is recorded in the caller's
    library (`calls_of`) instead of linked. False, with one warning, where this Numba's code
    library lacks that step (the functions are then linked in, as Numba does)."""
    global OUT_OF_LINE
    cls = _library_class()
    original = getattr(cls, "add_linking_library", None)
    if original is None or not hasattr(cls, "_ensure_finalized"):
        warnings.warn("npllama: this Numba's code library is not the one npllama was written for; the fused "
                      "kernels' workers are linked into every caller (a first compile takes longer)",
                      RuntimeWarning, stacklevel=2)
        return False
    if OUT_OF_LINE:
        return True

    def add_linking_library(self, library):
        callee = _callee(library)
        calls = [callee] if callee is not None else calls_of(library)
        if calls:
            known = calls_of(self)
            self._npllama_calls = known + [c for c in calls if c not in known]
        if callee is None:
            original(self, library)
        else:
            library._ensure_finalized()

    cls.add_linking_library = add_linking_library
    OUT_OF_LINE = True
    return True
