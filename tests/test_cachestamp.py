"""npllama's kernels are cached in the user's cache, by what their machine code depends on: an
edit to a callee's file must not leave a caller's stale machine code in use, an edit elsewhere
recompiles nothing, and a second installation of the same kernels shares their cache."""
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
from numba.core import caching
from numba.core.caching import FunctionCache

from npllama.kernels import cachestamp, cpu, quants
from npllama.engine import decode

pytestmark = pytest.mark.timeout(300)


def locator_of(func):
    return FunctionCache(func)._impl._locator


def test_npllama_kernels_are_kept_in_the_user_cache_by_their_modules_closure():
    for kernel, module in ((quants._block_sums, "kernels.quants"), (decode._decode_step, "engine.decode")):
        loc = locator_of(kernel.py_func)
        assert isinstance(loc, cachestamp._KernelCache)
        assert loc.get_source_stamp() == cachestamp.module_stamp(module)
        path = pathlib.Path(loc.get_cache_path())
        assert path.parent == cachestamp.cache_root() / cachestamp.platform_dir()
        assert path.name == f"{module}-{cachestamp.module_stamp(module)[:16]}"


def test_the_cache_root_follows_the_environment(tmp_path):
    code = "from npllama.kernels import cachestamp; print(cachestamp.cache_root())"
    base = {k: v for k, v in os.environ.items() if k not in ("NPLLAMA_KERNEL_CACHE", "NUMBA_CACHE_DIR")}

    def root(**env):
        return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert root(NPLLAMA_CACHE=str(tmp_path / "models")) == str(tmp_path / "models" / "kernels")
    assert root(NUMBA_CACHE_DIR=str(tmp_path / "numba")) == str(tmp_path / "numba" / "npllama")
    assert root(NUMBA_CACHE_DIR=str(tmp_path / "numba"), NPLLAMA_KERNEL_CACHE=str(tmp_path / "k")) == str(tmp_path / "k")


def test_the_stamps_hold_the_amx_choice():
    """Compiled panel products differ with cpu.AMX, which Numba's key does not hold:
    $NPLLAMA_AMX=0 turns AMX off, and the kernels' stamps with it."""
    linked = "|own-copies|out-of-line"  # linking's, installed on import
    off = cachestamp.ModuleStamps(extra=linked).stamp("kernels.panels")
    assert cachestamp.module_stamp("kernels.panels") == (
        cachestamp.ModuleStamps(extra="amx" + linked).stamp("kernels.panels") if cpu.AMX else off)
    assert cachestamp.ModuleStamps(extra="amx" + linked).stamp("kernels.panels") != off
    code = "from npllama.kernels import cachestamp, cpu; print(cpu.AMX, cachestamp.module_stamp('kernels.panels'))"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NPLLAMA_AMX": "0"}, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["False", off]


def test_functions_outside_npllama_keep_numbas_own_locators():
    def here(x):
        return x + 1
    loc = locator_of(here)
    assert not isinstance(loc, cachestamp._KernelCache)


def _package(root: pathlib.Path) -> pathlib.Path:
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    jit = "from numba import njit\n"
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "caller.py").write_text(jit + "from .sub.callee import g\n@njit\ndef f():\n    return g()\n")
    (pkg / "sub" / "callee.py").write_text(jit + "from ..consts import K\n@njit\ndef g():\n    return K\n")
    (pkg / "consts.py").write_text("K = 1\n")
    (pkg / "other.py").write_text(jit + "from .sub import (\n    helper,  # a module\n)\n@njit\ndef h():\n    return 3\n")
    (pkg / "sub" / "helper.py").write_text("X = 1\n")
    (pkg / "lonely.py").write_text(jit + "@njit\ndef k():\n    return 4\n")
    (pkg / "notes.txt").write_text("not source")
    return pkg


def test_a_stamp_changes_with_its_module_and_what_it_imports_and_only_then(tmp_path):
    pkg = _package(tmp_path)
    modules = ("caller", "sub.callee", "consts", "other", "sub.helper", "lonely")
    before = cachestamp.ModuleStamps(pkg)
    assert before.imports["caller"] == {"sub.callee"}
    assert before.imports["sub.callee"] == {"consts"}
    assert before.imports["other"] == {"sub.helper"}  # a name in parentheses that is a module
    stamps = {m: before.stamp(m) for m in modules}
    assert len(set(stamps.values())) == len(modules)

    (pkg / "notes.txt").write_text("still not source")
    assert {m: cachestamp.ModuleStamps(pkg).stamp(m) for m in modules} == stamps

    (pkg / "consts.py").write_text("K = 2\n")  # a constant the callee's kernel reads
    after = cachestamp.ModuleStamps(pkg)
    changed = {m for m in modules if after.stamp(m) != stamps[m]}
    assert changed == {"caller", "sub.callee", "consts"}

    (pkg / "sub" / "helper.py").write_text("X = 2\n")
    assert {m for m in modules if cachestamp.ModuleStamps(pkg).stamp(m) != after.stamp(m)} == {"other", "sub.helper"}

    (pkg / "backends").mkdir()
    (pkg / "backends" / "gpu.py").write_text("from numba import cuda\n")  # device kernels: no CPU kernel calls them
    assert "backends.gpu" not in cachestamp.ModuleStamps(pkg).digests


def test_imports_of_every_form_are_found(tmp_path):
    pkg = _package(tmp_path)
    (pkg / "forms.py").write_text(textwrap.dedent("""\
        from . import consts
        from .sub import callee as c, helper
        from npllama_like import nothing
        import pkg_absent
        from .lonely import k  # a function: the module
        """))
    found = cachestamp.ModuleStamps(pkg).imports["forms"]
    assert found == {"consts", "sub.callee", "sub.helper", "lonely"}


def test_npllamas_own_imports_are_read():
    stamps = cachestamp._stamps()
    assert {"kernels.quants", "kernels.panels", "kernels.workshare", "engine.block"} <= stamps.imports["engine.decode"]
    assert "kernels.qtypes" in stamps.imports["kernels.quants"]  # no Numba in it, but constants the kernels read
    assert "text.tokenizer" not in stamps.imports["engine.decode"]


def test_a_second_installation_shares_the_cache(tmp_path):
    """The same kernels installed elsewhere (another virtualenv, a reinstall) are kept in the
    same directories, so they load what the first compiled."""
    shutil.copytree(cachestamp.ROOT, tmp_path / "npllama", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("import sys; from numba.core.caching import FunctionCache; import npllama.engine.decode as d; "
            "print(d.__file__); print(FunctionCache(d._decode_step.py_func)._impl._locator.get_cache_path())")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    where, path = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True, cwd=tmp_path).stdout.split()
    assert pathlib.Path(where).is_relative_to(tmp_path)
    assert path == locator_of(decode._decode_step.py_func).get_cache_path()


def test_install_is_idempotent():
    cachestamp.install()
    cachestamp.install()
    classes = cachestamp._numba("CacheImpl")._locator_classes
    assert classes[0] is cachestamp.LOCATOR
    assert sum(c is cachestamp.LOCATOR for c in classes) == 1


def test_a_numba_without_the_locator_base_keeps_its_own_caching_with_a_warning(monkeypatch):
    monkeypatch.setattr(cachestamp, "LOCATOR", None)
    with pytest.warns(RuntimeWarning, match="Numba's own rules"):
        assert not cachestamp.install()


def test_a_cache_directory_is_probed_once_and_made_again_when_removed(tmp_path, monkeypatch):
    """Numba writes a temporary file into a kernel's cache directory to see that it can, for
    every kernel; npllama's locator does it once a directory, and still makes the directory
    again where it was removed since (Numba asks before each save)."""
    probes = []
    real = caching.tempfile.TemporaryFile
    monkeypatch.setattr(caching.tempfile, "TemporaryFile", lambda **kw: probes.append(kw["dir"]) or real(**kw))
    monkeypatch.setenv("NPLLAMA_KERNEL_CACHE", str(tmp_path))
    first, second = (cachestamp.LOCATOR(f.py_func, quants.__file__) for f in (quants._block_sums, quants._rows_f32))
    where = pathlib.Path(first.get_cache_path())
    assert where.is_relative_to(tmp_path) and second.get_cache_path() == str(where)
    first.ensure_cache_path()
    second.ensure_cache_path()
    first.ensure_cache_path()
    assert probes == [str(where)] and where.is_dir()
    shutil.rmtree(where)
    second.ensure_cache_path()
    assert where.is_dir() and probes == [str(where)]


UNWRITABLE = textwrap.dedent('''
    import warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import numpy as np
        from npllama.kernels import nn
        x = np.ones(8, np.float32)
        out = np.empty_like(x)
        nn._rmsnorm_row(x, x, np.float32(1e-5), out)  # its module and those it imports: one warning
    from numba.core.caching import FunctionCache
    print(len([w for w in caught if "cannot be written" in str(w.message)]), out[0],
          FunctionCache(nn._rmsnorm_row.py_func)._impl._locator.get_cache_path())
''')


def test_a_cache_that_cannot_be_written_compiles_for_the_process_with_one_warning(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = {**os.environ, "NPLLAMA_KERNEL_CACHE": str(blocker / "kernels")}
    count, value, path = subprocess.run([sys.executable, "-c", UNWRITABLE], env=env, capture_output=True, text=True,
                                        check=True).stdout.split()
    assert count == "1" and float(value) == pytest.approx(1.0, rel=1e-5)
    assert "npllama-kernels-" in path and not pathlib.Path(path).exists()  # removed at the process's exit
    assert blocker.read_text() == "not a directory"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cachestamp.cache_root() != blocker  # this process is untouched
