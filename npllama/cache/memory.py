"""Memory for the KV storage: refuse an allocation that cannot fit, before it is tried, and
allocate the KV pool without asking for huge pages.

NumPy allocates lazily: an array far larger than the machine's memory is "allocated" at once and
fails later, when it is written, as the kernel's out-of-memory kill rather than an error. The KV
cache and the KV pool, the allocations that grow with a context, a batch or a pool size, call
`check_fits` first, and get a `MemoryLimitError` with the numbers instead.

The memory available is the kernel's estimate of what can be allocated without swapping
(`MemAvailable` in /proc/meminfo, else the free pages from `os.sysconf`), lowered to what a
cgroup (v2) memory limit leaves, as in a container. Where none of these can be read, nothing is
checked.

NumPy asks the kernel for transparent huge pages (madvise) for every array of 4 MiB or more,
whatever the system's policy. Where huge pages are only given on request (the policy
"madvise", as on this project's VMs), a first write into them can be slow: 21 ms per 2 MiB
page here, 1.5 s for the first writes into a 147 MB array against 0.07 s on 4 KiB pages, about
a fifth of a 16-prompt `generate_many`. `zeros` maps anonymous memory itself and asks nothing,
so it gets what the system gives by default: huge pages where the policy is "always", small
ones elsewhere. The KV pool takes it; a session's KV cache keeps NumPy's huge pages, whose
reads at a long context's depth measured faster.

Those first writes cost a new session's cache 30 ms for a 128-token prompt of the default model
(against 1.3 ms into memory written before). So the buffers of caches that are gone are kept,
up to 64 MiB in all, for the next cache of the same shape (`Spares`), as llama.cpp keeps its
context's cache from one prompt to the next.
"""
from __future__ import annotations

import math
import mmap
import os
import threading

import numpy as np

from ..errors import MemoryLimitError

__all__ = ["available_bytes", "check_fits", "zeros", "Spares"]


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def available_bytes() -> int | None:
    """Bytes this process can still allocate without swapping, or None if unknown."""
    avail = None
    meminfo = _read("/proc/meminfo")
    if meminfo:
        for line in meminfo.splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            pass
    limit, used = _read("/sys/fs/cgroup/memory.max"), _read("/sys/fs/cgroup/memory.current")
    if limit and used and limit.strip().isdigit() and used.strip().isdigit():
        left = max(0, int(limit) - int(used))
        avail = left if avail is None else min(avail, left)
    return avail


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_fits(nbytes: int, what: str, hint: str) -> None:
    """Raise MemoryLimitError if `nbytes` more bytes cannot fit in the memory available.
    `what` names the allocation ("a KV cache of 131072 positions"), `hint` what to do instead."""
    avail = available_bytes()
    if avail is not None and nbytes > avail:
        raise MemoryLimitError(f"{what} needs {_gib(nbytes)} ({nbytes} bytes), but only {_gib(avail)} "
                               f"of memory is available; {hint}")


def zeros(shape: tuple, dtype) -> np.ndarray:
    """A writable zero-filled C-contiguous array on its own anonymous memory map, with the
    system's default pages (see the module's docstring); unmapped when the array is freed."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # a map cannot be empty
        return np.zeros(shape, dtype)
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


class Spares:
    """Arrays nothing uses any more, kept for a later allocation of the same shape and dtype: at
    most `limit` bytes in all, the oldest dropped first. Safe across threads; `put` never waits
    (a finalizer calls it), and drops the array when another thread holds the list."""

    def __init__(self, limit: int):
        self.limit = int(limit)
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()

    def put(self, a: np.ndarray) -> None:
        """Keep `a` (which the caller no longer uses) if it fits within the limit."""
        if not 0 < a.nbytes <= self.limit or not self._lock.acquire(blocking=False):
            return
        try:
            self._arrays.append(a)
            total = sum(x.nbytes for x in self._arrays)
            while total > self.limit:
                total -= self._arrays.pop(0).nbytes
        finally:
            self._lock.release()

    def take(self, shape: tuple, dtype) -> np.ndarray | None:
        """A kept array of `shape` and `dtype` (the newest), no longer kept; None if there is none."""
        dtype = np.dtype(dtype)
        with self._lock:
            for i in range(len(self._arrays) - 1, -1, -1):
                if self._arrays[i].shape == shape and self._arrays[i].dtype == dtype:
                    return self._arrays.pop(i)
        return None

    @property
    def nbytes(self) -> int:
        """Bytes kept."""
        return sum(x.nbytes for x in self._arrays)
