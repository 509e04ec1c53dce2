"""A kernel runs its own copies of the functions it calls (kernels/linking.py): its bits never
depend on which other kernels the process compiled or loaded before it."""
import json
import os
import subprocess
import sys
import textwrap

import llvmlite.binding as ll
import numpy as np
import pytest

from npllama.kernels import linking

pytestmark = pytest.mark.timeout(300)

# nn._rope on fixed input, after rows._rope_rows (which links its own copy of nn._rope_row)
# where argv[1] says "rows first"; prints the result's bytes as hex.
ROPE_SCRIPT = textwrap.dedent('''
    import sys
    import numpy as np
    from npllama.kernels import nn, rows
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 4, 16)).astype(np.float32)
    cos, sin = (rng.standard_normal((64, 8)).astype(np.float32) for _ in range(2))
    pos = np.arange(37, dtype=np.int64)
    if sys.argv[1] == "rows first":
        rows._rope_rows(x.copy(), pos, cos, sin, True)
    nn._rope(x, pos, cos, sin, True)
    print(x.tobytes().hex())
''')


def test_a_kernels_bits_do_not_depend_on_the_kernels_loaded_before_it(tmp_path):
    """The order that once gave nn._rope other bits: a process that compiled it alone, one that
    compiled rows._rope_rows first (nn._rope loaded), one that loaded both, rows' first (whose
    copy of nn._rope_row then came first in the JIT's symbols)."""
    env = {**os.environ, "NPLLAMA_KERNEL_CACHE": str(tmp_path / "kernels"), "NPLLAMA_COMPILE_HELPERS": "0"}
    outs = []
    for order in ("alone", "rows first", "rows first"):
        r = subprocess.run([sys.executable, "-c", ROPE_SCRIPT, order], env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(r.stdout.strip())
    assert outs[0] == outs[1] == outs[2]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((37, 4, 16)).astype(np.float32)
    cos, sin = (rng.standard_normal((64, 8)).astype(np.float32) for _ in range(2))
    a, b = x[..., :8], x[..., 8:]
    c, s = cos[:37, None, :], sin[:37, None, :]
    want = np.concatenate([a * c - b * s, a * s + b * c], axis=-1)
    got = np.frombuffer(bytes.fromhex(outs[0]), np.float32).reshape(x.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


IR = '''
define linkonce_odr i32 @"_ZN7npllama7kernels2nn4copyE"(i32 %x) { ret i32 %x }
define linkonce_odr i32 @"numba_helper"(i32 %x) { ret i32 %x }
define i32 @"_ZN7npllama7kernels4rows3ownE"(i32 %x) {
  %y = call i32 @"_ZN7npllama7kernels2nn4copyE"(i32 %x)
  ret i32 %y
}
declare i32 @"elsewhere"(i32)
'''


def _linkages(module):
    return {f.name: f.linkage.name for f in module.functions}


def test_linked_copies_in_an_npllama_library_get_names_of_its_own_and_its_functions_keep_theirs():
    module = ll.parse_assembly(IR)
    assert linking.localize(module) == 2
    names = _linkages(module)
    tag = next(n for n in names if n.startswith("numba_helper.")).split(".", 1)[1]
    assert names == {f"_ZN7npllama7kernels2nn4copyE.{tag}": "linkonce_odr", f"numba_helper.{tag}": "linkonce_odr",
                     "_ZN7npllama7kernels4rows3ownE": "external", "elsewhere": "external"}
    assert f"call i32 @_ZN7npllama7kernels2nn4copyE.{tag}(" in str(module)  # the call follows the copy
    module.verify()
    other = ll.parse_assembly(IR.replace("4rows3own", "5rows24other"))
    linking.localize(other)
    assert f"numba_helper.{tag}" not in _linkages(other)  # another library's copies: other names


def test_a_library_without_npllama_functions_is_left_as_numba_links_it():
    module = ll.parse_assembly(IR.replace("7npllama", "5other"))
    before = _linkages(module)
    assert linking.localize(module) == 0
    assert _linkages(module) == before


def test_installed_and_counted_in_the_cache_key(monkeypatch):
    from npllama.kernels import cachestamp
    assert linking.INSTALLED and linking.OUT_OF_LINE  # by importing npllama.kernels
    installed = cachestamp.ModuleStamps(extra="|own-copies|out-of-line").stamp("kernels.nn")
    assert cachestamp.module_stamp("kernels.nn") in (
        installed, cachestamp.ModuleStamps(extra="amx|own-copies|out-of-line").stamp("kernels.nn"))
    assert cachestamp.ModuleStamps(extra="|own-copies").stamp("kernels.nn") != installed
    assert cachestamp.ModuleStamps().stamp("kernels.nn") != installed


def test_a_numba_without_the_hooked_step_keeps_its_linking_with_one_warning(monkeypatch):
    class Library:
        pass
    monkeypatch.setattr(linking.codegen.JITCPUCodegen, "_library_class", Library)
    with pytest.warns(RuntimeWarning, match="last bits may depend"):
        assert linking.install() is False
    with pytest.warns(RuntimeWarning, match="workers are linked into every caller"):
        assert linking.install_out_of_line() is False


# A kernel module added to a copy of the package: a parallel caller of an out-of-line callee.
PROBE = textwrap.dedent('''
    import numpy as np
    from numba import njit, prange
    from . import linking


    @linking.out_of_line
    @njit(cache=True)
    def _callee(x, i):
        s = 0.0
        for j in range(x.shape[1]):
            s += x[i, j] * (j + 1)
        return s


    @njit(parallel=True, cache=True)
    def caller(x):
        out = np.empty(x.shape[0])
        for i in prange(x.shape[0]):
            row = np.int64(i)  # prange's index is unsigned in the region: one signature
            out[i] = _callee(x, row)
        return out
''')

# argv[1]: "caller" runs the caller (compiled or loaded); "callee" compiles some other functions
# first (Numba's names count a process's compiles), then the callee alone. Prints a record.
PROBE_SCRIPT = textwrap.dedent('''
    import json, sys
    import numpy as np
    from numba import njit
    from npllama.kernels import linking, probe_calls as p
    x = np.arange(15.0).reshape(5, 3)
    record = {}
    if sys.argv[1] == "caller":
        record["out"] = p.caller(x).tolist()
        record["caller_hits"] = sum(p.caller.stats.cache_hits.values())
        library = next(iter(p.caller.overloads.values())).library
        record["calls"] = [symbol for _, _, symbol in linking.calls_of(library)]
        if not record["caller_hits"]:  # compiled here: its module declares the callee, holds no copy
            record["declared"] = [f.name for f in library._final_module.functions if f.is_declaration]
    else:
        for k in range(3):
            njit(lambda v, k=k: v + k)(1.0)
        record["out"] = p._callee(x, 1)
    record["callee"] = next(iter(p._callee.overloads.values())).fndesc.mangled_name
    record["callee_hits"] = sum(p._callee.stats.cache_hits.values())
    print(json.dumps(record))
''')


def test_an_out_of_line_callee_is_called_by_its_symbol_and_loaded_before_a_cached_caller(tmp_path):
    """The caller's code calls the callee's own (no copy linked in); a later process loading
    the cached caller loads the callee first; and where the callee was compiled again since,
    under another name, the caller's saved name resolves to it."""
    import shutil
    from npllama.kernels import cachestamp
    shutil.copytree(cachestamp.ROOT, tmp_path / "npllama", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "npllama" / "kernels" / "probe_calls.py").write_text(PROBE)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "NPLLAMA_KERNEL_CACHE": str(tmp_path / "kernels")}

    def run(mode):
        r = subprocess.run([sys.executable, "-c", PROBE_SCRIPT, mode], env=env, capture_output=True, text=True,
                           cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.splitlines()[-1])

    x = np.arange(15.0).reshape(5, 3)
    want = (x * np.arange(1, 4)).sum(axis=1).tolist()
    first = run("caller")
    assert first["out"] == want and first["caller_hits"] == 0
    assert first["calls"] == [first["callee"]] and first["callee"] in first["declared"]
    loaded = run("caller")  # the caller from the cache, its callee loaded before it
    assert loaded["out"] == want and loaded["caller_hits"] == 1 and loaded["callee_hits"] == 1
    assert loaded["callee"] == first["callee"]
    for entry in (tmp_path / "kernels").rglob("probe_calls._callee*"):
        entry.unlink()
    again = run("callee")  # compiled anew: another name
    assert again["out"] == want[1] and again["callee_hits"] == 0 and again["callee"] != first["callee"]
    mapped = run("caller")  # the caller's saved name resolves to the callee's new one
    assert mapped["out"] == want and mapped["caller_hits"] == 1 and mapped["callee_hits"] == 1
    assert mapped["callee"] == again["callee"] and mapped["calls"] == [first["callee"]]


def test_only_npllamas_out_of_line_functions_are_found_for_a_saved_call():
    from npllama.engine import decode
    assert linking.find("npllama.engine.decode", "_worker") is decode._worker
    assert linking.find("npllama.engine.decode", "_decode_step") is None  # not called out of line
    assert linking.find("os", "system") is None  # never imported from an entry
