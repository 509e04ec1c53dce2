"""Structured output (llguidance) cost: the token mask per token for a vocabulary, and
constrained against unconstrained decode speed on a model. Never a pass/fail test.

    python bench/bench_structured.py [--model PATH] [--threads 2] [--tokens 48] [--rounds 3]
                                     [--mask-only] [--vocab PATH ...]

Mask cost: a JSON Schema constraint follows the tokens of a conforming JSON text; each step
times the llguidance mask (`Matcher.allowed`) and its application to float32 logits
(`Matcher.mask`), and the whole step (mask + consume), median over steps, for each --vocab
GGUF (default: the default model and Gemma 3 270M when cached). Speed: greedy decode of the
same chat prompt, unconstrained and with the schema, `--tokens` tokens each (the constrained
run's length decides; the unconstrained one is cut to it), best of `--rounds`, compiled
schema cached; tokens/s counts decode only (prefill excluded). `mask_share_of_step` is the
median mask step over the constrained decode step: the most that computing the mask while the
model computes the next logits could save.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from machine import print_cpu  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string"},
        "hobbies": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "hobbies", "member"],
    "additionalProperties": False,
}
SAMPLE = {"name": "Ada Lovelace", "age": 36, "city": "London",
          "hobbies": ["mathematics", "poetry", "analytical engines"], "member": True}
PROMPT = "Describe a famous person as a JSON object with name, age, city, hobbies and member."


class _Shape:  # what structured.constraint reads from a model: its tokenizer and n_vocab
    def __init__(self, path):
        from npllama.gguf.reader import GGUFFile
        from npllama.text.tokenizer import Tokenizer
        f = GGUFFile(path)
        self.tokenizer = Tokenizer.from_metadata(f.metadata)
        self.config = f.config


def mask_cost(path: str) -> dict:
    from npllama.generation.structured import constraint
    t0 = time.perf_counter()
    shape = _Shape(path)
    t1 = time.perf_counter()
    rule = constraint(shape, json_schema=SCHEMA)
    t2 = time.perf_counter()
    constraint(shape, json_schema=SCHEMA)
    t3 = time.perf_counter()
    text = json.dumps(SAMPLE, indent=2)
    ids = shape.tokenizer.encode(text, add_bos=False)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(shape.config.n_vocab).astype(np.float32)
    allowed_s, apply_s, step_s = [], [], []
    for _ in range(3):
        m = rule.matcher()
        for tid in ids:
            a = time.perf_counter()
            allowed = m.allowed()
            b = time.perf_counter()
            out = np.full(len(logits), -np.inf, dtype=np.float32)
            np.copyto(out, logits, where=allowed)
            c = time.perf_counter()
            m.consume(tid)
            d = time.perf_counter()
            allowed_s.append(b - a)
            apply_s.append(c - b)
            step_s.append(d - a)
    ms = lambda xs: round(1e3 * float(np.median(xs)), 4)
    return {"vocab": shape.config.n_vocab, "model": os.path.basename(path), "tokens": len(ids),
            "tokenizer_load_s": round(t1 - t0, 2), "first_compile_s": round(t2 - t1, 3),
            "cached_compile_ms": round(1e3 * (t3 - t2), 3), "mask_ms": ms(allowed_s), "apply_ms": ms(apply_s),
            "step_ms": ms(step_s), "step_p90_ms": round(1e3 * float(np.percentile(step_s, 90)), 4)}


def decode_speed(model_path: str, threads: int, tokens: int, rounds: int) -> dict:
    import npllama
    from npllama.generation.generate import generate_tokens
    from npllama.generation.sampling import GREEDY, make_sampler
    from npllama.generation.structured import constraint
    model = npllama.load(model_path, threads=threads)
    ids = model.tokenize(model.format_chat([{"role": "user", "content": PROMPT}]), special=True)
    rule = constraint(model, json_schema=SCHEMA)

    def run(matcher, n):
        s = model.session()
        gen = generate_tokens(s, ids, max_tokens=n, sampler=make_sampler(GREEDY), matcher=matcher,
                              stop_ids=set())
        first = next(gen)  # prefill and the first token
        t = time.perf_counter()
        count = 1
        for _ in gen:
            count += 1
        return count - 1, time.perf_counter() - t, first

    run(None, 4)  # compile / warm up
    n_con = tokens
    best = {}
    for _ in range(rounds):
        n, sec, _ = run(rule.matcher(), tokens)
        n_con = n + 1
        best["constrained"] = min(best.get("constrained", 1e9), sec / max(n, 1))
        n, sec, _ = run(None, n_con)
        best["free"] = min(best.get("free", 1e9), sec / max(n, 1))
    return {"model": os.path.basename(model_path), "threads": threads, "tokens": n_con,
            "free_tok_s": round(1 / best["free"], 2), "constrained_tok_s": round(1 / best["constrained"], 2),
            "ratio": round(best["free"] / best["constrained"], 3)}


def main() -> None:
    from npllama.gguf.hub import resolve_model
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="GGUF for the speed run (default: the default model)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mask-only", action="store_true", help="only the mask cost")
    ap.add_argument("--vocab", nargs="*", help="GGUFs whose vocabularies to time the mask for")
    args = ap.parse_args()
    print_cpu()
    model = args.model or resolve_model()
    vocabs = args.vocab
    if vocabs is None:
        gemma = os.path.expanduser("~/.cache/npllama/gemma-3-270m-q4_k_m.gguf")
        vocabs = [model] + ([gemma] if os.path.exists(gemma) else [])
    masks = [mask_cost(path) for path in vocabs]
    for m in masks:
        print(json.dumps({"mask": m}), flush=True)
    if not args.mask_only:
        d = decode_speed(model, args.threads, args.tokens, args.rounds)
        # what computing the mask during the next forward pass could save at most, per token
        d["mask_share_of_step"] = round(masks[0]["step_ms"] * d["constrained_tok_s"] / 1e3, 5) if masks else None
        print(json.dumps({"decode": d}), flush=True)


if __name__ == "__main__":
    main()
