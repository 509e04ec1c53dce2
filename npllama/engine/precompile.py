"""A model's kernels compiled before they are needed: in a helper process beside a first prompt,
or all of them ahead of time (`npllama compile`).

Numba compiles in one thread, under a lock a process holds for the whole compile, and a
machine that has never run npllama compiles two large groups of kernels before its first
reply: the prompt's (the packed layers, the products, attention) and the fused decode step,
each about half of the time. A prompt looks for the decode step in the cache before it runs
(`DecodePlan.load`); where it is not there, a helper process (`start`) compiles it beside the
prompt's own compile, into the same kernel cache, and the first decoded token waits for the
helper (`Helper.wait`) and loads what it saved. On two cores the first reply comes in about
half the time. A helper that fails, or cannot be started, costs nothing but the time: the
decode step is then compiled in the process, as before. $NPLLAMA_COMPILE_HELPERS=0 turns
helpers off (each helper sets it, so that helpers start none of their own).

`npllama compile` runs the same jobs (`JOBS`) for a model in both modes, several at a time,
so that an image, a CI cache or a cluster's workers start with every kernel compiled; with
`--target` for a named portable CPU (cpu.TARGETS) rather than this one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

from ..kernels import compilelog
from ..kernels.cachestamp import cache_root

HELPERS = "NPLLAMA_COMPILE_HELPERS"  # "0": no helper processes
_WAIT = 1800.0  # seconds a first token waits for a helper at most; then it compiles itself


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
    from ..generation.scheduler import generate_many
    list(generate_many(model, [_prompt(model), _prompt(model)[:5]], max_tokens=3, temperature=0))


JOBS = {"prefill": _prefill, "decode": _decode, "batch": _batch}


def command(job: str, path, activations: str, kv_dtype, threads: int) -> list[str]:
    """The command line of a process that runs `job` for the model at `path`."""
    return [sys.executable, "-m", __name__, job, str(path), activations, str(np.dtype(kv_dtype)), str(threads)]


def environment(**extra) -> dict:
    """A helper's environment: this one's, with helpers of its own turned off."""
    return {**os.environ, HELPERS: "0", **extra}


class Helper:
    """A process compiling one job's kernels for this one (`start`)."""

    def __init__(self, job: str, proc: subprocess.Popen):
        self.job, self.proc = job, proc

    def wait(self) -> bool:
        """Wait for the helper (shown by compilelog as its job being compiled); whether it
        finished well. A helper still running after _WAIT seconds is stopped."""
        with compilelog.elsewhere(f"{self.job} (in a helper process)") as shown:
            try:
                out, _ = self.proc.communicate(timeout=_WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.communicate()
                return False
            if self.proc.returncode != 0:
                return False
            try:
                shown.kernels = int(json.loads(out.splitlines()[-1])["kernels"])
            except (ValueError, KeyError, IndexError, TypeError):
                pass
            return True


def start(model, job: str) -> Helper | None:
    """A helper process compiling `job` for `model` (a model file's, in its mode), or None where
    helpers are turned off or one cannot be started."""
    if os.environ.get(HELPERS) == "0":
        return None
    try:
        proc = subprocess.Popen(command(job, model.path, model.activations, model.kv_dtype, model.threads),
                                env=environment(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    except OSError:
        return None
    return Helper(job, proc)


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
    from ..model import load
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
