"""The CUDA backend's kernels, in numba-cuda: dequantization and the fused quantized mat-vec of
the weight layouts that `model.upload` makes, RMSNorm, RoPE from the CPU engine's tables, the GLU
activations, and online-softmax (flash) attention split over blocks of keys.

Every kernel runs unchanged in Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, NumPy arrays in
place of CuPy's), which is how they are tested on machines without a GPU. Two things differ
between the simulator and a GPU, both fixed at import:
- Reductions across the lanes that share a row take a shared-memory tree in the simulator
  (which has no warp shuffles) and warp shuffles on a GPU (`_lane_sums`);
  NPLLAMA_CUDA_SHARED_REDUCTIONS=1 makes a GPU take the shared-memory form too, for checking
  one form against the other (bench/gpu_check.sh).
- `LANES`, the threads that share one row or one head, is 32 (a warp) on a GPU and 4 in the
  simulator, which runs each thread as a Python thread (~0.1 s per block of 32).
All arithmetic is float32 (integer quants widened to int32 before they multiply).

The wrappers (`matvec`, `dequantize`, `rmsnorm`, `head_norms`, `add_rmsnorm`, `rope_store`,
`glu`, `store_kv`, `attention`) take device arrays (CuPy's, or NumPy's in the simulator), check
shapes, and launch. `dequantize` gives a weight's float32 values, which the tests compare with
gguf's to check each layout. Several do in one launch what a layer's step would otherwise take
two or more for (the H200 runs found a decode step bound by its ~13 us a graph node, not by
arithmetic): the products with q, k and v, and with gate and up together with the GLU
(`matvec` of a fused group), a product and its residual add (`matvec(..., add=True)`), both QK
norms (`head_norms`), a post-norm and its residual add (`add_rmsnorm`), RoPE and the cache
write (`rope_store`).
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
_PAIRS = ROWS_PER_BLOCK // 2  # a GLU mat-vec's block: gate rows, then the same up rows
_X_ROWS = 8  # activation rows a block of the mat-vec takes, one after the other
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
def _lane_sums(vals, n, scratch, lane, base):
    """vals[i] = the sum of vals[i] over the LANES threads of a row, for each i < n, in every one
    of them (the row's lanes 0..LANES-1 use rows base.. of the shared scratch (threads, n or
    more)). Each value's sum is grouped the same whatever n; the shared-memory form waits at
    one set of barriers for all n."""
    if not SHUFFLES:
        for i in range(n):
            scratch[base + lane, i] = vals[i]
        cuda.syncthreads()
        step = LANES // 2
        while step > 0:
            if lane < step:
                for i in range(n):
                    scratch[base + lane, i] += scratch[base + lane + step, i]
            cuda.syncthreads()
            step //= 2
        for i in range(n):
            vals[i] = scratch[base, i]
        cuda.syncthreads()
        return
    for i in range(n):
        v = vals[i]
        for off in (16, 8, 4, 2, 1):
            v += cuda.shfl_xor_sync(_FULL, v, off)
        vals[i] = v


@cuda.jit(device=True, inline=True)
def _lane_sum(v, scratch, lane, base):
    """The sum of `v` over the LANES threads of a row, returned to every one of them
    (`_lane_sums` of one value; scratch (threads, 1))."""
    one = cuda.local.array(1, float32)
    one[0] = v
    _lane_sums(one, 1, scratch, lane, base)
    return one[0]


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
def _matvec_kernel(kind, scales, quants, x, out, rows, cols, e1, e2, act, add):
    """out = W x[s] for the rows s of x (S, cols): a block takes ROWS_PER_BLOCK rows of W
    and _X_ROWS rows of x (blockIdx.y), one after the other; LANES threads a row of W, each
    taking whole quant blocks of it (F32 rows: single elements), so that a lane's loads do not
    wait on each other; then one reduction across them for all the block's rows of x. Each
    (s, row) dot is summed in the same order whatever S, so a token's products do not depend
    on the tokens beside it. The rows of W fall in the groups [0, e1), [e1, e2) and [e2, rows)
    (a fused group's weights, `model.upload_all`; e1 = e2 = rows for one weight), and the flat
    out holds each group's products (S, its rows) in turn, so that each weight's are one
    C-contiguous array. (Taking one element a lane at a time, as before, took 1.2-4.2x the GPU
    time on SmolLM2's and Gemma 3's layer products and 0.75x on their heads, and decode steps
    1.11-1.14x the time, on an H200: bench/bench_gpu.py, README.)
    With act >= 0 (a fused gate/up group: gate rows [0, e1), up rows [e1, rows = 2 e1)), the
    first half of a block's rows of W are gate rows and the second half the same up rows, and
    out (S, e1) gets act(gate) * up (`_glu`), the GLU in the same launch; each dot summed as
    without it. With `add` (one weight), the products are added to out (the residual stream)
    instead of stored: the same float32 sum, then the add."""
    scratch = cuda.shared.array((_MATVEC_THREADS, _X_ROWS), float32)
    ups = cuda.shared.array((_PAIRS, _X_ROWS), float32)
    acc = cuda.local.array(_X_ROWS, float32)
    lane = cuda.threadIdx.x % LANES
    local = cuda.threadIdx.x // LANES
    row = cuda.blockIdx.x * ROWS_PER_BLOCK + local
    pair = cuda.blockIdx.x * _PAIRS + local % _PAIRS  # act >= 0: the GLU's column
    if act >= 0:
        row = rows if pair >= e1 else (pair + e1 if local >= _PAIRS else pair)
    s0 = cuda.blockIdx.y * _X_ROWS
    n = min(_X_ROWS, x.shape[0] - s0)
    for i in range(n):
        a = float32(0.0)
        if row < rows:
            xs = x[s0 + i]
            if kind == F32:
                for col in range(lane, cols, LANES):
                    a += scales[row, col, 0] * xs[col]
            else:
                for blk in range(lane, quants.shape[1], LANES):
                    a += _block_dot(kind, scales, quants, row, blk, xs)
        acc[i] = a
    _lane_sums(acc, n, scratch, lane, local * LANES)
    if act >= 0:
        if row < rows and lane == 0 and local >= _PAIRS:
            for i in range(n):
                ups[local - _PAIRS, i] = acc[i]
        cuda.syncthreads()
        if row < rows and lane == 0 and local < _PAIRS:
            for i in range(n):
                out[(s0 + i) * e1 + pair] = _glu(acc[i], ups[local, i], act)
    elif row < rows and lane == 0:
        g0, g1 = (0, e1) if row < e1 else ((e1, e2) if row < e2 else (e2, rows))
        base = x.shape[0] * g0 + row - g0
        for i in range(n):
            if add:
                out[base + (s0 + i) * (g1 - g0)] += acc[i]
            else:
                out[base + (s0 + i) * (g1 - g0)] = acc[i]


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


@cuda.jit(device=True, inline=True)
def _norm_row(x, w, eps, out, row, n, scratch, lane, add):
    """out[row] = x[row] / rms(x[row]) * w, or (add) out[row] += it; LANES threads a row, each
    every LANES-th element."""
    acc = float32(0.0)
    for i in range(lane, n, LANES):
        acc += x[row, i] * x[row, i]
    r = float32(1.0) / math.sqrt(_lane_sum(acc, scratch, lane, 0) / float32(n) + eps)
    for i in range(lane, n, LANES):
        y = (x[row, i] * r) * w[i]
        if add:
            out[row, i] += y
        else:
            out[row, i] = y


@cuda.jit
def _rmsnorm_kernel(x, w, eps, out, n):
    # block: one row of x (S, n)
    scratch = cuda.shared.array((LANES, 1), float32)
    _norm_row(x, w, eps, out, cuda.blockIdx.x, n, scratch, cuda.threadIdx.x, False)


@cuda.jit
def _head_norms_kernel(q, k, wq, wk, eps, out_q, out_k, n):
    """Block b: row b of q's rows (S * H, n), then of k's (S * KVH, n), each normed by its
    array's weight (a layer's QK norms, both in one launch)."""
    scratch = cuda.shared.array((LANES, 1), float32)
    row = cuda.blockIdx.x
    if row < q.shape[0]:
        _norm_row(q, wq, eps, out_q, row, n, scratch, cuda.threadIdx.x, False)
    else:
        _norm_row(k, wk, eps, out_k, row - q.shape[0], n, scratch, cuda.threadIdx.x, False)


@cuda.jit
def _add_rmsnorm_kernel(x, y, w, eps, n):
    """Block: one row; x[row] += y[row] / rms(y[row]) * w (a post-norm's output added to the
    residual stream in one launch)."""
    scratch = cuda.shared.array((LANES, 1), float32)
    _norm_row(y, w, eps, x, cuda.blockIdx.x, n, scratch, cuda.threadIdx.x, True)


@cuda.jit(device=True, inline=True)
def _pair(x, s, h, j, p, cos, sin, neox, half):
    """The two elements of pair j of head h of token s of x: pair j < half (the rotary pairs:
    j and j + half, or 2j and 2j + 1) rotated in place at position p; the pairs past them (a
    partial rotary's dimensions 2 half.. D) are 2j and 2j + 1, left as they are. Returns their
    indices."""
    if j >= half:
        return 2 * j, 2 * j + 1
    a_i = j if neox else 2 * j
    b_i = j + half if neox else 2 * j + 1
    c = cos[p, j]
    sn = sin[p, j]
    a = x[s, h, a_i]
    b = x[s, h, b_i]
    x[s, h, a_i] = a * c - b * sn
    x[s, h, b_i] = a * sn + b * c
    return a_i, b_i


@cuda.jit
def _rope_store_kernel(q, k, v, kv, slots, positions, cos, sin, neox, half):
    """Thread (token s, head of q or of k, pair j < D / 2): the pair rotated in place (`_pair`);
    for a head of k, the pair's elements of k (so rotated) and of v into row slots[s] of the
    interleaved records kv (rows, KVH, 2, D), cast to the buffer's type. One launch for a
    layer's RoPE and its cache write."""
    i = cuda.grid(1)
    S, H, KVH, pairs = q.shape[0], q.shape[1], k.shape[1], q.shape[2] // 2
    if i < S * (H + KVH) * pairs:
        s = i // ((H + KVH) * pairs)
        h = (i // pairs) % (H + KVH)
        j = i % pairs
        if h < H:
            _pair(q, s, h, j, positions[s], cos, sin, neox, half)
        else:
            h -= H
            a_i, b_i = _pair(k, s, h, j, positions[s], cos, sin, neox, half)
            r = slots[s]
            kv[r, h, 0, a_i] = k[s, h, a_i]
            kv[r, h, 0, b_i] = k[s, h, b_i]
            kv[r, h, 1, a_i] = v[s, h, a_i]
            kv[r, h, 1, b_i] = v[s, h, b_i]


@cuda.jit(device=True, inline=True)
def _glu(g, u, act):
    """act(g) * u: SiLU g * sigmoid(g), or GELU (tanh form) g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)).
    sigmoid(z) is 1 / (1 + e^-z) for z >= 0 and e^z / (1 + e^z) below, so its exponential never
    overflows (the simulator's math.exp raises where a GPU's gives inf)."""
    z = _GELU_C * (g + _GELU_A * g * g * g) if act == ACT_GELU_TANH else g
    if z >= 0:
        return g / (float32(1.0) + math.exp(-z)) * u
    e = math.exp(z)
    return g * e / (float32(1.0) + e) * u


@cuda.jit
def _glu_kernel(gate, up, out, act, n):
    i = cuda.grid(1)
    if i < n:
        out[i] = _glu(gate[i], up[i], act)


@cuda.jit
def _store_kv_kernel(kv, k, v, slots):
    """Thread (token s, KV head, dimension): its key and value into row slots[s] of the
    interleaved records kv (rows, KVH, 2, D) (a cache's positions, or a pool's flat slots),
    cast to the buffer's type."""
    i = cuda.grid(1)
    S, KVH, D = k.shape[0], k.shape[1], k.shape[2]
    if i < S * KVH * D:
        s = i // (KVH * D)
        h = (i // D) % KVH
        d = i % D
        kv[slots[s], h, 0, d] = k[s, h, d]
        kv[slots[s], h, 1, d] = v[s, h, d]


@cuda.jit
def _attention_split_kernel(q, kv, tables, seq_of, positions, window, scale, group, part_m, part_l, part_acc):
    """Block (query s * H + head h, split b): softmax attention over keys [b * SPLIT, (b+1) *
    SPLIT) that query s sees, left for the merge as (its maximum score m, its sum of weights l,
    its weighted sum of values). Each of the LANES threads scores whole keys of the split (key
    b * SPLIT + j * LANES + lane: a full dot over D, no reduction across lanes), the scores
    meet in shared memory, every thread takes their maximum and the weights' sum in the same
    order, and then lane d sums the values of dimensions d, d + LANES, ... over the keys in
    order. Key t of query s is record (t % page_size) of page tables[seq_of[s], t // page_size]
    of kv (pages, page_size, KVH, 2, D): a pool's pages, or a cache's buffer as one page.
    A split past the query's keys leaves l = 0, which the merge skips: a CUDA graph launches
    the splits of the cache's capacity and reads the positions from device memory."""
    weights = cuda.shared.array(SPLIT, float32)
    acc = cuda.local.array(_LANE_DIMS, float32)
    sh = cuda.blockIdx.x
    b = cuda.blockIdx.y
    lane = cuda.threadIdx.x
    H = q.shape[1]
    D = q.shape[2]
    page_size = kv.shape[1]
    s = sh // H
    h = sh % H
    kvh = h // group
    seq = seq_of[s]
    p = positions[s]  # the query sees keys t <= p (stored before this kernel), t > p - window
    base = b * SPLIT
    lo = base
    hi = min(base + SPLIT, p + 1)
    if window > 0:
        lo = max(lo, p - window + 1)
    n_own = (D - lane + LANES - 1) // LANES
    if hi <= lo:  # no key of this query in the split (the whole block takes this branch)
        for j in range(n_own):
            part_acc[sh, b, lane + j * LANES] = float32(0.0)
        if lane == 0:
            part_m[sh, b] = float32(-3.0e38)
            part_l[sh, b] = float32(0.0)
        return
    for i in range(lane, SPLIT, LANES):
        t = base + i
        score = float32(-3.0e38)
        if lo <= t and t < hi:
            page = tables[seq, t // page_size]
            r = t % page_size
            dot = float32(0.0)
            for d in range(D):
                dot += q[s, h, d] * float32(kv[page, r, kvh, 0, d])
            score = dot * scale
        weights[i] = score
    cuda.syncthreads()
    m = float32(-3.0e38)
    for i in range(lo - base, hi - base):
        m = max(m, weights[i])
    cuda.syncthreads()  # every thread has read the scores before they turn into weights
    for i in range(lane, SPLIT, LANES):
        weights[i] = math.exp(weights[i] - m)  # past the keys: exp(-3e38 - m) = 0, never read
    cuda.syncthreads()
    l = float32(0.0)
    for j in range(n_own):
        acc[j] = float32(0.0)
    for t in range(lo, hi):
        w = weights[t - base]
        l += w
        page = tables[seq, t // page_size]
        r = t % page_size
        for j in range(n_own):
            acc[j] += w * float32(kv[page, r, kvh, 1, lane + j * LANES])
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


def matvec(kind: int, scales, quants, x, out, rows: int, cols: int, groups=(), act=None, add=False, stream=0):
    """out[s, r] = sum_c W[r, c] x[s, c] for a weight of `kind` laid out as (scales, quants) and
    activation rows x (S, cols) into out (S, rows); each row's sums the same whatever S. With
    `groups`, one or two row boundaries inside W (a fused group's weights), out holds each
    group's products (S, its rows) one after the other: slice it flat at S times each boundary.
    With `act` (ACT_SILU, ACT_GELU_TANH) W is a fused gate/up group, its one boundary at
    rows / 2, and out (S, rows / 2) gets the GLU act(gate products) * (up products). With
    `add` (one weight), out += the products, in place."""
    S = x.shape[0]
    bounds = sorted(int(g) for g in groups)
    glu_ok = act is None or (bounds == [rows // 2] and rows % 2 == 0)
    if (x.ndim != 2 or x.shape[1] != cols or out.size != S * (rows if act is None else rows // 2)
            or len(bounds) > 2 or any(not 0 < g < rows for g in bounds) or not glu_ok
            or (add and (bounds or act is not None))):
        raise ValueError(f"matvec: x {x.shape}, out {out.shape}, groups {tuple(groups)}, act {act} and add {add} do "
                         f"not fit a ({rows}, {cols}) weight")
    e1, e2 = (bounds + [rows, rows])[:2]
    blocks = _blocks(rows, ROWS_PER_BLOCK) if act is None else _blocks(e1, _PAIRS)
    _matvec_kernel[(blocks, _blocks(S, _X_ROWS)), _MATVEC_THREADS, stream](
        kind, _c(scales), _c(quants), _c(x), _out("matvec: out", out).reshape(-1), rows, cols, e1, e2,
        -1 if act is None else int(act), bool(add))
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


def head_norms(q, k, wq, wk, eps: float, out_q, out_k, stream=0):
    """Each head of q (S, H, D) normed as `rmsnorm` by wq (D,), and each of k (S, KVH, D) by wk,
    into out_q and out_k, in one launch (a layer's QK norms)."""
    D = q.shape[-1]
    if (q.ndim != 3 or k.ndim != 3 or k.shape[0] != q.shape[0] or k.shape[2] != D or wq.shape != (D,)
            or wk.shape != (D,) or out_q.shape != q.shape or out_k.shape != k.shape):
        raise ValueError(f"head_norms: q {q.shape}, k {k.shape}, wq {wq.shape}, wk {wk.shape}, out_q {out_q.shape} "
                         f"and out_k {out_k.shape} do not fit")
    rows_q, rows_k = q.shape[0] * q.shape[1], k.shape[0] * k.shape[1]
    _head_norms_kernel[rows_q + rows_k, LANES, stream](
        _c(q).reshape(rows_q, D), _c(k).reshape(rows_k, D), _c(wq), _c(wk), np.float32(eps),
        _out("head_norms: out_q", out_q).reshape(rows_q, D), _out("head_norms: out_k", out_k).reshape(rows_k, D), D)
    return out_q, out_k


def add_rmsnorm(x, y, w, eps: float, stream=0):
    """x (S, n) += each row of y (S, n) normed as `rmsnorm` by w (n,), in place, in one launch."""
    if x.ndim != 2 or y.shape != x.shape or w.shape != (x.shape[1],):
        raise ValueError(f"add_rmsnorm: x {x.shape}, y {y.shape} and w {w.shape} do not fit")
    _add_rmsnorm_kernel[x.shape[0], LANES, stream](_out("add_rmsnorm: x", x), _c(y), _c(w), np.float32(eps),
                                                   x.shape[1])
    return x


def rope_store(q, k, v, kv, slots, positions, cos, sin, neox: bool, stream=0):
    """q (S, H, D) and k (S, KVH, D) rotated in place by the tables' rows at `positions` (S,)
    (cos and sin (positions, half): the first 2 half dimensions rotate), and the keys (so
    rotated) and the values v (S, KVH, D) stored into rows `slots` (S,) of the interleaved
    records kv (rows, KVH, 2, D), all in one launch; positions and slots are device arrays."""
    S, H, D = q.shape
    KVH, half = k.shape[1], cos.shape[1]
    if (positions.shape != (S,) or slots.shape != (S,) or k.shape != (S, KVH, D) or v.shape != k.shape or D % 2
            or 2 * half > D or sin.shape != cos.shape or kv.shape[1:] != (KVH, 2, D)):
        raise ValueError(f"rope_store: q {q.shape}, k {k.shape}, v {v.shape}, kv {kv.shape}, slots {slots.shape}, "
                         f"positions {positions.shape} and tables {cos.shape} do not fit")
    _rope_store_kernel[_blocks(S * (H + KVH) * (D // 2), 128), 128, stream](
        _out("rope_store: q", q), _out("rope_store: k", k), _c(v), _out("rope_store: kv", kv), _c(slots),
        _c(positions), _c(cos), _c(sin), bool(neox), half)
    return q, kv


def glu(gate, up, out, act: int, stream=0):
    """out = act(gate) * up elementwise over flat arrays of one length."""
    n = gate.size
    if up.size != n or out.size != n:
        raise ValueError(f"glu: gate {gate.shape}, up {up.shape} and out {out.shape} differ in size")
    _glu_kernel[_blocks(n, 128), 128, stream](_c(gate).reshape(-1), _c(up).reshape(-1),
                                              _out("glu: out", out).reshape(-1), int(act), n)
    return out


def store_kv(kv, k, v, slots, stream=0):
    """Keys and values k, v (S, KVH, D) into rows `slots` (S,) (a device array) of interleaved
    records kv (rows, KVH, 2, D): a cache's layer buffer and positions, or a pool's flat slots."""
    S, KVH, D = k.shape
    if v.shape != k.shape or kv.shape[1:] != (KVH, 2, D) or slots.shape != (S,):
        raise ValueError(f"store_kv: kv {kv.shape}, k {k.shape}, v {v.shape} and slots {slots.shape} do not fit")
    _store_kv_kernel[_blocks(S * KVH * D, 128), 128, stream](_out("store_kv: kv", kv), _c(k), _c(v), _c(slots))
    return kv


def attention(q, kv, tables, seq_of, positions, splits: int, window: int, scale: float, out, xp, stream=0):
    """Causal attention of queries q (S, H, D) at `positions` (S,) into out (S, H, D). Query s
    belongs to sequence seq_of[s], whose positions lie in the pages tables[seq_of[s]] (a row
    of int32 page ids) of kv (pages, page_size, KVH, 2, D), which hold every position up to
    the query's: a pool's pages, or a cache's layer buffer as a single page (tables [[0]]).
    `splits` blocks of SPLIT keys cover the last query's keys (more are allowed: they hold
    none). positions, seq_of and tables are device arrays."""
    S, H, D = q.shape
    KVH = kv.shape[2]
    if (H % KVH or kv.ndim != 5 or kv.shape[3:] != (2, D) or D > 256 or out.shape != q.shape
            or positions.shape != (S,) or seq_of.shape != (S,) or tables.ndim != 2):
        raise ValueError(f"attention: q {q.shape}, kv {kv.shape}, tables {tables.shape}, seq_of {seq_of.shape}, "
                         f"positions {positions.shape} and out {out.shape} do not fit")
    splits = max(1, int(splits))
    part_m = xp.empty((S * H, splits), np.float32)
    part_l = xp.empty((S * H, splits), np.float32)
    part_acc = xp.empty((S * H, splits, D), np.float32)
    _attention_split_kernel[(S * H, splits), LANES, stream](_c(q), _c(kv), _c(tables), _c(seq_of), _c(positions),
                                                            window, np.float32(scale), H // KVH,
                                                            _out("part_m", part_m), _out("part_l", part_l),
                                                            _out("part_acc", part_acc))
    _attention_merge_kernel[S * H, D, stream](_c(part_m), _c(part_l), _c(part_acc), _out("attention: out", out), H)
    return out
