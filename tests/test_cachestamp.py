"""Numba's cache is keyed by all of npllama's sources: an edit to a callee's file must not
leave a caller's stale machine code in use."""
import os
import pathlib
import shutil
import subprocess
import sys

from numba.core import caching
from numba.core.caching import FunctionCache

from npllama.kernels import cachestamp, cpu, quants
from npllama.engine import decode


def locator_of(func):
    return FunctionCache(func)._impl._locator


def test_npllama_kernels_carry_the_package_stamp():
    for kernel in (quants._block_sums, decode._decode_step):
        loc = locator_of(kernel.py_func)
        assert isinstance(loc, cachestamp._PackageStamp)
        assert loc.get_source_stamp() == cachestamp.source_stamp()


def test_the_stamp_holds_the_amx_choice():
    """Compiled panel products differ with cpu.AMX, which Numba's key does not hold:
    $NPLLAMA_AMX=0 turns AMX off, and the kernels' stamp with it."""
    assert cachestamp.source_stamp() == cachestamp.package_stamp() + (" amx" if cpu.AMX else "")
    code = "from npllama.kernels import cachestamp, cpu; print(cpu.AMX, cachestamp.source_stamp())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NPLLAMA_AMX": "0"}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", cachestamp.package_stamp()]


def test_functions_outside_npllama_keep_numbas_own_stamp():
    def here(x):
        return x + 1
    loc = locator_of(here)
    assert not isinstance(loc, cachestamp._PackageStamp)
    assert loc.get_source_stamp() not in (cachestamp.package_stamp(), cachestamp.source_stamp())


def test_the_stamp_changes_with_any_file_and_only_then(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    jit = "from numba import njit\n"
    (pkg / "caller.py").write_text(jit + "@njit\ndef f():\n    return g()\n")
    (pkg / "sub" / "callee.py").write_text(jit + "@njit\ndef g():\n    return 1\n")
    (pkg / "cli.py").write_text("print('no kernels here')\n")
    (pkg / "notes.txt").write_text("not source")
    first = cachestamp.package_stamp(pkg)
    assert cachestamp.package_stamp(pkg) == first
    (pkg / "notes.txt").write_text("still not source")
    (pkg / "cli.py").write_text("print('still no kernels')\n")
    assert cachestamp.package_stamp(pkg) == first
    (pkg / "sub" / "callee.py").write_text(jit + "@njit\ndef g():\n    return 2\n")   # only the callee changes
    second = cachestamp.package_stamp(pkg)
    assert second != first
    (pkg / "sub" / "new.py").write_text("import numba\n")
    third = cachestamp.package_stamp(pkg)
    assert third not in (first, second)
    (pkg / "backends").mkdir()
    (pkg / "backends" / "gpu.py").write_text("from numba import cuda\n")  # device kernels: no CPU kernel calls them
    assert cachestamp.package_stamp(pkg) == third


def test_install_is_idempotent():
    cachestamp.install()
    cachestamp.install()
    classes = cachestamp._numba("CacheImpl")._locator_classes
    assert classes[:3] == cachestamp.LOCATORS
    assert sum(isinstance(c, type) and issubclass(c, cachestamp._PackageStamp) for c in classes) == 3
    assert pathlib.Path(cachestamp.__file__).resolve().is_relative_to(cachestamp.ROOT)


def test_a_cache_directory_is_probed_once_and_made_again_when_removed(tmp_path, monkeypatch):
    """Numba writes a temporary file into a kernel's cache directory to see that it can, for
    every kernel; npllama's locators do it once a directory, and still make the directory
    again where it was removed since (Numba asks before each save)."""
    probes = []
    real = caching.tempfile.TemporaryFile
    monkeypatch.setattr(caching.tempfile, "TemporaryFile", lambda **kw: probes.append(kw["dir"]) or real(**kw))
    where = tmp_path / "cache"

    class Here(cachestamp.LOCATORS[1]):  # the in-tree locator, its directory moved to tmp_path
        def get_cache_path(self):
            return str(where)

    first, second = (Here(f.py_func, quants.__file__) for f in (quants._block_sums, decode._decode_step))
    first.ensure_cache_path()
    second.ensure_cache_path()
    first.ensure_cache_path()
    assert probes == [str(where)] and where.is_dir()
    shutil.rmtree(where)
    second.ensure_cache_path()
    assert where.is_dir() and probes == [str(where)]
