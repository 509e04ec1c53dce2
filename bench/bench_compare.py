"""npllama against llama.cpp (llama-cpp-python) and HF transformers on the same GGUF, the same
token ids and the same thread count, in one run. Prints prefill and decode tokens/s and the
ratios to llama.cpp. Never a pass/fail test.

    python bench/bench_compare.py [--model PATH] [--quant q8_0] [--threads 2] [--rounds 3]

--quant q8_0|f16 re-quantizes the model with gguf.quants (tests/requant.py); --quant
q4_k_m|q5_k_m|q6_k|q3_k_m|q2_k writes its F16 with gguf and has llama.cpp's own quantizer
(llama_cpp.llama_model_quantize, in the references' python) make the K-quant mix from it, as
the files people download are made. (SmolLM2's 576-wide rows are not whole 256-element
super-blocks: llama.cpp gives those tensors its fallback types, Q5_0 in Q4_K_M, Q5_1 in Q5_K_M,
Q8_0 in Q6_K.)

npllama runs twice: the default exact mode, and the opt-in int8-activation mode (npllama-int8,
with its default float16 KV cache; llama.cpp stores its cache in float16 too). A third mode
can be asked for with --engines: npllama-f16kv, the exact products with a float16 KV cache
(the same cache bytes as llama.cpp's, which is what long prompts spend their time reading).
llama.cpp-fa is llama.cpp with flash attention on (its CLI's default; llama-cpp-python's is
off). With --prompt 4000, the long-prompt comparison; a line then also gives each
engine's end-to-end time (prefill and decode) and its ratio to llama.cpp-fa's.

The references run in their own python (the venv of ../shared/tools/setup-refs.sh, or
$NPLLAMA_REF_PY); each is skipped with a note when it is not installed there.
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
sys.path.insert(0, str(HERE.parent / "tests"))
from machine import print_cpu  # noqa: E402

# Runs inside the references' python: argv = engine, gguf path, ids json, gen, threads, repeats.
REF_SCRIPT = r'''
import json, sys, time
import numpy as np
engine, path, ids, gen, threads, repeats = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
best_p = best_d = 0.0
if engine.startswith("llama.cpp"):
    from llama_cpp import Llama
    llm = Llama(model_path=path, n_ctx=len(ids) + gen + 8, n_batch=max(512, len(ids) + gen + 8), n_threads=threads,
                n_threads_batch=threads, flash_attn=engine == "llama.cpp-fa", verbose=False)
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter(); llm.eval(ids); t1 = time.perf_counter()
        for _ in range(gen):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        t2 = time.perf_counter()
        best_p, best_d = max(best_p, len(ids) / (t1 - t0)), max(best_d, gen / (t2 - t1))
else:
    import os, torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter(); out = m(torch.tensor([ids]), use_cache=True); t1 = time.perf_counter()
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
            for _ in range(gen):
                out = m(tok.view(1, 1), past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[0, -1].argmax()
            t2 = time.perf_counter()
            best_p, best_d = max(best_p, len(ids) / (t1 - t0)), max(best_d, gen / (t2 - t1))
print(json.dumps({"prefill": best_p, "decode": best_d}))
'''


# Runs inside the references' python: argv = F16 gguf in, gguf out, llama_ftype value, threads.
QUANTIZE_SCRIPT = r'''
import sys, llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = int(sys.argv[3]), int(sys.argv[4])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p)
sys.exit(f"llama_model_quantize returned {rc}" if rc else 0)
'''

# --quant choices made by llama.cpp's quantizer: name -> llama_ftype (LLAMA_FTYPE_MOSTLY_*)
LLAMA_QUANTS = {"q2_k": 10, "q3_k_m": 12, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}


def llama_quantize(py, f16_path, dst, quant, threads):
    """Make ``dst`` from the F16 GGUF ``f16_path`` with llama.cpp's quantizer (``quant``: a key of
    LLAMA_QUANTS), in the references' python ``py``."""
    r = subprocess.run([py, "-c", QUANTIZE_SCRIPT, str(f16_path), str(dst), str(LLAMA_QUANTS[quant]), str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llama.cpp's quantizer failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return dst


def ref_python() -> str | None:
    py = os.environ.get("NPLLAMA_REF_PY") or str(Path.home() / ".cache/npllama-refs/venv/bin/python")
    return py if Path(py).exists() else None


def run_ref(py, engine, path, ids, gen, threads, repeats):
    r = subprocess.run([py, "-c", REF_SCRIPT, engine, str(path), json.dumps(ids), str(gen), str(threads),
                        str(repeats)], capture_output=True, text=True)
    if r.returncode != 0:
        return None, (r.stderr.strip().splitlines() or ["failed"])[-1]
    return json.loads(r.stdout.strip().splitlines()[-1]), None


def model_file(ap, args, py, tmp: str) -> Path:
    """The GGUF that args.model and args.quant ask for (a re-quantized one in args.keep, or in
    `tmp`, reused when there); ap.error where a K-quant mix needs the references' `py`."""
    from npllama.gguf.hub import resolve_model
    path = resolve_model(args.model)
    if not args.quant:
        return path
    from gguf import GGMLQuantizationType as QT
    from requant import requantize
    where = Path(args.keep) if args.keep else Path(tmp)
    where.mkdir(parents=True, exist_ok=True)
    dst = where / f"{Path(path).stem}-{args.quant}.gguf"
    if dst.exists():
        return dst
    if args.quant in LLAMA_QUANTS:
        if py is None:
            ap.error(f"--quant {args.quant} needs llama.cpp's quantizer: run ../shared/tools/setup-refs.sh")
        f16 = requantize(path, Path(tmp) / "model-f16.gguf", QT.F16)
        return llama_quantize(py, f16, dst, args.quant, args.threads)
    return requantize(path, dst, QT[args.quant.upper()])


# npllama's modes: engine name -> (activations, KV cache dtype; None: the mode's default)
MODES = {"npllama": ("f32", None), "npllama-int8": ("int8", None), "npllama-f16kv": ("f32", "float16")}


def run_npllama(path, ids, gen, threads, repeats, activations="f32", kv_dtype=None):
    import npllama
    from npllama.bench import run_bench
    t0 = time.perf_counter()
    model = npllama.Model(path, threads=threads, activations=activations, kv_dtype=kv_dtype)
    load_s = time.perf_counter() - t0
    r = run_bench(model, ids=ids, gen_tokens=gen, repeats=repeats)
    return {"prefill": r["prefill_tok_s"], "decode": r["decode_tok_s"], "load_s": load_s,
            "first_call_s": r["first_call_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--quant", choices=["q8_0", "f16", *LLAMA_QUANTS],
                    help="re-quantize the model first: q8_0/f16 by gguf.quants, the K-quant mixes by llama.cpp's "
                         "quantizer from an F16 written by gguf")
    ap.add_argument("--keep", metavar="DIR", help="write the re-quantized model into DIR (reused when there)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every engine this many times, in turn, keeping each one's best (this "
                         "machine's speed drifts over minutes; alternating keeps the ratios fair)")
    ap.add_argument("--engines", default="npllama,npllama-int8,llama.cpp,transformers",
                    help="comma-separated, from npllama, npllama-int8, npllama-f16kv, llama.cpp, llama.cpp-fa "
                         "(flash attention on), transformers")
    args = ap.parse_args()
    print_cpu()
    engines = args.engines.split(",")
    known = [*MODES, "llama.cpp", "llama.cpp-fa", "transformers"]
    if unknown := [e for e in engines if e not in known]:
        ap.error(f"unknown engine(s) {', '.join(unknown)}; the engines are {', '.join(known)}")

    tmp = tempfile.TemporaryDirectory()
    py = ref_python()
    path = model_file(ap, args, py, tmp.name)
    ids = [int(i) for i in np.random.default_rng(0).integers(100, 40000, args.prompt)]
    results, notes, rounds = {}, [], []
    for _ in range(args.rounds):
        rounds.append({})
        for engine in engines:
            if engine in MODES:
                res = run_npllama(path, ids, args.gen, args.threads, args.repeats, *MODES[engine])
            elif py is None:
                res, err = None, "no references' python; run ../shared/tools/setup-refs.sh"
            else:
                res, err = run_ref(py, engine, path, ids, args.gen, args.threads, args.repeats)
            if res is None:
                notes.append(f"{engine}: skipped ({err})")
                continue
            rounds[-1][engine] = res
            if engine not in results:
                results[engine] = res
            else:
                best = results[engine]
                for key in ("prefill", "decode"):
                    best[key] = max(best[key], res[key])

    anchor = results.get("llama.cpp")
    print(f"model {Path(path).name}, {args.threads} threads, prefill {args.prompt} tokens, "
          f"decode {args.gen} tokens greedily, best of {args.repeats} x {args.rounds} round(s)")
    print(f"{'engine':<14}{'prefill tok/s':>15}{'decode tok/s':>14}{'prefill ratio':>15}{'decode ratio':>14}")
    for engine, r in results.items():
        pr = f"{r['prefill'] / anchor['prefill']:.2f}x" if anchor else "-"
        dr = f"{r['decode'] / anchor['decode']:.2f}x" if anchor else "-"
        print(f"{engine:<14}{r['prefill']:>15.1f}{r['decode']:>14.1f}{pr:>15}{dr:>14}")
    if anchor and args.rounds > 1:  # each round's own ratios: the spread the load on the machine makes
        for engine in results:
            if engine != "llama.cpp":
                per = [(r[engine]["prefill"] / r["llama.cpp"]["prefill"], r[engine]["decode"] / r["llama.cpp"]["decode"])
                       for r in rounds if engine in r and "llama.cpp" in r]
                med = np.median(np.array(per), axis=0)
                print(f"{engine} per round: prefill {', '.join(f'{p:.2f}x' for p, _ in per)} (median {med[0]:.2f}x); "
                      f"decode {', '.join(f'{d:.2f}x' for _, d in per)} (median {med[1]:.2f}x)")
    fa = results.get("llama.cpp-fa")
    if fa:
        def total(r):
            return args.prompt / r["prefill"] + args.gen / r["decode"]
        for engine, r in results.items():
            print(f"{engine}: {args.prompt} + {args.gen} tokens end to end {total(r):.2f} s, "
                  f"{total(fa) / total(r):.2f}x llama.cpp-fa; decode {r['decode'] / fa['decode']:.2f}x llama.cpp-fa's")
    for engine in MODES:
        if engine in results:
            r = results[engine]
            print(f"{engine} load {r['load_s']:.2f} s, first call {r['first_call_s']:.2f} s (compile or cache load)")
    for n in dict.fromkeys(notes):
        print(n)


if __name__ == "__main__":
    main()
