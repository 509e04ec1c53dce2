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

import hashlib
import pathlib

from numba.core import caching

from .cpu import AMX

ROOT = pathlib.Path(__file__).resolve().parent.parent  # the npllama package


def package_stamp(root: pathlib.Path = ROOT) -> str:
    """The sha256 of the .py files under `root` that import Numba, in path order (names and
    contents): the only files whose functions a compiled kernel can call or read. The device
    backends (`backends/`: CUDA kernels, which no CPU kernel calls and Numba does not cache)
    are left out, so that an edit there recompiles nothing."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] == "backends":
            continue
        src = path.read_bytes()
        if b"from numba" in src or b"import numba" in src:
            h.update(str(path.relative_to(root)).encode() + b"\0" + src + b"\0")
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


class _PackageStamp:
    """Mixin for Numba's source-file locators: the package's stamp, for npllama's files only."""

    def get_source_stamp(self):
        return stamp()

    @classmethod
    def from_function(cls, py_func, py_file):
        if not pathlib.Path(py_file).resolve().is_relative_to(ROOT):
            return None
        return super().from_function(py_func, py_file)


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
