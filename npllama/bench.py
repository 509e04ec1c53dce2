"""The figures `npllama bench` prints: first-call time, prefill and decode tokens/s, measured
through the public Session API on fixed token ids (greedy decode)."""
from __future__ import annotations

import time

import numpy as np


def run_bench(model, *, prompt_tokens: int = 128, gen_tokens: int = 64, repeats: int = 3, ids=None) -> dict:
    """Best-of-`repeats` prefill and decode speed; the first call (compile or cache load) apart.
    The prompt is `ids`, or `prompt_tokens` fixed pseudo-random ids."""
    if prompt_tokens < 1 or gen_tokens < 1 or repeats < 1:
        raise ValueError("prompt_tokens, gen_tokens and repeats must be positive")
    if ids is None:
        ids = np.random.default_rng(0).integers(100, model.config.n_vocab - 100, prompt_tokens)
    prompt_tokens = len(ids)
    t0 = time.perf_counter()
    warm = model.session()
    warm.feed(ids[:2])
    warm.feed(ids[2:3])
    first = time.perf_counter() - t0
    prefill = decode = 0.0
    for _ in range(repeats):
        s = model.session()
        t0 = time.perf_counter()
        logits = s.feed(ids)
        t1 = time.perf_counter()
        for _ in range(gen_tokens):
            logits = s.feed([int(np.argmax(logits))])
        t2 = time.perf_counter()
        prefill = max(prefill, prompt_tokens / (t1 - t0))
        decode = max(decode, gen_tokens / (t2 - t1))
    return {"model": str(model.path), "threads": model.threads, "first_call_s": first,
            "prompt_tokens": prompt_tokens, "gen_tokens": gen_tokens,
            "prefill_tok_s": prefill, "decode_tok_s": decode}
