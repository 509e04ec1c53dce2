"""Portable CPU targets: machine code compiled for a named baseline rather than for this CPU,
so that one machine can fill the kernel cache for a cluster of machines like it.

Numba compiles for the CPU it runs on, and its cache keys each kernel by that CPU's name and
features: machine code compiled on one CPU is loaded only by processes compiling for the same
CPU and features, so it never runs on a poorer one. A process with $NPLLAMA_TARGET set (one
of `TARGETS`) compiles and loads for that target instead, wherever it runs, as
`npllama compile --target NAME` did; on a CPU that lacks one of the target's features it
refuses with an error that names them, before anything is compiled. npllama's kernels choose
their instructions from the same features (kernels/cpu.py).

No Numba here: `apply` sets Numba's environment before Numba reads it at its import.
"""
from __future__ import annotations

import os
import sys

_V3 = "avx avx2 bmi bmi2 cx16 f16c fma lzcnt movbe popcnt sse4.1 sse4.2 ssse3 xsave"
# LLVM's CPU name and the features (LLVM's names) of each target: x86-64-v3 (Haswell and later,
# Zen 1-3: AVX2 and FMA), x86-64-v4 (Skylake-X and later, Zen 4: AVX-512 F/BW/CD/DQ/VL)
TARGETS = {
    "x86-64-v3": ("x86-64-v3", _V3),
    "x86-64-v4": ("x86-64-v4", _V3 + " avx512f avx512bw avx512cd avx512dq avx512vl"),
}
VARIABLE = "NPLLAMA_TARGET"


def environment(name: str) -> dict[str, str]:
    """Numba's environment for compiling for target `name`; ValueError for an unknown target,
    or one whose features this CPU lacks (its kernels run where they are compiled and loaded)."""
    if name not in TARGETS:
        raise ValueError(f"unknown CPU target {name!r}: use one of {', '.join(TARGETS)}")
    import platform  # here: 2.5 ms of every `import npllama` otherwise
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"the CPU target {name} is for x86-64 machines; this one is {platform.machine()}")
    import llvmlite.binding as llvm
    cpu, features = TARGETS[name]
    host = {k for k, v in llvm.get_host_cpu_features().items() if v}
    missing = sorted(set(features.split()) - host)
    if missing:
        raise ValueError(f"this CPU lacks {', '.join(missing)}, which target {name} needs: compile and run "
                         f"for {name} on machines that have them (unset ${VARIABLE} to compile for this one)")
    return {"NUMBA_CPU_NAME": cpu, "NUMBA_CPU_FEATURES": ",".join("+" + f for f in features.split())}


def apply() -> None:
    """Compile for $NPLLAMA_TARGET where it is set (`environment`), before Numba reads its
    settings; ValueError where it names a target this CPU cannot run, or Numba was imported
    first with other settings."""
    name = os.environ.get(VARIABLE)
    if not name:
        return
    env = environment(name)
    if "numba" in sys.modules:
        from numba.core import config
        if (config.CPU_NAME, config.CPU_FEATURES) != (env["NUMBA_CPU_NAME"], env["NUMBA_CPU_FEATURES"]):
            raise ValueError(f"${VARIABLE}={name} must be set before Numba is imported (import npllama first, "
                             f"or set NUMBA_CPU_NAME={env['NUMBA_CPU_NAME']} and "
                             f"NUMBA_CPU_FEATURES={env['NUMBA_CPU_FEATURES']})")
    os.environ.update(env)
