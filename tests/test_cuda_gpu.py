"""The CUDA backend on a real GPU (marked `gpu`; bench/gpu_check.sh runs them, and they skip
without a device). Never run on these CI machines, which have no GPU.

- Whole models against the CPU engine: models of SmolLM2-135M's and Gemma 3 270M's shapes
  (bench/shaped_model.py: every quant type of those files, Gemma 3's sliding windows, q/k
  norms and post-norms), whose CPU-engine logits bench/gpu_prep.py computed where the CPU
  engine runs, in $NPLLAMA_GPU_REF. The GPU machine then runs no CPU kernel (compiling them
  there would take minutes of the device's time).
- A session's decode steps through the captured CUDA graph equal the eager steps, after a
  fork and a truncate too.
- The kernels on those models' shapes against gguf's dequantization and NumPy in float64.
"""
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
REF = Path(os.environ.get("NPLLAMA_GPU_REF", ".gpu-carry"))


@pytest.fixture(scope="module")
def cupy():
    cp = pytest.importorskip("cupy", reason="CuPy is not installed (npllama[cuda])")
    from npllama.backends.cuda import simulated
    try:
        count = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver
        count = 0
    if count < 1 or simulated():
        pytest.skip("no CUDA device (or the simulator is on)")
    return cp


def shaped(name: str) -> tuple[Path, dict]:
    """The model of `name`'s shape (written by gpu_check.sh from its spec) and its CPU-engine reference."""
    path, ref = REF / f"{name}.gguf", REF / f"{name}.npz"
    if not ref.exists() or not path.exists():
        pytest.skip(f"{ref} or {path} is missing: run bench/gpu_prep.py here and bench/gpu_check.sh there")
    ref = dict(np.load(ref))
    ref["same_file"] = hashlib.sha256(path.read_bytes()).hexdigest() == str(ref["sha256"])
    return path, ref


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * float(np.abs(want).max()))


@pytest.fixture(scope="module", params=["smollm2", "gemma3"])
def model_and_ref(request, cupy):
    import npllama
    path, ref = shaped(request.param)
    return npllama.load(path, device="cuda"), ref


def test_model_matches_the_cpu_engine(model_and_ref):
    """The prompt's logits, then each decode step's (the reference's tokens fed back): the
    first decode step runs eagerly, the second captures the graph, the rest replay it."""
    gpu, ref = model_and_ref
    assert ref["same_file"], f"{gpu.path} is not the file the reference was computed on"
    s = gpu.session()
    close(s.feed(ref["prompt"], all_logits=True), ref["prompt_logits"])
    for tok, want in zip(ref["steps"], ref["step_logits"]):
        close(s.feed([int(tok)]), want)
    assert s.cache.graph is not None and s.cache.graph.graph is not None, "no decode graph was captured"


def test_graph_steps_equal_eager_steps(model_and_ref):
    gpu, ref = model_and_ref
    prompt, steps = ref["prompt"], [int(t) for t in ref["steps"]]

    def run(graphs):
        gpu.graphs = graphs
        try:
            s = gpu.session()
            s.feed(prompt)
            out = [s.feed([t]) for t in steps]
            f = s.fork()
            out += [f.feed([t]) for t in steps[:2]]  # a fork: its own buffer, its own graph
            s.truncate(len(prompt) + 1)
            out += [s.feed([t]) for t in steps[1:3]]  # positions the graph ran before
            return np.array(out)
        finally:
            gpu.graphs = True

    np.testing.assert_allclose(run(True), run(False), rtol=1e-6, atol=1e-6)


def test_matvec_and_dequantize_on_the_models_weights(model_and_ref, cupy):
    """Every quant type of the model, against gguf's dequantization and a float64 product."""
    from gguf import quants as gq
    from npllama.backends.cuda import kernels as K
    gpu, _ = model_and_ref
    seen = {}
    for w in gpu.product_weights():
        seen.setdefault(w.qtype, w)
    rng = np.random.default_rng(0)
    for qtype, w in seen.items():
        d = gpu.device_weights[w.name]
        exact = gq.dequantize(w.data, qtype).reshape(w.rows, w.cols)
        x = rng.standard_normal((9, w.cols)).astype(np.float32)  # two blocks of rows of x, the second short
        out = K.matvec(d.kind, d.scales, d.quants, cupy.asarray(x), cupy.empty((9, d.rows), np.float32), d.rows,
                       d.cols)
        want = x.astype(np.float64) @ exact.T.astype(np.float64)
        np.testing.assert_allclose(out.get(), want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=qtype.name)
        one = K.matvec(d.kind, d.scales, d.quants, cupy.asarray(x[8:]), cupy.empty((1, d.rows), np.float32), d.rows,
                       d.cols)
        np.testing.assert_array_equal(one.get()[0], out.get()[8], err_msg=qtype.name)  # whatever its neighbours
        full = K.dequantize(d.kind, d.scales, d.quants, cupy.empty((d.rows, d.cols), np.float32), d.rows, d.cols)
        # equal but for the last bit where the GPU fuses a scale's multiply and a minimum's add
        np.testing.assert_allclose(full.get(), exact, rtol=2e-7, atol=1e-7 * np.abs(exact).max(), err_msg=qtype.name)


@pytest.mark.parametrize("kv_len", [1, 63, 64, 4000])
def test_attention_against_numpy(cupy, kv_len):
    """One query over kv_len float16 keys (SmolLM2's 9 heads over 3 KV heads), with the splits
    of a larger capacity as a graph launches them."""
    from npllama.backends.cuda import kernels as K
    rng = np.random.default_rng(kv_len)
    kv = rng.standard_normal((kv_len + 5, 3, 2, 64)).astype(np.float16)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    positions = cupy.asarray(np.array([kv_len - 1]))
    one_page, seq_of = cupy.zeros((1, 1), np.int32), cupy.zeros(1, np.int64)
    out = K.attention(cupy.asarray(q), cupy.asarray(kv[None]), one_page, seq_of, positions,
                      -(-(kv_len + 5) // K.SPLIT) + 1, 0, 0.125, cupy.empty((1, 9, 64), np.float32), cupy)
    k, v = kv[:kv_len, :, 0].astype(np.float64), kv[:kv_len, :, 1].astype(np.float64)
    want = np.empty((9, 64))
    for h in range(9):
        sc = k[:, h // 3] @ q[0, h] * 0.125
        p = np.exp(sc - sc.max())
        want[h] = p @ v[:, h // 3] / p.sum()
    np.testing.assert_allclose(out.get()[0], want, rtol=1e-4, atol=1e-5)


def test_batched_pass_equals_sessions(model_and_ref):
    """The device's packed pass (generate_batch's) gives each sequence an eager session's
    logits bit for bit: three prompts of different lengths in one pass, then decode steps
    (the first eager, the second captured as a graph, the rest replayed)."""
    import npllama
    from npllama.engine.batch import forward_batch
    gpu, ref = model_and_ref
    prompt = [int(t) for t in ref["prompt"]]
    prompts, steps = [prompt, prompt[:2], prompt[1:] + prompt], [int(t) for t in ref["steps"][:4]]
    gpu.graphs = False
    try:
        sessions = [gpu.session() for _ in prompts]
        want = [[s.feed(p, all_logits=True) for s, p in zip(sessions, prompts)]]
        want += [[s.feed([t]) for s in sessions] for t in steps]
    finally:
        gpu.graphs = True
    pool = npllama.KVPool.for_model(gpu, tokens=3 * (2 * len(prompt) + 8))
    seqs = [pool.new_seq() for _ in prompts]
    got = [forward_batch(gpu, pool, seqs, prompts, all_logits=True)]
    got += [forward_batch(gpu, pool, seqs, [[t]] * 3) for t in steps]
    assert any(st.graph is not None for st in pool.steps.values()), "no batched step was captured"
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            np.testing.assert_array_equal(a, b)
