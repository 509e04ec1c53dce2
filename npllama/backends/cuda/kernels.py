"""The CUDA backend's kernels, in numba-cuda: dequantization and the fused quantized mat-vec of
the weight layouts that `model.upload` makes, RMSNorm, RoPE from the CPU engine's tables, the GLU
activations, and online-softmax (flash) attention split over blocks of keys.

Every kernel runs unchanged in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, NumPy arrays in
place of CuPy's), which is how they are tested on machines without a GPU. Two things differ
between the simulator and a GPU, both fixed at import:
- Reductions across the lanes that share a row take a shared-memory tree in the simulator
  (which has no warp shuffles) and warp shuffles on a GPU (`_lane_sum`);
  NPLLAMA_CUDA_SHARED_REDUCTIONS=1 makes a GPU take the shared-memory form too, for checking
  one form against the other (bench/gpu_check.sh).
- `LANES`, the threads that share one row or one head, is 32 (a warp) on a GPU and 4 in the
  simulator, which runs each thread as a Python thread (~0.1 s per block of 32).
All arithmetic is float32 (integer quants widened to int32 before they multiply).

The wrappers (`matvec`, `dequantize`, `rmsnorm`, `rope`, `glu`, `attention`) take device
arrays (CuPy's, or NumPy's in the simulator), check shapes, and launch.
"""
from __future__ import annotations

import math
import os

import numpy as np

if not hasattr(np, "row_stack"):  # numba-cuda (0.2x) overloads np.row_stack on its first compile;
    np.row_stack = np.vstack      # NumPy 2.5 removed that alias of vstack
from numba import config, cuda, float32, int32  # noqa: E402

SIMULATED = bool(config.ENABLE_CUDASIM)
SHUFFLES = not SIMULATED and os.environ.get("NPLLAMA_CUDA_SHARED_REDUCTIONS") != "1"
LANES = 4 if SIMULATED else 32  # threads per row (mat-vec, norms) and per head (attention)
ROWS_PER_BLOCK = 32 if SIMULATED else 4  # rows of a mat-vec per block of LANES * ROWS_PER_BLOCK threads
_MATVEC_THREADS = LANES * ROWS_PER_BLOCK
_LANE_DIMS = 256 // 4  # head dimensions one lane of attention owns at most: head_dim <= 256, LANES >= 4
SPLIT = 64  # keys per block of attention (flash decoding: blocks of keys merged in order)
_FULL = 0xFFFFFFFF

# weight kinds (model.upload lays each out as scales + quants, or float32 rows): Q8_0 d q; Q4_0
# d (q - 8) and Q4_1 d q + m on nibbles; A8_32 and A8_16 s q + m on a byte an element, per 32 or
# 16 elements (the other quant types, unpacked: Q5_1, Q5_K; Q6_K, Q3_K, Q2_K)
F32, Q8_0, Q4_0, Q4_1, A8_32, A8_16 = 0, 1, 2, 3, 4, 5
ACT_SILU, ACT_GELU_TANH = 0, 1
_GELU_C = float32(math.sqrt(2.0 / math.pi) * 2.0)
_GELU_A = float32(0.044715)


@cuda.jit(device=True, inline=True)
def _lane_sum(v, scratch, lane, base):
    """The sum of `v` over the LANES threads of a row (lanes 0..LANES-1, at scratch[base:]),
    returned to every one of them."""
    if not SHUFFLES:
        scratch[base + lane] = v
        cuda.syncthreads()
        step = LANES // 2
        while step > 0:
            if lane < step:
                scratch[base + lane] += scratch[base + lane + step]
            cuda.syncthreads()
            step //= 2
        total = scratch[base]
        cuda.syncthreads()
        return total
    for off in (16, 8, 4, 2, 1):
        v += cuda.shfl_xor_sync(_FULL, v, off)
    return v


@cuda.jit(device=True, inline=True)
def _weight(kind, scales, quants, row, col):
    """Element (row, col) of a weight of `kind`, dequantized exactly to float32."""
    if kind == F32:
        return scales[row, col, 0]
    if kind == A8_32 or kind == A8_16:
        size = 32 if kind == A8_32 else 16
        blk = col // size
        return scales[row, blk, 0] * float32(int32(quants[row, blk, col % size])) + scales[row, blk, 1]
    blk = col // 32
    j = col % 32
    if kind == Q8_0:
        return scales[row, blk, 0] * float32(int32(quants[row, blk, j]))
    q = quants[row, blk, j % 16]
    nib = int32(q & 15) if j < 16 else int32(q >> 4)
    if kind == Q4_0:
        return scales[row, blk, 0] * float32(nib - 8)
    return scales[row, blk, 0] * float32(nib) + scales[row, blk, 1]


@cuda.jit(device=True, inline=True)
def _block_dot(kind, scales, quants, row, blk, x):
    """sum_j W[row, j] x[j] over one block of a quantized weight (not F32): the block's quants
    dotted with x, then its scale (and minimum, times the sum of x) applied once."""
    if kind == A8_32 or kind == A8_16:
        size = 32 if kind == A8_32 else 16
        base = blk * size
        dot = float32(0.0)
        xs = float32(0.0)
        for j in range(size):
            xj = x[base + j]
            dot += float32(int32(quants[row, blk, j])) * xj
            xs += xj
        return scales[row, blk, 0] * dot + scales[row, blk, 1] * xs
    base = blk * 32
    dot = float32(0.0)
    xs = float32(0.0)
    if kind == Q8_0:
        for j in range(32):
            dot += float32(int32(quants[row, blk, j])) * x[base + j]
        return scales[row, blk, 0] * dot
    for j in range(16):
        q = quants[row, blk, j]
        lo = x[base + j]
        hi = x[base + 16 + j]
        dot += float32(int32(q & 15)) * lo + float32(int32(q >> 4)) * hi
        xs += lo + hi
    if kind == Q4_0:
        return scales[row, blk, 0] * (dot - float32(8.0) * xs)
    return scales[row, blk, 0] * dot + scales[row, blk, 1] * xs


@cuda.jit
def _matvec_kernel(kind, scales, quants, x, out, rows, cols):
    """out = W x: LANES threads a row, each taking whole quant blocks of it (F32 rows: single
    elements), so that a lane's loads do not wait on each other; then a reduction across them.
    (Taking one element a lane at a time, as before, took 1.2-4.2x the GPU time on SmolLM2's
    and Gemma 3's layer products and 0.75x on their heads, and decode steps 1.11-1.14x the
    time, on an H200: bench/bench_gpu.py, README.)"""
    scratch = cuda.shared.array(_MATVEC_THREADS, float32)
    lane = cuda.threadIdx.x % LANES
    local = cuda.threadIdx.x // LANES
    row = cuda.blockIdx.x * ROWS_PER_BLOCK + local
    acc = float32(0.0)
    if row < rows:
        if kind == F32:
            for col in range(lane, cols, LANES):
                acc += scales[row, col, 0] * x[col]
        else:
            for blk in range(lane, quants.shape[1], LANES):
                acc += _block_dot(kind, scales, quants, row, blk, x)
    total = _lane_sum(acc, scratch, lane, local * LANES)
    if row < rows and lane == 0:
        out[row] = total


@cuda.jit
def _dequantize_kernel(kind, scales, quants, out, rows, cols):
    # one thread per 32 columns of a row (a quant block)
    i = cuda.grid(1)
    per_row = (cols + 31) // 32
    if i < rows * per_row:
        row = i // per_row
        c0 = (i % per_row) * 32
        for col in range(c0, min(c0 + 32, cols)):
            out[row, col] = _weight(kind, scales, quants, row, col)


@cuda.jit
def _rmsnorm_kernel(x, w, eps, out, n):
    scratch = cuda.shared.array(LANES, float32)
    row = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    acc = float32(0.0)
    for i in range(lane, n, LANES):
        acc += x[row, i] * x[row, i]
    r = float32(1.0) / math.sqrt(_lane_sum(acc, scratch, lane, 0) / float32(n) + eps)
    for i in range(lane, n, LANES):
        out[row, i] = (x[row, i] * r) * w[i]


@cuda.jit
def _rope_kernel(x, positions, cos, sin, neox, half):
    # x: (S, H, D) rotated in place; one thread per (token, head, pair)
    i = cuda.grid(1)
    S, H = x.shape[0], x.shape[1]
    if i < S * H * half:
        s = i // (H * half)
        h = (i // half) % H
        k = i % half
        p = positions[s]
        c = cos[p, k]
        sn = sin[p, k]
        a_i = k if neox else 2 * k
        b_i = k + half if neox else 2 * k + 1
        a = x[s, h, a_i]
        b = x[s, h, b_i]
        x[s, h, a_i] = a * c - b * sn
        x[s, h, b_i] = a * sn + b * c


@cuda.jit
def _glu_kernel(gate, up, out, act, n):
    i = cuda.grid(1)
    if i < n:
        g = gate[i]
        z = _GELU_C * (g + _GELU_A * g * g * g) if act == ACT_GELU_TANH else g
        out[i] = g / (float32(1.0) + math.exp(-z)) * up[i]


@cuda.jit
def _store_kv_kernel(kv, k, v, positions):
    """Thread (token s, KV head, dimension): its key and value into row positions[s] of the
    interleaved layer buffer kv (capacity, KVH, 2, D), cast to the buffer's type."""
    i = cuda.grid(1)
    S, KVH, D = k.shape[0], k.shape[1], k.shape[2]
    if i < S * KVH * D:
        s = i // (KVH * D)
        h = (i // D) % KVH
        d = i % D
        kv[positions[s], h, 0, d] = k[s, h, d]
        kv[positions[s], h, 1, d] = v[s, h, d]


@cuda.jit
def _attention_split_kernel(q, kv, positions, window, scale, group, part_m, part_l, part_acc):
    """Block (query s * H + head h, split b): online softmax over keys [b * SPLIT, (b+1) * SPLIT)
    that query s sees; lane d of the LANES threads owns dimensions d, d + LANES, ...
    A split past the query's keys leaves l = 0, which the merge skips: a CUDA graph launches
    the splits of the cache's capacity and reads the positions from device memory."""
    scratch = cuda.shared.array(LANES, float32)
    acc = cuda.local.array(_LANE_DIMS, float32)
    sh = cuda.blockIdx.x
    b = cuda.blockIdx.y
    lane = cuda.threadIdx.x
    H = q.shape[1]
    D = q.shape[2]
    s = sh // H
    h = sh % H
    kvh = h // group
    p = positions[s]  # the query sees keys t <= p (stored before this kernel), t > p - window
    lo = b * SPLIT
    hi = min(lo + SPLIT, p + 1)
    if window > 0:
        lo = max(lo, p - window + 1)
    n_own = (D - lane + LANES - 1) // LANES
    for j in range(n_own):
        acc[j] = float32(0.0)
    m = float32(-3.0e38)
    l = float32(0.0)
    for t in range(lo, hi):
        part = float32(0.0)
        for j in range(n_own):
            d = lane + j * LANES
            part += q[s, h, d] * float32(kv[t, kvh, 0, d])
        score = _lane_sum(part, scratch, lane, 0) * scale
        m_new = max(m, score)
        alpha = math.exp(m - m_new)
        w = math.exp(score - m_new)
        l = l * alpha + w
        for j in range(n_own):
            d = lane + j * LANES
            acc[j] = acc[j] * alpha + w * float32(kv[t, kvh, 1, d])
        m = m_new
    for j in range(n_own):
        part_acc[sh, b, lane + j * LANES] = acc[j]
    if lane == 0:
        part_m[sh, b] = m
        part_l[sh, b] = l


@cuda.jit
def _attention_merge_kernel(part_m, part_l, part_acc, out, H):
    """Thread (query s * H + head h, dimension d): the splits merged in order."""
    sh = cuda.blockIdx.x
    d = cuda.threadIdx.x
    D = out.shape[2]
    if d < D:
        m = float32(-3.0e38)
        for b in range(part_m.shape[1]):
            if part_l[sh, b] > 0:
                m = max(m, part_m[sh, b])
        num = float32(0.0)
        den = float32(0.0)
        for b in range(part_m.shape[1]):
            if part_l[sh, b] > 0:
                f = math.exp(part_m[sh, b] - m)
                num += f * part_acc[sh, b, d]
                den += f * part_l[sh, b]
        out[sh // H, sh % H, d] = num / den if den > 0 else float32(0.0)


def _blocks(n: int, per: int) -> int:
    return max(1, -(-n // per))


def _c(a):
    """`a` C-contiguous (copied on its own device when it is not: the simulator moves NumPy
    arrays to its 'device' only as one contiguous buffer), as the kernels take it. On a GPU
    that is a Numba view of the CuPy array made without synchronizing: every launch and every
    CuPy operation of the backend runs on the model's one stream, in order, so Numba's
    default wait for the array's stream (its CUDA-array-interface sync) is never needed, and
    inside a CUDA graph's capture it would break the capture."""
    if not a.flags.c_contiguous:
        a = a.copy()
    return a if SIMULATED else cuda.as_cuda_array(a, sync=False)


def _out(name: str, a):
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous: the kernel writes it in place")
    return a if SIMULATED else cuda.as_cuda_array(a, sync=False)


def matvec(kind: int, scales, quants, x, out, rows: int, cols: int, stream=0):
    """out[r] = sum_c W[r, c] x[c] for a weight of `kind` laid out as (scales, quants)."""
    if x.shape != (cols,) or out.shape != (rows,):
        raise ValueError(f"matvec: x {x.shape} and out {out.shape} do not fit a ({rows}, {cols}) weight")
    _matvec_kernel[_blocks(rows, ROWS_PER_BLOCK), _MATVEC_THREADS, stream](
        kind, _c(scales), _c(quants), _c(x), _out("matvec: out", out), rows, cols)
    return out


def dequantize(kind: int, scales, quants, out, rows: int, cols: int, stream=0):
    """The (rows, cols) float32 weight, into `out`."""
    if out.shape != (rows, cols):
        raise ValueError(f"dequantize: out {out.shape} is not ({rows}, {cols})")
    _dequantize_kernel[_blocks(rows * -(-cols // 32), 128), 128, stream](
        kind, _c(scales), _c(quants), _out("dequantize: out", out), rows, cols)
    return out


def rmsnorm(x, w, eps: float, out, stream=0):
    """Each row of x (S, n) scaled by 1 / rms(row) and by w (n,)."""
    if x.ndim != 2 or w.shape != (x.shape[1],) or out.shape != x.shape:
        raise ValueError(f"rmsnorm: x {x.shape}, w {w.shape} and out {out.shape} do not fit")
    _rmsnorm_kernel[x.shape[0], LANES, stream](_c(x), _c(w), np.float32(eps), _out("rmsnorm: out", out), x.shape[1])
    return out


def rope(x, positions, cos, sin, neox: bool, stream=0):
    """x (S, H, D) rotated in place by the tables' rows at `positions` (S,), a device array."""
    S, H, _ = x.shape
    half = cos.shape[1]
    if positions.shape != (S,):
        raise ValueError(f"rope: {positions.shape[0]} positions for {S} tokens")
    _rope_kernel[_blocks(S * H * half, 128), 128, stream](_out("rope: x", x), _c(positions), _c(cos), _c(sin),
                                                          bool(neox), half)
    return x


def glu(gate, up, out, act: int, stream=0):
    """out = act(gate) * up elementwise over flat arrays of one length."""
    n = gate.size
    if up.size != n or out.size != n:
        raise ValueError(f"glu: gate {gate.shape}, up {up.shape} and out {out.shape} differ in size")
    _glu_kernel[_blocks(n, 128), 128, stream](_c(gate).reshape(-1), _c(up).reshape(-1),
                                              _out("glu: out", out).reshape(-1), int(act), n)
    return out


def store_kv(kv, k, v, positions, stream=0):
    """Keys and values k, v (S, KVH, D) into rows `positions` (S,) (a device array) of an
    interleaved layer buffer kv (capacity, KVH, 2, D)."""
    S, KVH, D = k.shape
    if v.shape != k.shape or kv.shape[1:] != (KVH, 2, D) or positions.shape != (S,):
        raise ValueError(f"store_kv: kv {kv.shape}, k {k.shape}, v {v.shape} and positions {positions.shape} "
                         f"do not fit")
    _store_kv_kernel[_blocks(S * KVH * D, 128), 128, stream](_out("store_kv: kv", kv), _c(k), _c(v), _c(positions))
    return kv


def attention(q, kv, positions, splits: int, window: int, scale: float, out, xp, stream=0):
    """Causal attention of queries q (S, H, D) at `positions` (S,) (a device array) over an
    interleaved layer buffer kv (capacity, KVH, 2, D) that holds every position up to each
    query's, into out (S, H, D); `splits` blocks of SPLIT keys cover the last query's keys
    (more are allowed: they hold none)."""
    S, H, D = q.shape
    KVH = kv.shape[1]
    if H % KVH or kv.shape[3] != D or D > 256 or out.shape != q.shape or positions.shape != (S,):
        raise ValueError(f"attention: q {q.shape}, kv {kv.shape}, positions {positions.shape} and out "
                         f"{out.shape} do not fit")
    splits = max(1, int(splits))
    part_m = xp.empty((S * H, splits), np.float32)
    part_l = xp.empty((S * H, splits), np.float32)
    part_acc = xp.empty((S * H, splits, D), np.float32)
    _attention_split_kernel[(S * H, splits), LANES, stream](_c(q), _c(kv), _c(positions), window,
                                                            np.float32(scale), H // KVH, _out("part_m", part_m),
                                                            _out("part_l", part_l), _out("part_acc", part_acc))
    _attention_merge_kernel[S * H, D, stream](_c(part_m), _c(part_l), _c(part_acc), _out("attention: out", out), H)
    return out

