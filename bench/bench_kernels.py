"""Decode-product throughput of the npllama.quants kernels against this machine's read bandwidth.

Measures, in one run:
  1. read bandwidth: a Numba parallel sum over a large float32 array (best of several);
  2. for the default model's weight shapes and types (SmolLM2-135M Q4_1 layers, Q8_0 token
     embedding), the decode product y = W @ x in GB/s of weight bytes, cycling over enough
     copies of each matrix that the weights come from DRAM rather than cache (median call time).

Usage: python bench/bench_kernels.py [--threads N] [--min-mb MB] [--repeats R]
"""
from __future__ import annotations

import argparse
import math
import os
import time

import numba
import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize
from numba import njit, prange

from npllama import quants

SHAPES = [  # (what, type, rows = out features, cols = in features)
    ("attn q/o, 576x576", QT.Q4_1, 576, 576),
    ("attn k/v, 192x576", QT.Q4_1, 192, 576),
    ("ffn gate/up, 1536x576", QT.Q4_1, 1536, 576),
    ("ffn down, 576x1536", QT.Q4_1, 576, 1536),
    ("token embd, 49152x576", QT.Q8_0, 49152, 576),
]


@njit(parallel=True, cache=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _sum(a):
    s = np.float32(0.0)
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def read_bandwidth(mb: int, repeats: int) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s over an ``mb`` MB float32 array."""
    a = np.ones(mb * (1 << 20) // 4, np.float32)
    _sum(a)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        _sum(a)
        best = min(best, time.perf_counter() - t)
    return a.nbytes / best / 1e9


def parse_args(doc: str, repeats: int, repeats_help: str) -> argparse.Namespace:
    """The options every kernel benchmark takes: --threads, --min-mb, --repeats."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--min-mb", type=int, default=128,
                    help="total MB of weight copies cycled per shape, well above the last-level cache (default 128)")
    ap.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} (default {repeats})")
    return ap.parse_args()


def start(args: argparse.Namespace) -> float:
    """Set the thread count, warn when the machine is busy, and return the read bandwidth (GB/s)."""
    numba.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    if load > os.cpu_count() - 0.5:
        print(f"warning: load average {load:.1f} on {os.cpu_count()} CPUs; other processes will skew the timings")
    return read_bandwidth(512, args.repeats)


def bench_product(qtype: QT, rows: int, cols: int, min_mb: int, repeats: int) -> tuple[float, float, float]:
    """(weight MB, median kernel µs, median matmul() µs) per product, cycling over DRAM-resident copies."""
    rng = np.random.default_rng(0)
    w = quantize(rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32), qtype)
    copies = max(2, math.ceil(min_mb * (1 << 20) / w.nbytes))
    ws = np.empty((copies,) + w.shape, np.uint8)
    ws[:] = w
    x = rng.normal(0.0, 1.0, cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    code = int(qtype)

    def kernel(i):
        quants._matvec(code, ws[i], x, out)

    def wrapper(i):
        quants.matmul(ws[i], qtype, x, out=out)

    medians = []
    for fn in (kernel, wrapper):
        fn(0)
        times = []
        for _ in range(repeats):
            for i in range(copies):
                t = time.perf_counter()
                fn(i)
                times.append(time.perf_counter() - t)
        medians.append(float(np.median(times)) * 1e6)
    return w.nbytes / 1e6, medians[0], medians[1]


def main() -> None:
    args = parse_args(__doc__, 5, "passes over the copies; products report the median call, bandwidth the best pass")
    bw = start(args)
    print(f"threads: {args.threads}   read bandwidth (parallel sum, 512 MB float32): {bw:.1f} GB/s\n")
    print(f"{'matrix':<24}{'type':<6}{'MB':>7}{'kernel us':>11}{'GB/s':>7}{'of bw':>7}{'matmul() us':>13}{'GB/s':>7}")
    for what, qtype, rows, cols in SHAPES:
        mb, t_kernel, t_wrap = bench_product(qtype, rows, cols, args.min_mb, args.repeats)
        gbs_k = mb * 1e6 / (t_kernel * 1e-6) / 1e9
        gbs_w = mb * 1e6 / (t_wrap * 1e-6) / 1e9
        print(f"{what:<24}{qtype.name:<6}{mb:>7.2f}{t_kernel:>11.1f}{gbs_k:>7.1f}{gbs_k / bw:>7.0%}"
              f"{t_wrap:>13.1f}{gbs_w:>7.1f}")


if __name__ == "__main__":
    main()
