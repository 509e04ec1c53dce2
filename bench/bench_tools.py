"""Tool calling on the default model (its own template: the generic JSON format).

    nice -n 19 .venv/bin/python bench/bench_tools.py [--threads 2] [--seeds 3]

Reports:
* the time per tool call: `model.chat(..., tool_choice="required", parallel_tool_calls=False)`,
  prompt and decoding included, median over the prompts (after one warm-up call);
* the grammar's cost per token: the same prompt decoded greedily for the same number of tokens
  with and without the tool grammar (tokens/s and their ratio), and the mask's own cost per
  token (computing, applying and advancing llguidance's mask along the constrained tokens);
* with tool_choice="auto", sampled (temperature 0.7) over prompts that do and do not call for a
  tool: the share of answers that are valid calls (known tool, arguments valid under its schema)
  or clean text (no markup), and how many were each. `--max-tokens` (default 512) is large enough
  that the answers end on their own; the count of answers cut by it is reported apart.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema
import numba
import numpy as np

import npllama
from npllama.generation import tools as T
from npllama.generation.structured import constraint

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers.",
     "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 80}},
                    "required": ["query"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "Add 17 and 25.", "Search the web for the tallest building.",
           "Is it raining in Tokyo right now?", "What is 3 plus 4?", "Find news about the Mars rover.",
           "Say hello.", "Write a haiku about autumn.", "What is the capital of Italy?",
           "Thank you, that is all.", "Tell me a joke.", "How are you today?"]


def user(text):
    return [{"role": "user", "content": text}]


def time_per_call(model) -> float:
    model.chat(user(PROMPTS[0]), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
               temperature=0, max_tokens=64)  # warm-up
    times = []
    for p in PROMPTS:
        t = time.perf_counter()
        m = model.chat(user(p), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                       temperature=0, max_tokens=64)
        times.append(time.perf_counter() - t)
        assert len(m["tool_calls"]) == 1, m
    return statistics.median(times)


def grammar_cost(model, n_tokens: int = 48) -> dict:
    plan = T.plan(model, user(PROMPTS[0]), TOOLS, "auto")
    ids = model.tokenize(plan.prompt, special=True)
    c = model.complete(ids, grammar=plan.grammar, temperature=0, max_tokens=n_tokens)
    n = len(c.tokens)
    free, bound = [], []
    for _ in range(3):
        t = time.perf_counter()
        model.complete(ids, grammar=plan.grammar, temperature=0, max_tokens=n)
        bound.append(time.perf_counter() - t)
        t = time.perf_counter()
        free_c = model.complete(ids, temperature=0, max_tokens=n, logit_bias={i: -100.0 for i in model.tokenizer.eot_ids})
        free.append(time.perf_counter() - t)
    assert len(free_c.tokens) == n
    logits = np.zeros(model.config.n_vocab, np.float32)
    matcher_times = []
    for _ in range(5):
        m = constraint(model, grammar=plan.grammar).matcher()
        t = time.perf_counter()
        for tok in c.tokens:
            m.mask(logits)
            m.consume(tok.id)
        matcher_times.append((time.perf_counter() - t) / n)
    return {"tokens": n, "free_tps": n / min(free), "grammar_tps": n / min(bound),
            "ratio": min(free) / min(bound), "mask_ms": 1000 * statistics.median(matcher_times)}


def auto_share(model, seeds: int, max_tokens: int) -> dict:
    counts = {"calls": 0, "text": 0, "bad": 0, "cut": 0}
    for p in PROMPTS:
        for seed in range(seeds):
            m = model.chat(user(p), tools=TOOLS, temperature=0.7, seed=seed, max_tokens=max_tokens)
            calls = m.get("tool_calls", [])
            counts["cut"] += m["finish_reason"] == "length"
            ok = m["finish_reason"] in ("stop", "tool_calls")
            try:
                for call in calls:
                    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            except (ValueError, KeyError, jsonschema.ValidationError):
                ok = False
            if calls and ok:
                counts["calls"] += 1
            elif not calls and ok and "tool_calls" not in (m["content"] or "") and m["content"]:
                counts["text"] += 1
            else:
                counts["bad"] += 1
    total = counts["calls"] + counts["text"] + counts["bad"]
    return {**counts, "total": total, "share": (counts["calls"] + counts["text"]) / total}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=512)
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    model = npllama.load()
    print(f"time per tool call (required, one call, median of {len(PROMPTS)}): {time_per_call(model):.3f} s")
    g = grammar_cost(model)
    print(f"grammar cost ({g['tokens']} tokens, greedy): {g['grammar_tps']:.1f} tok/s with the tool grammar, "
          f"{g['free_tps']:.1f} without ({g['ratio']:.3f}x); mask {g['mask_ms']:.3f} ms per token")
    a = auto_share(model, args.seeds, args.max_tokens)
    print(f"auto, temperature 0.7, max_tokens {args.max_tokens}, {a['total']} answers: {a['share']:.1%} valid calls "
          f"or clean text ({a['calls']} calls, {a['text']} text, {a['bad']} neither; {a['cut']} cut by max_tokens)")


if __name__ == "__main__":
    main()
