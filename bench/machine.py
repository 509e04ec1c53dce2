"""The machine a benchmark runs on, in one line: the CPU's model name and the instruction sets
npllama's kernels can use (/proc/cpuinfo, else LLVM's view of the host), the int8 dot path they
compile for, whether the panel products use AMX tiles, and $NPLLAMA_TARGET where it is set.
Importing the kernel modules compiles nothing."""
from __future__ import annotations

import os
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")

# (what, its /proc/cpuinfo flags, LLVM's names for them)
FEATURES = [
    ("AVX-512", ("avx512f",), ("avx512f",)),
    ("VNNI", ("avx512_vnni", "avx_vnni"), ("avx512vnni", "avxvnni")),
    ("AMX", ("amx_tile", "amx_int8", "amx_bf16"), ("amx-tile", "amx-int8", "amx-bf16")),
    ("AVX2", ("avx2",), ("avx2",)),
    ("F16C", ("f16c",), ("f16c",)),
]


def describe_cpu() -> str:
    """One line: the CPU's model name and count, its FEATURES, npllama's int8 dot path
    (quants_int8.DOT_ISA), whether AMX tiles are used (cpu.AMX) and $NPLLAMA_TARGET."""
    import llvmlite.binding as llvm
    from npllama.kernels import cpu, quants_int8
    from npllama.targets import VARIABLE
    try:
        lines = CPUINFO.read_text().splitlines()
    except OSError:
        lines = []
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in reversed(lines))}  # CPU 0's flags
    name = cpu.model_name(str(CPUINFO))
    if "flags" in field:
        flags, column = set(field["flags"].split()), 1
    else:
        try:
            flags = {k for k, v in llvm.get_host_cpu_features().items() if v}
        except RuntimeError:  # LLVM cannot read this host's features
            flags = set()
        column = 2

    def has(feature: tuple) -> str:
        found = [n for n in feature[column] if n in flags]
        return "no" if not found else "yes" if len(feature[column]) == 1 else f"yes ({', '.join(found)})"
    target = os.environ.get(VARIABLE)
    return (f"CPU: {name}, {os.cpu_count()} CPUs; " + ", ".join(f"{f[0]} {has(f)}" for f in FEATURES)
            + f"; int8 dots {quants_int8.DOT_ISA}, AMX tiles {'yes' if cpu.AMX else 'no'}"
            + (f"; {VARIABLE}={target}" if target else ""))


def print_cpu() -> None:
    """Print `describe_cpu()`'s line."""
    print(describe_cpu(), flush=True)
