"""npllama's kernels load from Numba's cache with their bitcode unparsed until a compile links
them, without Numba's registries, and without importing the modules of the Numba functions they
inline (kernels/cacheload.py); other functions keep Numba's own loading. Numba's runtime module
is loaded from what an earlier process saved."""
import hashlib
import json
import marshal
import os
import platform
import subprocess
import sys
import textwrap

import llvmlite.binding as ll
import numpy as np
import pytest
from numba import njit
from numba.core import caching

from npllama.kernels import cacheload, nn

pytestmark = pytest.mark.timeout(300)

# Run twice with one NUMBA_CACHE_DIR: the first process compiles and saves, the second loads.
# It prints, as JSON, what it saw of npllama's _rmsnorm_row and of a cached function of its own.
SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    from numba import njit
    from numba.core import base
    from npllama.kernels import aligned, cacheload, nn
    sys.path.insert(0, sys.argv[1])
    import usermod

    refreshes = []  # the target context's refreshes (its registries loaded)
    refresh = base.BaseContext.refresh
    base.BaseContext.refresh = lambda self: (refreshes.append(1), refresh(self))[1]

    x = np.linspace(-2, 3, 37).astype(np.float32)
    w = np.linspace(0.5, 1.5, 37).astype(np.float32)
    out = np.empty_like(x)
    nn._rmsnorm_row(x, w, np.float32(1e-5), out)
    (cres,) = nn._rmsnorm_row.overloads.values()
    lib = cres.library
    seen = {"hits": sum(nn._rmsnorm_row.stats.cache_hits.values()), "lazy": isinstance(lib, cacheload._LazyBitcode),
            "unparsed": getattr(lib, "_bitcode", None) is not None, "out": out.tolist(), "refreshed": len(refreshes)}
    buf = aligned._empty((3, 5), np.float32)  # inlines Numba's own array functions (numba.np.arrayobj)
    (ecres,) = aligned._empty.overloads.values()
    seen["empty"] = [list(buf.shape), buf.ctypes.data % 64]
    seen["env_modules"] = sorted({env.globals["__name__"] for env in ecres.referenced_envs or ()})
    seen["arrayobj_imported"] = "numba.np.arrayobj" in sys.modules

    @njit
    def caller(x, w, out):  # compiled here: links _rmsnorm_row's module in
        nn._rmsnorm_row(x, w, np.float32(1e-5), out)
        return out.sum()

    out2 = np.empty_like(x)
    seen["caller"] = float(caller(x, w, out2))
    seen["caller_out"] = out2.tolist()
    seen["parsed_after_link"] = getattr(lib, "_bitcode", None) is None and lib._shared_module is not None
    del refreshes[:]
    seen["user"] = float(usermod.add_one(np.arange(5.0)).sum())
    seen["user_refreshed"] = len(refreshes)
    (ucres,) = usermod.add_one.overloads.values()
    seen["user_hits"] = sum(usermod.add_one.stats.cache_hits.values())
    seen["user_lazy"] = isinstance(ucres.library, cacheload._LazyBitcode)
    print(json.dumps(seen))
''')

USERMOD = textwrap.dedent('''
    from numba import njit

    @njit(cache=True)
    def add_one(x):
        return x + 1.0
''')


def _rmsnorm(x, w, eps):
    x64 = x.astype(np.float64)
    r = np.float32(1.0 / np.sqrt((x64 * x64).sum() / len(x) + eps))
    return (x * r) * w


def test_a_cached_kernel_loads_unparsed_and_parses_when_linked(tmp_path):
    (tmp_path / "usermod.py").write_text(USERMOD)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}
    runs = [json.loads(subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], env=env, capture_output=True,
                                      text=True, check=True).stdout.splitlines()[-1]) for _ in range(2)]
    first, second = runs
    assert first["hits"] == 0 and second["hits"] == 1  # compiled and saved, then loaded
    assert not first["lazy"] and second["lazy"]
    assert second["unparsed"]
    assert first["refreshed"] > 0 and second["refreshed"] == 0  # a load alone needs no registries
    assert first["user_refreshed"] > 0 and second["user_refreshed"] > 0  # Numba's own load refreshes
    assert second["parsed_after_link"]  # a compile linking the kernel parsed its bitcode
    # the environments of Numba's functions inlined into a loaded kernel, rebuilt without their modules
    assert first["arrayobj_imported"] and "numba.np.arrayobj" in second["env_modules"]
    assert not second["arrayobj_imported"]
    assert first["empty"] == second["empty"] == [[3, 5], 0]
    x = np.linspace(-2, 3, 37).astype(np.float32)
    w = np.linspace(0.5, 1.5, 37).astype(np.float32)
    want = _rmsnorm(x, w, np.float32(1e-5))
    for run in runs:
        np.testing.assert_allclose(run["out"], want, rtol=2e-6)
        assert run["caller_out"] == run["out"]
        assert run["caller"] == pytest.approx(float(np.sum(run["out"], dtype=np.float32)), rel=1e-6)
        assert run["user"] == 15.0
    # a function outside npllama is saved and loaded by Numba's own code
    assert first["user_hits"] == 0 and second["user_hits"] == 1
    assert not first["user_lazy"] and not second["user_lazy"]


def test_the_names_carried_are_those_numbas_loader_reads():
    @njit
    def f(x):
        return nn._exp(x) + 1

    f(np.float32(0.5))
    (cres,) = f.overloads.values()
    _, kind, (_, bitcode) = cres.library.serialize_using_object_code()
    module = ll.parse_bitcode(bitcode)
    loader = {gv.name for gvs in (module.functions, module.global_variables) for gv in gvs if not gv.is_declaration}
    assert kind == "object"
    assert set(cacheload.defined_names(cres.library)) == loader
    assert cres.fndesc.llvm_func_name in loader


def test_installed_for_npllama_and_kept_out_where_numba_lacks_an_attribute(monkeypatch):
    assert caching.FunctionCache._impl_class is cacheload._LazyLoad
    assert caching.FunctionCache.load_overload is cacheload._load_overload
    assert cacheload.install()  # again: the same
    assert caching.FunctionCache.load_overload is cacheload._load_overload
    monkeypatch.setattr(caching.FunctionCache, "_impl_class", caching.CompileResultCacheImpl)
    monkeypatch.setattr(caching.FunctionCache, "load_overload", cacheload._numba_load_overload)
    monkeypatch.setattr(cacheload, "_LIBRARY_ATTRIBUTES", cacheload._LIBRARY_ATTRIBUTES + ("no_such_attribute",))
    with pytest.warns(RuntimeWarning, match="as Numba loads them"):
        assert not cacheload.install()
    assert caching.FunctionCache._impl_class is caching.CompileResultCacheImpl
    assert caching.FunctionCache.load_overload is cacheload._numba_load_overload


# Numba's runtime module: compiled and saved by a process whose first function is an npllama
# kernel (looked for in the cache, then compiled), then loaded from what was saved. Prints, as
# JSON, which of the two this process did.
RUNTIME_SCRIPT = textwrap.dedent('''
    import json
    import numpy as np
    from numba import njit
    from numba.core.runtime import rtsys
    from npllama.kernels import aligned, cacheload

    buf = aligned._empty((3, 5), np.float32)  # loaded or compiled; it allocates through the runtime
    loaded = isinstance(rtsys._library, cacheload._LazyBitcode)

    @njit
    def total(n):  # compiled here: links the runtime's module in
        return np.ones(n).sum()

    print(json.dumps({"loaded": loaded, "shape": list(buf.shape), "total": total(5)}))
''')


def test_the_runtime_module_is_saved_then_loaded_and_a_bad_file_replaced(tmp_path):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache")}

    def run():
        out = subprocess.run([sys.executable, "-c", RUNTIME_SCRIPT], env=env, capture_output=True, text=True,
                             check=True).stdout.splitlines()[-1]
        saved = sorted((tmp_path / "cache").rglob("nrt-*.bin"))
        return json.loads(out), saved

    first, saved = run()  # the kernel compiled; the runtime compiled and saved before it
    second, again = run()  # the kernel and the runtime loaded
    assert len(saved) == 1 and again == saved
    assert not first["loaded"] and second["loaded"]
    for out in (first, second):
        assert out["shape"] == [3, 5] and out["total"] == 5.0
    (path,) = saved
    good = path.read_bytes()
    path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # one bit off: compiled anew and replaced
    third, _ = run()
    assert not third["loaded"] and cacheload._read_runtime(str(path)) is not None
    fourth, _ = run()
    assert fourth["loaded"] and fourth["total"] == 5.0


def test_a_saved_runtime_is_read_back_only_whole(tmp_path):
    path = str(tmp_path / "nrt-x.bin")
    saved = ("nrt", b"\x7fELF machine code", b"BC bitcode", ["NRT_incref", "NRT_decref"])
    assert cacheload._read_runtime(path) is None  # no file
    cacheload._write_runtime(path, saved)
    assert cacheload._read_runtime(path) == saved
    data = open(path, "rb").read()
    n = len(cacheload._RUNTIME_MAGIC)
    for bad in (data[:-3], b"x" + data[1:], data[:n] + bytes(32) + data[n + 32:], b""):
        open(path, "wb").write(bad)
        assert cacheload._read_runtime(path) is None
    payload = marshal.dumps(("nrt", b"code", "not bytes", []))  # whole, but not what is saved
    open(path, "wb").write(cacheload._RUNTIME_MAGIC + hashlib.sha256(payload).digest() + payload)
    assert cacheload._read_runtime(path) is None
    cacheload._write_runtime(str(tmp_path / "no such dir" / "nrt-x.bin"), saved)  # not writable: left as it is
    assert not (tmp_path / "no such dir").exists()


# One kernel through the cache at $NPLLAMA_KERNEL_CACHE: prints whether it was loaded from
# the cache, its result, and the warnings about the cache.
KERNEL_SCRIPT = textwrap.dedent('''
    import json, logging, sys, warnings
    import numpy as np
    logging.basicConfig(stream=sys.stderr)
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        from npllama.kernels import nn
        x = np.linspace(-2, 3, 37).astype(np.float32)
        w = np.linspace(0.5, 1.5, 37).astype(np.float32)
        out = np.empty_like(x)
        nn._rmsnorm_row(x, w, np.float32(1e-5), out)
    print(json.dumps({"hits": sum(nn._rmsnorm_row.stats.cache_hits.values()), "out": out.tolist(),
                      "warnings": [str(c.message) for c in caught]}))
''')

WANT = _rmsnorm(np.linspace(-2, 3, 37).astype(np.float32), np.linspace(0.5, 1.5, 37).astype(np.float32),
                np.float32(1e-5))


def _kernel_run(cache, prelude="", **env):
    r = subprocess.run([sys.executable, "-c", prelude + KERNEL_SCRIPT],
                       env={**os.environ, "NPLLAMA_KERNEL_CACHE": str(cache), **env}, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.splitlines()[-1])
    np.testing.assert_allclose(seen["out"], WANT, rtol=2e-6)
    return seen, r.stderr


def _entry_files(cache, suffix):
    return sorted(p for p in cache.rglob(f"nn._rmsnorm_row-*{suffix}"))


def test_a_damaged_entry_is_compiled_anew_and_replaced(tmp_path):
    cache = tmp_path / "cache"
    assert _kernel_run(cache)[0]["hits"] == 0
    assert _kernel_run(cache)[0]["hits"] == 1
    (data,) = _entry_files(cache, ".nbc")
    (index,) = _entry_files(cache, ".nbi")
    good = data.read_bytes()

    def damaged(path, content):  # compiled anew (said on stderr), then loaded from the replaced entry
        path.write_bytes(content)
        seen, err = _kernel_run(cache)
        assert seen["hits"] == 0 and "compiling it anew" in err
        assert _kernel_run(cache)[0]["hits"] == 1

    damaged(data, good[:len(good) // 2])  # truncated
    damaged(data, b"")
    # the machine code changed where pickle cannot see it: a byte flipped inside the object code
    # (found by its ELF header), caught by the entry's checksum
    at = data.read_bytes().index(b"\x7fELF") + 200
    content = data.read_bytes()
    damaged(data, content[:at] + bytes([content[at] ^ 0x40]) + content[at + 1:])
    damaged(index, index.read_bytes()[:-7])  # a truncated index: written anew


def test_two_processes_compiling_at_once_both_answer_and_leave_a_valid_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "NPLLAMA_KERNEL_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", KERNEL_SCRIPT], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        seen = json.loads(out.splitlines()[-1])
        assert seen["hits"] == 0 and not seen["warnings"]
        np.testing.assert_allclose(seen["out"], WANT, rtol=2e-6)
    assert _kernel_run(cache)[0]["hits"] == 1  # what either saved loads


FULL_DISK = textwrap.dedent('''
    import errno
    from numba.core import caching
    def full(self, name, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    caching.IndexDataCacheFile._save_data = full
''')


def test_a_full_disk_leaves_the_kernel_compiled_in_memory_with_one_warning(tmp_path):
    seen, _ = _kernel_run(tmp_path / "cache", prelude=FULL_DISK)
    assert seen["hits"] == 0
    assert len(seen["warnings"]) == 1 and "No space left" in seen["warnings"][0]


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 target name")
def test_machine_code_for_another_cpu_is_never_loaded(tmp_path):
    """Compiled for this CPU (AVX2 or AVX-512 on the machines that run the tests), then asked
    for by a process compiling for a poorer target (x86-64-v2: SSE4.2) on the same cache:
    compiled anew for it, and each target then loads its own."""
    cache = tmp_path / "cache"
    poor = {"NUMBA_CPU_NAME": "x86-64-v2", "NUMBA_CPU_FEATURES": ""}
    assert _kernel_run(cache)[0]["hits"] == 0
    assert _kernel_run(cache, **poor)[0]["hits"] == 0
    assert _kernel_run(cache, **poor)[0]["hits"] == 1
    assert _kernel_run(cache)[0]["hits"] == 1
