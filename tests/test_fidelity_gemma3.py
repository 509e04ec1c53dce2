"""Fidelity of Gemma 3 270M Q4_K_M (the real model from PyPI) against HF transformers in float32
on the same GGUF, and against llama.cpp's agreement with it.

The fixtures come from bench/make_gemma3_fixtures.py: three texts of 1,100-1,600 tokens (past
the 512-token sliding window of the local layers) with HF's top-10 logits, log-sum-exp and
next-token logprobs at every position and llama.cpp's teacher-forced top-1; and greedy
continuations of five prompts (two of them 640 tokens long) from HF and from llama.cpp.
npllama's exact mode is checked through the prefill path and through the fused single-token
decode step; the int8-activation mode through the decode step.
"""
import json
from pathlib import Path

import numpy as np
import pytest

import npllama

pytestmark = [pytest.mark.model, pytest.mark.slow]
FIX = Path(__file__).parent / "fixtures"
DOC = json.loads((FIX / "fidelity_gemma3.json").read_text())
TEXTS = sorted(DOC["texts"])
DECODE_FROM, DECODE_N = 448, 160  # decode-path positions 448..607: across the 512 window


@pytest.fixture(scope="module")
def gemma3(gemma3_path):
    return npllama.Model(gemma3_path)


@pytest.fixture(scope="module")
def fix():
    return np.load(FIX / "fidelity_gemma3.npz")


def _logsoftmax_at(logits, ids):
    """log_softmax(logits)[i, ids[i]] in float64, a few rows at a time (a 262k vocabulary's
    float64 copies of a whole text's logits would take gigabytes)."""
    out = np.empty(len(ids))
    for r0 in range(0, len(ids), 64):
        lg = logits[r0:r0 + 64].astype(np.float64)
        m = lg.max(-1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(lg - m).sum(-1))
        out[r0:r0 + 64] = lg[np.arange(len(lg)), ids[r0:r0 + 64]] - lse
    return out


def _agree(a, b):
    """How many leading tokens of `a` equal `b`'s."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_tokenizer_gives_hfs_ids(gemma3, fix):
    """The fixtures' ids are HF's tokenization (BOS first); npllama's must be the same."""
    for text in TEXTS:
        assert gemma3.tokenize(DOC["texts"][text]) == fix[f"{text}/ids"].tolist(), text
    for key, g in DOC["greedy"].items():
        if key.startswith("short"):
            assert gemma3.tokenize(DOC["prompts"][int(key[5:])]) == g["prompt"], key


@pytest.mark.parametrize("text", TEXTS)
def test_prefill_top1_and_perplexity(gemma3, fix, text):
    """Teacher-forced through the prefill path over a whole text: top-1 agreement with HF float32
    >= 99% (llama.cpp's is printed beside it), perplexity within 1% of HF's."""
    ids = fix[f"{text}/ids"]
    assert len(ids) > 1000
    top = fix[f"{text}/top_ids"]
    s = gemma3.session()
    agree, worst, nll = 0, 0.0, []
    for c0 in range(0, len(ids), 256):  # the session's prefill in pieces: 256 rows of logits at a time
        logits = s.feed(ids[c0:c0 + 256], all_logits=True)
        agree += int((logits.argmax(-1) == top[c0:c0 + 256, 0]).sum())
        worst = max(worst, float(np.abs(np.take_along_axis(logits, top[c0:c0 + 256], 1)
                                        - fix[f"{text}/top_logits"][c0:c0 + 256]).max()))
        n = min(len(logits), len(ids) - 1 - c0)  # the last position has no next token
        nll.append(-_logsoftmax_at(logits[:n], ids[c0 + 1:c0 + 1 + n]))
    cpp = int((fix[f"{text}/llama_cpp_top1"] == top[:, 0]).sum())
    ppl = np.exp(np.concatenate(nll).mean())
    ref_ppl = DOC["hf_perplexity"][text]
    print(f"\n{text}: {len(ids)} tokens, top-1 {agree / len(ids):.2%} (llama.cpp {cpp / len(ids):.2%}), "
          f"perplexity {ppl:.4f} vs HF {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.3%}), "
          f"max |logit diff| on HF's top-10 {worst:.3f}")
    assert agree / len(ids) >= 0.99
    assert abs(ppl / ref_ppl - 1) <= 0.01


def _decode_top1(model, ids, top1):
    """Feed ids[:DECODE_FROM] by prefill, then the next DECODE_N one at a time through the decode
    step: (agreeing positions, decoded positions, negative log-likelihoods of the next tokens)."""
    s = model.session()
    s.feed(ids[:DECODE_FROM])
    end = min(len(ids) - 1, DECODE_FROM + DECODE_N)
    steps = [s.feed([int(t)]) for t in ids[DECODE_FROM:end]]
    logits = np.stack(steps)
    agree = int((logits.argmax(-1) == top1[DECODE_FROM:end]).sum())
    return agree, end - DECODE_FROM, -_logsoftmax_at(logits, ids[DECODE_FROM + 1:end + 1])


@pytest.mark.parametrize("text", TEXTS)
def test_decode_step_top1_and_perplexity(gemma3, fix, text):
    """Teacher-forced through the fused single-token decode step, across the 512 window:
    top-1 agreement with HF float32 >= 99% and perplexity within 1% of HF's on those positions."""
    ids = fix[f"{text}/ids"]
    agree, n, nll = _decode_top1(gemma3, ids, fix[f"{text}/top_ids"][:, 0])
    ppl = np.exp(nll.mean())
    ref_ppl = np.exp(-fix[f"{text}/target_logprob"][DECODE_FROM:DECODE_FROM + n].astype(np.float64).mean())
    print(f"\n{text}, decode step at positions {DECODE_FROM}..{DECODE_FROM + n - 1}: top-1 {agree}/{n} = "
          f"{agree / n:.2%}; perplexity {ppl:.4f} vs HF {ref_ppl:.4f} ({ppl / ref_ppl - 1:+.3%})")
    assert n == DECODE_N
    assert agree / n >= 0.99
    assert abs(ppl / ref_ppl - 1) <= 0.01


@pytest.mark.parametrize("text", TEXTS)
def test_int8_decode_top1(gemma3_path, fix, text):
    """The opt-in int8-activation mode through the decode step: its top-1 agreement with HF float32
    is printed, with a loose floor (llama.cpp, which also quantizes activations, agrees with HF at
    94-95% of these texts' positions; its top-1 is in the fixture)."""
    ids = fix[f"{text}/ids"]
    agree, n, _ = _decode_top1(npllama.Model(gemma3_path, activations="int8"), ids, fix[f"{text}/top_ids"][:, 0])
    print(f"\nint8 activations, {text}, decode step at positions {DECODE_FROM}..{DECODE_FROM + n - 1}: "
          f"top-1 {agree}/{n} = {agree / n:.2%}")
    assert agree / n >= 0.90


@pytest.mark.parametrize("text", TEXTS)
def test_int8_prefill_top1(gemma3_path, fix, text):
    """The int8-activation mode through the prefill path (the panel products: Q4_K, Q6_K, Q5_0,
    Q8_0 weights), teacher-forced over a whole text: top-1 agreement with HF float32, with the
    decode step's floor."""
    ids = fix[f"{text}/ids"]
    logits = npllama.Model(gemma3_path, activations="int8").session().feed(ids, all_logits=True)
    agree = int((logits.argmax(-1) == fix[f"{text}/top_ids"][:, 0]).sum())
    print(f"\nint8 activations, {text}, prefill: top-1 {agree}/{len(ids)} = {agree / len(ids):.2%}")
    assert agree / len(ids) >= 0.90


def test_int8_generate_batch_equals_each_prompt_alone(gemma3_path):
    """int8 activations on a K-quant mix (every product weight has panels, Q6_K's included):
    generate_batch's packed passes give each prompt the tokens it gives alone through a
    session (prefill, then the fused decode step), prompts past the sliding window included."""
    m = npllama.Model(gemma3_path, activations="int8")
    prompts = [g["prompt"] for g in DOC["greedy"].values()]
    alone = [m.generate(p, temperature=0, max_tokens=8) for p in prompts]
    assert m.generate_batch(prompts, temperature=0, max_tokens=8, max_batch=3) == alone


def _greedy(model, prompt, n):
    """n greedy tokens after `prompt`, each new token through the fused decode step (the
    prefill path's agreement is the teacher-forced test's)."""
    s = model.session()
    logits = s.feed(prompt)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = s.feed(out[-1:])
    return out


def test_greedy_follows_hf_as_long_as_llama_cpp(gemma3):
    """Greedy continuations (96 tokens; two prompts are 640 tokens long, past the window): in total
    npllama follows HF float32's for at least as many tokens as llama.cpp does."""
    ours_total = cpp_total = 0
    for key, g in DOC["greedy"].items():
        ours = _greedy(gemma3, g["prompt"], len(g["hf"]))
        a, c = _agree(ours, g["hf"]), _agree(g["llama_cpp"], g["hf"])
        print(f"\n{key} ({len(g['prompt'])}-token prompt): npllama follows HF for {a} tokens, "
              f"llama.cpp for {c} (of {len(g['hf'])})")
        ours_total, cpp_total = ours_total + a, cpp_total + c
    print(f"npllama follows HF for {ours_total} tokens in all, llama.cpp for {cpp_total}")
    assert ours_total >= cpp_total
