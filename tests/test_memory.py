"""Allocations that cannot fit are refused up front, with the bytes needed and available."""
import numpy as np
import pytest

from npllama.cache import memory
from npllama.errors import MemoryLimitError
from npllama.cache.kvcache import KVCache
from npllama.cache.kvpool import KVPool

GiB = 2**30


def test_available_bytes_is_plausible():
    avail = memory.available_bytes()
    assert avail is not None and 0 < avail < 2**50  # Linux: /proc/meminfo


def test_kv_cache_too_large_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: 3 * GiB)
    # 30 layers x 3 KV heads x 64 x 2 (K and V) x 4 bytes = 46080 bytes per position
    with pytest.raises(MemoryLimitError, match=r"a float32 KV cache of 131072 positions \(30 layers x 3 KV heads "
                                               r"x 64\) needs 5.62 GiB \(6039797760 bytes\), but only 3.00 GiB of "
                                               r"memory is available; use a shorter context, or a float16 KV cache"):
        KVCache(30, 3, 64, capacity=131072)
    assert KVCache(30, 3, 64, capacity=65536, dtype=np.float16).nbytes == 1509949440  # fits


def test_kv_cache_growth_asks_for_what_is_needed_when_doubling_would_not_fit(monkeypatch):
    c = KVCache(1, 1, 256, capacity=1024)  # 2 KiB per position
    monkeypatch.setattr(memory, "available_bytes", lambda: 1800 * 2048)
    c.ensure_capacity(1500)  # doubling to 2048 positions would need 4 MiB
    assert c.capacity == 1500
    with pytest.raises(MemoryLimitError, match="KV cache of 5000 positions .* needs 0.01 GiB"):
        c.ensure_capacity(5000)
    assert c.capacity == 1500  # unchanged


def test_kv_pool_too_large_is_refused_with_the_numbers(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda: GiB)
    with pytest.raises(MemoryLimitError, match=r"a float32 KV pool of 100000 pages x 16 positions \(30 layers "
                                               r"x 3 KV heads x 64\) needs 68.66 GiB .* only 1.00 GiB .* use fewer pages"):
        KVPool(30, 3, 64, n_pages=100000)


def test_real_limit_refuses_an_absurd_context():
    """No monkeypatching: a context of 2**40 positions cannot fit on any machine."""
    with pytest.raises(MemoryLimitError, match="needs .* GiB .* of memory is available"):
        KVCache(30, 3, 64, capacity=2**40)


def _vm_flags(a: np.ndarray) -> list[str]:
    """The VmFlags of the mapping holding a's middle byte (Linux smaps; NumPy's madvise leaves
    out the page with the allocator's header, a mapping of its own)."""
    addr, inside = a.__array_interface__["data"][0] + a.nbytes // 2, False
    for line in open("/proc/self/smaps"):
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= addr < hi
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError("no mapping holds the array")


@pytest.mark.parametrize("shape, dtype", [((3, 5, 7), np.float32), ((1 << 21,), np.float16), ((2, 0, 4), np.float32)])
def test_zeros_are_writable_zeros_of_the_shape(shape, dtype):
    a = memory.zeros(shape, dtype)
    assert a.shape == shape and a.dtype == dtype and a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    a[...] = 1
    assert (a == 1).all()
    b = memory.zeros(shape, dtype)  # a map of its own
    assert not b.any() and not np.shares_memory(a, b)


def test_zeros_do_not_ask_for_huge_pages_as_numpy_does():
    n = 8 << 20
    assert "hg" in _vm_flags(np.zeros(n, np.uint8))  # NumPy's madvise(MADV_HUGEPAGE) at >= 4 MiB
    assert "hg" not in _vm_flags(memory.zeros((n,), np.uint8))
    pool = KVPool(30, 3, 64, n_pages=64)  # 11 MiB
    assert "hg" not in _vm_flags(pool.slots())


def test_spares_keep_the_newest_arrays_within_the_limit():
    s = memory.Spares(1000)
    a, b, c = np.empty(100, np.float32), np.empty(100, np.float32), np.empty(60, np.float32)
    s.put(a)
    s.put(b)
    s.put(c)  # 400 + 400 + 240 bytes: over the limit, so the oldest (a) goes
    assert s.nbytes == 640
    s.put(np.empty(251, np.float32))  # more than the limit alone: not kept
    s.put(np.empty(0, np.float32))    # nothing to keep
    assert s.nbytes == 640
    assert s.take((100,), np.float16) is None  # the shape and the dtype must both match
    assert s.take((100,), np.float32) is b and s.take((100,), np.float32) is None
    assert s.take((60,), "float32") is c and s.nbytes == 0


def test_spares_put_never_waits_for_the_lock():
    """put runs in a finalizer, maybe while its own thread holds the lock in take: it drops the
    array instead of waiting."""
    s = memory.Spares(1000)
    with s._lock:
        s.put(np.empty(10, np.float32))
    assert s.nbytes == 0
