"""Peak memory of a long session: the model file, the KV cache, and everything else.

    python bench/bench_memory.py [--tokens 4096] [--model PATH] [--kv-dtype float16] [--activations int8]
                                 [--llama-cpp]

Prints peak RSS (which counts the memory-mapped weights once they are read), the model file
size, the KV cache size, the runtime's own footprint (Python, NumPy, Numba and its LLVM JIT,
measured before the model is touched), the weights' panels (what the products read) where they
are mapped from the model cache, and what is left over (which holds the panels where this process
packed them), then what the runtime is made of: LLVM's shared library, and whether Numba
imported SciPy (it does at its first compile or cache load when SciPy is installed, for
BLAS). With --llama-cpp, the same tokens through llama-cpp-python in a fresh process of the
references' python (../shared/tools/setup-refs.sh, or $NPLLAMA_REF_PY), with a context of the
session's capacity and its float16 cache, flash attention off (its default) and on: their
peak RSS beside npllama's. Never a pass/fail test.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_compare import ref_python  # noqa: E402
from machine import print_cpu  # noqa: E402

# Runs inside the references' python: argv = gguf path, context size, flash attention (0/1), ids
# json. Prints the process's peak RSS in MiB after the prompt and one more token: VmHWM, its
# own memory's high-water mark (getrusage's ru_maxrss would start from this process's RSS at
# the fork that made the child).
LLAMA_CPP = r'''
import json, sys
from llama_cpp import Llama
ids = json.loads(sys.argv[4])
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), n_threads=2, n_threads_batch=2,
            flash_attn=sys.argv[3] == "1", verbose=False)
llm.eval(ids[:-1])
llm.eval(ids[-1:])
print(next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024)
'''


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--model")
    ap.add_argument("--kv-dtype", choices=["float32", "float16"],
                    help="KV cache storage (default: the mode's, float16 with --activations int8, else float32)")
    ap.add_argument("--activations", default="f32", choices=["f32", "int8"], help="decode activations")
    ap.add_argument("--llama-cpp", action="store_true", help="also llama-cpp-python's peak RSS on the same tokens")
    args = ap.parse_args()
    print_cpu()
    import npllama
    from npllama.gguf import panelfile
    from npllama.kernels import quants
    from npllama.kernels.codepages import resident_mib
    quants.dequantize(np.zeros((1, 34), np.uint8), 8)  # start Numba's JIT: part of the runtime
    runtime, llvm, scipy = rss_mib(), resident_mib("libllvmlite"), "scipy" in sys.modules
    m = npllama.load(args.model, kv_dtype=args.kv_dtype, activations=args.activations)
    s = m.session()
    ids = np.random.default_rng(0).integers(100, m.config.n_vocab - 100, args.tokens)
    t0 = time.perf_counter()
    s.feed(ids[:-1])
    s.feed(ids[-1:])
    dt = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    file_mib = resident_mib(os.path.realpath(m.path))  # the rows with panels leave the resident set as they are packed
    mapped = resident_mib(str(panelfile.directory()))  # the panels, where mapped from the model cache
    kv = s.cache.nbytes / 2**20
    print(f"{args.tokens}-token session ({dt:.1f} s): peak RSS {peak:.0f} MiB = model file {file_mib:.0f} "
          f"(resident, of {os.path.getsize(m.path) / 2**20:.0f}) + panels mapped from the model cache {mapped:.0f} "
          f"+ KV cache {kv:.0f} ({s.cache.dtype}, capacity {s.cache.capacity}) + runtime {runtime:.0f} "
          f"+ other {peak - file_mib - mapped - kv - runtime:.0f} MiB")
    panels = m.panel_arena.nbytes / 2**20
    print(f"the panels of the products: {panels:.0f} MiB, " + ("mapped from the model cache (gguf/panelfile.py)"
                                                              if mapped else "packed in this process (in 'other')"))
    print(f"runtime: LLVM's library {llvm:.0f} MiB resident; Numba imported SciPy for its BLAS bindings: "
          f"{'yes' if scipy else 'no'}")
    if args.llama_cpp:
        py = ref_python()
        if py is None:
            print("llama-cpp-python: skipped (no references' python; run ../shared/tools/setup-refs.sh)")
            return
        for fa in (0, 1):
            out = subprocess.run([py, "-c", LLAMA_CPP, m.path, str(s.cache.capacity), str(fa),
                                  json.dumps(ids.tolist())], capture_output=True, text=True, check=True)
            theirs = float(out.stdout.split()[-1])
            print(f"llama-cpp-python, flash attention {'on' if fa else 'off'}, n_ctx {s.cache.capacity}, float16 "
                  f"cache: peak RSS {theirs:.0f} MiB; npllama / llama-cpp-python {peak / theirs:.2f}")


if __name__ == "__main__":
    main()
