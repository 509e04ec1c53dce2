"""A short reply from a fresh process: `npllama run` against a fresh llama-cpp-python script.
Wall time and peak RSS of each, in alternating rounds, then where npllama's
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

    python bench/bench_coldstart.py --fresh [--demo] [--helpers both|on|off] [--model PATH] [--threads N]

--fresh measures the first reply of a machine that has never run npllama: its kernel cache
empty (NPLLAMA_KERNEL_CACHE a new temporary directory each run; the model still read from the
model cache). A fresh process runs `npllama run`'s steps through the Python API, greedily, 32
tokens of "Explain in two sentences why the sky is blue.", and splits its wall time into the
import (npllama, NumPy, Numba), the model's opening, the compile (seconds under Numba's
"numba:compile" events for npllama's functions, outermost ones, in this process), the wait for
the helper process that compiles the decode step beside the prompt (engine/precompile.py; its
own record, the kernels it compiled and its seconds, is printed beside the wait), and the rest
(computing). The same listener times each npllama function's compiles: inclusive, and
exclusive of the npllama functions compiled inside it (Numba's own overloads that it needs stay
in its time), the top 15 by exclusive time. --helpers both (the default) runs that first reply
twice, helpers on and off (NPLLAMA_COMPILE_HELPERS=0), each with a cache of its own, so that
the helper's gain is a ratio within one run. Then the plain `npllama run --temp 0 -n 32 ...`
with an empty kernel cache (helpers as a user gets them, unless --helpers off): its wall time
and peak RSS (the largest single process, the helper included).

--demo times `make demo` on a fresh clone of the committed HEAD, with HOME a new temporary
directory (pip's cache, the model cache and the kernel cache all empty; PIP_* settings kept but
PIP_CACHE_DIR, and NPLLAMA_*, NUMBA_CACHE_DIR and XDG_CACHE_HOME dropped):
the install (`make .venv/.installed-demo`), then the run (`make demo`: the model's download,
the compile and a reply at the CLI's defaults), each timed. Every mode starts with the CPU
(bench/machine.py: its model name and instruction sets, and the kernels' int8 dot path).
"""
from __future__ import annotations

import argparse
import compileall
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_compare import ref_python
from machine import print_cpu

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
chat = model.tokenizer.chat_template is not None  # a base model (Gemma 3 270M) takes the prompt as it is
ids = model.tokenize(model.format_chat([{"role": "user", "content": sys.argv[3]}]) if chat else sys.argv[3], special=chat)
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

SKY = "Explain in two sentences why the sky is blue."
FRESH_TOKENS = 32
TOP = 15  # kernels listed by exclusive compile time

# The steps of `npllama run` on an empty kernel cache, as the CLI takes them (its compile report
# on stderr, the garbage collector paused while the model loads), with the compiles of
# npllama's functions timed each (argv: model, threads or "", message, tokens). Prints one
# line of JSON.
FRESH = r"""
import gc, json, os, resource, sys, threading, time
t = [time.perf_counter()]
import npllama, numpy, numba
from numba.core import event

def ours(f):
    return (getattr(f, "__module__", None) or "").startswith("npllama.")

class Compiles(event.Listener):  # npllama's compiles: each function's inclusive and exclusive seconds
    total, kernels, stacks = 0.0, {}, threading.local()
    def on_start(self, ev):
        stack = Compiles.stacks.__dict__.setdefault("s", [])
        stack.append([getattr(ev.data["dispatcher"], "py_func", None), time.perf_counter(), 0.0])
    def on_end(self, ev):
        stack = Compiles.stacks.__dict__.setdefault("s", [])
        if not stack:
            return
        f, t0, nested = stack.pop()
        if not ours(f):
            return
        took = time.perf_counter() - t0
        name = f"{f.__module__.removeprefix('npllama.')}.{f.__qualname__}"
        k = Compiles.kernels.setdefault(name, [0, 0.0, 0.0])
        k[0] += 1; k[1] += took; k[2] += took - nested
        for outer in reversed(stack):
            if ours(outer[0]):
                outer[2] += took
                break
        else:
            Compiles.total += took
event.register("numba:compile", Compiles())

helper = {"wait": 0.0}
marks = [(0.0, 0.0)]
def mark():
    t.append(time.perf_counter()); marks.append((Compiles.total, helper["wait"]))
mark()

from npllama.kernels import compilelog
from npllama.engine import precompile
compilelog.set_stream(sys.stderr, always=True)
start0, wait0 = precompile.start, precompile.Helper.wait
def start(model, job):
    h = start0(model, job)
    if h is not None:
        helper.update(job=job, started=time.perf_counter() - t[0])
    return h
def wait(self):
    communicate = self.proc.communicate
    def keep(*a, **k):
        out, err = communicate(*a, **k)
        helper["out"] = out
        return out, err
    self.proc.communicate = keep
    w0 = time.perf_counter()
    try:
        helper["ok"] = wait0(self)
    finally:
        helper["wait"] += time.perf_counter() - w0
        helper["ended"] = time.perf_counter() - t[0]
    return helper["ok"]
precompile.start, precompile.Helper.wait = start, wait
gc.disable()
try:
    model = npllama.load(sys.argv[1], threads=int(sys.argv[2]) if sys.argv[2] else None)
finally:
    gc.freeze(); gc.enable()
mark()
chat = model.tokenizer.chat_template is not None  # a base model (Gemma 3 270M) takes the prompt as it is
ids = model.tokenize(model.format_chat([{"role": "user", "content": sys.argv[3]}]) if chat else sys.argv[3], special=chat)
mark()
pieces = model.generate(ids, max_tokens=int(sys.argv[4]), temperature=0.0, stream=True)
text = next(pieces)
mark()
text += "".join(pieces)
mark()
record = None
try:
    record = json.loads(helper.get("out", "").splitlines()[-1])
except (ValueError, IndexError):
    pass
print(json.dumps({"wall": [b - a for a, b in zip(t, t[1:])],
                  "compile": [b[0] - a[0] for a, b in zip(marks, marks[1:])],
                  "wait": [b[1] - a[1] for a, b in zip(marks, marks[1:])],
                  "kernels": Compiles.kernels, "compilelog": compilelog.stats(), "threads": model.threads,
                  "helper": {k: v for k, v in helper.items() if k != "out"}, "record": record,
                  "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "helper_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, "reply": text}))
"""
FRESH_STEPS = ["import npllama, NumPy, Numba", "open the model (+ the engine)", "tokenizer + chat template",
               "first token (prefill)", "the other tokens"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, help="default 2; with --fresh, npllama's own (the physical cores)")
    ap.add_argument("--tokens", type=int, help=f"default 16; with --fresh, {FRESH_TOKENS}")
    ap.add_argument("--fresh", action="store_true", help="the first reply with empty kernel caches")
    ap.add_argument("--helpers", choices=["both", "on", "off"], default="both",
                    help="--fresh: the first reply with the compile helper, without, or both (default)")
    ap.add_argument("--demo", action="store_true", help="`make demo`'s wall time on a fresh clone, with a fresh HOME")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    print_cpu()
    if args.fresh or args.demo:
        if args.fresh:
            fresh(args)
        if args.demo:
            demo()
        return
    from npllama.gguf.hub import resolve_model
    path = str(resolve_model(args.model))
    compileall.compile_dir(str(ROOT / "npllama"), quiet=1)
    threads, tokens = args.threads or 2, args.tokens or 16
    ours = [sys.executable, "-m", "npllama", "run", MESSAGE, "-m", path, "-t", str(threads), "-n",
            str(tokens), "--temp", "0"]
    py = ref_python()
    theirs = [py, "-c", LLAMA_CPP, path, str(threads), MESSAGE, str(tokens)] if py else None
    if theirs is None:
        print("llama-cpp-python: skipped (no references' python; run ../shared/tools/setup-refs.sh)")
    runs = {"npllama": [], "llama-cpp-python": []}
    replies = {}
    for _ in range(args.rounds):
        for name, cmd in (("npllama", ours), ("llama-cpp-python", theirs)):
            if cmd is not None:
                wall, rss, replies[name], _ = run_child(cmd)
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
    steps = [json.loads(subprocess.run([sys.executable, "-c", PHASES, path, str(threads), MESSAGE,
                                        str(tokens)], capture_output=True, text=True, cwd=ROOT,
                                       check=True).stdout.splitlines()[-1]) for _ in range(args.rounds)]
    print(f"where npllama's time goes (median of {args.rounds} fresh processes; Numba cache: loading kernels):")
    for i, step in enumerate(STEPS):
        print(f"  {step:30s} {statistics.median(s['wall'][i] for s in steps):6.3f} s"
              f"   (Numba cache {statistics.median(s['cache'][i] for s in steps):.3f} s)")


def fresh(args) -> None:
    """The first reply with empty kernel caches: through the API (split into its parts), with and
    without the helper as --helpers says, then the plain `npllama run` (the module's docstring)."""
    from npllama.engine.precompile import HELPERS
    from npllama.gguf.hub import resolve_model
    path = str(resolve_model(args.model))  # the model cache's copy (fetched only where it is not there)
    compileall.compile_dir(str(ROOT / "npllama"), quiet=1)
    tokens = args.tokens or FRESH_TOKENS

    def empty_cache(cache: str, helpers: bool) -> dict:
        env = {**os.environ, "NPLLAMA_KERNEL_CACHE": cache}
        env.pop(HELPERS, None)
        return env if helpers else {**env, HELPERS: "0"}
    walls = {}
    for mode in (["on", "off"] if args.helpers == "both" else [args.helpers]):
        with tempfile.TemporaryDirectory(prefix="npllama-kernels-") as cache:
            wall, _, out, _ = run_child([sys.executable, "-c", FRESH, path, str(args.threads or ""), SKY, str(tokens)],
                                        env=empty_cache(cache, mode == "on"))
        r = json.loads(out.splitlines()[-1])
        walls[mode] = sum(r["wall"])
        print_first_reply(mode, r, wall, tokens)
    if len(walls) == 2:
        print(f"helpers on / off: the first reply {walls['on']:.1f} s / {walls['off']:.1f} s = "
              f"{walls['on'] / walls['off']:.2f}")
    cmd = [sys.executable, "-m", "npllama", "run", "--temp", "0", "-n", str(tokens), SKY]
    cmd += (["-m", path] if args.model else []) + (["-t", str(args.threads)] if args.threads else [])
    helpers = args.helpers != "off"
    with tempfile.TemporaryDirectory(prefix="npllama-kernels-") as cache:
        wall, rss, out, err = run_child(cmd, env=empty_cache(cache, helpers))
    print(f"`npllama run --temp 0 -n {tokens} \"{SKY}\"`, empty kernel cache, helpers {'on' if helpers else 'off'}: "
          f"wall {wall:.1f} s, peak RSS {rss:.0f} MiB (the largest single process, the helper's included)")
    for line in err.replace("\r", "\n").splitlines():
        if line.startswith("npllama: compiled"):
            print(f"  {line.strip()}")
    print(f"  reply: {out[:100]!r}{'...' if len(out) > 100 else ''}")


def print_first_reply(mode: str, r: dict, process: float, tokens: int) -> None:
    """One run of FRESH: its steps, its split, the helper, and the kernels' compile times."""
    wall, comp, wait = r["wall"], r["compile"], r["wait"]
    total = sum(wall)
    print(f"first reply, helpers {mode} (a fresh process, empty kernel cache, {r['threads']} threads, "
          f"{tokens} greedy tokens):")
    print(f"  {'step':30s} {'wall':>8s} {'compiling':>10s} {'waiting for the helper':>23s}")
    for i, step in enumerate(FRESH_STEPS):
        print(f"  {step:30s} {wall[i]:6.2f} s {comp[i]:8.2f} s {wait[i]:21.2f} s")
    print(f"  {'the first reply':30s} {total:6.2f} s {sum(comp):8.2f} s {sum(wait):21.2f} s"
          f"   (the process: {process:.2f} s, Python's start and exit included)")
    opened = wall[1] - comp[1] - wait[1]
    rest = total - wall[0] - opened - sum(comp) - sum(wait)
    print(f"  = import {wall[0]:.2f} + open {opened:.2f} + compile {sum(comp):.2f} + wait for the helper "
          f"{sum(wait):.2f} + compute/the rest {rest:.2f} s")
    h, rec = r["helper"], r["record"]
    if "started" in h:
        job = (f"{rec['kernels']} kernels, {rec['seconds']:.1f} s (its model's load and the job, after its imports)"
               if rec else "no record (it failed: the step was compiled in the process)")
        print(f"  helper process ({h['job']}): started at {h['started']:.2f} s, its record: {job}; "
              f"waited for until {h.get('ended', float('nan')):.2f} s; peak RSS {r['helper_rss']:.0f} MiB")
    n, seconds = r["compilelog"]
    print(f"  main process: {n} kernels compiled in {seconds:.2f} s (compilelog.stats), peak RSS {r['rss']:.0f} MiB")
    print(f"  reply: {r['reply'][:100]!r}{'...' if len(r['reply']) > 100 else ''}")
    kernels = sorted(r["kernels"].items(), key=lambda kv: -kv[1][2])
    print(f"  npllama's functions by exclusive compile time (top {min(TOP, len(kernels))} of {len(kernels)}; "
          f"exclusive: less the npllama functions compiled inside)")
    print(f"    {'exclusive':>9s} {'inclusive':>9s} {'compiles':>8s}  function")
    for name, (count, inclusive, exclusive) in kernels[:TOP]:
        print(f"    {exclusive:7.2f} s {inclusive:7.2f} s {count:8d}  {name}")
    print(f"    {sum(k[2] for _, k in kernels):7.2f} s {'':9s} {sum(k[0] for _, k in kernels):8d}  all of them "
          f"(= the compile above)")


def demo() -> None:
    """`make demo` on a fresh clone of HEAD, with an empty HOME: the install, then the run."""
    tmp = Path(tempfile.mkdtemp(prefix="npllama-demo-"))
    try:
        home, clone = tmp / "home", tmp / "npllama"
        home.mkdir()
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        head = subprocess.run(["git", "-C", str(clone), "log", "-1", "--format=%h %s"], capture_output=True,
                              text=True).stdout.strip()
        # no npllama or Numba settings, no pip cache elsewhere, and the system's python3 (not a venv's)
        env = {k: v for k, v in os.environ.items() if not k.startswith("NPLLAMA_") and k not in (
            "NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PIP_CACHE_DIR", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
        venvs = {os.path.join(d, "bin") for d in (os.environ.get("VIRTUAL_ENV"), sys.prefix)
                 if d and d != sys.base_prefix}
        env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep) if d not in venvs)
        env["HOME"] = str(home)
        print(f"make demo on a fresh clone of {head[:70]!r}, HOME empty:")
        wall, rss, _, _ = run_child(["make", ".venv/.installed-demo"], cwd=clone, env=env)
        print(f"  install (make .venv/.installed-demo)  {wall:6.1f} s")
        run, rss, out, err = run_child(["make", "demo"], cwd=clone, env=env)
        print(f"  run (make demo: the model's download, the compile, a reply of up to 256 tokens)  {run:6.1f} s, "
              f"peak RSS {rss:.0f} MiB")
        print(f"  total  {wall + run:6.1f} s")
        for line in err.replace("\r", "\n").splitlines():
            if line.startswith(("npllama: compiled", "npllama: fetching")):
                print(f"  {line.strip()}")
        reply = out.splitlines()[-1] if out else ""
        print(f"  reply: {reply[:100]!r}{'...' if len(reply) > 100 else ''}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_child(cmd: list[str], cwd=ROOT, env: dict | None = None) -> tuple[float, float, str, str]:
    """Wall seconds, peak RSS in MiB (of the largest single process: `cmd` or one of its children,
    as wait4 counts them) and the standard output and error of `cmd` in a fresh process."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=cwd, env=env)
    errs = []  # stderr drained beside stdout, so that a child's full stderr pipe cannot stall it
    drain = threading.Thread(target=lambda: errs.append(p.stderr.read()))
    drain.start()
    out = p.stdout.read()
    drain.join()
    err = errs[0]
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed: {(err.decode().strip().splitlines() or ['?'])[-1]}")
    return wall, usage.ru_maxrss / 1024, out.decode().strip(), err.decode()


if __name__ == "__main__":
    main()
