"""Gemma 3 270M Q4_K_M, the real model from PyPI, through every public entry point: the
sliding window of its layers in the prefill, decode and batched paths, the CLI on a model
without a chat template, generate_batch, score and embed. (Agreement with HF float32 is in
test_fidelity_gemma3.py.)"""
import subprocess
import sys

import numpy as np
import pytest

import npllama

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def gemma(gemma3_path):
    return npllama.Model(gemma3_path)


def _text(model, n_tokens):
    """Token ids of a text at least n_tokens long (plain English, repeated with numbers)."""
    parts, ids = [], []
    i = 0
    while len(ids) < n_tokens:
        parts.append(f"Paragraph {i}: the river ran past the mill, and the miller counted {i * 7} sacks of flour "
                     f"before the evening bell rang over the valley.")
        i += 1
        ids = model.tokenize(" ".join(parts))
    return ids[:n_tokens]


def test_config_reads_the_gemma3_block(gemma):
    c = gemma.config
    assert (c.arch, c.n_layer, c.n_embd, c.head_dim, c.n_head, c.n_head_kv) == ("gemma3", 18, 640, 256, 4, 1)
    assert c.act == "gelu_tanh" and c.qk_norm and c.post_norms and c.rope_neox
    assert c.embd_scale == pytest.approx(640 ** 0.5)
    # five sliding layers (window 512, RoPE base 10000), then a global one (base 1e6)
    assert c.layer_window == tuple(0 if i % 6 == 5 else 512 for i in range(18))
    assert [c.ropes[t].base for t in c.layer_rope] == [1e6 if i % 6 == 5 else 1e4 for i in range(18)]
    assert c.softcap == 0.0 and c.tied_output


def test_past_the_window_decode_and_batch_match_prefill(gemma):
    """600 tokens (past the 512-token window): the last tokens' logits are the same whether the
    prompt runs in one prefill, its last 8 tokens are decoded one at a time by the fused step,
    or the batched path runs it beside a short sequence."""
    ids = _text(gemma, 600)
    want = gemma.session().feed(ids, all_logits=True)[-8:]
    s = gemma.session()
    s.feed(ids[:-8])
    got = np.stack([s.feed([t]) for t in ids[-8:]])
    span = float(want.max() - want.min())
    assert np.abs(got - want).max() <= 1e-4 * span
    assert (got.argmax(1) == want.argmax(1)).all()

    pool = npllama.KVPool.for_model(gemma, tokens=1024)
    a, b = pool.new_seq(), pool.new_seq()
    out = npllama.forward_batch(gemma, pool, [a, b], [ids, ids[:5]], all_logits=True)
    assert np.abs(out[0][-8:] - want).max() <= 1e-4 * span
    short = gemma.session().feed(ids[:5], all_logits=True)
    assert np.abs(out[1] - short).max() <= 1e-4 * float(short.max() - short.min())


def _npllama(*args):
    return subprocess.run([sys.executable, "-m", "npllama", *map(str, args)], capture_output=True, text=True,
                          timeout=600)


def test_cli_run_sends_the_prompt_raw_and_chat_refuses(gemma3_path):
    r = _npllama("run", "-m", gemma3_path, "The capital of France is", "-n", "6", "--temp", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    assert r.stderr.count("no chat template") == 1
    r = _npllama("chat", "-m", gemma3_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "no chat template" in r.stderr


def test_api_on_the_real_model(gemma):
    with pytest.raises(ValueError, match="no chat template"):
        gemma.chat([{"role": "user", "content": "Hi"}])
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,"]
    batch = gemma.generate_batch(prompts, max_tokens=8, temperature=0)
    assert batch == [gemma.generate(p, max_tokens=8, temperature=0) for p in prompts]
    assert all(batch)

    ids, logprobs = gemma.score("The quick brown fox jumps over the lazy dog")
    logits = gemma.session().feed([gemma.tokenizer.bos_id] + ids[:-1], all_logits=True).astype(np.float64)
    m = logits.max(1, keepdims=True)
    lsm = logits - m - np.log(np.exp(logits - m).sum(1, keepdims=True))
    np.testing.assert_allclose(logprobs, lsm[np.arange(len(ids)), ids], atol=1e-4)

    e = gemma.embed(["a cat", "a kitten", "the stock market"])
    assert e.shape == (3, 640)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)
    hidden = gemma.forward(gemma.tokenize("a cat"), 0, gemma.new_cache(), output="hidden").astype(np.float64)
    v = hidden.mean(0)
    np.testing.assert_allclose(e[0], v / np.linalg.norm(v), atol=1e-5)
