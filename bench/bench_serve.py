"""`npllama serve` under concurrent load, against llama-cpp-python's server on the same model and
threads. Never a pass/fail test.

    python bench/bench_serve.py [--n 16] [--gen 64] [--threads 2] [--model PATH] [--activations f32,int8]
        [--engines npllama,npllama-serial,llama-cpp-python,llama-cpp-python-serial]

Each engine is started as its own server process on a free loopback port and sent `--n` chat
requests at once (greedy, `--gen` tokens at most, streamed), after two warm-up requests; a
`-serial` engine is the same server sent the same requests one at a time. Printed per engine:
generated tokens per second of wall time over the whole set, time to first token (median and
p99) and request latency (median and p99). llama-cpp-python's server runs one request at a
time (a lock held for the whole request); it is started with `--interrupt_requests False`,
without which each new request aborts the stream in progress. It runs from the references'
python ($NPLLAMA_REF_PY, else ~/.cache/npllama-refs/venv) with its server extras, and is
skipped with a note without them. Targets: npllama's 16-stream throughput >= 3x
llama-cpp-python's server, and >= 2x npllama one request at a time.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from machine import print_cpu  # noqa: E402

REF_PY = os.environ.get("NPLLAMA_REF_PY", str(Path.home() / ".cache/npllama-refs/venv/bin/python"))
SUBJECTS = ["the ocean", "volcanoes", "honeybees", "the Roman Empire", "black holes", "photosynthesis",
            "jazz music", "the internet", "mountain climbing", "ancient Egypt", "electric cars", "chess",
            "the moon", "rain forests", "coffee", "the printing press"]
TASKS = ["Write a short poem about {}.", "Explain {} to a ten-year-old.", "List three surprising facts about {}.",
         "Write the opening paragraph of an adventure story about {}."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(engine: str, model: str, threads: int, n: int, gen: int, port: int, activations: str = "f32") -> subprocess.Popen:
    if engine == "llama-cpp-python":
        cmd = [REF_PY, "-m", "llama_cpp.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
               "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "2048",
               "--interrupt_requests", "False"]  # by default a new request aborts the running stream
    else:
        cmd = [sys.executable, "-m", "npllama", "serve", "-m", model, "--port", str(port), "-t", str(threads),
               "-c", str(min(2048, 256 + gen)), "--parallel", str(n), "--log-level", "warning", "--activations", activations]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tempfile.TemporaryFile("w+")  # not a pipe: a chatty server would fill it and block
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"{engine} server exited: {log.read()[-2000:]}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{engine} server did not start in 300 s")


def chat(url: str, question: str, gen: int) -> dict:
    """One streamed greedy chat request: tokens, time to first token, latency."""
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": gen,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, chunks, usage = None, 0, None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            usage = ev.get("usage") or usage
            if any(c.get("delta", {}).get("content") for c in ev.get("choices", [])):
                chunks += 1
                first = first or time.perf_counter() - t0
    return {"tokens": usage["completion_tokens"] if usage else chunks, "ttft": first or 0.0,
            "latency": time.perf_counter() - t0}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))]


def run(url: str, questions, gen: int, concurrent: bool) -> dict:
    t0 = time.perf_counter()
    if concurrent:
        with cf.ThreadPoolExecutor(len(questions)) as ex:
            res = list(ex.map(lambda q: chat(url, q, gen), questions))
    else:
        res = [chat(url, q, gen) for q in questions]
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in res)
    return {"requests": len(res), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "ttft_p50": pct([r["ttft"] for r in res], 50), "ttft_p99": pct([r["ttft"] for r in res], 99),
            "lat_p50": pct([r["latency"] for r in res], 50), "lat_p99": pct([r["latency"] for r in res], 99)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="GGUF path (default: the default model)")
    ap.add_argument("--n", type=int, default=16, help="concurrent requests (default 16)")
    ap.add_argument("--gen", type=int, default=64, help="tokens per request at most (default 64)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--activations", default="f32,int8", help="npllama's modes (default f32,int8)")
    ap.add_argument("--engines", default="npllama,npllama-serial,llama-cpp-python,llama-cpp-python-serial")
    args = ap.parse_args()
    print_cpu()
    from npllama.gguf.hub import resolve_model
    model = str(args.model or resolve_model())
    questions = [TASKS[i % len(TASKS)].format(SUBJECTS[i % len(SUBJECTS)]) for i in range(args.n)]
    engines = args.engines.split(",")
    results = {}
    runs = [("npllama", a) for a in args.activations.split(",")] + [("llama-cpp-python", "")]
    for name, act in runs:
        modes = [m for m in engines if m == name or m.startswith(name + "-")]
        if not modes:
            continue
        if name == "llama-cpp-python" and subprocess.run(
                [REF_PY, "-c", "import llama_cpp.server.app, uvicorn, sse_starlette, starlette_context"],
                capture_output=True).returncode:
            print(f"llama-cpp-python: skipped ({REF_PY} lacks llama_cpp's server extras: "
                  f"pip install 'llama-cpp-python[server]' there)")
            continue
        port = free_port()
        proc = start(name, model, args.threads, args.n, args.gen, port, act or "f32")
        url = f"http://127.0.0.1:{port}"
        try:
            for q in ("Hello!", "What is two plus two?"):  # warm up (prompts unlike the measured ones)
                chat(url, q, args.gen)
            for mode in modes:
                label = mode.replace(name, f"{name} {act}") if act else mode
                results[label] = run(url, questions, args.gen, concurrent=not mode.endswith("-serial"))
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"\n{args.n} chat requests, greedy, <= {args.gen} tokens each, {args.threads} threads, {Path(model).name}")
    print(f"{'engine':<26} {'tokens':>6} {'wall s':>7} {'tok/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'lat p50':>8} {'lat p99':>8}")
    for mode, r in results.items():
        label = mode.replace("-serial", " (serial)")
        print(f"{label:<26} {r['tokens']:6d} {r['wall_s']:7.2f} {r['tok_s']:7.1f} {r['ttft_p50']:9.3f} "
              f"{r['ttft_p99']:9.3f} {r['lat_p50']:8.3f} {r['lat_p99']:8.3f}")
    for act in args.activations.split(","):
        mine = f"npllama {act}"
        if mine not in results:
            continue
        for other, target in (("llama-cpp-python", " (target >= 3x)"), ("llama-cpp-python-serial", ""),
                              (f"{mine}-serial", " (target >= 2x)")):
            if other in results:
                print(f"{mine} {args.n}-stream / {other.replace('-serial', ' (serial)')}: "
                      f"{results[mine]['tok_s'] / results[other]['tok_s']:.2f}x{target}")

if __name__ == "__main__":
    main()
