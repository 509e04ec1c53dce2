"""The CUDA backend on a real GPU: prefill and decode tokens/s, with the decode steps replayed
as a CUDA graph (with and without the fused q/k/v and gate/up-with-GLU mat-vecs) and run eagerly,
against HF transformers (CUDA, float32) on the same GGUF; a batch of 64 prompts against the
CPU engine's throughput (gpu_prep.py's); the cost of one kernel launch. Never a pass/fail test; bench/gpu_check.sh runs it where a GPU is lent.

    python bench/bench_gpu.py [--model PATH ...] [--prompt 128] [--gen 64] [--cpu]

Without --model it writes a random model of SmolLM2-135M's shape (tests/tinygguf.py; Q4_1; the
tests' small vocabulary); gpu_check.sh passes the random models of the real files' shapes
(bench/shaped_model.py), since a GPU machine here has no network and the real files are larger
than what travels. --cpu adds the CPU engine on the same machine (its kernels compile first).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from npllama.bench import run_bench  # noqa: E402


def default_model() -> str:
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
                                             dtype=torch.float32).cuda().eval()
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


def launch_costs(n: int = 500) -> dict:
    """Host microseconds per launch of a one-thread kernel (n back to back): through the
    wrapper (CuPy arrays turned into Numba views, then the launch), the view alone, the launch
    of Numba views, and the launch of CuPy arrays left to Numba."""
    import cupy
    from numba import cuda
    from npllama.backends.cuda import kernels as K
    a = cupy.zeros(1, np.float32)
    v = cuda.as_cuda_array(a, sync=False)
    ways = {"wrapper (K.glu)": lambda: K.glu(a, a, a, K.ACT_SILU),
            "cuda.as_cuda_array alone": lambda: cuda.as_cuda_array(a, sync=False),
            "kernel on Numba views": lambda: K._glu_kernel[1, 128](v, v, v, 0, 1),
            "kernel on CuPy arrays": lambda: K._glu_kernel[1, 128](a, a, a, 0, 1)}
    out = {}
    for name, f in ways.items():
        f()
        cupy.cuda.runtime.deviceSynchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        cupy.cuda.runtime.deviceSynchronize()
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


def gpu_us(model, fn, n: int = 20) -> float:
    """GPU microseconds of one fn() (launches on the model's stream): n calls captured as a
    CUDA graph and replayed between events, so no host time counts."""
    import cupy
    s = model.stream.cupy
    with model.stream:
        fn()
        s.begin_capture()
        for _ in range(n):
            fn()
        g = s.end_capture()
        g.launch(s)
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(s)
        g.launch(s)
        e1.record(s)
        e1.synchronize()
    return cupy.cuda.get_elapsed_time(e0, e1) * 1000 / n


def breakdown(model, ids) -> None:
    """Where a decode step's time goes: the whole step through the session, the captured
    step's replay alone (GPU), and some products' mat-vec (GPU)."""
    import cupy
    from npllama.backends.cuda import kernels as K
    s = model.session()
    logits = s.feed(ids)
    for _ in range(3):
        logits = s.feed([int(np.argmax(logits))])
    t0 = time.perf_counter()
    for _ in range(50):
        logits = s.feed([int(np.argmax(logits))])
    step = (time.perf_counter() - t0) / 50 * 1e6
    g = s.cache.graph
    with model.stream:
        g.graph.launch(model.stream.cupy)
        model.stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(50):
            g.graph.launch(model.stream.cupy)
        model.stream.synchronize()
    replay = (time.perf_counter() - t0) / 50 * 1e6
    print(f"decode step: {step:.0f} us through the session, {replay:.0f} us the graph's replay alone")
    L = model.layers[0]
    for w in (L.wq, L.wk, L.w_up, L.w_down, model.output):
        d = model.device_weights[w.name]
        x = cupy.ones((1, d.cols), np.float32)
        o = cupy.empty((1, d.rows), np.float32)
        us = gpu_us(model, lambda: K.matvec(d.kind, d.scales, d.quants, x, o, d.rows, d.cols,
                                            stream=model.launch_stream))
        mb = (d.scales.nbytes + d.quants.nbytes) / 1e6
        print(f"  mat-vec {w.name:22s} {d.rows}x{d.cols} ({mb:.1f} MB read): {us:.1f} us ({mb / us:.2f} TB/s)")
    layer_kernels(model)


def layer_kernels(model, keys: int = 200) -> None:
    """GPU microseconds of each other launch of a decode step's layer, as graph nodes (`gpu_us`),
    on the model's shapes, attention over `keys` keys of a 256-key cache (its 4 splits)."""
    import cupy
    from npllama.backends.cuda import kernels as K
    cfg, st = model.config, model.launch_stream
    E, H, KVH, D, eps = cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.rms_eps
    rng = np.random.default_rng(0)
    x, y = (cupy.asarray(rng.standard_normal((1, E), np.float32)) for _ in range(2))
    wE, wD = cupy.ones(E, np.float32), cupy.ones(D, np.float32)
    q, q2 = cupy.asarray(rng.standard_normal((1, H, D), np.float32)), cupy.empty((1, H, D), np.float32)
    k, k2 = cupy.asarray(rng.standard_normal((1, KVH, D), np.float32)), cupy.empty((1, KVH, D), np.float32)
    v = cupy.asarray(rng.standard_normal((1, KVH, D), np.float32))
    kv = cupy.asarray(rng.standard_normal((256, KVH, 2, D)).astype(np.float32))
    cos, sin = (cupy.asarray(t[0]) for t in model.ropes.tables(256))
    at = cupy.full(1, keys - 1, np.int64)
    one_page, seq_of = cupy.zeros((1, 1), np.int32), cupy.zeros(1, np.int64)
    ways = {"rmsnorm": lambda: K.rmsnorm(x, wE, eps, y, stream=st),
            "add_rmsnorm (post-norm + add)": lambda: K.add_rmsnorm(x, y, wE, eps, stream=st),
            "head_norms (QK norms)": lambda: K.head_norms(q, k, wD, wD, eps, q2, k2, stream=st),
            "rope_store (RoPE + cache write)": lambda: K.rope_store(q, k, v, kv, at, at, cos, sin, cfg.rope_neox,
                                                                     stream=st),
            f"attention ({keys} keys, 4 splits + merge)": lambda: K.attention(
                q, kv[None], one_page, seq_of, at, 4, 0, cfg.attn_scale, q2, cupy, stream=st)}
    group = model.fused.get(model.layers[0].w_gate.name)
    if group is not None:
        d, rows = group
        h, g = cupy.ones((1, d.cols), np.float32), cupy.empty((1, rows[0]), np.float32)
        ways[f"gate/up mat-vec with the GLU {d.rows}x{d.cols}"] = lambda: K.matvec(
            d.kind, d.scales, d.quants, h, g, d.rows, d.cols, groups=(rows[0],), act=K.ACT_SILU, stream=st)
    for name, fn in ways.items():
        try:
            print(f"  {name:44s} {gpu_us(model, fn):7.1f} us", flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the rest still measured
            print(f"  {name:44s} failed: {type(e).__name__}: {e}", flush=True)


def batch(model, path: str) -> None:
    """gpu_prep.py's batch of 64 prompts through `complete_many` on the device (continuous
    batching over a device pool, all 64 at once), against the CPU engine's throughput and
    tokens on the same batch, which gpu_prep.py measured where it ran (in NAME.npz beside the
    model)."""
    from gpu_prep import BATCH, BATCH_GEN, batch_prompts
    from npllama.generation.scheduler import complete_many
    prompts, best = batch_prompts(model.config.n_vocab), 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        done = complete_many(model, prompts, max_tokens=BATCH_GEN, temperature=0, max_batch=BATCH)
        best = max(best, sum(len(c.tokens) for c in done) / (time.perf_counter() - t0))
    line = f"batch of {BATCH} prompts ({len(prompts[0])} tokens, {BATCH_GEN} generated): {best:.1f} tok/s generated"
    ref = Path(path).with_suffix(".npz")
    ref = np.load(ref) if ref.exists() else {}
    if "cpu_batch_tok_s" not in ref:
        line += " (no CPU reference: run bench/gpu_prep.py where the CPU engine runs, and carry .gpu-carry)"
    else:
        same = sum(list(ref["cpu_batch_tokens"][i][:len(c.tokens)]) == [t.id for t in c.tokens]
                   for i, c in enumerate(done))
        line += (f"; the CPU engine where gpu_prep.py ran: {float(ref['cpu_batch_tok_s']):.1f} tok/s, so "
                 f"{best / float(ref['cpu_batch_tok_s']):.1f}x (target >= 10x); {same}/{BATCH} outputs "
                 f"token-identical to the CPU's")
    print(line, flush=True)


def bench_model(path: str, args) -> None:
    import npllama
    print(f"== {Path(path).name}", flush=True)
    gpu = npllama.load(path, device="cuda")
    ids = np.random.default_rng(0).integers(3, gpu.config.n_vocab, args.prompt).tolist()
    rows = {"npllama cuda (graphs)": rates(gpu, ids, args.gen)}
    breakdown(gpu, ids)
    batch(gpu, path)
    gpu.fuse = False
    rows["npllama cuda (graphs, unfused)"] = rates(gpu, ids, args.gen)
    gpu.fuse, gpu.graphs = True, False
    rows["npllama cuda (eager)"] = rates(gpu, ids, args.gen)
    del gpu
    if args.cpu:
        rows["npllama cpu"] = rates(npllama.load(path), ids, args.gen)
    try:
        rows["HF transformers cuda"] = hf_rates(path, ids, args.gen)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        print(f"HF transformers: skipped ({type(e).__name__}: {e})")
    for name, (p, d) in rows.items():
        print(f"{name:30s} prefill {p:9.1f} tok/s   decode {d:7.1f} tok/s", flush=True)
    (p, d), (_, de) = rows["npllama cuda (graphs)"], rows["npllama cuda (eager)"]
    print(f"graphs / eager decode: {d / de:.2f}x; one mat-vec for q/k/v and one for gate/up with the GLU, "
          f"against one a weight and the GLU's own kernel: "
          f"{d / rows['npllama cuda (graphs, unfused)'][1]:.2f}x")
    if "HF transformers cuda" in rows:
        hp, hd = rows["HF transformers cuda"]
        print(f"npllama cuda / HF transformers cuda: prefill {p / hp:.2f}x, decode {d / hd:.2f}x (target decode >= 2x)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--cpu", action="store_true", help="add the CPU engine on this machine")
    args = ap.parse_args()
    for path in args.model or [default_model()]:
        bench_model(path, args)
    for name, us in launch_costs().items():
        print(f"launch of a one-thread kernel, {name}: {us:.1f} us")


if __name__ == "__main__":
    main()
