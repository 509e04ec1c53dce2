"""Kernels compiled ahead of their use: a helper process compiles the decode step beside a
first prompt (engine/precompile.py), `npllama compile` compiles a model's every job (compile.py), and
$NPLLAMA_TARGET compiles for a portable CPU target (npllama/targets.py)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import npllama
from npllama import compile as jobs, targets
from npllama.engine import decode, precompile
from npllama.kernels import cacheload, cpu

pytestmark = pytest.mark.timeout(900)


def test_a_prompt_missing_the_decode_step_has_a_helper_compile_it_and_its_first_token_waits(tiny_q8_path,
                                                                                            monkeypatch):
    want = npllama.load(tiny_q8_path)
    s = want.session()
    s.feed([1, 2, 3])
    expected = s.feed([4])

    model = npllama.load(tiny_q8_path)
    started, compiled = [], []
    monkeypatch.setattr(cacheload, "load_cached", lambda dispatcher, sig: False)  # the cache has no step
    monkeypatch.setattr(decode._decode_step, "compile", lambda sig: compiled.append(sig))
    fake = [sys.executable, "-c", "import json; print(json.dumps({'kernels': 3}))"]
    monkeypatch.setattr(precompile, "command", lambda *a: started.append(a) or fake)
    monkeypatch.delenv(precompile.HELPERS, raising=False)
    s = model.session()
    s.feed([1, 2, 3])
    assert len(started) == 1 and started[0][:3] == ("decode", model.path, "f32")  # the prompt compiled its own
    assert model.decode_plan._helper is not None and not compiled
    monkeypatch.undo()
    np.testing.assert_array_equal(s.feed([4]), expected)  # waited for the helper, then ran the step
    assert model.decode_plan._helper is None


def test_without_helpers_the_decode_step_is_compiled_in_the_process(tiny_q8_path, monkeypatch):
    model = npllama.load(tiny_q8_path)
    compiled = []
    monkeypatch.setattr(cacheload, "load_cached", lambda dispatcher, sig: False)
    monkeypatch.setattr(decode._decode_step, "compile", lambda sig: compiled.append(sig))
    monkeypatch.setenv(precompile.HELPERS, "0")
    model.decode_plan.load(model.new_cache(8), 1)
    assert len(compiled) == 1 and model.decode_plan._helper is None


def test_a_failed_helper_leaves_the_step_to_the_process(tiny_q8_path, monkeypatch):
    model = npllama.load(tiny_q8_path)
    monkeypatch.setattr(cacheload, "load_cached", lambda dispatcher, sig: False)
    monkeypatch.setattr(precompile, "command", lambda *a: [sys.executable, "-c", "raise SystemExit(3)"])
    monkeypatch.delenv(precompile.HELPERS, raising=False)
    s = model.session()
    s.feed([1, 2, 3])
    helper = model.decode_plan._helper
    monkeypatch.undo()
    assert helper is not None and not helper.wait()
    ref = npllama.load(tiny_q8_path).session()
    ref.feed([1, 2, 3])
    model.decode_plan._helper = helper  # waited for again by the step, which then runs as before
    np.testing.assert_array_equal(s.feed([4]), ref.feed([4]))


def test_npllama_compile_runs_every_job_in_processes(tiny_q8_path):
    r = subprocess.run([sys.executable, "-m", "npllama", "compile", "-m", str(tiny_q8_path), "--activations", "f32",
                        "-j", "2"], capture_output=True, text=True, timeout=850)
    assert r.returncode == 0, r.stderr[-3000:]
    for job in jobs.JOBS:
        assert any(line.split()[:2] == [job, "f32"] and "kernels compiled" in line for line in r.stderr.splitlines())
    assert "done in" in r.stderr


def test_a_job_reports_what_it_compiled(tiny_q8_path):
    out = subprocess.run(precompile.command("decode", tiny_q8_path, "f32", "float32", 1), capture_output=True,
                         text=True, check=True, env=precompile.environment(), timeout=850).stdout
    record = json.loads(out.splitlines()[-1])
    assert record["job"] == "decode" and record["kernels"] >= 0 and record["seconds"] > 0


def test_an_unknown_or_unrunnable_target_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="unknown CPU target 'x86-64-v9'"):
        targets.environment("x86-64-v9")
    import llvmlite.binding as llvm
    monkeypatch.setattr(llvm, "get_host_cpu_features", lambda: {"avx2": True, "fma": True, "avx512f": False})
    with pytest.raises(ValueError, match="this CPU lacks .*avx512f.* which target x86-64-v4 needs"):
        targets.environment("x86-64-v4")


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2", "movbe"} <= cpu.target_features(), reason="an AVX2 host")
def test_npllama_target_compiles_for_the_target_and_its_kernels_agree(tmp_path):
    """A process with $NPLLAMA_TARGET=x86-64-v3 compiles for it (no AVX-512, whatever this CPU
    has), its kernels pick their AVX2 paths, and their results are this CPU's."""
    code = ("import numpy as np, npllama\n"
            "from numba.core import config\n"
            "from npllama.kernels import cpu, quants_int8, nn\n"
            "x = np.linspace(-2, 3, 37).astype(np.float32); out = np.empty_like(x)\n"
            "nn._rmsnorm_row(x, x, np.float32(1e-5), out)\n"
            "print(config.CPU_NAME, quants_int8.DOT_ISA, 'avx512f' in cpu.FEATURES, out.tolist())")
    env = {**os.environ, "NPLLAMA_TARGET": "x86-64-v3", "NPLLAMA_KERNEL_CACHE": str(tmp_path)}
    name, isa, avx512, out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                            check=True).stdout.split(maxsplit=3)
    assert (name, isa, avx512) == ("x86-64-v3", "avx2", "False")
    x = np.linspace(-2, 3, 37).astype(np.float32)
    mine = np.empty_like(x)
    from npllama.kernels import nn
    nn._rmsnorm_row(x, x, np.float32(1e-5), mine)
    np.testing.assert_allclose(json.loads(out), mine, rtol=2e-6)
    bad = {**os.environ, "NPLLAMA_TARGET": "x86-64-v9"}
    r = subprocess.run([sys.executable, "-c", "import npllama"], env=bad, capture_output=True, text=True)
    assert r.returncode != 0 and "unknown CPU target 'x86-64-v9'" in r.stderr
