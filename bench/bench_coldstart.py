"""A short reply from a fresh process: `npllama run` against a fresh llama-cpp-python script
(issue 21.1). Wall time and peak RSS of each, in alternating rounds, then where npllama's
time goes. Never a pass/fail test.

    python bench/bench_coldstart.py [--model PATH] [--rounds 5] [--threads 2] [--tokens 16]

Both sides reply greedily to the same chat message ("Say hi.") through the model's chat
template, with at most --tokens tokens, in a new process each round; the script prints both
replies, so that one can see they are the same. npllama's modules are byte-compiled first
(`compileall`), as an installed package's are: an editable install under
PYTHONDONTWRITEBYTECODE=1 would otherwise compile them from source in every process.

The breakdown runs the same steps through the Python API in a fresh process: importing
npllama (NumPy, Numba, LLVM), opening the model, the tokenizer (built on first use, with the
chat template), the first token (prefill) and the rest; the Numba cache's share of them
(time holding Numba's compiler lock, under which a kernel's machine code is loaded from its cache) is
printed beside them. llama-cpp-python runs in the references' python (../shared/tools/setup-refs.sh,
or $NPLLAMA_REF_PY), and is skipped with a note when it is not there.
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_compare import ref_python

ROOT = Path(__file__).resolve().parent.parent
MESSAGE = "Say hi."

LLAMA_CPP = r'''
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), n_threads_batch=int(sys.argv[2]), verbose=False)
out = llm.create_chat_completion([{"role": "user", "content": sys.argv[3]}], max_tokens=int(sys.argv[4]),
                                 temperature=0.0)
print(out["choices"][0]["message"]["content"])
'''

# The steps of `npllama run`, timed one by one (argv: model, threads, message, tokens).
PHASES = r'''
import json, sys, time
t = [time.perf_counter()]
import npllama
from numba.core import event
class Cache(event.Listener):  # time holding Numba's compiler lock: loading kernels from its cache
    total, depth = 0.0, 0
    def on_start(self, ev):
        Cache.depth += 1
        if Cache.depth == 1:
            self.t = time.perf_counter()
    def on_end(self, ev):
        Cache.depth -= 1
        if Cache.depth == 0:
            Cache.total += time.perf_counter() - self.t
event.register("numba:compiler_lock", Cache())
marks = [0.0]
def mark():
    t.append(time.perf_counter()); marks.append(Cache.total)
mark()
model = npllama.load(sys.argv[1], threads=int(sys.argv[2]))
mark()
ids = model.tokenize(model.format_chat([{"role": "user", "content": sys.argv[3]}]), special=True)
mark()
pieces = model.generate(ids, max_tokens=int(sys.argv[4]), temperature=0.0, stream=True)
text = next(pieces)
mark()
text += "".join(pieces)
mark()
print(json.dumps({"wall": [b - a for a, b in zip(t, t[1:])], "cache": [b - a for a, b in zip(marks, marks[1:])]}))
'''
STEPS = ["import npllama, Numba", "open the model (+ the engine)", "tokenizer + chat template", "first token (prefill)",
         "the other tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from npllama.gguf.hub import resolve_model
    path = str(resolve_model(args.model))
    compileall.compile_dir(str(ROOT / "npllama"), quiet=1)
    ours = [sys.executable, "-m", "npllama", "run", MESSAGE, "-m", path, "-t", str(args.threads), "-n",
            str(args.tokens), "--temp", "0"]
    py = ref_python()
    theirs = [py, "-c", LLAMA_CPP, path, str(args.threads), MESSAGE, str(args.tokens)] if py else None
    if theirs is None:
        print("llama-cpp-python: skipped (no references' python; run ../shared/tools/setup-refs.sh)")
    runs = {"npllama": [], "llama-cpp-python": []}
    replies = {}
    for _ in range(args.rounds):
        for name, cmd in (("npllama", ours), ("llama-cpp-python", theirs)):
            if cmd is not None:
                wall, rss, replies[name] = run_child(cmd)
                runs[name].append((wall, rss))
    for name, rs in runs.items():
        if rs:
            walls = [w for w, _ in rs]
            print(f"{name:17s} wall median {statistics.median(walls):.2f} s (min {min(walls):.2f}, max "
                  f"{max(walls):.2f}), peak RSS {max(r for _, r in rs):.0f} MiB; reply: {replies[name]!r}")
    if runs["llama-cpp-python"]:
        ratios = [a[0] / b[0] for a, b in zip(runs["npllama"], runs["llama-cpp-python"])]
        print(f"npllama / llama-cpp-python wall, per round: {', '.join(f'{r:.2f}' for r in ratios)} "
              f"(median {statistics.median(ratios):.2f}; target <= 0.8)")
    steps = [json.loads(subprocess.run([sys.executable, "-c", PHASES, path, str(args.threads), MESSAGE,
                                        str(args.tokens)], capture_output=True, text=True, cwd=ROOT,
                                       check=True).stdout.splitlines()[-1]) for _ in range(args.rounds)]
    print(f"where npllama's time goes (median of {args.rounds} fresh processes; Numba cache: loading kernels):")
    for i, step in enumerate(STEPS):
        print(f"  {step:30s} {statistics.median(s['wall'][i] for s in steps):6.3f} s"
              f"   (Numba cache {statistics.median(s['cache'][i] for s in steps):.3f} s)")


def run_child(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in MiB and the standard output of `cmd` in a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    out, err = p.stdout.read(), p.stderr.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed: {(err.decode().strip().splitlines() or ['?'])[-1]}")
    return wall, usage.ru_maxrss / 1024, out.decode().strip()


if __name__ == "__main__":
    main()
