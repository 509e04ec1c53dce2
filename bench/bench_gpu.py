"""The CUDA backend on a real GPU: prefill and decode tokens/s against the CPU engine and HF
transformers (CUDA, float32) on the same GGUF, and the cost of one kernel launch. Never a
pass/fail test; bench/gpu_check.sh runs it where a GPU is lent.

    python bench/bench_gpu.py [--model PATH] [--prompt 128] [--gen 32]

Without --model (or $NPLLAMA_MODEL) it writes a random model of SmolLM2-135M's shape (30
layers, 576 wide, 9 heads, 3 KV heads, 1536 feed-forward; Q4_1; the tests' small vocabulary),
since a GPU machine here has no network and the default model is larger than what travels.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from npllama.bench import run_bench  # noqa: E402


def model_path(arg: str | None) -> str:
    path = arg or os.environ.get("NPLLAMA_MODEL")
    if path:
        return path
    from gguf import GGMLQuantizationType as QT
    from tinygguf import write_tiny_llama
    out = Path(tempfile.mkdtemp()) / "smollm2-shape-q4_1.gguf"
    print("writing a random model of SmolLM2-135M's shape (Q4_1) ...", flush=True)
    return str(write_tiny_llama(out, n_layer=30, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536, n_ctx=2048,
                                qtype=QT.Q4_1))


def rates(model, ids, gen):
    """(prefill tok/s, decode tok/s) through a session, best of 3 (npllama bench's protocol);
    logits come back to the host each call, so each timing ends with the device's work done."""
    r = run_bench(model, ids=ids, gen_tokens=gen, repeats=3)
    return r["prefill_tok_s"], r["decode_tok_s"]


def hf_rates(path, ids, gen):
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name,
                                             torch_dtype=torch.float32).cuda().eval()
    best_p = best_d = 0.0
    with torch.no_grad():
        for _ in range(3):
            x = torch.tensor([ids], device="cuda")
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = m(x, use_cache=True)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(gen):
                out = m(tok, past_key_values=past, use_cache=True)
                past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            best_p, best_d = max(best_p, len(ids) / (t1 - t0)), max(best_d, gen / (t2 - t1))
    return best_p, best_d


def launch_cost(n: int = 2000) -> float:
    """Seconds per launch of a one-thread kernel, launched n times back to back."""
    import cupy
    from npllama.backends.cuda import kernels as K
    a = cupy.zeros(1, np.float32)
    K.glu(a, a, a, K.ACT_SILU)
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        K.glu(a, a, a, K.ACT_SILU)
    cupy.cuda.runtime.deviceSynchronize()
    return (time.perf_counter() - t0) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=32)
    args = ap.parse_args()
    import npllama
    path = model_path(args.model)
    gpu = npllama.load(path, device="cuda")
    ids = np.random.default_rng(0).integers(3, gpu.config.n_vocab, args.prompt).tolist()
    rows = {"npllama cuda": rates(gpu, ids, args.gen), "npllama cpu": rates(npllama.load(path), ids, args.gen)}
    try:
        rows["HF transformers cuda"] = hf_rates(path, ids, args.gen)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"HF transformers: skipped ({type(e).__name__}: {e})")
    for name, (p, d) in rows.items():
        print(f"{name:22s} prefill {p:9.1f} tok/s   decode {d:7.1f} tok/s")
    if "HF transformers cuda" in rows:
        (p, d), (hp, hd) = rows["npllama cuda"], rows["HF transformers cuda"]
        print(f"npllama cuda / HF transformers cuda: prefill {p / hp:.2f}x, decode {d / hd:.2f}x (target decode >= 2x)")
    print(f"one kernel launch: {launch_cost() * 1e6:.1f} us")


if __name__ == "__main__":
    main()
