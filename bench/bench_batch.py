"""Batched generation (continuous batching over the paged KV pool) against running the same
prompts one by one, in npllama and in llama.cpp (llama-cpp-python); plus KV memory per cached
token, float16-KV fidelity and the saving from shared prompt prefixes. Never a pass/fail test.

    python bench/bench_batch.py [--n 16,64] [--gen 64] [--max-batch 16] [--threads 2]
                                [--engines npllama,llama.cpp,llama.cpp-batched] [--model PATH]
                                [--activations f32|int8] [--rounds R]

Throughput is generated tokens per second of wall time over the whole set (prefill included);
llama.cpp runs each prompt greedily for the number of tokens npllama generated for it, one by one
(`llama.cpp`) and in its own batched decoding (`llama.cpp-batched`: one context, unified KV cache,
flash attention, the common prompt prefix decoded once and copied between sequences). With
--rounds R every engine runs once per round, in turn; the table gives medians, and the ratios
are also given per round. The reference runs in its own python (the venv of
../shared/tools/setup-refs.sh, or $NPLLAMA_REF_PY) and is skipped with a note when llama_cpp
is not installed there.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_compare import ref_python  # noqa: E402
from machine import print_cpu  # noqa: E402

# Run inside the references' python: argv = gguf path, json file of {"ids": [[...]], "gen": [...]}, threads;
# print {"seconds": ..., "tokens": [[...]]}, each prompt greedy for its number of tokens in "gen".
REF_SCRIPT = r"""
import json, sys, time
import numpy as np
import llama_cpp
from llama_cpp import Llama
path, spec, threads = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
ids, gens = spec["ids"], spec["gen"]
llm = Llama(model_path=path, n_ctx=max(len(i) + g for i, g in zip(ids, gens)) + 8, n_batch=512,
            n_threads=threads, n_threads_batch=threads, verbose=False)
n_vocab = llm.n_vocab()
def pick():  # Llama.eval no longer fills llm.scores; its batch asks for the last token's logits
    return int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).argmax())
llm.reset(); llm.eval(ids[0][:4])  # warm up
t0 = time.perf_counter()
out = []
for p, g in zip(ids, gens):
    llm.reset()
    llm.eval(p)
    toks = [pick()]
    while len(toks) < g:
        llm.eval(toks[-1:])
        toks.append(pick())
    out.append(toks)
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": out}))
"""

# llama.cpp's own batched decoding, as its `batched` and `parallel` examples do it: one context with a
# unified KV cache and flash attention, the prompts' common token prefix decoded once on sequence 0
# and copied to the other sequences, the remainders in one llama_batch, then one llama_decode per
# step for all live sequences. Same argv and output as REF_SCRIPT, plus "prefix": the prefix's length.
BATCHED_REF_SCRIPT = r"""
import json, os, sys, time
import numpy as np
import llama_cpp as L
path, spec, threads = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3])
ids, gens = spec["ids"], spec["gen"]
n = len(ids)
c = min(len(os.path.commonprefix(ids)), min(map(len, ids)) - 1)  # each sequence keeps >= 1 own token
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
cp = L.llama_context_default_params()
cp.n_ctx = c + sum(len(i) - c + g for i, g in zip(ids, gens)) + 8
cp.n_batch = max(512, c, sum(len(i) - c for i in ids))
cp.n_seq_max = n
cp.n_threads = cp.n_threads_batch = threads
cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED
cp.kv_unified = True
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(cp.n_batch, 0, 1)

def decode(entries):  # (token, position, sequence, wants logits); -> argmax per entry that wants them
    for k, (t, p, s, o) in enumerate(entries):
        batch.token[k], batch.pos[k], batch.n_seq_id[k], batch.logits[k] = t, p, 1, o
        batch.seq_id[k][0] = s
    batch.n_tokens = len(entries)
    if L.llama_decode(ctx, batch) != 0:
        raise SystemExit(f"llama_decode failed on a batch of {len(entries)} tokens")
    return [int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, k), shape=(n_vocab,)).argmax())
            for k, e in enumerate(entries) if e[3]]

def run(ids, gens):
    if c:
        decode([(t, j, 0, False) for j, t in enumerate(ids[0][:c])])
        for s in range(1, n):
            L.llama_memory_seq_cp(mem, 0, s, -1, -1)
    firsts = decode([(t, j, s, j == len(p) - 1) for s, p in enumerate(ids) for j, t in enumerate(p) if j >= c])
    out = [[t] for t in firsts]
    live = [s for s in range(n) if gens[s] > 1]
    while live:
        for s, t in zip(live, decode([(out[s][-1], len(ids[s]) + len(out[s]) - 1, s, True) for s in live])):
            out[s].append(t)
        live = [s for s in live if len(out[s]) < gens[s]]
    return out

run([p[:c + 2] for p in ids], [2] * n)  # warm up
L.llama_memory_clear(mem, True)
t0 = time.perf_counter()
out = run(ids, gens)
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": out, "prefix": c}))
"""

SUBJECTS = ["the ocean", "volcanoes", "honeybees", "the Roman Empire", "black holes", "photosynthesis",
            "jazz music", "the internet", "mountain climbing", "ancient Egypt", "electric cars", "chess",
            "the moon", "rain forests", "coffee", "the printing press"]
TASKS = ["Write a short poem about {}.", "Explain {} to a ten-year-old.", "List three surprising facts about {}.",
         "Write the opening paragraph of an adventure story about {}."]
CONTEXT = ("Please answer carefully, in plain language, and keep the answer focused: the reader is busy, "
           "curious and new to the topic, and will read the answer on a phone during a short break. ")
SYSTEM = ("You are a patient and precise assistant for a science museum. You answer visitors' questions "
          "in clear, friendly English, you avoid jargon, you never invent facts, and when you are unsure "
          "you say so. Keep answers short: two or three sentences at most, suitable for a display panel "
          "next to an exhibit. Do not use lists or headings. Prefer concrete examples over abstractions.")


def make_prompts(model, n: int) -> list[str]:
    """n varied chat prompts of different lengths (deterministic)."""
    out = []
    for i in range(n):
        subject, task = SUBJECTS[i % len(SUBJECTS)], TASKS[(i // len(SUBJECTS)) % len(TASKS)]
        text = task.format(subject)
        if i % 3 == 1:
            text = CONTEXT + text
        elif i % 3 == 2:
            text = text + " " + CONTEXT * 2
        out.append(model.format_chat([{"role": "user", "content": text}]))
    return out


def run_llama_cpp(py, script, path, ids, gens, threads):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"ids": ids, "gen": gens}, f)
    try:
        r = subprocess.run([py, "-c", script, str(path), f.name, str(threads)], capture_output=True, text=True)
    finally:
        os.unlink(f.name)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def bench_throughput(model, n, gen, max_batch, engines, py, threads, rounds=1):
    from npllama.generation.scheduler import complete_many
    prompts = make_prompts(model, n)
    ids = [model.tokenize(p, special=True) for p in prompts]
    n_prompt = sum(map(len, ids))
    # warm up (compilation or cache load) outside the timings
    complete_many(model, prompts[:2], temperature=0, max_tokens=2)
    model.complete(prompts[0], temperature=0, max_tokens=2)

    refs = [(e, script, name) for e, script, name in
            (("llama.cpp", REF_SCRIPT, "llama.cpp sequential"),
             ("llama.cpp-batched", BATCHED_REF_SCRIPT, "llama.cpp batched (unified KV)")) if e in engines]
    if refs and py is None:
        print("llama.cpp: skipped (no references' python; run ../shared/tools/setup-refs.sh)")
        refs = []
    times = {}  # engine name -> seconds in each round (the engines alternate within a round)
    ref = {}  # engine -> {"seconds": ..., "tokens": ...} of the last round
    for _ in range(rounds):
        t0 = time.perf_counter()
        alone = [model.complete(p, temperature=0, max_tokens=gen) for p in prompts]
        times.setdefault("npllama sequential (generate)", []).append(time.perf_counter() - t0)
        stats = {}
        t0 = time.perf_counter()
        together = complete_many(model, prompts, temperature=0, max_tokens=gen, max_batch=max_batch, stats=stats)
        times.setdefault("npllama generate_many", []).append(time.perf_counter() - t0)
        for engine, script, name in list(refs):
            res, err = run_llama_cpp(py, script, model.path, ids, [max(1, len(c.tokens)) for c in alone], threads)
            if res is None:
                print(f"{engine}: skipped ({err})")
                refs.remove((engine, script, name))
                times.pop(name, None)
                continue
            times.setdefault(name, []).append(res["seconds"])
            ref[engine] = res
    n_gen = sum(len(c.tokens) for c in alone)
    same = sum([t.id for t in a.tokens] == [t.id for t in b.tokens] for a, b in zip(alone, together))
    seq, batch = times["npllama sequential (generate)"], times["npllama generate_many"]

    print(f"\n{n} prompts ({n_prompt} prompt tokens, {min(map(len, ids))}..{max(map(len, ids))} each), "
          f"greedy, up to {gen} new tokens each ({n_gen} generated), max_batch {max_batch}"
          + (f"; median of {rounds} rounds, the engines alternating" if rounds > 1 else ""))
    print(f"{'engine':<34}{'seconds':>9}{'gen tok/s':>11}{'all tok/s':>11}{'vs seq':>9}")
    t_seq = float(np.median(seq))
    for name, secs in times.items():
        sec = float(np.median(secs))
        print(f"{name:<34}{sec:>9.2f}{n_gen / sec:>11.1f}{(n_gen + n_prompt) / sec:>11.1f}{t_seq / sec:>8.2f}x")
    per_round = [a / b for a, b in zip(seq, batch)]
    if rounds > 1:
        print("generate_many vs sequential per round: " + ", ".join(f"{x:.2f}x" for x in per_round)
              + f" (median {np.median(per_round):.2f}x)")
    print(f"generate_many: {stats['steps']} forward passes; token-identical to sequential for {same}/{n} prompts")
    if "llama.cpp-batched" in ref:
        b = ref["llama.cpp-batched"]
        vs = [r / t for r, t in zip(times["llama.cpp batched (unified KV)"], batch)]
        print(f"generate_many vs llama.cpp batched ({b['prefix']}-token common prefix decoded once): "
              + ", ".join(f"{x:.2f}x" for x in vs) + f" gen tok/s (median {np.median(vs):.2f}x; the target is >= 1.5x)")
        if "llama.cpp" in ref:
            alike = sum(x == y for x, y in zip(ref["llama.cpp"]["tokens"], b["tokens"]))
            print(f"llama.cpp batched: token-identical to llama.cpp sequential for {alike}/{n} prompts "
                  f"(they may differ: a unified batch changes llama.cpp's logits)")
    return float(np.median(per_round))


def bench_memory_and_f16(model, text_tokens: int = 160):
    from npllama.engine.batch import forward_batch
    from npllama.cache.kvpool import KVPool
    ids = model.tokenize(" ".join(f"{s.capitalize()} is a fine subject: {t.format(s)}" for s in SUBJECTS
                                  for t in TASKS[:1]) * 3)[:text_tokens]
    logits = {}
    for dtype in (np.float32, np.float16):
        pool = KVPool.for_model(model, tokens=len(ids), dtype=dtype)
        (logits[dtype],) = forward_batch(model, pool, [pool.new_seq()], [ids], all_logits=True)
        print(f"KV {np.dtype(dtype).name}: {pool.bytes_per_token} bytes per cached token "
              f"({pool.bytes_per_token / 1024:.1f} KiB; {model.config.n_layer} layers x {model.config.n_head_kv} "
              f"kv heads x {model.config.head_dim} x K,V)")
    a, b = logits[np.float32], logits[np.float16]
    top1 = float((a.argmax(-1) == b.argmax(-1)).mean())
    print(f"f16 KV vs f32 KV over {len(ids)} positions of text: max |logit diff| {np.abs(a - b).max():.4f} "
          f"(logits up to {np.abs(a).max():.1f}), top-1 agreement {100 * top1:.1f}%")


def bench_shared_prefix(model, n, gen, max_batch):
    from npllama.generation.scheduler import complete_many
    prompts = [model.format_chat([{"role": "system", "content": SYSTEM},
                                  {"role": "user", "content": TASKS[1].format(s)}]) for s in SUBJECTS[:n]]
    common = len(os.path.commonprefix([model.tokenize(p, special=True) for p in prompts]))
    res = {}
    for shared in (False, True):
        stats = {}
        t0 = time.perf_counter()
        complete_many(model, prompts, temperature=0, max_tokens=gen, max_batch=max_batch, prefix_cache=shared,
                      stats=stats)
        res[shared] = (time.perf_counter() - t0, stats)
    (t0_, s0), (t1_, s1) = res[False], res[True]
    print(f"\nshared prefix: {len(prompts)} prompts with a common {common}-token system prompt, {gen} new tokens")
    print(f"  prefill tokens computed: {s0['prefill_tokens']} unshared, {s1['prefill_tokens']} shared "
          f"({s1['cached_tokens']} taken from the prefix cache); wall {t0_:.2f} s -> {t1_:.2f} s "
          f"({t0_ / t1_:.2f}x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--n", default="16,64", help="prompt counts, comma separated")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engines", default="npllama,llama.cpp,llama.cpp-batched")
    ap.add_argument("--skip", default="", help="comma separated: throughput,memory,prefix")
    ap.add_argument("--activations", default="f32", choices=["f32", "int8"], help="npllama's mode")
    ap.add_argument("--rounds", type=int, default=1,
                    help="throughput rounds, each running every engine once (medians and per-round ratios)")
    args = ap.parse_args()
    print_cpu()

    import npllama
    from npllama.gguf.hub import resolve_model
    model = npllama.Model(resolve_model(args.model), threads=args.threads, activations=args.activations)
    skip = set(filter(None, args.skip.split(",")))
    print(f"model {Path(model.path).name}, {args.threads} threads, activations {args.activations}")
    if "throughput" not in skip:
        py = ref_python()
        for n in (int(x) for x in args.n.split(",")):
            bench_throughput(model, n, args.gen, args.max_batch, args.engines.split(","), py, args.threads,
                             args.rounds)
    if "memory" not in skip:
        print()
        bench_memory_and_f16(model)
    if "prefix" not in skip:
        bench_shared_prefix(model, min(8, len(SUBJECTS)), min(args.gen, 16), args.max_batch)


if __name__ == "__main__":
    main()
