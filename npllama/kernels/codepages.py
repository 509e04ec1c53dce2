"""LLVM's code pages, resident only while Numba compiles or loads a kernel.

Numba links all of LLVM (llvmlite's libllvmlite.so, 170 MB on disk). Its start (it compiles
its runtime's module) and each kernel it loads from its cache run parts of that library, and
Linux maps a file's pages in large folios (1 MiB here), so after the first kernel ~108 MiB of
the library stay in the process's resident set, though a process whose kernels are loaded
runs none of that code until it loads another. `install` has every outermost release of
Numba's compiler lock (the end of each load or compile) hand the library's clean mappings back
with madvise(MADV_DONTNEED): their pages stay in the OS's page cache, and the next load faults
back those it runs, from memory rather than disk. Mappings that the dynamic linker wrote
(relocations) hold private copies and are left alone. A no-op where there is no /proc/self/smaps
or madvise (not Linux).
"""
from __future__ import annotations

import ctypes
import mmap
import threading

from numba.core import event

LIBRARY = "libllvmlite"


def _mappings(name: str, smaps: str) -> list[tuple[int, int, str, dict[str, int]]]:
    """(start, end, permissions, {smaps field: kB}) of each of this process's mappings of a
    file whose path contains `name`."""
    found, fields = [], None
    with open(smaps) as f:
        for line in f:
            parts = line.split()
            if not parts:
                continue
            if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
                fields = None
                if len(parts) >= 6 and name in parts[5]:
                    start, end = (int(a, 16) for a in parts[0].split("-"))
                    fields = {}
                    found.append((start, end, parts[1], fields))
            elif fields is not None and len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    return found


def clean_mappings(name: str = LIBRARY, smaps: str = "/proc/self/smaps") -> list[tuple[int, int]]:
    """The (start, end) addresses of this process's read-only mappings of a file whose path
    contains `name` and none of whose pages this process wrote (no anonymous pages, the
    private copies a write makes): what the OS can always read again from the file's pages.
    (Private_Dirty does not tell: it also counts the page cache's pages of a file written a
    moment ago, by pip say, and not yet on disk.)"""
    return [(start, end) for start, end, perms, fields in _mappings(name, smaps)
            if "w" not in perms and not fields.get("Anonymous", 0)]


def resident_mib(name: str = LIBRARY, smaps: str = "/proc/self/smaps") -> float:
    """Resident MiB of this process's mappings of files whose path contains `name`."""
    return sum(fields.get("Rss", 0) for *_, fields in _mappings(name, smaps)) / 1024


class _Releaser(event.Listener):
    """Listens to Numba's compiler lock; at its outermost release (per thread: the lock is
    re-entrant) drops the library's clean pages from the resident set."""

    def __init__(self, ranges: list[tuple[int, int]], madvise):
        self.ranges, self.madvise = ranges, madvise
        self.depth = threading.local()

    def on_start(self, ev):
        self.depth.n = getattr(self.depth, "n", 0) + 1

    def on_end(self, ev):
        # an end without its start (the listener installed while the lock was held) counts
        # as the outermost one rather than leaving the count below zero for good
        self.depth.n = max(0, getattr(self.depth, "n", 0) - 1)
        if self.depth.n == 0:
            self.release()

    def release(self) -> None:
        for start, end in self.ranges:
            self.madvise(start, end - start, mmap.MADV_DONTNEED)


_releaser: _Releaser | None = None


def install() -> _Releaser | None:
    """Release LLVM's code pages after every kernel load or compile from now on (once per
    process; later calls return the same listener). None where the OS cannot."""
    global _releaser
    if _releaser is not None or not hasattr(mmap, "MADV_DONTNEED"):
        return _releaser
    try:
        import llvmlite.binding.ffi  # noqa: F401  (maps the library, as Numba's import has)
        ranges = clean_mappings()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _releaser = _Releaser(ranges, madvise)
    event.register("numba:compiler_lock", _releaser)
    return _releaser
