"""Decode-product throughput of the npllama.kernels.quants kernels against this machine's read bandwidth.

Measures, in one run:
  1. read bandwidth: a Numba parallel sum over a large float32 array (best of several);
  2. for the default model's weight shapes and types (SmolLM2-135M Q4_1 layers, Q8_0 token
     embedding), the decode product y = W @ x in GB/s of weight bytes, cycling over enough
     copies of each matrix that the weights come from DRAM rather than cache (median call time).

With --kquants, instead: the products of the K-quant mixes' types and shapes (SmolLM2-135M and
Gemma 3 270M as llama.cpp's Q4_K_M/Q5_K_M make them: Q5_0/Q5_1 where rows are not whole
256-element super-blocks, Q4_K/Q5_K/Q6_K where they are) by the direct block dots
(quants._matvec: float32 activations, the exact mode's decode products before its int24
panels), by dequantizing each row into a float32 scratch and dotting it (the decode step's path
for these types before the direct dots; kept here as the reference), by the int8-activation
dots (quants_int8._matvec_i8) and by the panel products with int24 activations (the exact mode's
decode products: kernels/panels.py, one activation row), x quantized once outside the timing,
each pass cycling over the copies from inside compiled code, interleaved; median of the passes.

Usage: python bench/bench_kernels.py [--threads N] [--min-mb MB] [--repeats R] [--kquants]
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

from npllama.kernels import quants
from npllama.kernels import panels, quants_int8
from npllama.kernels.qtypes import type_mask

from machine import print_cpu

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


KQUANT_SHAPES = [  # (what, type, rows, cols)
    ("smollm2 gate/up 1536x576", QT.Q4_1, 1536, 576),   # for comparison: Q4_1, Q8_0
    ("smollm2 gate/up 1536x576", QT.Q8_0, 1536, 576),
    ("smollm2 q/o 576x576", QT.Q5_0, 576, 576),
    ("smollm2 gate/up 1536x576", QT.Q5_0, 1536, 576),
    ("smollm2 gate/up 1536x576", QT.Q5_1, 1536, 576),
    ("smollm2 down 576x1536", QT.Q4_K, 576, 1536),
    ("smollm2 down 576x1536", QT.Q5_K, 576, 1536),
    ("smollm2 down 576x1536", QT.Q6_K, 576, 1536),
    ("gemma3 gate/up 2048x640", QT.Q5_0, 2048, 640),
    ("gemma3 o 640x1024", QT.Q4_K, 640, 1024),
    ("gemma3 down 640x2048", QT.Q4_K, 640, 2048),
    ("gemma3 down 640x2048", QT.Q6_K, 640, 2048),
    ("q3_k 576x1536", QT.Q3_K, 576, 1536),
    ("q2_k 576x1536", QT.Q2_K, 576, 1536),
]


def parse_args(doc: str, repeats: int, repeats_help: str) -> argparse.Namespace:
    """The options every kernel benchmark takes: --threads, --min-mb, --repeats."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2, help="Numba threads (default 2)")
    ap.add_argument("--min-mb", type=int, default=128,
                    help="total MB of weight copies cycled per shape, well above the last-level cache (default 128)")
    ap.add_argument("--repeats", type=int, default=repeats, help=f"{repeats_help} (default {repeats})")
    if doc == __doc__:
        ap.add_argument("--kquants", action="store_true", help="the K-quant mixes' products (see above)")
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

    mask = type_mask([qtype])

    def kernel(i):
        quants._matvec(mask, code, ws[i], x, out)

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


# not cached: numba's cache does not notice changes in the kernels these call
@njit(parallel=True, fastmath={"reassoc", "contract", "nsz", "arcp"})
def _matvec_deq(mask, code, data, x, out):
    """out = W x by dequantizing each row into a float32 scratch, then dotting it."""
    rows = data.shape[0]
    per = quants._task_rows(rows)
    for c in prange((rows + per - 1) // per):
        row = np.empty(x.shape[0], np.float32)
        for r in range(c * per, min(rows, (c + 1) * per)):
            quants._prefetch_ahead(data, r)
            quants._deq_row(mask, code, data[r], row)
            acc = np.float32(0.0)
            for i in range(x.shape[0]):
                acc += row[i] * x[i]
            out[r] = acc


@njit
def _pass(kind, mask, code, ws, x, qs, d, s, out):
    for i in range(ws.shape[0]):
        if kind == 0:
            quants._matvec(mask, code, ws[i], x, out)
        elif kind == 1:
            _matvec_deq(mask, code, ws[i], x, out)
        else:
            quants_int8._matvec_i8(mask, code, ws[i], x, qs, d, s, out)


@njit
def _pass_panels(mask, code, pws, rows, xr, out):
    for i in range(pws.shape[0]):
        panels._matmul_panels(mask, code, pws[i], rows, xr, out)


def random_weight(qtype: QT, rows: int, cols: int, rng) -> np.ndarray:
    """Random block bytes with small float16 scales (gguf cannot quantize to K-quants)."""
    from gguf.constants import GGML_QUANT_SIZES
    block, size = GGML_QUANT_SIZES[qtype]
    w = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets = {QT.Q4_1: (0, 2), QT.Q8_0: (0,), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2),
               QT.Q5_K: (0, 2), QT.Q6_K: (208,)}[qtype]
    for o in offsets:
        w[..., o:o + 2] = rng.normal(0.0, 0.001, (rows, cols // block)).astype(np.float16)[..., None].view(np.uint8)
    return w.reshape(rows, -1)


def bench_kquants(args, bw: float) -> None:
    print("times: best pass; speedup: median over passes of deq+dot / direct in the same pass, and its range")
    print(f"{'matrix':<26}{'type':<6}{'MB':>6}{'direct us':>10}{'GB/s':>6}{'deq+dot us':>11}{'GB/s':>6}"
          f"{'speedup':>8}{'int8 us':>9}{'GB/s':>6}{'of bw':>6}{'range':>11}{'int24 us':>10}{'GB/s':>6}{'of bw':>6}")
    rng = np.random.default_rng(0)
    for what, qtype, rows, cols in KQUANT_SHAPES:
        w = random_weight(qtype, rows, cols, rng)
        copies = max(2, math.ceil(args.min_mb * (1 << 20) / w.nbytes))
        ws = np.empty((copies,) + w.shape, np.uint8)
        ws[:] = w
        x = rng.normal(0.0, 1.0, cols).astype(np.float32)
        qs, d, s = quants_int8.quantize_x(x)
        out = np.empty(rows, np.float32)
        kinds = range(4 if panels.has_panels(qtype) else 3)  # Q3_K and Q2_K have no panels
        pws = np.stack([panels.pack_panels(w, qtype)] * copies) if len(kinds) == 4 else None
        xr = panels.quantize_rows_i24(x.reshape(1, cols))

        def run(k):
            if k < 3:
                _pass(k, type_mask([qtype]), int(qtype), ws, x, qs, d, s, out)
            else:
                _pass_panels(type_mask([qtype]), int(qtype), pws, rows, xr, out.reshape(1, rows))
        times = {k: [] for k in kinds}
        for k in times:
            run(k)
        for _ in range(args.repeats):  # interleaved, so drifting load hits all alike
            for k in times:
                t = time.perf_counter()
                run(k)
                times[k].append((time.perf_counter() - t) / copies)
        us = [float(np.min(times[k])) * 1e6 for k in kinds]
        gbs = [w.nbytes / 1e3 / u for u in us]
        ratio = np.array(times[1]) / np.array(times[0])  # per pass: the same load for both
        print(f"{what:<26}{qtype.name:<6}{w.nbytes / 1e6:>6.2f}{us[0]:>10.1f}{gbs[0]:>6.1f}{us[1]:>11.1f}{gbs[1]:>6.1f}"
              f"{np.median(ratio):>8.2f}{us[2]:>9.1f}{gbs[2]:>6.1f}{gbs[2] / bw:>6.0%}"
              f"{ratio.min():>7.2f}-{ratio.max():.2f}"
              + (f"{us[3]:>10.1f}{gbs[3]:>6.1f}{gbs[3] / bw:>6.0%}" if len(us) == 4 else f"{'-':>10}"))


def main() -> None:
    args = parse_args(__doc__, 5, "passes over the copies; products report the median call, bandwidth the best pass")
    print_cpu()
    bw = start(args)
    if args.kquants:
        print(f"threads: {args.threads}   int8 dots: {quants_int8.DOT_ISA}   "
              f"read bandwidth (parallel sum, 512 MB float32): {bw:.1f} GB/s\n")
        bench_kquants(args, bw)
        return
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
