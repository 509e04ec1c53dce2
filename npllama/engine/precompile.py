"""A model's kernels compiled before they are needed: the decode step in a helper process beside
a first prompt.

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

A helper is the program `python -m npllama.compile` (npllama/compile.py), which also runs
`npllama compile`'s jobs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from ..kernels import compilelog

HELPERS = "NPLLAMA_COMPILE_HELPERS"  # "0": no helper processes
_WAIT = 1800.0  # seconds a first token waits for a helper at most; then it compiles itself


def command(job: str, path, activations: str, kv_dtype, threads: int) -> list[str]:
    """The command line of a process that runs `job` for the model at `path`."""
    return [sys.executable, "-m", "npllama.compile", job, str(path), activations, str(np.dtype(kv_dtype)),
            str(threads)]


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
