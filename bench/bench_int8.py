"""Decode products with int8 activations (npllama.kernels.quants_int8) against the float32-activation
kernels (npllama.kernels.quants._matvec), in GB/s of weight bytes read.

For the default model's weight shapes and types (as bench/bench_kernels.py), each pass runs one
product per copy of the matrix, cycling over enough copies that the weights come from DRAM,
from inside compiled code as the fused decode step calls them (no Python dispatch per call).
The int8 columns include quantizing x, once per `share` products as the decode step does
(q/k/v share the normed input, gate/up too; o, down and the output head have their own x).
The "panels" columns: the int8 product on the weight's panels (kernels/panels.py), which the
decode step reads in int8 mode for every type that has them (`panels.has_panels`); the "int24"
columns: the same with int24 activations, the exact mode's decode products (f32: its products
before). Reported: median over passes of the mean time per product.

Usage: python bench/bench_int8.py [--threads N] [--min-mb MB] [--repeats R]
"""
from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.quants import quantize
from numba import njit

from npllama.kernels import panels, quants, quants_int8
from npllama.kernels.qtypes import type_mask

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_kernels import parse_args, start  # noqa: E402
from machine import print_cpu  # noqa: E402

SHAPES = [  # (what, type, rows = out features, cols = in features, products sharing one x)
    ("attn q, 576x576", QT.Q4_1, 576, 576, 3),
    ("attn o, 576x576", QT.Q4_1, 576, 576, 1),
    ("attn k/v, 192x576", QT.Q4_1, 192, 576, 3),
    ("ffn gate/up, 1536x576", QT.Q4_1, 1536, 576, 2),
    ("ffn down, 576x1536", QT.Q4_1, 576, 1536, 1),
    ("output, 49152x576", QT.Q8_0, 49152, 576, 1),
]


# not cached: numba's cache does not notice changes in the kernels these call
@njit
def _pass_f32(mask, code, ws, x, out):
    for i in range(ws.shape[0]):
        quants._matvec(mask, code, ws[i], x, out)


@njit
def _pass_i8(mask, code, ws, x, qs, d, s, out, share):
    for i in range(ws.shape[0]):
        if i % share == 0:
            quants_int8._quantize_x_q8(x, qs, d, s)
        quants_int8._matvec_i8(mask, code, ws[i], x, qs, d, s, out)


@njit
def _pass_panels(mask, code, pws, rows, x, xr, out, share):
    for i in range(pws.shape[0]):
        if i % share == 0:
            panels._quantize_into(x, xr)
        panels._matmul_panels(mask, code, pws[i], rows, xr, out)


@njit
def _pass_quantize(x, qs, d, s, k):
    for _ in range(k):
        quants_int8._quantize_x_q8(x, qs, d, s)


def bench_shape(qtype: QT, rows: int, cols: int, share: int, min_mb: int, repeats: int):
    """(weight MB, f32 µs, int8 µs, int8 on the panels µs, int24 on the panels µs, quantize µs)
    per product."""
    rng = np.random.default_rng(0)
    w = quantize(rng.normal(0.0, 0.02, (rows, cols)).astype(np.float32), qtype)
    copies = max(2, math.ceil(min_mb * (1 << 20) / w.nbytes))
    copies = -(-copies // share) * share
    ws = np.empty((copies,) + w.shape, np.uint8)
    ws[:] = w
    x = rng.normal(0.0, 1.0, cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    qs = np.empty(cols, np.int8)
    d = np.empty(cols // 32, np.float32)
    s = np.empty(cols // 32, np.float32)
    code, mask = int(qtype), type_mask([qtype])
    runs = {"f32": lambda: _pass_f32(mask, code, ws, x, out),
            "i8": lambda: _pass_i8(mask, code, ws, x, qs, d, s, out, share)}
    pws = np.stack([panels.pack_panels(w, qtype)] * copies)
    x2, out2 = x.reshape(1, cols), out.reshape(1, rows)
    xr, xr24 = panels.quantize_rows(x2), panels.quantize_rows_i24(x2)
    runs["panels"] = lambda: _pass_panels(mask, code, pws, rows, x2, xr, out2, share)
    runs["int24"] = lambda: _pass_panels(mask, code, pws, rows, x2, xr24, out2, share)
    times = {k: [] for k in runs}
    for fn in runs.values():
        fn()
    for _ in range(repeats):      # interleaved, so drifting load hits both alike
        for k, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[k].append((time.perf_counter() - t) / copies)
    k = 10000
    _pass_quantize(x, qs, d, s, 1)
    t = time.perf_counter()
    _pass_quantize(x, qs, d, s, k)
    t_q = (time.perf_counter() - t) / k
    t_us = {k: float(np.median(v)) * 1e6 for k, v in times.items()}
    return w.nbytes / 1e6, t_us["f32"], t_us["i8"], t_us["panels"], t_us["int24"], t_q * 1e6


def main() -> None:
    args = parse_args(__doc__, 7, "passes over the copies")
    print_cpu()
    bw = start(args)
    print(f"threads: {args.threads}   vpdpbusd: {quants_int8.VNNI}   "
          f"read bandwidth (parallel sum, 512 MB float32): {bw:.1f} GB/s\n")
    print(f"{'matrix':<24}{'type':<6}{'MB':>6}{'share':>6}{'f32 us':>9}{'GB/s':>7}"
          f"{'int8 us':>9}{'GB/s':>7}{'of bw':>7}{'int8/f32':>9}{'panels us':>10}{'GB/s':>7}{'of bw':>7}"
          f"{'int24 us':>9}{'GB/s':>7}{'of bw':>7}{'quant x us':>11}")
    for what, qtype, rows, cols, share in SHAPES:
        mb, t32, t8, tp, t24, tq = bench_shape(qtype, rows, cols, share, args.min_mb, args.repeats)
        g32, g8 = mb * 1e3 / t32, mb * 1e3 / t8
        packed = (f"{tp:>10.1f}{mb * 1e3 / tp:>7.1f}{mb * 1e3 / tp / bw:>7.0%}"
                  f"{t24:>9.1f}{mb * 1e3 / t24:>7.1f}{mb * 1e3 / t24 / bw:>7.0%}")
        print(f"{what:<24}{qtype.name:<6}{mb:>6.2f}{share:>6}{t32:>9.1f}{g32:>7.1f}"
              f"{t8:>9.1f}{g8:>7.1f}{g8 / bw:>7.0%}{g8 / g32:>9.2f}{packed}{tq:>11.2f}")


if __name__ == "__main__":
    main()
