"""`npllama compile`: every kernel a model runs, compiled ahead of its first use, so that an
image, a CI cache or a cluster's workers start with them all; and the program a helper process
runs (engine/precompile.py).

A job (`JOBS`) runs a small piece of work of one kind on a model, which compiles (or loads)
the kernels that kind of work runs: a prompt's, the fused decode step's, continuous
batching's. `compile_all` runs every job in each mode in processes of their own, several at a
time (Numba compiles in one thread a process); `--target` runs them for a portable CPU
(npllama/targets.py) rather than for this one.

    python -m npllama.compile JOB PATH ACTIVATIONS KV_DTYPE THREADS
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np

from .engine.precompile import command, environment
from .kernels import compilelog


def _prompt(model) -> np.ndarray:
    """Eight valid token ids: a prompt for the jobs (any ids: only their kernels matter)."""
    return np.arange(8, dtype=np.int64) % model.config.n_vocab


def _decode(model) -> None:
    """The fused decode step, compiled (or loaded) without running it."""
    if not model.config.n_expert:
        model.decode_plan.load(model.new_cache(16), model.threads, helper=False)


def _prefill(model) -> None:
    """A prompt's kernels: its packed layers, products, attention and output head (every
    row's logits, which keeps the decode step out: `_decode` is its own job)."""
    model.session(ctx=32).feed(_prompt(model), all_logits=True)


def _batch(model) -> None:
    """Continuous batching's kernels: two prompts through the paged pool, decoded together."""
    from .generation.scheduler import generate_many
    list(generate_many(model, [_prompt(model), _prompt(model)[:5]], max_tokens=3, temperature=0))


JOBS = {"prefill": _prefill, "decode": _decode, "batch": _batch}


def compile_all(path, modes, jobs: int, env: dict):
    """Run every job of `JOBS` for the model at `path` in each of the activation `modes`, in
    processes `jobs` at a time with `env` added to their environment (a CPU target's): yields
    each job's record (`run_job`, with its "activations", and "error" where it failed) as it
    ends."""
    todo = [(job, mode) for mode in modes for job in JOBS]
    running = []
    while todo or running:
        while todo and len(running) < max(1, jobs):
            job, mode = todo.pop(0)
            kv = "float16" if mode == "int8" else "float32"
            proc = subprocess.Popen(command(job, path, mode, kv, 1), env=environment(**env), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running.append((job, mode, proc))
        time.sleep(0.1)
        for item in [r for r in running if r[2].poll() is not None]:
            running.remove(item)
            job, mode, proc = item
            out, err = proc.communicate()
            try:
                record = json.loads(out.splitlines()[-1])
            except (ValueError, IndexError):
                record = {"job": job, "error": (err.strip().splitlines() or ["no output"])[-1]}
            if proc.returncode != 0:
                record["error"] = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
            yield {**record, "activations": mode}


def run_job(job: str, path, activations: str, kv_dtype, threads: int) -> dict:
    """Run `job` for the model at `path` in this process: {"job", "kernels", "seconds"}, the
    kernels it compiled (not those it loaded) and its time."""
    from .model import load
    t0 = time.perf_counter()
    before = compilelog.stats()[0]
    model = load(path, threads=threads, activations=activations, kv_dtype=kv_dtype)
    with compilelog.job(f"{job} {activations} {'+'.join(sorted(model.file.quant_mix()))}"):
        JOBS[job](model)
    return {"job": job, "kernels": compilelog.stats()[0] - before, "seconds": time.perf_counter() - t0}


def main(argv: list[str]) -> int:
    """`python -m npllama.engine.precompile JOB PATH ACTIVATIONS KV_DTYPE THREADS`: prints the
    job's record (`run_job`) as one line of JSON."""
    job, path, activations, kv_dtype, threads = argv
    print(json.dumps(run_job(job, path, activations, kv_dtype, int(threads))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
