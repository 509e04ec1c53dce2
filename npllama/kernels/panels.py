"""Products of activation rows on weights laid out in panels of 16 rows, with the
activations quantized per block of 32: to int8 (the int8 mode) or to int24 (the exact mode).
Both modes' prefill, decode step and batched pass read these kernels for the weights that
have panels, so a token's products are the same bits in all three. rows.py, quants.py and
quants_int8.py have the products on the GGUF blocks, for the weights without panels.

Panels
------
A Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K or Q6_K weight is laid out again, once, in panels
of 16 rows (`pack_panels`; the last panel padded with zero rows). A panel holds its 16 rows
block by block (a K-quant's super-block of 256 is 8 blocks); for each block of 32 columns:

    quants: 64-byte vectors whose bytes 4r..4r+3 are bytes 4k..4k+3 of row r's quants, for
            k = 0..3 (all but Q8_0: each byte holds the low 4 bits of element 4k+i in its low
            nibble and of element 16+4k+i in its high one, as in a Q4_0 block) or k = 0..7
            (Q8_0: one element a byte, offset by 128 so that it is unsigned)
    bits:   (Q5_0, Q5_1, Q5_K) a 64-byte vector of the fifth bits: bit k of byte 4r+i is the
            fifth bit of row r's element 4k+i, bit 4+k that of element 16+4k+i (k = 0..3);
            (Q6_K) two such vectors, of bits 4 and 5
    d:      the 16 rows' float16 scales, then (Q4_1, Q5_1) their float16 minimums m; for Q4_K
            and Q5_K the rows' float16 super-block d, then dmin, then the block's 6-bit scales
            sc and mins m a byte each (the kernels take d sc and -dmin m: exact in float32, 11
            bits times 6); for Q6_K the rows' float16 d, then the int8 scales sc of the block's
            low half (one per 16 elements), then of its high half (d sc, exact in float32)

so a panel block is the size of its 16 GGUF blocks (Q4_1 320 bytes, Q4_0 288, Q5_0 352, Q5_1
384, Q8_0 544), or 11/9 of it (Q4_K 352), 13/11 (Q5_K 416), 16/15 (Q6_K 448).

The micro-kernel
----------------
int8: each activation row x is quantized per block of 32 as the decode step quantizes it
(`quants_int8._quantize_x_q8`: int8 q, scale d_x, s_x = d_x sum q), plus the integer sums of
q over each half of the block. For a panel and a tile of up to 4 activation rows, per block:
each 64-byte vector of quants (split into its low and high nibbles, the high bits or-ed in as
bits 4 and 5) meets the 4 bytes of x that its elements multiply, broadcast to all 16 rows, in
one u8 x s8 dot into 16 int32 lanes (vpdpbusd: lane r accumulates row r), so a block costs 8
dots per activation row, after which

    acc_r += float(isum_r - bias sum q) * (d_r d_x)    bias: 8 (Q4_0), 16 (Q5_0), 128 (Q8_0), else 0
    acc_r += m_r s_x                                    (Q4_1, Q5_1, Q4_K, Q5_K)

or for Q6_K, whose halves have their own d (the low nibbles' elements are the first half, the
high nibbles' the second), the same first line for each half with its own sums (bias 32).

int24 (`_quantize_rows_i24`): q = round(x / d_x) with d_x = max|x| / (126 * 65536) per block,
an integer of 24 bits (the width of a float32's significand: each x is kept to within about
2^-23 of its block's max|x|, about the rounding of a float32 dot at that block's largest term),
written as three signed base-256 digits q = 65536 q1 + 256 q2 + q3. Each digit plane takes
the int8 dots; the last two planes' integer sums (less their bias) are joined exactly in
int32, s23 = 256 s2 + s3 (below 2^29), and a block's sum is 65536 f1 + float(s23) in float32,
then scaled as above. So a product agrees with a float64 dot of the dequantized weights and x
to float32 rounding (about 1e-7 of the output's scale, as a float32 dot), at 3 dots where
int8 takes 1: a decode step's products still run at the memory's bandwidth, which float32
dots of the dequantized weights (8 vector operations per 32 weights) do not reach.

Each tile of activation rows reads the whole panel: the first tile from memory, the others
from the caches. With few rows (a batched decode pass's 16: four tiles) the first tile waited
on memory, which the hardware prefetcher alone did not hide. So the tiles of the first
`_PREFETCH_ROWS` rows ask for the next panel's bytes as they read their own, the requests
spread over those four tiles (one tile's requests alone did not help; every tile's at 128 rows
did no better). One activation row (the decode step's) has a kernel of its own,
`_panel_dots_one`, which asks for the next panel too. With AVX2 (a Zen 3) its products from
memory took 0.63-0.92x the time. With AVX-512 VNNI on an Intel Xeon they took 0.69-0.99x
(int24) and 0.69-0.91x (int8), and whole decode steps 0.56-0.79x; a Zen 4's had come near the
memory's bandwidth without it. (Asking from the one-row tiles of the kernel for several rows
left those rows' code the same, instruction for instruction, yet made int24 products of 128
rows 1.1-1.5x slower.)

The integer sums are exact, and every activation row's float operations are the same whatever
the tile size, so a row's products do not depend on the other rows beside it (batched passes
equal single runs bit for bit). The dot is vpdpbusd where the CPU has AVX512-VNNI, two 256-bit
ones with AVX-VNNI, vpmaddubsw with AVX2 (its i16 pair sums added up in i16 while they cannot
overflow, then widened by one vpmaddwd; a Q8_0 byte as two nibbles), else portable IR
(widening multiplies; `_make_panel_dots(isa)` builds any).

With AMX-INT8 (an Intel Xeon since Sapphire Rapids; cpu.AMX, which $NPLLAMA_AMX=0
turns off) and at least `_AMX_ROWS` (48) activation rows, each tile of 16 of them
takes one tdpbsud a block (a half of one for Q6_K) and plane, on a tile of the 16 rows' x and
one of the panel's weights put together as bytes (`_make_panel_dots_amx`); the rows after
the last such tile take the vpdpbusd kernel. The integer sums are the same, and one routine
(`_ir_finish`) takes every kernel's to floats, so the bits are the same too. A tdpbsud makes
16 x 16 sums at once, but they reach the vector registers only through memory (a tile's 1 KiB
store, then loads), once a block of 32 because each block has its own scales. On an Intel Xeon
(Emerald Rapids, one thread, the weights in the caches) the products of 128 rows took 0.65-0.9x
the vpdpbusd kernel's time, those of 64 rows 0.7-1.0x. The weights as bytes go into a scratch
`wb` that the callers make once (`weight_bytes`), where each call's own from the heap cost as
much as the tiles saved in calls of 16 rows.

Njit level (C-contiguous arrays, nothing raises):

* ``_quantize_rows(x, xq, xd, xs, xi)``, ``_quantize_rows_i24``: each row of x (T, n)
  float32 quantized; ``_quantize_into(x, xr)`` either, by the form of xr;
  ``_quantize_parallel(x, xr)`` the same, the rows shared among the threads.
* ``xr``, the activation rows as the products take them: ``(xq, xd, xs, xi)``, int8 (xq (T,
  n), xi (T, n // 16)) or int24 (xq (T, 3, n), xi (T, 3, n // 16): the planes).
* ``_panel_rows(mask, code, pw, p, xr, tmp, wb)``: tmp[t, :] = the 16 products of panel p with
  every activation row t (tmp: (T, 16) float32; wb: uint8 scratch of ``weight_bytes(T, n)``),
  by the micro-kernel ``_panel_dots_one`` (one row) or ``_panel_dots_many`` (``_panel_dots``,
  after AMX's tiles where the CPU has them). ``mask`` (a qtypes.TypeMask, which Numba types
  as its literal value) names the types whose code the micro-kernels hold (quants.py's
  docstring); a code outside it gives NaN.
* ``_matmul_panels``, ``_qkv_panels``, ``_gate_up_panels`` (mask first): the products,
  parallel over panels.

Python level: ``has_panels(qtype)``, ``panel_shape(qtype, rows, cols)``, ``pack_panels(data,
qtype, out=None)``, ``quantize_rows(x)``, ``quantize_rows_i24(x)``, ``activation_rows(x, int8)``
and ``matmul_panels(panels, qtype, rows, x, int8=True)``.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import get_num_threads, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .nn import _glu1
from .qtypes import kernel_types
from .quants import (_F32T, _I8, _I16, _I32, _Q4_0, _Q4_1, _Q4_K, _Q5_0, _Q5_1, _Q5_K, _Q6_K, _Q8_0, _const_vec,
                     _ir_call, _ir_load, _ir_prefetch, _ir_splat, _is_c_array, _mask_codes, _shuffle, _vec)
from . import aligned
from .aligned import _empty
from .cpu import AMX
from .quants_int8 import DOT_ISA, _ir_f16_vec, _quantize_x_q8

__all__ = ["PANEL", "has_panels", "panel_shape", "pack_panels", "quantize_rows", "quantize_rows_i24", "activation_rows",
           "matmul_panels"]

PANEL = 16  # weight rows per panel: the int32 lanes of a 512-bit vector
# The micro-kernel's tiles of activation rows, largest first. int8's 2 and 3 rows ran no
# faster in a tile of 4; int24 prefill products (128 rows) ran as fast in tiles of 2 or 3 as
# in tiles of 4.
_TT = (4, 1)
_PREFETCH_ROWS = 16  # the tiles of activation rows below this prefetch the next panel (the docstring)

# kind: (GGUF block bytes, offset of its quants, 4-byte groups per block, panel block bytes, bias,
#        has m, the panel's scales ("f16": d, then m where it has them; "k": d, dmin, then sc
#        and m as bytes; "q6_k": d, then the halves' int8 sc), high bits: 0, or 1 (the fifth:
#        Q5_0/Q5_1's uint32 before the quants), or 2 (Q6_K), and whether a block's halves have
#        their own scale (Q6_K: their d sc take the places of d and m))
_KINDS = {
    "q4_0": (18, 2, 4, 288, 8, False, "f16", 0, False),
    "q4_1": (20, 4, 4, 320, 0, True, "f16", 0, False),
    "q5_0": (22, 6, 4, 352, 16, False, "f16", 1, False),
    "q5_1": (24, 8, 4, 384, 0, True, "f16", 1, False),
    "q8_0": (34, 2, 8, 544, 128, False, "f16", 0, False),
    "q4_k": (144, 16, 4, 352, 0, True, "k", 0, False),   # a K-quant's GGUF block is a super-block of 256
    "q5_k": (176, 48, 4, 416, 0, True, "k", 1, False),
    "q6_k": (210, 0, 4, 448, 32, False, "q6_k", 2, True),
}
_CODES = {_Q4_0: "q4_0", _Q4_1: "q4_1", _Q5_0: "q5_0", _Q5_1: "q5_1", _Q8_0: "q8_0", _Q4_K: "q4_k", _Q5_K: "q5_k",
          _Q6_K: "q6_k"}
_TYPES = "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K"


def has_panels(qtype) -> bool:
    """Whether weights of GGUF type `qtype` have the panel kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)."""
    return int(qtype) in _CODES


# ---------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------

@njit(inline="always")
def _word(row, i):
    """The 4 bytes at uint16 index i of `row` (uint16), as one little-endian integer."""
    return np.int64(row[i]) | np.int64(row[i + 1]) << 16


@njit(inline="always")
def _spread(nib):
    """Bit i of the 4-bit `nib` as bit 0 of byte i (the four shifted copies do not overlap)."""
    return (nib * 0x00204081) & 0x01010101


@njit(inline="always")
def _bit_word(row, at, j):
    """The panel's high-bit bytes i = 0..3 of 32 elements whose bits j are bit j of the bytes
    at uint16 index `at` of `row`: bit k of byte i from element 4k+i, bit 4+k from 16+4k+i."""
    v = 0
    for k in range(4):
        v |= ((_word(row, at + 2 * k) >> j) & 0x01010101) << k
        v |= ((_word(row, at + 8 + 2 * k) >> j) & 0x01010101) << (4 + k)
    return v


@njit(parallel=True, cache=True)
def _pack(src, dst, dst16, size, qoff, groups, pbs, has_m, flip, five):
    """Panels of the GGUF rows `src` (rows, nb * size / 2) uint16 into `dst` (n_panels,
    nb * pbs / 4) uint32 and its uint16 view `dst16`, zeroed, four bytes at a time."""
    rows = src.shape[0]
    h, w = size // 2, pbs // 4  # a GGUF block's uint16, a panel block's uint32
    nb = src.shape[1] // h
    for p in prange(dst.shape[0]):
        for r in range(min(PANEL, rows - p * PANEL)):
            row = src[p * PANEL + r]
            for b in range(nb):
                q = b * h + qoff // 2
                ob = b * w
                for k in range(groups):
                    dst[p, ob + 16 * k + r] = _word(row, q + 2 * k) ^ flip
                od = ob + 16 * groups
                if five:  # the fifth bit of element j is bit j of the uint32 before the quants
                    hb = _word(row, q - 2)
                    v = 0
                    for k in range(4):
                        v |= _spread((hb >> (4 * k)) & 15) << k | _spread((hb >> (16 + 4 * k)) & 15) << (4 + k)
                    dst[p, od + r] = v
                    od += 16
                dst16[p, 2 * od + r] = row[b * h]  # d
                if has_m:
                    dst16[p, 2 * od + 16 + r] = row[b * h + 1]


@njit(parallel=True, cache=True)
def _pack_k(src, src8, dst, dst16, dst8, size, pbs):
    """Panels of the K-quant rows `src` (rows, super-blocks * size / 2) uint16 (`src8`: its
    bytes; size: Q4_K 144, Q5_K 176, Q6_K 210) into `dst` (n_panels, super-blocks * 8 * pbs /
    4) uint32 (dst16, dst8: its uint16 and byte views), zeroed: each block of 32 (sub-block) as
    a Q4_1 (Q4_K) or Q5_1 (Q5_K) panel block with the float16 d and dmin and the block's 6-bit
    sc and m as bytes, or (Q6_K) its low nibbles, bits 4 and 5, the float16 d and the int8 sc
    of its two halves."""
    rows = src.shape[0]
    h = size // 2
    ns = src.shape[1] // h
    bits = (size - 144) // 32   # high bits: Q4_K 0, Q5_K 1, Q6_K 2
    for p in prange(dst.shape[0]):
        for r in range(min(PANEL, rows - p * PANEL)):
            row, row8 = src[p * PANEL + r], src8[p * PANEL + r]
            for sb in range(ns):
                o = sb * h  # the super-block, in uint16
                for j in range(8):
                    ob = (sb * 8 + j) * pbs  # the panel block, in bytes
                    if bits < 2:
                        sc = 2 * o + 4  # Q4_K's and Q5_K's packed 6-bit scales and mins
                        if j < 4:
                            s, m = row8[sc + j] & 63, row8[sc + j + 4] & 63
                        else:
                            s = (row8[sc + j + 4] & 15) | ((row8[sc + j - 4] >> 6) << 4)
                            m = (row8[sc + j + 4] >> 4) | ((row8[sc + j] >> 6) << 4)
                        at = ob + 256 + 64 * bits
                        dst16[p, at // 2 + r] = row[o]            # d (float16)
                        dst16[p, at // 2 + 16 + r] = row[o + 1]   # dmin
                        dst8[p, at + 64 + r] = s
                        dst8[p, at + 80 + r] = m
                        qs, shift = o + 8 + 16 * bits + 16 * (j // 2), 4 * (j % 2)  # nibbles: low for even j
                        if bits:  # Q5_K's fifth bit: bit j of qh[i]
                            dst[p, (ob + 256) // 4 + r] = _bit_word(row, o + 8, j)
                    else:  # Q6_K: half j // 4 of the super-block, its group j % 4 of 32
                        half, g = j // 4, j % 4
                        qs, shift = o + 32 * half + 16 * (g % 2), 4 * (g // 2)
                        for b in range(2):  # bits 4 and 5: bits 2g and 2g + 1 of qh[i]
                            dst[p, (ob + 256 + 64 * b) // 4 + r] = _bit_word(row, o + 64 + 16 * half, 2 * g + b)
                        dst16[p, (ob + 384) // 2 + r] = row[o + 104]  # d (float16, last in the super-block)
                        dst8[p, ob + 416 + r] = row8[2 * o + 192 + 2 * j]  # the int8 sc of the block's halves
                        dst8[p, ob + 432 + r] = row8[2 * o + 193 + 2 * j]
                    for k in range(4):  # element i's low 4 bits in the low nibble, 16 + i's in the high
                        lo = (_word(row, qs + 2 * k) >> shift) & 0x0F0F0F0F
                        hi = (_word(row, qs + 8 + 2 * k) >> shift) & 0x0F0F0F0F
                        dst[p, ob // 4 + 16 * k + r] = lo | hi << 4


def panel_shape(qtype, rows: int, cols: int) -> tuple[int, int]:
    """(panels, bytes per panel) of a weight of GGUF type `qtype` with panel kernels, `rows` x `cols`."""
    kind = _CODES.get(int(qtype))
    if kind is None:
        raise ValueError(f"no panel kernels for type {qtype!r}; they exist for {_TYPES}")
    return (rows + PANEL - 1) // PANEL, cols // 32 * _KINDS[kind][3]


def pack_panels(data, qtype, out=None) -> np.ndarray:
    """The panels (n_panels, blocks of 32 * panel block bytes) uint8 of a weight `data` (rows,
    row bytes) uint8 of a type with panels (`has_panels`): the size of the weight rounded up
    to 16 rows, or for K-quants 11/9 of it (Q4_K), 13/11 (Q5_K), 16/15 (Q6_K); in `out`
    (zeroed, of `panel_shape`) where given, else a new array."""
    kind = _CODES.get(int(qtype))
    if kind is None:
        raise ValueError(f"no panel kernels for type {qtype!r}; they exist for {_TYPES}")
    size, qoff, groups, pbs, bias, has_m, _, bits, _ = _KINDS[kind]
    data = np.ascontiguousarray(data)
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] % size:
        raise ValueError(f"{kind} rows must be a uint8 array of shape (rows, {size} * blocks), "
                         f"got {data.dtype} {data.shape}")
    k_quant = kind.endswith("_k")
    shape = panel_shape(qtype, data.shape[0], data.shape[1] // size * (256 if k_quant else 32))
    if out is None:
        out = np.zeros(shape, np.uint8)
    elif out.shape != shape or out.dtype != np.uint8 or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous uint8 array of shape {shape}, got {out.dtype} {out.shape}")
    src, dst, dst16 = data.view(np.uint16), out.view(np.uint32), out.view(np.uint16)  # every size is even
    if k_quant:
        _pack_k(src, data, dst, dst16, out, size, pbs)
    else:
        _pack(src, dst, dst16, size, qoff, groups, pbs, has_m, 0x80808080 if kind == "q8_0" else 0, bits == 1)
    return out


# ---------------------------------------------------------------------------------------
# The activation rows
# ---------------------------------------------------------------------------------------

@njit(cache=True)
def _quantize_rows(x, xq, xd, xs, xi):
    """Quantize each row of x (T, n): xq (T, n) int8, xd, xs (T, n // 32) float32 as
    quants_int8._quantize_x_q8, and xi (T, n // 16) int32, the sums of q over each half (16
    values) of each block."""
    T, n = x.shape
    for t in range(T):
        _quantize_x_q8(x[t], xq[t], xd[t], xs[t])
        for h in range(n // 16):
            acc = 0
            for j in range(16):
                acc += np.int32(xq[t, 16 * h + j])
            xi[t, h] = acc


# int24 activations: q = rint(x / d) with d = max|x| / _I24 per block of 32, written as three
# signed base-256 digits q = 65536 q1 + 256 q2 + q3, each in -128..127 (|q| <= _I24 keeps the
# top digit within 126)
_I24 = 126 * 65536


@intrinsic
def _quantize_row_i24(typingctx, x, q, d, s, i):
    """One row x (n,) as int24 blocks (`_quantize_rows_i24`): q (3 n,) the planes one after
    another, d and s (n // 32,), i (3 n // 16,) each plane's half-block sums; one block of 32
    per iteration in vector IR (exact IEEE float32 arithmetic, as the int8 quantizer's)."""
    if not (_is_c_array(x, types.float32) and _is_c_array(q, types.int8) and _is_c_array(d, types.float32)
            and _is_c_array(s, types.float32) and _is_c_array(i, types.int32)):
        return None

    def codegen(context, builder, sig, args):
        xp, qp, dp, sp, ip = (context.make_array(ty)(context, builder, v).data for ty, v in zip(sig.args, args))
        n = builder.extract_value(context.make_array(sig.args[0])(context, builder, args[0]).shape, 0)
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        nb = builder.sdiv(n, c(32))
        f32 = lambda v: ir.Constant(_F32T, v)  # noqa: E731
        vf, vi = _vec(_F32T, 32), _vec(_I32, 32)
        k = lambda v: _const_vec(_I32, 32, v)  # noqa: E731

        def reduce(name, v):
            return _ir_call(builder, f"llvm.vector.reduce.{name}.v{v.type.count}i32", _I32, [v])

        def digit(v):  # v's low base-256 digit in -128..127, and (v - digit) / 256
            lo = builder.sub(builder.and_(builder.add(v, k(128)), k(255)), k(128))
            return lo, builder.ashr(builder.sub(v, lo), k(8))

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            o = builder.mul(b, c(32))
            v = _ir_load(builder, xp, o, vf, 4)
            # max |x_j| as the largest bit pattern without the sign bit: a NaN (above inf) sticks
            amax = builder.bitcast(reduce("umax", builder.and_(builder.bitcast(v, vi), k(0x7FFFFFFF))), _F32T)
            db = builder.fdiv(amax, f32(float(_I24)))
            idb = builder.select(builder.fcmp_ordered(">", db, f32(0.0)), builder.fdiv(f32(1.0), db), f32(0.0))
            ok = builder.and_(builder.fcmp_ordered("<", db, f32(math.inf)),     # false for NaN
                              builder.fcmp_ordered("<", idb, f32(math.inf)))
            v = builder.select(ok, v, ir.Constant(vf, [0.0] * 32))             # no inf/NaN below
            r = _ir_call(builder, "llvm.rint.v32f32", vf, [builder.fmul(v, _ir_splat(builder, idb, 32))])
            qv = builder.fptosi(r, vi)                                          # |q| <= _I24 + 1
            q3, rest = digit(qv)
            q2, q1 = digit(rest)
            for p, plane in enumerate((q1, q2, q3)):
                at = builder.add(builder.mul(c(p), n), o)
                builder.store(builder.trunc(plane, _vec(_I8, 32)),
                              builder.bitcast(builder.gep(qp, [at]), _vec(_I8, 32).as_pointer()), align=1)
                for h in range(2):
                    half = _shuffle(builder, plane, plane, list(range(16 * h, 16 * h + 16)))
                    at = builder.add(builder.mul(c(p), builder.add(nb, nb)), builder.add(builder.add(b, b), c(h)))
                    builder.store(reduce("add", half), builder.gep(ip, [at]))
            builder.store(db, builder.gep(dp, [b]))
            builder.store(builder.fmul(db, builder.sitofp(reduce("add", qv), _F32T)), builder.gep(sp, [b]))
        return context.get_dummy_value()

    return types.none(x, q, d, s, i), codegen


@njit(cache=True)
def _quantize_rows_i24(x, xq, xd, xs, xi):
    """Each row of x (T, n) as int24 blocks: xq (T, 3, n) int8, the digit planes q1, q2, q3;
    xd (T, n // 32) float32 d; xs (T, n // 32) float32 d sum q; xi (T, 3, n // 16) int32, the
    sums of each plane over each half (16 values) of each block. As the int8 quantizer's: d =
    max|x| / _I24, q = rint(x * (1 / d)), and q = 0 where 1 / d is not finite (a zero block, or
    one so small that 1 / d overflows, contributes 0), and a block with an inf or NaN gets d =
    inf or NaN and s = NaN, so that the products come out NaN as with float32 activations."""
    T, n = x.shape
    for t in range(T):
        _quantize_row_i24(x[t], xq[t].reshape(3 * n), xd[t], xs[t], xi[t].reshape(3 * (n // 16)))


def _quantize_into(x, xr):
    """Quantize the rows of x (T, n) into the activation rows xr of either form (int8, int24)."""
    (_quantize_rows_i24 if xr[0].ndim == 3 else _quantize_rows)(x, xr[0], xr[1], xr[2], xr[3])


@overload(_quantize_into)
def _quantize_into_jit(x, xr):
    if xr[0].ndim == 3:
        return lambda x, xr: _quantize_rows_i24(x, xr[0], xr[1], xr[2], xr[3])
    return lambda x, xr: _quantize_rows(x, xr[0], xr[1], xr[2], xr[3])


@njit(parallel=True, cache=True)
def _quantize_parallel(x, xr, nt):
    """`_quantize_into` with the rows shared among `nt` threads (the prefill's and the batched
    pass's activations; the decode step quantizes its one row in threads of its own)."""
    T = x.shape[0]
    for c in prange(nt):
        lo, hi = c * T // nt, (c + 1) * T // nt
        _quantize_into(x[lo:hi], (xr[0][lo:hi], xr[1][lo:hi], xr[2][lo:hi], xr[3][lo:hi]))


def _quantize(x, xr):
    """Quantize the rows of x into xr, at least 8 rows a thread (a parallel region takes about 3 us to start)."""
    _quantize_parallel(x, xr, max(1, min(len(x) // 8, get_num_threads())))


def empty_rows(T: int, n: int, int8: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Room for T activation rows of n values (xq, xd, xs, xi): of `_quantize_rows`' form
    (int8), or of `_quantize_rows_i24`'s (int8=False)."""
    planes = () if int8 else (3,)
    return (aligned.empty((T, *planes, n), np.int8), np.empty((T, n // 32), np.float32),
            np.empty((T, n // 32), np.float32), np.empty((T, *planes, n // 16), np.int32))


def quantize_rows_i24(x) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(xq, xd, xs, xi) of `_quantize_rows_i24` for x of shape (T, n), n a multiple of 32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"x must have shape (T, n) with n a multiple of 32, got {x.shape}")
    xr = empty_rows(*x.shape, int8=False)
    _quantize(x, xr)
    return xr


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(xq, xd, xs, xi) of `_quantize_rows` for x of shape (T, n), n a multiple of 32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % 32:
        raise ValueError(f"x must have shape (T, n) with n a multiple of 32, got {x.shape}")
    xr = empty_rows(*x.shape, int8=True)
    _quantize(x, xr)
    return xr


# ---------------------------------------------------------------------------------------
# The micro-kernels
# ---------------------------------------------------------------------------------------

def _ir_dpbusd(builder, acc, u, s, isa):
    """acc (<16 x i32>) + the sums of 4 consecutive products u_j s_j in each lane, for <64 x i8>
    u (unsigned) and s (signed), by vpdpbusd or portable IR (AVX2: `_Pairs`)."""
    v16 = _vec(_I32, 16)
    if isa == "vnni512":
        return _ir_call(builder, "llvm.x86.avx512.vpdpbusd.512", v16,
                        [acc, builder.bitcast(u, v16), builder.bitcast(s, v16)])
    if isa == "vnni256":
        v8 = _vec(_I32, 8)
        halves = []
        for h in range(2):
            idx = list(range(32 * h, 32 * h + 32))
            a = _shuffle(builder, acc, acc, list(range(8 * h, 8 * h + 8)))
            halves.append(_ir_call(builder, "llvm.x86.avx512.vpdpbusd.256", v8,
                                   [a, builder.bitcast(_shuffle(builder, u, u, idx), v8),
                                    builder.bitcast(_shuffle(builder, s, s, idx), v8)]))
        return _shuffle(builder, halves[0], halves[1], list(range(16)))
    v64 = _vec(_I32, 64)
    p = builder.mul(builder.zext(u, v64), builder.sext(s, v64), flags=["nsw"])
    for i in range(4):
        acc = builder.add(acc, _shuffle(builder, p, p, list(range(i, 64, 4))), flags=["nsw"])
    return acc


class _Pairs:
    """AVX2's dots (no vpdpbusd): vpmaddubsw's i16 pair sums u_0 s_0 + u_1 s_1 of <64 x i8> u
    (unsigned, at most `umax`) and s (signed), added up in i16 while no sum can pass 2^15 (for
    s in -128..127: 8 of them for 4-bit u, 4 for 5-bit, 2 for 6-bit), then widened and added
    into the <16 x i32> lanes by one vpmaddwd with the dots' multiplier (1, or 16 for a Q8_0
    byte's high nibble; each multiplier has its own i16 sums). A 4-bit block's 16 vpmaddubsw
    for one activation row take 2 vpmaddwd where they took 16 (Zen 3 issues two of either a
    cycle)."""

    def __init__(self, builder, umax):
        self.builder, self.limit = builder, 32767 // (2 * 128 * umax)
        self.acc, self.pend = ir.Constant(_vec(_I32, 16), [0] * 16), {}  # multiplier: (i16 halves, count)

    def add(self, u, s, mult=1):
        b = self.builder
        if self.pend.get(mult, (None, 0))[1] == self.limit:
            self._widen(mult)
        halves = [_ir_call(b, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16),
                           [_shuffle(b, v, v, list(range(32 * h, 32 * h + 32))) for v in (u, s)]) for h in range(2)]
        if mult in self.pend:
            old, count = self.pend[mult]
            self.pend[mult] = ([b.add(a, h) for a, h in zip(old, halves)], count + 1)
        else:
            self.pend[mult] = (halves, 1)

    def _widen(self, mult):
        b = self.builder
        m = _const_vec(_I16, 16, mult)
        lanes = [_ir_call(b, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [h, m]) for h in self.pend.pop(mult)[0]]
        self.acc = b.add(self.acc, _shuffle(b, lanes[0], lanes[1], list(range(16))))

    def flush(self):
        """The lanes' i32 sums so far."""
        for mult in list(self.pend):
            self._widen(mult)
        return self.acc


_V16I, _V16F, _V64B = _vec(_I32, 16), _vec(_F32T, 16), _vec(_I8, 64)


def _ir_prefetch_next(builder, kind, pp, ob, panel_bytes):
    """Ask for the next panel's block at byte `ob` of `pp` (a panel is `panel_bytes` long; a
    hint, harmless past the last panel)."""
    for line in range(0, _KINDS[kind][3], 64):
        _ir_prefetch(builder, builder.gep(pp, [builder.add(builder.add(ob, ir.Constant(ob.type, line)), panel_bytes)]))


def _ir_scales(builder, kind, pp, ob):
    """The 16 rows' d, and their m or second d (_KINDS), of the panel block at byte `ob` of `pp`
    (its scales follow its quants and high bits)."""
    _, _, groups, _, _, has_m, layout, bits, _ = _KINDS[kind]
    at = builder.add(ob, ir.Constant(ob.type, 64 * (groups + bits)))

    def f16(o):
        return _ir_f16_vec(builder, _ir_load(builder, pp, builder.add(at, ir.Constant(at.type, o)),
                                             _vec(_I16, 16), 1))

    def byte(o, signed):  # a byte a row as float; its products with a float16 are exact in float32
        b = _ir_load(builder, pp, builder.add(at, ir.Constant(at.type, o)), _vec(_I8, 16), 1)
        return builder.sitofp(b, _V16F) if signed else builder.uitofp(b, _V16F)
    if layout == "q6_k":  # d sc of each half
        d = f16(0)
        return builder.fmul(d, byte(32, True)), builder.fmul(d, byte(48, True))
    if layout == "k":  # d sc and -dmin m
        return builder.fmul(f16(0), byte(64, False)), builder.fneg(builder.fmul(f16(32), byte(80, False)))
    return f16(0), (f16(32) if has_m else None)


def _ir_move_bit(builder, h, frm, to):
    """Bit `frm` of each byte of h (<64 x i8>) at bit `to`, the rest 0."""
    # shifted as 32-bit lanes: the mask keeps of each byte only a bit that came from the
    # same byte, and x86 has no byte shifts (LLVM made them GF2P8AFFINEQB, which Zen 4
    # issues at half the rate of a dword shift)
    w = builder.bitcast(h, _V16I)
    w = (builder.lshr(w, _const_vec(_I32, 16, frm - to)) if frm > to else
         builder.shl(w, _const_vec(_I32, 16, to - frm)) if frm < to else w)
    return builder.and_(builder.bitcast(w, _V64B), _const_vec(_I8, 64, 1 << to))


def _ir_nibble(builder, v, i):
    """The low (i 0) or high (1) nibbles of v's bytes."""
    return builder.lshr(v, _const_vec(_I8, 64, 4)) if i else builder.and_(v, _const_vec(_I8, 64, 15))


def _ir_parts(builder, kind, pp, ob, k):
    """Group k of the panel block at byte `ob` of `pp`: its unsigned weights as [(64 bytes,
    the block's column of their first element)]: bytes 4r..4r+3 are row r's elements col..col+3."""
    _, _, groups, _, _, _, _, bits, _ = _KINDS[kind]
    c = lambda v: ir.Constant(ob.type, v)  # noqa: E731
    v = _ir_load(builder, pp, builder.add(ob, c(64 * k)), _V64B, 1)
    if groups == 8:  # one element a byte
        return [(v, 4 * k)]
    ps = [_ir_nibble(builder, v, 0), _ir_nibble(builder, v, 1)]
    for j in range(bits):  # bit 4 + j of the low nibbles' elements is bit k of h, the high's 4 + k
        h = _ir_load(builder, pp, builder.add(ob, c(64 * (groups + j))), _V64B, 1)
        ps = [builder.or_(ps[i], _ir_move_bit(builder, h, 4 * i + k, 4 + j)) for i in range(2)]
    return [(ps[0], 4 * k), (ps[1], 16 + 4 * k)]


def _ir_finish(builder, kind, arrays, P, r, b, sums, dw, mw, acc):
    """*acc (<16 x float>) += activation row r's products with block b of the panel's 16 rows,
    from `sums[p]`: plane p's integer sums, one for each half of the block where the kind's
    halves have their own scale, else one (the module's docstring). Every kernel takes a
    block's sums to floats by this one sequence of operations, so a row's products are the
    same bits whichever kernel made its integer sums."""
    _, _, _, _, bias, has_m, _, _, halves = _KINDS[kind]
    _, _, dp, sp, ip, _, n, _ = arrays
    c = lambda v: ir.Constant(n.type, v)  # noqa: E731
    nb = builder.sdiv(n, c(32))
    at = builder.add(builder.mul(r, nb), b)
    # per plane: the sums of x that take the bias off (xi's half-block sums: row r plane p at (P r + p) 2 nb)
    xis = []
    for p in range(P):
        ai = builder.add(builder.mul(builder.add(builder.mul(r, c(P)), c(p)), nb), b)
        xi = [_ir_load(builder, ip, builder.add(builder.add(ai, ai), c(h)), _I32, 4) for h in range(2)]
        xis.append(xi if halves else [builder.add(xi[0], xi[1])])
    if P == 3:  # int24: planes 2 and 3 as one integer, 256 s2 + s3 (below 2^29)
        sh = _const_vec(_I32, 16, 8)
        sums = [sums[0], [builder.add(builder.shl(s2, sh), s3) for s2, s3 in zip(sums[1], sums[2])]]
        xis = [xis[0], [builder.add(builder.shl(x2, ir.Constant(_I32, 8)), x3) for x2, x3 in zip(xis[1], xis[2])]]
    if bias:
        sums = [[builder.sub(s, _ir_splat(builder, builder.mul(x, ir.Constant(_I32, bias)), 16))
                 for s, x in zip(ss, xx)] for ss, xx in zip(sums, xis)]
    fs = [builder.sitofp(s, _V16F) for s in sums[0]]
    if P == 3:  # 65536 f1 + float(256 s2 + s3)
        fs = [_ir_call(builder, "llvm.fma.v16f32", _V16F,
                       [f1, _const_vec(_F32T, 16, 65536.0), builder.sitofp(s23, _V16F)])
              for f1, s23 in zip(fs, sums[1])]
    a = builder.load(acc)
    dx = _ir_splat(builder, _ir_load(builder, dp, at, _F32T, 4), 16)
    for j, f in enumerate(fs):
        scale = builder.fmul(mw if j else dw, dx)
        a = _ir_call(builder, "llvm.fma.v16f32", _V16F, [f, scale, a])
    if has_m:
        sx = _ir_splat(builder, _ir_load(builder, sp, at, _F32T, 4), 16)
        a = _ir_call(builder, "llvm.fma.v16f32", _V16F, [mw, sx, a])
    builder.store(a, acc)


def _panel_arrays(context, builder, sig, args):
    """The kernels' arguments (mask, code, panel, xr, tmp) as (code, P, T, arrays): P the
    planes (1 int8, 3 int24), T the activation rows, arrays (panel, xq, xd, xs, xi, tmp
    pointers, n, the panel's bytes)."""
    code = context.cast(builder, args[1], sig.args[1], types.intp)
    xr = cgutils.unpack_tuple(builder, args[3])
    arrs = ([context.make_array(sig.args[2])(context, builder, args[2])]
            + [context.make_array(ty)(context, builder, a) for ty, a in zip(sig.args[3], xr)]
            + [context.make_array(sig.args[4])(context, builder, args[4])])
    nd = sig.args[3][0].ndim
    n = builder.extract_value(arrs[1].shape, nd - 1)
    arrays = [a.data for a in arrs] + [n, builder.extract_value(arrs[0].shape, 0)]
    return code, (1 if nd == 2 else 3), builder.extract_value(arrs[1].shape, 0), arrays


def _panel_args(mask, code, panel, xr, tmp) -> bool:
    """Whether a micro-kernel takes these types: a type mask (a literal; TypingError for any
    other), an integer code, a C-contiguous uint8 panel, the activation rows xr (xq, xd, xs,
    xi) in int8 (xq and xi 2-D) or int24 blocks (3-D: the planes), and tmp (T, 16) float32."""
    _mask_codes(mask)
    if not (isinstance(xr, types.BaseTuple) and len(xr) == 4 and isinstance(xr[0], types.Array)):
        return False
    nd = xr[0].ndim
    return (isinstance(code, types.Integer) and _is_c_array(panel, types.uint8) and nd in (2, 3)
            and _is_c_array(xr[0], types.int8, nd) and _is_c_array(xr[1], types.float32, 2)
            and _is_c_array(xr[2], types.float32, 2) and _is_c_array(xr[3], types.int32, nd)
            and _is_c_array(tmp, types.float32, 2))


def _ir_by_type(builder, mask, code, emit, tmp, rows):
    """emit(kind) in a branch taken where `code` is its type, for each type of `mask` (the
    kernel's mask argument's literal type) that has panels: only those types' code is made.
    Where `code` is none of them, the first `rows` rows of tmp (float32 (T, 16); rows: an IR
    value) are NaN: no caller passes such a code, each computing its mask from its weights."""
    on = _mask_codes(mask)
    matched = ir.Constant(ir.IntType(1), 0)
    for qt, kind in _CODES.items():
        if qt in on:
            hit = builder.icmp_signed("==", code, ir.Constant(code.type, qt))
            matched = builder.or_(matched, hit)
            with builder.if_then(hit):
                emit(kind)
    with builder.if_then(builder.not_(matched), likely=False):
        with cgutils.for_range(builder, rows) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, PANEL))
            builder.store(ir.Constant(_V16F, [math.nan] * 16),
                          builder.bitcast(builder.gep(tmp, [at]), _V16F.as_pointer()), align=4)


def _make_panel_dots(isa: str, one_row: bool = False):
    """The micro-kernels for `isa` (see quants_int8._dot_isa), an intrinsic ``panel_dots(mask,
    code, panel, xr, tmp)``: tmp[t, i] = dot(row i of the panel, x_t) for every activation row
    t (tmp: (T, 16) float32) of a weight of type `code` (one with panels), xr the activation
    rows in int8 or int24 blocks (4 arrays, the module's docstring); the code of the types of
    `mask` (a TypeMask) only (`_ir_by_type`: NaN for another code). With `one_row`, for
    one activation row (the decode step's): tiles of one row, which prefetch the next panel
    (the module's docstring)."""

    def tile(builder, kind, arrays, t0, tt, P):  # tmp[t0 + t, :] for t < tt, int8 (P 1) or int24 (P 3) x
        _, _, groups, pbs, _, _, _, bits, halves = _KINDS[kind]
        pp, qp, _, _, _, tmp, n, panel_bytes = arrays
        nb = builder.sdiv(n, ir.Constant(n.type, 32))
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        rows = [builder.add(t0, c(t)) for t in range(tt)]
        # xrow[p][t]: plane p of row t's x
        xrow = [[builder.bitcast(builder.gep(qp, [builder.mul(builder.add(builder.mul(r, c(P)), c(p)), n)]),
                                 _I8.as_pointer()) for r in rows] for p in range(P)]
        acc = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(tt)]
        # whether this tile prefetches the next panel (the docstring)
        ahead = builder.icmp_signed("<", t0, c(_PREFETCH_ROWS)) if tt > 1 or one_row else None
        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            ob = builder.mul(b, c(pbs))
            xo = builder.mul(b, c(32))
            if ahead is not None:  # the next panel's block b
                with builder.if_then(ahead):
                    _ir_prefetch_next(builder, kind, pp, ob, panel_bytes)

            def x4(t, col, p):  # the 4 bytes of plane p of row t's x from column 32 b + col, in every lane
                w = _ir_load(builder, xrow[p][t], builder.add(xo, c(col)), _I32, 1)
                return builder.bitcast(_ir_splat(builder, w, 16), _V64B)

            dw, mw = _ir_scales(builder, kind, pp, ob)
            # the integer sums: one a half (Q6_K), else one a block, in two chains in a tile of
            # one row of int8, whose one chain would wait on each dot's latency (a tile of 4
            # rows, or int24's planes, have independent chains already; AVX2's chains of i16
            # adds wait one cycle a dot)
            nsum = 2 if halves or (tt == 1 and P == 1 and isa != "avx2") else 1
            if isa == "avx2":
                umax = (16 << bits) - 1  # the largest unsigned weight a dot meets (a Q8_0 byte's nibbles: 15)
                pairs = [[[_Pairs(builder, umax) for _ in range(tt)] for _ in range(nsum)] for _ in range(P)]
            else:
                isum = [[[ir.Constant(_V16I, [0] * 16)] * tt for _ in range(nsum)] for _ in range(P)]
            for k in range(groups):
                for half, (u, col) in enumerate(_ir_parts(builder, kind, pp, ob, k)):
                    j = (half if groups == 4 else k) % nsum
                    # AVX2: a Q8_0 byte as its two nibbles, the high one's sums times 16
                    us = ([(_ir_nibble(builder, u, 0), 1), (_ir_nibble(builder, u, 1), 16)]
                          if isa == "avx2" and groups == 8 else [(u, 1)])
                    for p in range(P):
                        for t in range(tt):
                            xv = x4(t, col, p)
                            if isa == "avx2":
                                for v, mult in us:
                                    pairs[p][j][t].add(v, xv, mult)
                            else:
                                isum[p][j][t] = _ir_dpbusd(builder, isum[p][j][t], u, xv, isa)
            if isa == "avx2":
                isum = [[[pr.flush() for pr in chain] for chain in plane] for plane in pairs]
            for t in range(tt):
                sums = [[isum[p][j][t] for j in range(2)] if halves else
                        [isum[p][0][t] if nsum == 1 else builder.add(isum[p][0][t], isum[p][1][t])]
                        for p in range(P)]
                _ir_finish(builder, kind, arrays, P, rows[t], b, sums, dw, mw, acc[t])
        for t in range(tt):
            ptr = builder.bitcast(builder.gep(tmp, [builder.mul(rows[t], c(PANEL))]), _V16F.as_pointer())
            builder.store(builder.load(acc[t]), ptr, align=4)

    def codegen(context, builder, sig, args):
        code, P, T, arrays = _panel_arrays(context, builder, sig, args)
        c = lambda v: ir.Constant(T.type, v)  # noqa: E731

        def emit(kind):
            done = c(0)
            for tt in ((1,) if one_row else _TT):  # tiles of tt rows while tt rows are left
                count = builder.sdiv(builder.sub(T, done), c(tt))
                with cgutils.for_range(builder, count) as loop:
                    tile(builder, kind, arrays, builder.add(done, builder.mul(loop.index, c(tt))), tt, P)
                done = builder.add(done, builder.mul(count, c(tt)))
        _ir_by_type(builder, sig.args[0], code, emit, arrays[5], T)
        return context.get_dummy_value()

    @intrinsic(prefer_literal=True)
    def panel_dots(typingctx, mask, code, panel, xr, tmp):
        if not _panel_args(mask, code, panel, xr, tmp):
            return None
        return types.none(mask, code, panel, xr, tmp), codegen

    return panel_dots


_panel_dots = _make_panel_dots(DOT_ISA)
_panel_dots_one = _make_panel_dots(DOT_ISA, one_row=True)


# ---------------------------------------------------------------------------------------
# AMX
# ---------------------------------------------------------------------------------------

_UNPACK_AHEAD = 2  # blocks: the first tile puts the weights together this far ahead of their tdpbsud
_C_TILES, _A_TILE, _B_TILE = 0, 3, 6  # the tile registers: the sums (one a plane, or a plane's half), x, weights


def _ir_tile(builder, name, *args):
    """The AMX intrinsic llvm.x86.`name` on tile register numbers (ints) and other values."""
    _ir_call(builder, f"llvm.x86.{name}", ir.VoidType(),
             [ir.Constant(_I8, a) if isinstance(a, int) else a for a in args])


def _make_panel_dots_amx():
    """The micro-kernel for AMX-INT8, an intrinsic ``panel_dots(mask, code, panel, xr, tmp, wb)`` of
    `_make_panel_dots`' form that computes the tiles of 16 activation rows, rows 0 to 16 (T //
    16) - 1, and leaves the rest; wb: room for the panel's weights as bytes (uint8, 16 n).

    Per block of 32 (or each half of one: Q6_K), one tdpbsud takes the 16 rows' x (int8, or one
    int24 plane: signed) in a tile of 16 rows, and the panel's weights (unsigned) in a tile of 8
    (4) rows of 64 bytes whose row k holds each weight row's elements 4k..4k+3: the panel's
    groups as the dots take them, the nibbles and high bits put together, once a call into wb
    (Q8_0's are its panel as it is). The 16 x 16 integer sums go through `_ir_finish` as every
    kernel's do, so the products are the other kernels' bits.

    Values pass between the tiles and the vector registers through memory, and a load of what
    was just stored from the other side waits for it. So the first tile puts the weights
    together `_UNPACK_AHEAD` blocks ahead of their tdpbsud (the later tiles find them in wb),
    and each block's sums are taken to floats while the next block's tdpbsud run. Without
    those, and with the 16 rows' floats unrolled (their addresses spilled the registers), the
    kernel was no faster than the vpdpbusd one.
    """

    def tiles(builder, kind, arrays, P, T, wb):
        _, _, groups, pbs, _, _, _, _, halves = _KINDS[kind]
        pp, qp, _, _, _, tmp, n, panel_bytes = arrays
        nh = 2 if halves else 1
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        nb = builder.sdiv(n, c(32))
        cfg = cgutils.alloca_once_value(builder, ir.Constant(ir.ArrayType(_I8, 64), None))
        cfg8 = builder.bitcast(cfg, _I8.as_pointer())
        builder.store(ir.Constant(_I8, 1), cfg8)  # palette 1; tile i's bytes a row at 16 + 2 i, its rows at 48 + i
        shapes = {}
        for i in range(3):
            shapes.update({_C_TILES + i: (16, 64), _A_TILE + i: (16, 32 // nh)})
        for h in range(nh):
            shapes[_B_TILE + h] = (8 // nh, 64)
        for i, (nrows, colsb) in shapes.items():
            at = builder.bitcast(builder.gep(cfg8, [c(16 + 2 * i)]), _I16.as_pointer())
            builder.store(ir.Constant(_I16, colsb), at)
            builder.store(ir.Constant(_I8, nrows), builder.gep(cfg8, [c(48 + i)]))
        _ir_tile(builder, "ldtilecfg", cfg8)

        def unpack(b):  # block b's weights as bytes into wb, its next panel's bytes asked for
            ob = builder.mul(b, c(pbs))
            _ir_prefetch_next(builder, kind, pp, ob, panel_bytes)
            at = builder.mul(b, c(512))
            for k in range(groups):
                for u, col in _ir_parts(builder, kind, pp, ob, k):
                    builder.store(u, builder.bitcast(builder.gep(wb, [builder.add(at, c(16 * col))]),
                                                     _V64B.as_pointer()), align=1)

        if groups != 8:  # the first blocks; the first tile puts the others together _UNPACK_AHEAD blocks ahead
            with cgutils.for_range(builder, builder.select(builder.icmp_signed("<", nb, c(_UNPACK_AHEAD)), nb,
                                                           c(_UNPACK_AHEAD))) as loop:
                unpack(loop.index)
        # the integer sums of a block: (plane p, half h) at 1024 (p nh + h), in two buffers (even, odd blocks)
        size = 1024 * P * nh
        sums = builder.bitcast(cgutils.alloca_once(builder, _V16I, size=2 * size // 64), _I8.as_pointer())
        acc = cgutils.alloca_once(builder, _V16F, size=16)  # the 16 rows' products
        pairs = [(p, h) for h in range(nh) for p in range(P)]

        def sums_of(b):
            return builder.gep(sums, [builder.mul(builder.and_(b, c(1)), c(size))])

        def finish(t0, b):  # block b's sums, as floats into the 16 rows' acc
            dw, mw = _ir_scales(builder, kind, pp, builder.mul(b, c(pbs)))
            at = sums_of(b)
            with cgutils.for_range(builder, c(16)) as rows:  # a loop: unrolled, its addresses took the registers
                r = rows.index
                s = [[_ir_load(builder, at, builder.add(builder.mul(r, c(64)), c(1024 * (p * nh + h))), _V16I, 4)
                      for h in range(nh)] for p in range(P)]
                _ir_finish(builder, kind, arrays, P, builder.add(t0, r), b, s, dw, mw, builder.gep(acc, [r]))

        with cgutils.for_range(builder, builder.sdiv(T, c(16))) as tl:
            t0 = builder.mul(tl.index, c(16))
            for r in range(16):
                builder.store(ir.Constant(_V16F, [0.0] * 16), builder.gep(acc, [c(r)]))
            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                if groups == 8:  # Q8_0: the panel's bytes as they are, read first by the first tile
                    ob = builder.mul(b, c(pbs))
                    w = builder.gep(pp, [ob])
                    with builder.if_then(builder.icmp_signed("==", t0, c(0))):
                        _ir_prefetch_next(builder, kind, pp, ob, panel_bytes)
                else:
                    w = builder.gep(wb, [builder.mul(b, c(512))])
                    ahead = builder.add(b, c(_UNPACK_AHEAD))
                    with builder.if_then(builder.and_(builder.icmp_signed("==", t0, c(0)),
                                                      builder.icmp_signed("<", ahead, nb))):
                        unpack(ahead)
                for h in range(nh):
                    _ir_tile(builder, "tileloadd64", _B_TILE + h, builder.gep(w, [c(256 * h)]), c(64))
                for first in range(0, len(pairs), 3):  # three sums at a time, each in tiles of its own
                    group = list(enumerate(pairs[first:first + 3]))
                    for i, (p, h) in group:
                        xo = builder.add(builder.mul(builder.add(builder.mul(t0, c(P)), c(p)), n),
                                         builder.add(builder.mul(b, c(32)), c(16 * h)))
                        _ir_tile(builder, "tilezero", _C_TILES + i)
                        _ir_tile(builder, "tileloadd64", _A_TILE + i, builder.gep(qp, [xo]), builder.mul(n, c(P)))
                    for i, (p, h) in group:
                        _ir_tile(builder, "tdpbsud", _C_TILES + i, _A_TILE + i, _B_TILE + h)
                    for i, (p, h) in group:
                        _ir_tile(builder, "tilestored64", _C_TILES + i,
                                 builder.gep(sums_of(b), [c(1024 * (p * nh + h))]), c(64))
                with builder.if_then(builder.icmp_signed(">", b, c(0))):
                    finish(t0, builder.sub(b, c(1)))
            finish(t0, builder.sub(nb, c(1)))
            for r in range(16):
                ptr = builder.gep(tmp, [builder.mul(builder.add(t0, c(r)), c(PANEL))])
                builder.store(builder.load(builder.gep(acc, [c(r)])), builder.bitcast(ptr, _V16F.as_pointer()), align=4)
        _ir_tile(builder, "tilerelease")

    def codegen(context, builder, sig, args):
        code, P, T, arrays = _panel_arrays(context, builder, sig, args[:5])
        wb = context.make_array(sig.args[5])(context, builder, args[5]).data
        _ir_by_type(builder, sig.args[0], code, lambda kind: tiles(builder, kind, arrays, P, T, wb), arrays[5],
                    builder.mul(builder.sdiv(T, ir.Constant(T.type, 16)), ir.Constant(T.type, 16)))
        return context.get_dummy_value()

    @intrinsic(prefer_literal=True)
    def panel_dots(typingctx, mask, code, panel, xr, tmp, wb):
        if not (_panel_args(mask, code, panel, xr, tmp) and _is_c_array(wb, types.uint8)):
            return None
        return types.none(mask, code, panel, xr, tmp, wb), codegen

    return panel_dots


# The fewest activation rows whose products take AMX's tiles. On an Intel Xeon (Emerald
# Rapids), with `wb` made once a thread: one thread, the default model's shapes in a loop,
# the tiles took the products at 16 rows 1.25x faster than the vpdpbusd kernel in int8 and
# 1.02x in int24, at 32 rows 1.54x and 1.05x, at 48 1.44x and 1.24x. But with two threads, a
# parallel region a product (the products of a prefill), 16 int8 rows took 1.2x as long
# with the tiles, 32 about as long, 48 0.8x (int24 0.9x); and batched decode passes of 16
# sequences were no faster. (With `wb` from the heap in every call, 16 rows had been
# 0.74-1.05x in the loop.)
_AMX_ROWS = 48

if AMX:
    _panel_dots_amx = _make_panel_dots_amx()

    @njit(cache=True, inline="always")
    def _panel_dots_many(mask, code, panel, xr, tmp, wb):
        """`_panel_dots`, with the tiles of 16 activation rows by AMX when there are at least
        `_AMX_ROWS` (wb: `weight_bytes` bytes)."""
        T = tmp.shape[0]
        done = T // 16 * 16 if T >= _AMX_ROWS else 0
        if done:
            _panel_dots_amx(mask, code, panel, xr, tmp, wb)
        if done < T:  # one call site: the kernel's code is large
            _panel_dots(mask, code, panel, (xr[0][done:], xr[1][done:], xr[2][done:], xr[3][done:]), tmp[done:])
else:
    @njit(cache=True, inline="always")
    def _panel_dots_many(mask, code, panel, xr, tmp, wb):
        """`_panel_dots` (wb unused: there are no AMX tiles)."""
        _panel_dots(mask, code, panel, xr, tmp)


@njit(cache=True)
def weight_bytes(T, n):
    """The size of the scratch `wb` (uint8) that `_panel_rows` takes beside T activation rows
    of n values: room for a panel's weights as bytes where AMX's tiles may take them, else 0.
    A caller makes it once for all its calls, for the widest rows it has (in a parallel loop's
    body, np.empty of it is made once a thread)."""
    return 16 * n if AMX and T >= _AMX_ROWS else 0


@njit(cache=True, inline="always")
def _panel_rows(mask, code, pw, p, xr, tmp, wb):
    """tmp[t, i] = dot(row 16 p + i of the weight whose panels are `pw`, x_t) for every
    activation row t of xr (tmp: (T, 16) float32; wb: uint8, `weight_bytes` of xr's shape, or
    of a wider one's), by the code of the types of `mask` only. Inlined into its callers, one
    call site each (the kernels' code is large): a 16-row decode pass makes ~10,000 calls,
    which cost 0.3-0.5 ms of its 6 ms of products (inlined, the products took 0.93x the time)."""
    if xr[0].shape[0] == 1:  # its own kernel (the module's docstring)
        _panel_dots_one(mask, code, pw[p], xr, tmp)
    else:
        _panel_dots_many(mask, code, pw[p], xr, tmp, wb)


@njit(cache=True)
def _store(tmp, out, p, rows):
    """out[:, 16 p + i] = tmp[:, i] for the panel's rows that exist."""
    b, m = p * PANEL, min(PANEL, rows - p * PANEL)
    if m == PANEL:  # a whole panel: a constant trip count, which vectorizes (95 -> 60 ns for 16 rows)
        for t in range(tmp.shape[0]):
            for i in range(PANEL):
                out[t, b + i] = tmp[t, i]
    else:
        for t in range(tmp.shape[0]):
            for i in range(m):
                out[t, b + i] = tmp[t, i]


@njit(cache=True, error_model="numpy")
def _glu_store(g, u, out, p, act):
    """out[:, 16 p + i] = act(g[:, i]) * u[:, i] for the panel's rows that exist (g, u: (T,
    16) float32, a panel's gate and up products). Numpy's error model lets the loop vectorize:
    under Python's, the division in `_glu1` checks for zero, and the loop ran an element at a
    time (a third of a one-thread packed prefill's time)."""
    for t in range(out.shape[0]):
        for i in range(min(PANEL, out.shape[1] - p * PANEL)):
            out[t, p * PANEL + i] = _glu1(g[t, i], u[t, i], act)


@njit(parallel=True, cache=True)
def _matmul_panels(mask, code, pw, rows, xr, out):
    """out (T, rows) = x @ W.T for the panels `pw` of a weight of `rows` rows, parallel over panels."""
    for i in prange(pw.shape[0]):
        p = np.int64(i)  # prange's index is unsigned in the parallel region: one signature of the callees
        tmp = _empty((xr[0].shape[0], PANEL), np.float32)  # rows on cache lines
        wb = _empty((weight_bytes(xr[0].shape[0], xr[0].shape[-1]),), np.uint8)
        _panel_rows(mask, code, pw, p, xr, tmp, wb)
        _store(tmp, out, p, rows)


@njit(parallel=True, cache=True)
def _qkv_panels(mask, cq, pq, ck, pk, cv, pv, xr, q, k, v):
    """q, k, v = x @ Wq.T, x @ Wk.T, x @ Wv.T in one parallel region over all their panels."""
    nq, nk = pq.shape[0], pk.shape[0]
    for i in prange(nq + nk + pv.shape[0]):
        c = np.int64(i)  # as in _matmul_panels
        tmp = _empty((xr[0].shape[0], PANEL), np.float32)
        wb = _empty((weight_bytes(xr[0].shape[0], xr[0].shape[-1]),), np.uint8)
        if c < nq:
            code, pw, out, p = cq, pq, q, c
        elif c < nq + nk:
            code, pw, out, p = ck, pk, k, c - nq
        else:
            code, pw, out, p = cv, pv, v, c - nq - nk
        _panel_rows(mask, code, pw, p, xr, tmp, wb)  # one call site: it is inlined
        _store(tmp, out, p, out.shape[1])


@njit(parallel=True, cache=True)
def _gate_up_panels(mask, cg, pg, cu, pu, xr, out, act):
    """out = act(x @ Wg.T) * (x @ Wu.T), the GLU fused per panel (act: a code of nn.ACTS)."""
    T, rows = out.shape
    for j in prange(pg.shape[0]):
        p = np.int64(j)  # as in _matmul_panels
        g = _empty((T, PANEL), np.float32)
        u = _empty((T, PANEL), np.float32)
        wb = _empty((weight_bytes(xr[0].shape[0], xr[0].shape[-1]),), np.uint8)
        for s in range(2):  # one call site: it is inlined
            _panel_rows(mask, cg if s == 0 else cu, pg if s == 0 else pu, p, xr, g if s == 0 else u, wb)
        _glu_store(g, u, out, p, act)


def activation_rows(x, int8: bool) -> tuple:
    """x (T, n), n a multiple of 32, as the products take it (`xr`): in int8 blocks, or in
    int24 ones (the exact mode)."""
    return quantize_rows(x) if int8 else quantize_rows_i24(x)


def matmul_panels(panels: np.ndarray, qtype, rows: int, x, *, int8: bool = True) -> np.ndarray:
    """x @ W.T (T, rows) for a weight W of `rows` rows given by its panels (`pack_panels`) and
    activation rows x (T, n): x quantized to int8 blocks, or with int8=False to int24 ones."""
    kind = _CODES.get(int(qtype))
    if kind is None:
        raise ValueError(f"no panel kernels for type {qtype!r}; they exist for {_TYPES}")
    xr = activation_rows(x, int8)
    T, n = xr[0].shape[0], xr[0].shape[-1]
    if panels.dtype != np.uint8 or panels.shape != panel_shape(qtype, rows, n):
        raise ValueError(f"panels of shape {panels.shape} do not hold a {kind} weight of {rows} rows and "
                         f"{n} columns; make them with pack_panels")
    out = np.empty((T, rows), np.float32)
    _matmul_panels(kernel_types([qtype]), int(qtype), np.ascontiguousarray(panels), rows, xr, out)
    return out
