"""A whole tiny model on the CUDA backend in Numba's simulator against the CPU engine: logits
equal to float32 rounding for a prompt and decode steps, with fork, truncate and reset, and
the text API on top; its batched pass over a device pool against its own sessions, bit for bit
(NUMBA_ENABLE_CUDASIM=1; see test_sim_kernels.py)."""
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import npllama
from npllama.backends.cuda.model import CudaModel, DeviceKVCache, DeviceKVPool
from npllama.engine.batch import forward_batch
from tinygguf import write_tiny_llama


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny model in Q4_1 (every kernel kind is checked by test_sim_kernels.py) on both."""
    path = write_tiny_llama(tmp_path_factory.mktemp("cuda") / "tiny.gguf", qtype=QT.Q4_1, n_ff=64)
    return npllama.load(path), npllama.load(path, device="cuda")


def close(a, b):
    np.testing.assert_allclose(b, a, rtol=1e-4, atol=2e-5 * max(1.0, float(np.abs(a).max())))


def test_session_matches_cpu(models):
    cpu, gpu = models
    assert isinstance(gpu, CudaModel) and gpu.device == "cuda" and cpu.device == "cpu"
    s1, s2 = cpu.session(), gpu.session()
    assert isinstance(s2.cache, DeviceKVCache) and s2.cache.capacity == 0
    close(s1.feed([5, 70, 80, 90, 33], all_logits=True), s2.feed([5, 70, 80, 90, 33], all_logits=True))
    close(s1.feed([7]), s2.feed([7]))
    f1, f2 = s1.fork(), s2.fork()
    assert not np.shares_memory(f2.cache.buffers(), s2.cache.buffers())
    s1.truncate(3), s2.truncate(3)
    close(s1.feed([11]), s2.feed([11]))  # after truncate: position 3 again
    close(f1.feed([12]), f2.feed([12]))  # the fork kept all 6 positions
    assert (s2.pos, f2.pos) == (4, 7)
    s2.reset()
    s1.reset()
    close(s1.feed([9]), s2.feed([9]))
    on_device = gpu.forward([3, 4], s2.pos, s2.cache, all_logits=True, device_arrays=True)
    assert isinstance(on_device, gpu.xp.ndarray) and on_device.shape == (2, gpu.config.n_vocab)
    close(cpu.forward([3, 4], s1.pos, s1.cache, all_logits=True), on_device)


def test_text_api(models, monkeypatch):
    cpu, gpu = models
    assert gpu.generate("hello", max_tokens=2, temperature=0) == cpu.generate("hello", max_tokens=2, temperature=0)
    close(cpu.embed("hi"), gpu.embed("hi"))
    monkeypatch.setattr(gpu, "fuse", False)  # each of q, k, v, gate and up its own mat-vec, the GLU its own kernel
    close(cpu.embed("hi"), gpu.embed("hi"))
    with pytest.raises(ValueError, match="own cache"):
        gpu.forward([1], 0, cpu.new_cache())


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_architecture_fixture_matches_cpu(arch):
    """Converted tiny HF models (tests/fixtures/arch): Gemma 3's QK norms, post-norms, GeGLU,
    sliding windows and embedding scale, Qwen 3's QK norms, on the device as on the CPU."""
    path = Path(__file__).parent.parent / "fixtures" / "arch" / f"{arch}.gguf"
    cpu, gpu = npllama.load(path), npllama.load(path, device="cuda")
    s1, s2 = cpu.session(), gpu.session()
    ids = [1, 5, 9, 13, 17, 21]
    close(s1.feed(ids, all_logits=True), s2.feed(ids, all_logits=True))
    close(s1.feed([4]), s2.feed([4]))


def test_batched_pass_equals_sessions(models, monkeypatch):
    """`forward_batch` on the device, over a pool in device memory: each sequence gets a device
    session's logits bit for bit, for prompts of different lengths in one pass (pages of 3,
    so a prompt spans two; chunks of 3 tokens, so the second chunk holds both sequences and
    attends to keys the first wrote), a decode step of both (the fixed-shape step a GPU
    captures), and a fork that shares its pages and then writes into a shared one (copy on
    write) beside its source."""
    from npllama.backends.cuda import model as device_model
    monkeypatch.setattr(device_model, "CHUNK_TOKENS", 3)
    _, gpu = models
    pool = npllama.KVPool.for_model(gpu, tokens=32, page_size=3)
    assert isinstance(pool, DeviceKVPool) and isinstance(pool.buffer(0), gpu.xp.ndarray)
    prompts = [[5, 70, 80, 90], [7]]
    seqs, sessions = [pool.new_seq() for _ in prompts], [gpu.session() for _ in prompts]
    for got, s, p in zip(forward_batch(gpu, pool, seqs, prompts, all_logits=True), sessions, prompts):
        np.testing.assert_array_equal(got, s.feed(p, all_logits=True))
    assert len(gpu.fused) == 2 * gpu.config.n_layer  # q/k/v and gate/up: one mat-vec each
    for got, s, t in zip(forward_batch(gpu, pool, seqs, [[3], [4]]), sessions, [3, 4]):
        np.testing.assert_array_equal(got, s.feed([t]))
    assert len(pool.steps) == 1
    fork, twin = pool.fork(seqs[0]), sessions[0].fork()
    shared = fork.pages[1]
    got = forward_batch(gpu, pool, [fork, seqs[0]], [[8, 2], [9]])
    np.testing.assert_array_equal(got[0], twin.feed([8, 2]))
    np.testing.assert_array_equal(got[1], sessions[0].feed([9]))
    assert (fork.length, seqs[0].length) == (7, 6) and fork.pages[1] != shared == seqs[0].pages[1]


def test_generate_batch_steps_prompts_together(models, monkeypatch):
    """`generate_batch` on the device steps its prompts together (continuous batching over a
    device pool: two steps for two prompts of two tokens); greedy, each result is that prompt's
    alone (the CPU engine's, which a device session's logits equal to float rounding)."""
    from npllama.generation import scheduler
    cpu, gpu = models
    stats, many = {}, scheduler.generate_many
    monkeypatch.setattr(scheduler, "generate_many", lambda *a, **o: many(*a, **o, stats=stats))
    prompts = ["hello", "a b c"]
    assert gpu.generate_batch(prompts, max_tokens=2, temperature=0) == [
        cpu.generate(p, max_tokens=2, temperature=0) for p in prompts]
    assert stats["steps"] == 2


def test_pool_on_the_wrong_device(models):
    cpu, gpu = models
    with pytest.raises(ValueError, match="KVPool.for_model"):
        forward_batch(gpu, npllama.KVPool.for_model(cpu, tokens=8), [None], [[1]])
    host_pool = npllama.KVPool.for_model(cpu, tokens=8)
    with pytest.raises(ValueError, match="on device 'cuda' and the model on 'cpu'"):
        forward_batch(cpu, npllama.KVPool.for_model(gpu, tokens=8), [host_pool.new_seq()], [[1]])
