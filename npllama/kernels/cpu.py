"""What the compilation target's CPU offers the kernels, read once at import: its features
(the int8 dots' instruction set follows them, quants_int8.DOT_ISA, and attention's pass
widths) and whether the panel products may use AMX tiles. No kernels here: the cache's stamp
(cachestamp) reads `AMX` while the kernel modules are being loaded."""
from __future__ import annotations

import ctypes
import os
import platform
import sys

import llvmlite.binding as llvm
from numba import config as numba_config

__all__ = ["AMX", "FEATURES", "model_name", "target_features"]


def target_features() -> set[str]:
    """CPU features of numba's compilation target (NUMBA_CPU_FEATURES, else the host's)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return set()
    features = numba_config.CPU_FEATURES
    if features is None:
        return {k for k, v in llvm.get_host_cpu_features().items() if v}
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def model_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name: the first in `cpuinfo`, else the platform's word for it, else "?"."""
    try:
        with open(cpuinfo) as f:
            name = next((line.partition(":")[2].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        name = ""
    return name or platform.processor() or "?"


def amx_ready(features) -> bool:
    """Whether the panel products of many rows may use AMX tiles: not turned off
    ($NPLLAMA_AMX=0), the target has AMX-INT8 (which LLVM reports only where the OS saves the
    tiles' state), and Linux lets this process use the tile data (arch_prctl
    ARCH_REQ_XCOMP_PERM, once for all its threads; an instruction on tiles faults without it)."""
    if (os.environ.get("NPLLAMA_AMX") == "0" or not {"amx-tile", "amx-int8"} <= features
            or not sys.platform.startswith("linux")):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA


FEATURES: set[str] = target_features()

AMX: bool = amx_ready(FEATURES)
"""Whether the panel products of many activation rows (panels._AMX_ROWS) use AMX tiles
(panels._make_panel_dots_amx). Compiled code reads it and Numba's key (the CPU's name and
features) does not hold it, so it is part of the kernels' cache stamp (cachestamp)."""
