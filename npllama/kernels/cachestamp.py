"""Where npllama's compiled kernels are kept, and what keys them.

Numba keeps a cached function beside its source file (or under a directory named by the
file's absolute path) and keys it by that one file's modification time. For npllama that
goes wrong three ways: a compiled kernel inlines the kernels it calls from other files (the
fused decode step calls the quant dots of quants.py) and reads their constants, so an edit to
a callee's file would leave the caller's stale machine code in use; every virtualenv and every
reinstall has a copy of its own, compiled again for minutes; and a package installed where it
cannot be written has no cache at all.

Here every npllama function is kept in the user's cache (`cache_root()`: the models' cache's
`kernels`, or where $NPLLAMA_KERNEL_CACHE or $NUMBA_CACHE_DIR say), in a directory named by what its machine code depends
on: Python's, Numba's, llvmlite's and NumPy's versions (`platform_dir`), then the function's
module and that module's *closure stamp* (`module_stamp`): the sha256 of the module's source
and of every npllama module it imports, directly or through others (read from their import
lines), with the import-time choices that compiled code reads and Numba's key does not
(whether the panel products use AMX tiles, cpu.AMX) and the way its callees are linked in
(`linking`). Numba's index in that directory keys
each entry by its signature and the CPU it was compiled for (its name and features), and
Numba reads an index written by its own version only. So an edit recompiles the kernels of
the edited module and of the modules that import it, and nothing else; a second virtualenv,
or a reinstall that leaves the kernels as they were, recompiles nothing; and machine code for
another CPU, Numba or Python is never loaded.

A cache directory that cannot be made or written (read-only, or another user's) leaves the
kernels compiled into a temporary directory of the process's own, removed at its exit, with
one warning (a full disk, met while saving, is cacheload's). Functions outside npllama keep
Numba's own locators. This reaches into Numba's caching (`_CacheLocator`, `CacheImpl`):
`install` puts it in place only where those are there, else Numba's caching stays as it is,
with one warning.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import os
import pathlib
import re
import shutil
import sys
import tempfile
import warnings

import llvmlite
import numba
import numpy as np
from numba.core import caching

from . import linking
from .cpu import AMX

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the npllama package


def cache_root() -> pathlib.Path:
    """Where npllama keeps the machine code it compiles: $NPLLAMA_KERNEL_CACHE; else `npllama`
    in Numba's cache directory where one is set ($NUMBA_CACHE_DIR); else `kernels` in
    npllama's cache ($NPLLAMA_CACHE, else ~/.cache/npllama, where the models are too)."""
    if os.environ.get("NPLLAMA_KERNEL_CACHE"):
        return pathlib.Path(os.environ["NPLLAMA_KERNEL_CACHE"]).expanduser()
    if numba.config.CACHE_DIR:
        return pathlib.Path(numba.config.CACHE_DIR).expanduser() / "npllama"
    return pathlib.Path(os.environ.get("NPLLAMA_CACHE") or pathlib.Path.home() / ".cache" / "npllama") / "kernels"


def platform_dir() -> str:
    """The cache's directory for this Python, Numba, llvmlite and NumPy (whose versions the
    machine code and its pickled records depend on)."""
    py = "".join(map(str, sys.version_info[:2])) + getattr(sys, "abiflags", "")
    return f"py{py}-numba{numba.__version__}-llvmlite{llvmlite.__version__}-numpy{np.__version__}"


# `from X import names` where X is relative, or npllama's own (names: one line, or in parentheses),
# and `import npllama.x`; found anywhere (a docstring's example too: the stamp may only be wider),
# starting at their keyword, which the regular expressions' search skips to fast
_IMPORT = re.compile(rb"from[ \t]+(\.+[\w.]*|npllama\b[\w.]*)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)")
_PLAIN_IMPORT = re.compile(rb"import[ \t]+(npllama\.[\w.]+)")


def _sources(root: pathlib.Path) -> dict[str, tuple[bytes, bool]]:
    """{dotted module name under root: (source, whether it is a package's __init__)} for every
    .py file under root, but for the device backends (`backends/`: CUDA kernels, which no CPU
    kernel calls and Numba does not cache); the package's own __init__ is named ''."""
    found = {}
    for folder, subfolders, files in os.walk(root):  # ~10x faster than Path.rglob: once a process
        parts = pathlib.Path(folder).relative_to(root).parts
        if not parts:
            subfolders[:] = [d for d in subfolders if d != "backends"]
        for f in files:
            if f.endswith(".py"):
                package = f == "__init__.py"
                name = ".".join(parts if package else (*parts, f[:-3]))
                with open(os.path.join(folder, f), "rb") as fh:
                    found[name] = (fh.read(), package)
    return found


def _imports(name: str, source: bytes, package: bool, modules: set[str]) -> set[str]:
    """The modules of `modules` (dotted names under the package) that module `name` imports:
    `from .x import y` names x, and x.y where y is a module; a name that is not one of its
    modules reads the package's __init__."""
    found = set()
    home = name if package else name.rpartition(".")[0]  # what a one-dot import is relative to
    for target, names in _IMPORT.findall(source):
        target = target.decode()
        if target.startswith("."):
            level = len(target) - len(target.lstrip("."))
            base = home
            for _ in range(level - 1):
                base = base.rpartition(".")[0]
            target = ".".join(p for p in (base, target[level:]) if p)
        else:
            target = target[len("npllama"):].lstrip(".")
        lines = (line.split("#")[0] for line in names.decode().strip("()").splitlines())
        for item in ",".join(lines).split(","):
            item = item.split(" as ")[0].strip()
            if item:
                sub = f"{target}.{item}" if target else item
                found.add(sub if sub in modules else target)
    for target in _PLAIN_IMPORT.findall(source):
        parts = target.decode().split(".")[1:]
        found.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return found & modules


class ModuleStamps:
    """The closure stamps of the modules under `root` (see `stamp`), read once."""

    def __init__(self, root: pathlib.Path = ROOT, extra: str = ""):
        sources = _sources(root)
        self.extra = extra
        self.digests = {m: hashlib.sha256(src).hexdigest() for m, (src, _) in sources.items()}
        names = set(sources)
        self.imports = {m: _imports(m, src, package, names) for m, (src, package) in sources.items()}

    @functools.lru_cache(maxsize=None)
    def stamp(self, module: str) -> str:
        """The sha256 of `extra`, and of the names and sources of `module` and of every module it
        imports, directly or not (in name order); KeyError for a module not under root."""
        seen, todo = {module}, [module]
        while todo:
            for dep in self.imports[todo.pop()] - seen:
                seen.add(dep)
                todo.append(dep)
        h = hashlib.sha256(self.extra.encode() + b"\0")
        for dep in sorted(seen):
            h.update(f"{dep}\0{self.digests[dep]}\0".encode())
        return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _stamps() -> ModuleStamps:
    """npllama's closure stamps as this process compiles: with its import-time choices (once a
    process)."""
    return ModuleStamps(extra=("amx" if AMX else "") + ("|own-copies" if linking.INSTALLED else "")
                        + ("|out-of-line" if linking.OUT_OF_LINE else ""))


def module_stamp(module: str) -> str:
    """The closure stamp of npllama's module `module` ('engine.decode'; see `ModuleStamps`),
    as this process compiles it."""
    return _stamps().stamp(module)


@functools.lru_cache(maxsize=None)
def _module_of(py_file: str) -> str | None:
    """npllama's dotted module name of the source file `py_file` ('engine.decode'), None for a
    file outside npllama's kernels (asked for every kernel as its module defines it: ~230
    times in a process that loads them, from ~20 files)."""
    path = pathlib.Path(py_file).resolve()
    if not path.is_relative_to(ROOT) or path.suffix != ".py":
        return None
    parts = path.relative_to(ROOT).with_suffix("").parts
    module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return module if module in _stamps().digests else None


_writable: set[str] = set()  # cache directories this process has found writable
_fallback: list[str] = []  # the process's own cache directory, once the user's failed


def _own_cache(reason: OSError) -> str:
    """The temporary directory this process compiles into where the user's cache cannot be
    written: made (and the one warning given) once, removed at the process's exit."""
    if not _fallback:
        _fallback.append(tempfile.mkdtemp(prefix="npllama-kernels-"))
        atexit.register(shutil.rmtree, _fallback[0], True)
        warnings.warn(f"npllama: the kernel cache {cache_root()} cannot be written ({reason}); kernels are "
                      f"compiled for this process only. Set NPLLAMA_KERNEL_CACHE to a writable directory "
                      f"to keep them.", RuntimeWarning, stacklevel=2)
    return _fallback[0]


def _directory(module: str) -> str:
    """The cache directory of `module`'s kernels under `root` (the module's docstring)."""
    root = _fallback[0] if _fallback else str(cache_root())
    return os.path.join(root, platform_dir(), f"{module}-{module_stamp(module)[:16]}")


class _KernelCache:
    """Mixin for a Numba cache locator: npllama's functions in the user's cache, by their
    module's closure stamp (the module's docstring). The functions of other files get None,
    and Numba's own locators."""

    def __init__(self, py_func, py_file):
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._module = _module_of(py_file)
        self._cache_path = _directory(self._module)

    def get_cache_path(self):
        return self._cache_path

    def get_source_stamp(self):
        return module_stamp(self._module)

    def get_disambiguator(self):
        return str(self._lineno)

    @classmethod
    def from_function(cls, py_func, py_file):
        if _module_of(py_file) is None:
            return None
        self = cls(py_func, py_file)
        try:
            self.ensure_cache_path()
        except OSError as e:
            _own_cache(e)
            self._cache_path = _directory(self._module)
            self.ensure_cache_path()
        return self

    def ensure_cache_path(self):
        """Numba's check (the directory made, a temporary file written in it, or OSError)
        with the temporary file once a directory a process rather than once a kernel. The
        directory is still made again where it was removed since (Numba asks before each
        save)."""
        path = self.get_cache_path()
        if path in _writable:
            os.makedirs(path, exist_ok=True)
        else:
            super().ensure_cache_path()
            _writable.add(path)


def _numba(name: str):
    """A class of numba.core.caching by its name (Numba < 0.62 prefixes them with '_'); None
    where this Numba has no such class."""
    return getattr(caching, name, None) or getattr(caching, "_" + name, None)


def _locator_class():
    """npllama's locator class on Numba's base class, None where this Numba has none."""
    base = getattr(caching, "_CacheLocator", None)
    return None if base is None else type("KernelCacheLocator", (_KernelCache, base), {"__module__": __name__})


LOCATOR = _locator_class()


def install() -> bool:
    """Put npllama's locator before Numba's own (once); False, with one warning, where this
    Numba lacks what that needs (its own caching then stays)."""
    impl = _numba("CacheImpl")
    if LOCATOR is None or not isinstance(getattr(impl, "_locator_classes", None), list):
        warnings.warn("npllama: this Numba's caching is not the one npllama's kernel cache was written for; "
                      "kernels are cached by Numba's own rules instead", RuntimeWarning, stacklevel=2)
        return False
    if LOCATOR not in impl._locator_classes:
        impl._locator_classes = [LOCATOR] + list(impl._locator_classes)
    return True
