"""npllama's kernels loaded from Numba's cache without parsing their LLVM bitcode first, and
without Numba's registries.

Numba's cache keeps, beside each kernel's machine code, the kernel's LLVM bitcode, which a
later compile links in when it calls the kernel (and may inline). Loading an entry parses
that bitcode at once, only to learn which symbols the kernel defines (so that the JIT engine
hands out their addresses) and to keep the parsed module for a link that a process running
cached kernels never makes: in a short `npllama run`, 0.15 s of the 0.21 s its kernels took
to load, and ~24 MiB of parsed IR held for good.

Here an npllama entry also carries the names its bitcode defines, taken when the entry is
saved (`_LazyLoad.reduce`). Loading it (`_LazyLoad.rebuild`) loads the machine code as Numba
does, declares those names to the JIT engine, and keeps the bitcode unparsed: the library's
`_shared_module` (the module Numba links into a caller's compile) is parsed the first time a
compile reads it. The CompileResult is Numba's own (`CompileResult._rebuild`, handed the
library made here), so a loaded kernel behaves as Numba's would.

Numba also refreshes its target context before every load: it imports and installs the
typing and lowering registries of all it can compile (0.13 s the first time, 0.17-0.26 s over
a short reply's loads), of which loading machine code needs only its runtime (NRT). An
npllama entry loads after the runtime's initialization alone (`_load_overload`); a compile,
in this process or later, refreshes the contexts itself (numba.core.compiler), as does a
lowering that finds no definition.

That initialization (`rtsys.initialize`) builds the runtime's LLVM module (reference counts,
atomics, the abort of an unresolved symbol) and has LLVM optimize and compile it: 0.017 s of
every fresh process, where loading the same machine code takes 0.002. `initialize_runtime`
does what it does, with the compiled module saved beside npllama's kernels (in the directory
Numba's locators give this file) and loaded from there by later processes as the kernels are.
The file is named by what the machine code depends on (Numba's and llvmlite's versions, the
CPU and its features as Numba's codegen names them) and by Python's version (whose `marshal`
writes it), and carries a sha256 of its contents: a file that does not match is compiled anew
and replaced, and a directory that cannot be written leaves the compile as it is. The runtime's C helpers are registered with LLVM before the module
is compiled or loaded, as Numba registers them: the module calls them. With Numba's NRT
debugging on (NUMBA_DEBUG_NRT), whose module differs, Numba builds it itself.

Each entry also carries the environments of the functions compiled into it (Numba's record
of each function's module and constants), and unpickling one imports its module: for
functions of Numba's own inlined into a kernel, `numba.np.arrayobj`, `numba.cpython.unicode`
and others (~0.03 s). Compiled nopython code reads only an environment's constants; the
module's namespace is read by object-mode code alone, which npllama never compiles. An
npllama entry's environments are rebuilt (`_rebuild_env`) on the namespace of their module
where it is imported, else on one of its name alone.

Functions outside npllama (whose locator is not one of `cachestamp`'s) are saved and loaded
by Numba's own code. All this reaches into Numba's caching and codegen: `install` puts it in
place only where every attribute it uses is there, else Numba's loading stays as it is. One
Numba version gives one outcome, and Numba's index holds entries of one Numba version only,
so an entry is always read in the form it was written.
"""
from __future__ import annotations

import hashlib
import logging
import marshal
import os
import sys
import tempfile
import warnings

import llvmlite
import llvmlite.binding as ll
import numba
from numba.core import caching, codegen, config, environment, sigutils
from numba.core.compiler_lock import global_compiler_lock
from numba.core.runtime import _nrt_python, nrtdynmod, rtsys

from . import linking
from .cachestamp import _KernelCache, _numba

_log = logging.getLogger("npllama")

_LIBRARY_ATTRIBUTES = ("enable_object_caching", "_set_compiled_object", "_finalize_final_module",
                       "_get_module_for_linking")


class _LazyBitcode:
    """Mixin for a Numba code library loaded from the cache: its linking module (`_shared_module`,
    read only by `_get_module_for_linking`) parsed from `_bitcode` at its first read."""

    _bitcode: bytes | None = None

    @property
    def _shared_module(self):
        if self._bitcode is not None:
            self.__dict__["_shared"] = ll.parse_bitcode(self._bitcode)
            self._bitcode = None
        return self.__dict__.get("_shared")

    @_shared_module.setter
    def _shared_module(self, module):
        self.__dict__["_shared"] = module


_lazy_classes: dict[type, type] = {}


def _lazy_class(library_class: type) -> type:
    """`library_class` with its linking module parsed on first use (one subclass per class)."""
    cls = _lazy_classes.get(library_class)
    if cls is None:
        cls = _lazy_classes[library_class] = type(f"Lazy{library_class.__name__}", (_LazyBitcode, library_class),
                                                  {"__module__": __name__})
    return cls


def defined_names(library) -> list[str]:
    """The symbols that `library`'s linking module defines: what Numba's loader reads from the
    parsed bitcode (`JitEngine._load_defined_symbols`)."""
    module = library._get_module_for_linking()
    return sorted(gv.name for gvs in (module.functions, module.global_variables) for gv in gvs
                  if not gv.is_declaration)


def load_library(codegen_, name: str, object_code: bytes, bitcode: bytes):
    """A code library of `codegen_` running `object_code` (Numba's cached machine code for
    library `name`), its `bitcode` kept unparsed: Numba's `CPUCodeLibrary._unserialize` for
    object code, less the parse and the symbol scan (the caller declares the names)."""
    library = _lazy_class(codegen_._library_class)(codegen_, name)
    library.enable_object_caching()
    library._set_compiled_object(object_code)
    library._bitcode = bitcode
    library._finalize_final_module()
    return library


def _rebuild_env(modname: str, consts: list, env_name: str):
    """Numba's `environment._rebuild_env` without importing `modname` (see the module's docstring)."""
    env = environment.lookup_environment(env_name)
    if env is None:
        module = sys.modules.get(modname)
        env = environment.Environment(module.__dict__ if module is not None else {"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
    return env


class _Environment:
    """An environment in a saved entry, pickled to be rebuilt by `_rebuild_env`."""

    __slots__ = ("env",)

    def __init__(self, env):
        self.env = env

    def __reduce__(self):
        return _rebuild_env, (self.env.globals.get("__name__"), self.env.consts, self.env.env_name)


def _environments_rebuilt_here(x):
    """`x` (a compile result's payload), its environments (at any depth of tuples) to be rebuilt
    by `_rebuild_env`."""
    if isinstance(x, environment.Environment):
        return _Environment(x)
    return tuple(map(_environments_rebuilt_here, x)) if type(x) is tuple else x


class _LazyLoad(caching.CompileResultCacheImpl):
    """Numba's cache of compile results; for npllama's functions, entries that load without
    parsing their bitcode (see the module's docstring)."""

    def _ours(self) -> bool:
        return isinstance(self._locator, _KernelCache)

    def reduce(self, cres):
        payload = super().reduce(cres)
        if not self._ours():
            return payload
        name, kind, data = payload[0]
        calls = [(d.py_func.__module__, d.py_func.__qualname__, args, symbol)
                 for d, args, symbol in linking.calls_of(cres.library)]
        return defined_names(cres.library), _digest(kind, data), _environments_rebuilt_here(payload), calls

    def rebuild(self, target_context, payload):
        if not (self._ours() and len(payload) == 4 and isinstance(payload[0], list)):  # Numba's own form
            return super().rebuild(target_context, payload)
        names, digest, payload, calls = payload
        name, kind, data = payload[0]
        if digest != _digest(kind, data):
            raise _DamagedEntry(f"the machine code of {name} does not match its checksum")
        cg = target_context.codegen()
        symbols = getattr(cg._engine, "_defined_symbols", None)
        if kind != "object" or not isinstance(symbols, set):  # loaded as Numba loads it
            return super().rebuild(target_context, payload)
        calls = [_load_callee(*call) for call in calls]

        def unserialize(state):  # asked for by CompileResult._rebuild after the entry's reload_init
            library = load_library(cg, name, *data)
            symbols.update(names)
            library._npllama_calls = calls  # its bitcode's calls, for a caller that links it in
            return library

        cg.unserialize_library = unserialize
        try:
            return super().rebuild(target_context, payload)
        finally:
            del cg.unserialize_library


def _load_callee(module: str, qualname: str, args: tuple, symbol: str) -> tuple:
    """Before a cached kernel that calls `module.qualname` (an `out_of_line` function) for the
    argument types `args` by `symbol` loads: that function loaded from the cache, or compiled,
    and `symbol` resolving to it where this process knows it by another name (linking's
    docstring); the call as `linking.calls_of` gives it. Raises LookupError where it is not an
    `out_of_line` function any more (the entry is then compiled anew)."""
    dispatcher = linking.find(module, qualname)
    if dispatcher is None:
        raise LookupError(f"{module}.{qualname} is not a function called out of line")
    if not load_cached(dispatcher, args):
        dispatcher.compile(args)
    cres = dispatcher.overloads[tuple(args)]
    own = cres.fndesc.mangled_name
    if own != symbol:
        address = cres.library.get_pointer_to_function(own)
        if not address:
            raise LookupError(f"the code of {module}.{qualname} does not define {own}")
        ll.add_symbol(symbol, address)
    return dispatcher, tuple(args), symbol


class _DamagedEntry(Exception):
    """A cache entry whose machine code is not what was saved."""


def _digest(kind: str, data) -> bytes:
    """The sha256 of an entry's machine code and bitcode (where it holds them: `kind` 'object')."""
    if kind != "object":
        return b""
    h = hashlib.sha256()
    for part in data:
        h.update(part)
    return h.digest()


_RUNTIME_MAGIC = b"npllama NRT 1\n"


def _register_runtime_helpers() -> None:
    """What `rtsys.initialize` does before it compiles the module: the runtime's C functions,
    by the names the module calls them."""
    if config.NRT_STATS:
        _nrt_python.memsys_enable_stats()
    for py_name, address in _nrt_python.c_helpers.items():
        ll.add_symbol(py_name if py_name.startswith("_") else "NRT_" + py_name, address)


def _runtime_path(codegen_) -> str | None:
    """Where this process's runtime module is saved: a file in the cache directory that Numba's
    locators give this module's file, named by what its contents depend on (the module's
    docstring); None where no locator gives one."""
    for locator_class in _numba("CacheImpl")._locator_classes:
        locator = locator_class.from_function(initialize_runtime, __file__)
        if locator is not None:
            key = repr((sys.version_info[:2], numba.__version__, llvmlite.__version__, codegen_.magic_tuple()))
            return os.path.join(locator.get_cache_path(), f"nrt-{hashlib.sha256(key.encode()).hexdigest()[:16]}.bin")
    return None


def _read_runtime(path: str) -> tuple[str, bytes, bytes, list[str]] | None:
    """(library name, machine code, bitcode, defined names) saved at `path`; None where the
    file is missing or does not hold what `_write_runtime` wrote."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    n = len(_RUNTIME_MAGIC)
    if data[:n] != _RUNTIME_MAGIC or hashlib.sha256(data[n + 32:]).digest() != data[n:n + 32]:
        return None
    try:
        saved = marshal.loads(data[n + 32:])
    except (EOFError, ValueError, TypeError):
        return None
    kinds = (str, bytes, bytes, list)
    ok = (type(saved) is tuple and len(saved) == 4 and all(map(isinstance, saved, kinds))
          and all(isinstance(name, str) for name in saved[3]))
    return saved if ok else None


def _write_runtime(path: str, saved: tuple[str, bytes, bytes, list[str]]) -> None:
    """Save `saved` at `path` whole or not at all (a temporary file renamed over it); a cache
    directory that cannot be written is left as it is."""
    payload = marshal.dumps(saved)
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".nrt-")
    except OSError:
        return
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(_RUNTIME_MAGIC + hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _compile_runtime(target_context):
    """Numba's `compile_nrt_functions`, with the library's machine code kept to be saved."""
    module, library = nrtdynmod.create_nrt_module(target_context)
    library.enable_object_caching()
    library.add_ir_module(module)
    library.finalize()
    return library


def initialize_runtime(target_context) -> None:
    """`rtsys.initialize(target_context)`, its module loaded from the cache where an earlier
    process saved it (see the module's docstring); once a process."""
    if rtsys._init:
        return
    codegen_ = target_context.codegen()
    symbols = getattr(getattr(codegen_, "_engine", None), "_defined_symbols", None)
    if config.DEBUG_NRT or not isinstance(symbols, set):
        rtsys.initialize(target_context)
        return
    with global_compiler_lock:
        if rtsys._init:
            return
        path = _runtime_path(codegen_)
        saved = _read_runtime(path) if path is not None else None
        _register_runtime_helpers()
        if saved is not None:
            name, object_code, bitcode, names = saved
            library = load_library(codegen_, name, object_code, bitcode)
            symbols.update(names)
        else:
            library = _compile_runtime(target_context)
            if path is not None:
                _, _, (object_code, bitcode) = library.serialize_using_object_code()
                _write_runtime(path, (library.name, object_code, bitcode, defined_names(library)))
        rtsys._library = library
        rtsys._init = True


_numba_load_overload = caching.FunctionCache.load_overload


def _load_overload(self, sig, target_context):
    """`FunctionCache.load_overload`: for npllama's functions, without refreshing the target
    context first (see the module's docstring), and an entry that cannot be read (truncated,
    damaged, or its index) a miss: the kernel is compiled anew and its entry replaced."""
    if not (isinstance(self._impl, _LazyLoad) and self._impl._ours()):
        return _numba_load_overload(self, sig, target_context)
    initialize_runtime(target_context)  # what loading machine code needs of the refresh
    try:
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)
    except Exception as e:  # noqa: BLE001: whatever a damaged file makes pickle or the loader raise
        _log.warning("npllama: a cached kernel of %s could not be read (%s: %s); compiling it anew",
                     self._py_func.__qualname__, type(e).__name__, e)
        return None


_numba_save_overload = caching.FunctionCache.save_overload
_unsaved: list[str] = []  # the first save that failed, where one did (warned about once)


def _save_overload(self, sig, data):
    """`FunctionCache.save_overload`: for npllama's functions, an index that cannot be read is
    written anew, and a save that fails (a full disk, a directory made read-only since) leaves
    the kernel compiled in memory, with one warning a process."""
    if not (isinstance(self._impl, _LazyLoad) and self._impl._ours()):
        return _numba_save_overload(self, sig, data)
    try:
        try:
            self._save_overload(sig, data)
        except OSError:
            raise
        except Exception:  # noqa: BLE001: a damaged index (pickle's errors): written anew, empty
            self._cache_file.flush()
            self._save_overload(sig, data)
    except OSError as e:
        if not _unsaved:
            _unsaved.append(str(e))
            warnings.warn(f"npllama: a compiled kernel could not be saved in the kernel cache ({e}); it is "
                          f"kept for this process only", RuntimeWarning, stacklevel=2)


def load_cached(dispatcher, sig) -> bool:
    """Whether `dispatcher` has machine code for the signature `sig`, loaded from the cache
    where it is there: the first steps of Numba's `Dispatcher.compile`, without its compile (a
    miss is the caller's to compile, here or elsewhere). Where this Numba's dispatcher lacks
    what that reads, it compiles (True)."""
    args, _ = sigutils.normalize_signature(sig)
    if tuple(args) in dispatcher.overloads:
        return True
    cache, hits, ctx = (getattr(dispatcher, a, None) for a in ("_cache", "_cache_hits", "targetctx"))
    if not (hasattr(cache, "load_overload") and hasattr(hits, "__setitem__") and hasattr(ctx, "insert_user_function")
            and hasattr(dispatcher, "add_overload")):
        dispatcher.compile(sig)
        return True
    with global_compiler_lock:
        cres = cache.load_overload(sig, ctx)
        if cres is None:
            return False
        hits[sig] += 1
        ctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        dispatcher.add_overload(cres)
    return True


def _supported() -> bool:
    """Whether this Numba has every attribute this module uses."""
    library_class = getattr(codegen.JITCPUCodegen, "_library_class", None)
    engine = getattr(codegen, "JitEngine", None)
    cache = caching.FunctionCache
    return (library_class is not None and all(hasattr(library_class, a) for a in _LIBRARY_ATTRIBUTES)
            and engine is not None and hasattr(engine, "_load_defined_symbols")
            and all(hasattr(cache, a) for a in ("_load_overload", "_save_overload", "_guard_against_spurious_io_errors"))
            and hasattr(rtsys, "initialize") and hasattr(rtsys, "_init")
            and isinstance(getattr(_nrt_python, "c_helpers", None), dict)
            and hasattr(nrtdynmod, "create_nrt_module") and hasattr(codegen.JITCPUCodegen, "magic_tuple")
            and hasattr(environment, "lookup_environment") and hasattr(environment.Environment, "_memo")
            and getattr(cache, "_impl_class", None) in (caching.CompileResultCacheImpl, _LazyLoad))


def install() -> bool:
    """Load npllama's cached kernels lazily from now on (once); False, with one warning, where
    this Numba lacks what that needs (its own loading then stays)."""
    if not _supported():
        warnings.warn("npllama: this Numba's caching is not the one npllama's kernel loading was written for; "
                      "cached kernels load as Numba loads them (slower)", RuntimeWarning, stacklevel=2)
        return False
    caching.FunctionCache._impl_class = _LazyLoad
    caching.FunctionCache.load_overload = _load_overload
    caching.FunctionCache.save_overload = _save_overload
    return True
