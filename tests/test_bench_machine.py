"""bench/machine.py: the one line that names the machine at the start of every benchmark."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import machine  # noqa: E402
from npllama.kernels import cpu, quants_int8  # noqa: E402


def test_describe_cpu_names_the_model_and_the_kernels_paths(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    cpu0 = "model name\t: Test CPU 9000\nflags\t\t: fpu avx2 f16c avx_vnni amx_tile amx_int8\n"
    info.write_text(f"processor\t: 0\n{cpu0}\nprocessor\t: 1\nmodel name\t: Other\nflags\t\t: fpu\n")
    monkeypatch.setattr(machine, "CPUINFO", info)
    monkeypatch.setenv("NPLLAMA_TARGET", "x86-64-v3")
    line = machine.describe_cpu()
    assert "\n" not in line and line.startswith("CPU: Test CPU 9000, ")
    assert "AVX-512 no, VNNI yes (avx_vnni), AMX yes (amx_tile, amx_int8), AVX2 yes, F16C yes" in line
    assert f"int8 dots {quants_int8.DOT_ISA}, AMX tiles {'yes' if cpu.AMX else 'no'}" in line
    assert line.endswith("; NPLLAMA_TARGET=x86-64-v3")


def test_describe_cpu_without_proc_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.setattr(machine, "CPUINFO", tmp_path / "missing")
    monkeypatch.delenv("NPLLAMA_TARGET", raising=False)
    line = machine.describe_cpu()
    assert "\n" not in line and line.startswith("CPU: ") and "AMX " in line
    assert f"int8 dots {quants_int8.DOT_ISA}" in line and "NPLLAMA_TARGET" not in line
