"""Numba's on-disk cache, keyed by all of npllama's compiled sources rather than one file's.

Numba keys a cached function by the source of its own file. A compiled kernel inlines the
kernels it calls from other files (the fused decode step calls the quant dots of quants.py)
and reads their constants, so after an edit to a callee's file Numba would load the caller's
stale machine code. The locators here give every npllama function one source stamp, the hash
of every npllama file that imports Numba: an edit to any of them recompiles all kernels once,
and an edit elsewhere (the CLI, the text API) recompiles nothing. The stamp also holds the
choices made at import that compiled code reads and Numba's key does not (`source_stamp`).
Functions outside npllama keep Numba's own stamp.
"""
from __future__ import annotations

import functools
import hashlib
import os
import pathlib

from numba.core import caching

from .cpu import AMX

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the npllama package


def package_stamp(root: pathlib.Path = ROOT) -> str:
    """The sha256 of the .py files under `root` that import Numba, in path order (names and
    contents): the only files whose functions a compiled kernel can call or read. The device
    backends (`backends/`: CUDA kernels, which no CPU kernel calls and Numba does not cache)
    are left out, so that an edit there recompiles nothing."""
    names = []  # the .py files' paths under root, as tuples of their parts
    for folder, subfolders, files in os.walk(root):  # ~10x faster than Path.rglob: once a process
        parts = pathlib.Path(folder).relative_to(root).parts
        if not parts:
            subfolders[:] = [d for d in subfolders if d != "backends"]
        names += [(*parts, f) for f in files if f.endswith(".py")]
    h = hashlib.sha256()
    for name in sorted(names):
        with open(os.path.join(root, *name), "rb") as f:
            src = f.read()
        if b"from numba" in src or b"import numba" in src:
            h.update("/".join(name).encode() + b"\0" + src + b"\0")
    return h.hexdigest()


def source_stamp() -> str:
    """Every npllama kernel's stamp: `package_stamp()`, and the import-time choices that
    compiled code reads and Numba's key (the CPU's name and features) does not hold: whether
    the panel products use AMX tiles (cpu.AMX, which depends on Linux granting the tiles and
    on $NPLLAMA_AMX too). A process that chose otherwise recompiles."""
    return package_stamp() + (" amx" if AMX else "")


_stamp: str | None = None


def stamp() -> str:
    """`source_stamp()`, computed once a process."""
    global _stamp
    if _stamp is None:
        _stamp = source_stamp()
    return _stamp


@functools.lru_cache(maxsize=None)
def _in_package(py_file: str) -> bool:
    """Whether the source file `py_file` is one of npllama's (asked for every kernel as its
    module defines it: ~230 times in a process that loads them, from ~20 files)."""
    return pathlib.Path(py_file).resolve().is_relative_to(ROOT)


_writable: set[str] = set()  # cache directories this process has found writable


class _PackageStamp:
    """Mixin for Numba's source-file locators: the package's stamp, for npllama's files only."""

    def get_source_stamp(self):
        return stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not _in_package(py_file):
            return None
        return super().from_function(py_func, py_file)

    def ensure_cache_path(self):
        """Numba's check (the directory made, a temporary file written in it, or OSError)
        with the temporary file once a directory a process rather than once a kernel: all
        of npllama's kernels share a few directories. The directory is still made again
        where it was removed since (Numba asks before each save)."""
        path = self.get_cache_path()
        if path in _writable:
            os.makedirs(path, exist_ok=True)
        else:
            super().ensure_cache_path()
            _writable.add(path)


def _numba(name: str):
    """A class of numba.core.caching by its name (Numba < 0.62 prefixes them with '_')."""
    return getattr(caching, name, None) or getattr(caching, "_" + name)


# the same order as Numba's own: $NUMBA_CACHE_DIR, else __pycache__, else the user's cache dir
LOCATORS = [type(f"Package{base.__name__.lstrip('_')}", (_PackageStamp, base), {})
            for base in map(_numba, ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))]


def install() -> None:
    """Put the package-stamped locators before Numba's own (once)."""
    impl = _numba("CacheImpl")
    if not any(isinstance(c, type) and issubclass(c, _PackageStamp) for c in impl._locator_classes):
        impl._locator_classes = LOCATORS + list(impl._locator_classes)
