"""Embedding and reranking throughput: texts/s for 1,000 short texts (8 to 64 tokens each) through
`model.embed`, and one `model.rerank` of 100 such documents, with each run's peak RSS.

    python bench/bench_embed.py [--texts 1000] [--documents 100] [--repeats 3] [--json]

Models: the tests' tiny fixtures (tests/fixtures/embed: a 2-layer BERT of width 64, a RoBERTa
cross-encoder), and random models of real shapes built here (no model hub is needed): the
fixtures' metadata and vocabulary with all-MiniLM-L6-v2's shape (6 layers, width 384, 12 heads,
feed-forward 1536, context 512), an embedder and a cross-encoder (ms-marco-MiniLM-L-6-v2's
shape), F32 as llama.cpp's converter writes them with --outtype f32. A pass's speed does not
depend on the weights' values, so these time what the real models would; their vectors mean
nothing. Only the 400-piece vocabulary differs, and the texts are made to the token counts.

Each model runs in a fresh process: its first call (compile, or Numba's cache load) is reported
apart, the best of `--repeats` timed calls is the throughput, and the peak RSS is the process's
high-water mark (VmHWM). No llama.cpp comparison: llama-cpp-python is not built on this machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from machine import print_cpu  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "embed"
MINILM = {"block_count": 6, "embedding_length": 384, "feed_forward_length": 1536, "attention.head_count": 12,
          "context_length": 512}


def shaped(fixture: Path, out: Path, shape: dict) -> Path:
    """A random model with the fixture's metadata and tensor names at `shape` (bench/shaped_model.py)."""
    import shaped_model
    s = shaped_model.spec(fixture)
    arch = s["arch"]
    old = {name[len(arch) + 1:]: value for name, value, _, _ in s["fields"] if name.startswith(arch + ".")}
    s["fields"] = [(n, shape.get(n[len(arch) + 1:], v) if n.startswith(arch + ".") else v, t, sub)
                   for n, v, t, sub in s["fields"]]
    n_embd, n_ff, n_ctx = shape["embedding_length"], shape["feed_forward_length"], shape["context_length"]
    resize = {old["embedding_length"]: n_embd, old["feed_forward_length"]: n_ff, old["context_length"]: n_ctx}
    tensors = []
    for name, dims, qtype in s["tensors"]:
        if name.startswith("blk.") and int(name.split(".")[1]) >= shape["block_count"]:
            continue
        if name == "position_embd.weight":  # (n_embd, positions): the positions follow the context
            dims = [n_embd, n_ctx]
        else:
            dims = [resize.get(d, d) for d in dims]
        tensors.append((name, dims, qtype))
    for i in range(old["block_count"], shape["block_count"]):  # more layers: block 0's tensors again
        tensors += [(name.replace("blk.0.", f"blk.{i}.", 1), dims, q) for name, dims, q in tensors
                    if name.startswith("blk.0.")]
    s["tensors"] = tensors
    shaped_model.write(s, out)
    return out


def texts_of(tok, n: int, rng, low: int = 8, high: int = 64) -> list[str]:
    """n texts of low..high tokens each (special tokens included), words from the vocabulary."""
    words = [w for w in (tok.id_to_bytes(i).decode("utf-8", "replace") for i in range(tok.n_vocab))
             if w.isalpha() and w.isascii() and len(w) > 1]
    out = []
    for _ in range(n):
        target, text = int(rng.integers(low, high + 1)), []
        while len(tok.encode_input(" ".join(text))[0]) < target:
            text.append(str(rng.choice(words)))
        while len(tok.encode_input(" ".join(text))[0]) > target and len(text) > 1:
            text.pop()
        out.append(" ".join(text))
    return out


def run_one(path: str, task: str, n: int, repeats: int) -> dict:
    """In this process: the first call, then the best of `repeats` calls, and the peak RSS."""
    import npllama
    model = npllama.load(path)
    tok = model.tokenizer
    rng = np.random.default_rng(0)
    texts = texts_of(tok, n, rng)
    tokens = sum(len(tok.encode_input(t)[0]) for t in texts)
    t0 = time.perf_counter()
    if task == "embed":
        model.embed(texts[:4])
    else:
        model.rerank(texts[0], texts[1:5])
    first = time.perf_counter() - t0
    query = "what does the fox do"
    if task == "rerank":
        tokens = sum(len(tok.encode_input(query, d)[0]) for d in texts)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        model.embed(texts) if task == "embed" else model.rerank(query, texts)
        best = min(best, time.perf_counter() - t0)
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024
    return {"model": Path(path).name, "task": task, "n": n, "tokens": tokens, "threads": model.threads,
            "first_call_s": first, "seconds": best, "per_s": n / best, "tokens_per_s": tokens / best,
            "peak_rss_mib": hwm, "file_mib": Path(path).stat().st_size / 2**20}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--documents", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("PATH", "TASK"), help=argparse.SUPPRESS)  # a child's run
    args = ap.parse_args()
    if args.one:
        n = args.texts if args.one[1] == "embed" else args.documents
        print(json.dumps(run_one(args.one[0], args.one[1], n, args.repeats)))
        return
    print_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(FIXTURES / "bert.gguf", "embed"), (FIXTURES / "roberta-rerank.gguf", "rerank"),
                (shaped(FIXTURES / "bert.gguf", Path(tmp) / "minilm-l6-shaped.gguf", MINILM), "embed"),
                (shaped(FIXTURES / "roberta-rerank.gguf", Path(tmp) / "minilm-l6-rerank-shaped.gguf", MINILM),
                 "rerank")]
        results = []
        for path, task in runs:
            out = subprocess.run([sys.executable, __file__, "--one", str(path), task, "--texts", str(args.texts),
                                  "--documents", str(args.documents), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(results))
        return
    print(f"{'model':32} {'task':7} {'n':>5} {'tokens':>7} {'first call':>10} {'per s':>9} {'tok/s':>9} "
          f"{'peak RSS':>9} {'file':>8}")
    for r in results:
        print(f"{r['model']:32} {r['task']:7} {r['n']:5d} {r['tokens']:7d} {r['first_call_s']:9.2f}s "
              f"{r['per_s']:9.1f} {r['tokens_per_s']:9.0f} {r['peak_rss_mib']:7.0f}MiB {r['file_mib']:6.1f}MiB")


if __name__ == "__main__":
    main()
