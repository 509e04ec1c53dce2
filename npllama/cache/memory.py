"""Refuse an allocation that cannot fit, before it is tried.

NumPy allocates lazily: an array far larger than the machine's memory is "allocated" at once and
fails later, when it is written, as the kernel's out-of-memory kill rather than an error. The KV
cache and the KV pool, the allocations that grow with a context, a batch or a pool size, call
`check_fits` first, and get a `MemoryLimitError` with the numbers instead.

The memory available is the kernel's estimate of what can be allocated without swapping
(`MemAvailable` in /proc/meminfo, else the free pages from `os.sysconf`), lowered to what a
cgroup (v2) memory limit leaves, as in a container. Where none of these can be read, nothing is
checked.
"""
from __future__ import annotations

import os

from ..errors import MemoryLimitError

__all__ = ["available_bytes", "check_fits"]


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
