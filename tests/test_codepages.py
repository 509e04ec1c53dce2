"""LLVM's code pages leave the resident set after each kernel load or compile
(npllama/kernels/codepages.py)."""
import pathlib

import numpy as np
import pytest
from numba import njit
from numba.core import event
from numba.core.compiler_lock import global_compiler_lock

from npllama.kernels import codepages

SMAPS = """\
7f0000000000-7f0000100000 r--p 00000000 fe:01 42 /venv/llvmlite/binding/libllvmlite.so
Rss:                1024 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000100000-7f0000500000 r-xp 00100000 fe:01 42 /venv/llvmlite/binding/libllvmlite.so
Rss:                4096 kB
Private_Dirty:      4096 kB
Anonymous:             0 kB
7f0000500000-7f0000501000 r--p 00500000 fe:01 42 /venv/llvmlite/binding/libllvmlite.so
Rss:                   4 kB
Private_Dirty:         4 kB
Anonymous:             4 kB
7f0000501000-7f0000502000 rw-p 00501000 fe:01 42 /venv/llvmlite/binding/libllvmlite.so
Rss:                   4 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 r-xp 00000000 fe:01 43 /usr/lib/libc.so.6
Rss:                1024 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
7f0000700000-7f0000800000 r--p 00000000 00:00 0
Rss:                   0 kB
Private_Dirty:         0 kB
Anonymous:             0 kB
"""


def test_clean_mappings_are_the_librarys_read_only_never_written_ones(tmp_path):
    """The relocated read-only mapping (its pages are private copies: anonymous), the
    writable one, other files and anonymous memory are left out; a mapping whose pages are
    dirty in the page cache (a file written a moment ago: Private_Dirty, not Anonymous) is in."""
    f = tmp_path / "smaps"
    f.write_text(SMAPS)
    assert codepages.clean_mappings(smaps=str(f)) == [(0x7f0000000000, 0x7f0000100000),
                                                      (0x7f0000100000, 0x7f0000500000)]
    assert codepages.resident_mib(smaps=str(f)) == (1024 + 4096 + 4 + 4) / 1024


def test_release_comes_at_the_outermost_release_of_the_compiler_lock():
    calls = []
    r = codepages._Releaser([(4096, 3 * 4096)], lambda start, size, advice: calls.append((start, size, advice)))
    with event.install_listener("numba:compiler_lock", r):
        with global_compiler_lock:
            with global_compiler_lock:
                pass
            assert calls == []
        assert calls == [(4096, 2 * 4096, codepages.mmap.MADV_DONTNEED)]


@pytest.mark.skipif(not pathlib.Path("/proc/self/smaps").exists(), reason="Linux only")
def test_a_compile_leaves_llvm_out_of_the_resident_set_and_its_code_runs(monkeypatch):
    """Compiling touches most of LLVM (over 70 MiB of it); at the end of the compile its pages
    are handed back, and LLVM compiles and the compiled code runs as before. (Measured at
    the release itself: another thread's compile may touch LLVM again at any time.)"""
    r = codepages._releaser
    assert r is not None and r.ranges  # installed by importing npllama.kernels
    after = []
    release = r.release
    monkeypatch.setattr(r, "release", lambda: (release(), after.append(codepages.resident_mib())))

    @njit
    def weighted(a, b):
        return (a * b).sum() + a.size

    a = np.arange(7, dtype=np.float64)
    assert weighted(a, a[::-1]) == float(np.dot(a, a[::-1]) + 7)
    assert after and after[-1] < 16, (after, r.ranges, codepages.clean_mappings())
    assert weighted(a.astype(np.float32), a.astype(np.float32)) == float(np.dot(a, a) + 7)  # compiles again
    assert len(after) >= 2 and after[-1] < 16, after


def test_an_end_without_its_start_does_not_stop_the_releases():
    calls = []
    r = codepages._Releaser([(4096, 2 * 4096)], lambda *args: calls.append(args))
    r.on_end(None)
    r.on_end(None)  # installed while the lock was held twice
    r.on_start(None)
    r.on_end(None)
    assert len(calls) == 3
