"""The CUDA backend on a real GPU (marked `gpu`; bench/gpu_check.sh runs them, and they skip
without a device): the default model against the CPU engine, and the kernels on the default
model's shapes against the CPU kernels. Never run on these CI machines, which have no GPU."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu


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


@pytest.fixture(scope="module")
def models(cupy, default_model_path):
    import npllama
    return npllama.load(default_model_path), npllama.load(default_model_path, device="cuda")


def test_default_model_matches_cpu(models):
    cpu, gpu = models
    ids = cpu.tokenize("The capital of France is")
    s1, s2 = cpu.session(), gpu.session()
    a, b = s1.feed(ids, all_logits=True), s2.feed(ids, all_logits=True)
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * np.abs(a).max())
    for _ in range(8):
        tok = int(np.argmax(a[-1] if a.ndim == 2 else a))
        a, b = s1.feed([tok]), s2.feed([tok])
        np.testing.assert_allclose(b, a, rtol=1e-3, atol=1e-3 * np.abs(a).max())
        assert int(np.argmax(a)) == int(np.argmax(b))


def test_matvec_on_the_models_weights(models, cupy):
    from npllama.backends.cuda import kernels as K
    cpu, gpu = models
    x = np.random.default_rng(0).standard_normal(cpu.config.n_embd).astype(np.float32)
    for w in (cpu.layers[0].wq, cpu.layers[0].w_gate, cpu.output):
        d = gpu.device_weights[w.name]
        out = K.matvec(d.kind, d.scales, d.quants, cupy.asarray(x), cupy.empty(d.rows, np.float32), d.rows, d.cols)
        np.testing.assert_allclose(out.get(), w @ x, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kv_len", [1, 63, 64, 4000])
def test_attention_against_the_cpu_kernel(cupy, kv_len):
    from npllama.backends.cuda import kernels as K
    from npllama.kernels.attention import attend
    rng = np.random.default_rng(kv_len)
    kv = rng.standard_normal((kv_len, 3, 2, 64)).astype(np.float16)
    q = rng.standard_normal((1, 9, 64)).astype(np.float32)
    out = K.attention(cupy.asarray(q), cupy.asarray(kv), kv_len, kv_len - 1, 0, 0.125,
                      cupy.empty((1, 9, 64), np.float32), cupy)
    np.testing.assert_allclose(out.get(), attend(q, kv, kv_len, scale=0.125), rtol=1e-4, atol=1e-5)
