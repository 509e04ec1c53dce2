"""Dequantization and quantized matrix products for the GGML block formats, in Numba.

Data layout follows GGUF: a tensor of shape (..., n) is stored as uint8 rows of
``row_bytes(qtype, n)`` bytes, each row a run of blocks of ``qtypes.BLOCK_SIZES[qtype]``.

Public API (Python level, validates its inputs):

* ``dequantize(data, qtype)`` -- bit-exact with ``gguf.quants.dequantize``.
* ``matmul(data, qtype, x, out=None)`` -- ``W @ x`` (x of shape (n,)) or ``x @ W.T``
  (x of shape (S, n)) computed from the block data, W being the (rows, n) weight.
* ``row_elems``, ``row_bytes``, ``SUPPORTED_TYPES``.

Njit level, for fused kernels (C-contiguous arrays and scalars only; they never raise;
``code`` is ``int(qtype)``; ``mask`` a ``qtypes.TypeMask``, which Numba types as its literal
value: the kernels that branch on the type compile one version per mask, holding only the
code of its types, and give NaN for a code outside it, which no caller passes: each computes
its mask from the types it reads, ``qtypes.type_mask``):

* ``_deq_row(mask, code, src, dst)`` and ``_deq_row_<type>(src, dst)``: dequantize one row
  (``src`` uint8, ``dst`` float32).
* ``_dequantize_rows(mask, code, src2d, dst2d)``: row-parallel dequantization.
* ``_rows_f32(mask, code, data, r0, r1, x, xsum, row, out)``: ``out[r] = dot(row r of data,
  x)`` for rows r0..r1-1 on the calling thread (the fused decode step's work items), with
  ``_block_sums(x, xsum)`` computed once per x; built on the single-row dots
  ``_dot_row_<type>(row, x, xsum, nb)`` for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and Q2_K..Q6_K
  (nb: blocks of the type, 32 or 256 elements; xsum is read by the types with minima), the
  float types dequantizing each row into the caller's float32 ``row`` (at least as long as x) first.
* ``_has_dot(code)``, ``_dot_row(mask, code, row, x, xsum)``: whether a type has a direct
  dot, and that dot for one row (the prefill row kernels' few-rows path).
* ``_matvec(mask, code, data, x, out)``: the same product for all rows, row-parallel.
* ``_deq_row_vec(mask, code, src, dst)``: ``_deq_row``'s values by vector code (rows.py).
* ``_prefetch_ahead(data, r)``: the row loops' software prefetch of the weight bytes a
  little past row r (``_prefetch(data, i)`` beneath: a hint, valid past the end);
  ``_touch_lines(a)``: a load of every cache line of a contiguous view (paged attention's
  next block of records).

Dequantization reproduces gguf's float32 arithmetic order exactly (float16 scales are
widened to float32 first, products are rounded before sums, no fused multiply-add), so
those kernels are compiled without fastmath, and say so explicitly (``fastmath=False``):
a Numba function that leaves fastmath unset inherits it from the first fast-math caller that
compiles it, and the disk cache keeps that version. The product kernels use fastmath without
nnan/ninf and agree with dequantize-then-dot up to float32 summation order.
"""
from __future__ import annotations

import math
import platform
from typing import NamedTuple

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config as numba_config, njit, prange, types
from numba.core import cgutils, errors
from numba.extending import intrinsic, overload, typeof_impl

from .qtypes import BLOCK_SIZES, QT, TypeMask, kernel_types, type_name
from .threads import single_threaded_blas

# Product kernels may reassociate and contract, but must keep inf/nan semantics.
_FAST = {"contract", "reassoc", "nsz", "arcp"}

# Type codes used at njit level: the GGML enum values.
_F32 = int(QT.F32)
_F16 = int(QT.F16)
_BF16 = int(QT.BF16)
_Q8_0 = int(QT.Q8_0)
_Q4_0 = int(QT.Q4_0)
_Q4_1 = int(QT.Q4_1)
_Q5_0 = int(QT.Q5_0)
_Q5_1 = int(QT.Q5_1)
_Q2_K = int(QT.Q2_K)
_Q3_K = int(QT.Q3_K)
_Q4_K = int(QT.Q4_K)
_Q5_K = int(QT.Q5_K)
_Q6_K = int(QT.Q6_K)


# ---------------------------------------------------------------------------------------
# Type masks (qtypes.TypeMask): the types whose code a kernel holds
# ---------------------------------------------------------------------------------------

_MASK_TYPES: dict[int, types.IntegerLiteral] = {}


@typeof_impl.register(TypeMask)
def _typeof_type_mask(val, c):
    """A TypeMask's Numba type: its literal value, so that a kernel called with it compiles (and
    caches) a version for that mask, which the overloads and intrinsics below specialize. (A
    plain int made literal by numba.literally in the kernel types the kernel again at every
    call from Python, ~5 ms; a TypeMask costs a call ~2 us.) The type is made once a value:
    made anew, a call took ~8 us."""
    t = _MASK_TYPES.get(val)
    if t is None:
        t = _MASK_TYPES[int(val)] = types.literal(int(val))
    return t


def _mask_codes(mask) -> frozenset[int]:
    """The type codes of a kernel's type mask, from its Numba type (a literal: a TypeMask's).
    Any other mask (an int64: a plain int) is refused: its kernel would not know which types'
    code to leave out."""
    if not isinstance(mask, types.IntegerLiteral):
        raise errors.TypingError(f"a kernel's type mask must be a qtypes.TypeMask (a literal), got {mask}")
    return frozenset(int(t) for t in QT if mask.literal_value >> int(t) & 1)


def _type_flags(mask) -> tuple[bool, ...]:
    """Whether the kernel's type mask takes each type: (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K). The overloads below test these flags, closure
    constants, before each type's code: Numba prunes the branches of a false one before it types
    them, so a type outside the mask is neither typed nor compiled."""
    on = _mask_codes(mask)
    return tuple(t in on for t in (_F32, _F16, _BF16, _Q8_0, _Q4_0, _Q4_1, _Q5_0, _Q5_1, _Q2_K, _Q3_K, _Q4_K, _Q5_K,
                                   _Q6_K))


# ---------------------------------------------------------------------------------------
# LLVM IR helpers for the intrinsics below (float16 conversion and the decode row dots)
# ---------------------------------------------------------------------------------------

_I8 = ir.IntType(8)
_I16 = ir.IntType(16)
_I32 = ir.IntType(32)
_F32T = ir.FloatType()
# The float operations of the IR below may contract (a multiply and an add into an FMA), but
# not reassociate: their order is written out in the IR, and a kernel that calls a routine
# carries a copy of it that LLVM optimizes again inside that kernel's module, where
# reassociation could regroup a sum. The copies are weak symbols and a process runs the first
# one it loaded, so a regrouped copy made a product's last bits depend on the load order.
_IR_FLAGS = ("contract",)


def _hardware_f16() -> bool:
    """Whether numba's target converts float16 -> float32 in one instruction (x86 F16C, AArch64).

    Elsewhere LLVM would emit a call to a runtime helper that the JIT may not resolve.
    """
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    features = numba_config.CPU_FEATURES
    if features is None:
        return bool(llvm.get_host_cpu_features().get("f16c", False))
    return "+f16c" in features.split(",")


_HW_F16 = _hardware_f16()


def _ir_i32(v):
    return ir.Constant(_I32, v)


def _ir_call(builder, name, ret, args):
    """Call the function (an LLVM intrinsic) ``name`` returning ``ret`` on ``args``."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _ir_as_i32(builder, h):
    """An integer value truncated or zero-extended to i32 (float16 bits sit in its low 16)."""
    if h.type.width > 32:
        return builder.trunc(h, _I32)
    if h.type.width < 32:
        return builder.zext(h, _I32)
    return h


def _ir_f16_exact(builder, h):
    """float32 from the float16 bits in the low half of i32 ``h``: exact, NaN payloads kept."""
    sign = builder.shl(builder.and_(h, _ir_i32(0x8000)), _ir_i32(16))
    em = builder.and_(h, _ir_i32(0x7FFF))
    # normal numbers: rebias the exponent by 127 - 15; inf/nan: by 2 * (127 - 15), giving 0xFF
    special = builder.icmp_unsigned(">=", em, _ir_i32(0x7C00))
    bias = builder.select(special, _ir_i32(0x38000), _ir_i32(0x1C000))
    normal = builder.shl(builder.add(em, bias), _ir_i32(13))
    # subnormal m * 2**-24: shift the leading one of m to bit 10, k = ctlz(m) - 21 (only
    # selected below when em < 0x400, where 1 <= k <= 11)
    k = builder.sub(builder.ctlz(em, ir.Constant(ir.IntType(1), 0)), _ir_i32(21))
    mant = builder.shl(builder.and_(builder.shl(em, k), _ir_i32(0x3FF)), _ir_i32(13))
    sub = builder.or_(builder.shl(builder.sub(_ir_i32(113), k), _ir_i32(23)), mant)
    sub = builder.select(builder.icmp_unsigned("==", em, _ir_i32(0)), _ir_i32(0), sub)
    bits = builder.select(builder.icmp_unsigned("<", em, _ir_i32(0x400)), sub, normal)
    return builder.bitcast(builder.or_(bits, sign), _F32T)


def _ir_f16_fast(builder, h):
    """float32 from float16 bits (i32 ``h``) for the products: one instruction where the
    hardware has it (which quiets signalling NaNs), else the exact conversion."""
    if _HW_F16:
        return builder.fpext(builder.bitcast(builder.trunc(h, _I16), ir.HalfType()), _F32T)
    return _ir_f16_exact(builder, h)


def _ir_load(builder, base, offset, ty, align):
    """Load a ``ty`` (scalar or vector) from element ``offset`` of the pointer ``base``."""
    ptr = builder.bitcast(builder.gep(base, [offset]), ty.as_pointer())
    return builder.load(ptr, align=align)


def _ir_load_f16(builder, base, offset):
    """float16 bits at byte ``offset`` of ``base``, zero-extended to i32."""
    return builder.zext(_ir_load(builder, base, offset, _I16, 1), _I32)


def _ir_splat(builder, v, n):
    vec = builder.insert_element(ir.Constant(ir.VectorType(v.type, n), ir.Undefined), v, _ir_i32(0))
    return builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _ir_hsum(builder, v):
    """Sum of the lanes of a float vector (a power of two long), by halving."""
    n = v.type.count
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi, flags=_IR_FLAGS)
    return builder.extract_element(v, _ir_i32(0))


def _ir_blocks(context, builder, nb_value, nb_type, step, unroll=1):
    """Emit ``for b in range(nb): step(b, u)``, ``unroll`` blocks an iteration with u = 0 ..
    unroll - 1 (the slot: each has an accumulator of its own, for independent dependency
    chains), then the blocks left over, with u = 0."""
    nb = context.cast(builder, nb_value, nb_type, types.intp)
    one, k = ir.Constant(nb.type, 1), ir.Constant(nb.type, unroll)
    whole = builder.mul(builder.udiv(nb, k), k)
    with cgutils.for_range_slice(builder, ir.Constant(nb.type, 0), whole, k, inc=True) as (b, _):
        for u in range(unroll):
            step(builder.add(b, ir.Constant(nb.type, u)), u)
    if unroll > 1:
        with cgutils.for_range_slice(builder, whole, nb, one, inc=True) as (b, _):
            step(b, 0)


def _ir_accumulate(builder, acc_ptr, value):
    builder.store(builder.fadd(builder.load(acc_ptr), value, flags=_IR_FLAGS), acc_ptr)


def _ir_scaled(builder, d, v):
    return builder.fmul(_ir_splat(builder, d, v.type.count), v, flags=_IR_FLAGS)


def _ir_vec_zero(n):
    return ir.Constant(ir.VectorType(_F32T, n), [0.0] * n)


def _ir_nibbles(builder, rp, o, bias):
    """Two <16 x float>: the low nibbles of the 16 bytes at rp[o:] minus ``bias``, then their
    high nibbles minus ``bias`` (Q4_0/Q4_1's elements 0-15 and 16-31)."""
    vi = ir.VectorType(_I32, 16)
    q = builder.zext(_ir_load(builder, rp, o, ir.VectorType(_I8, 16), 1), vi)
    halves = (builder.and_(q, ir.Constant(vi, [15] * 16)), builder.lshr(q, ir.Constant(vi, [4] * 16)))
    if bias:
        halves = [builder.sub(h, ir.Constant(vi, [bias] * 16)) for h in halves]
    return [builder.sitofp(h, ir.VectorType(_F32T, 16)) for h in halves]


def _ir_pair_dot(builder, lo, hi, xp, xo):
    """<16 x float>: lo * x[xo : xo + 16] + hi * x[xo + 16 : xo + 32], for <16 x float> lo, hi:
    a 32-element run's products folded in halves (a multiply and an FMA per 32 weights)."""
    vf = ir.VectorType(_F32T, 16)
    x0 = _ir_load(builder, xp, xo, vf, 4)
    x1 = _ir_load(builder, xp, builder.add(xo, ir.Constant(xo.type, 16)), vf, 4)
    return builder.fadd(builder.fmul(lo, x0, flags=_IR_FLAGS), builder.fmul(hi, x1, flags=_IR_FLAGS),
                        flags=_IR_FLAGS)


def _is_c_array(ty, dtype, ndim=1):
    """Whether the Numba type `ty` is a C-contiguous array of `ndim` dimensions of `dtype`."""
    return isinstance(ty, types.Array) and ty.ndim == ndim and ty.layout == "C" and ty.dtype == dtype


# ---------------------------------------------------------------------------------------
# Scalar helpers
# ---------------------------------------------------------------------------------------

@intrinsic
def _f16_to_f32(typingctx, bits):
    """float32 value of the float16 whose bit pattern is the low 16 bits of integer ``bits``
    (exact, as numpy's astype: NaN payloads and signalling NaNs are kept)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return _ir_f16_exact(builder, _ir_as_i32(builder, args[0]))  # reads only the low 16 bits

    return types.float32(bits), codegen


@njit(cache=True, fastmath=False)
def _f16_at(src, o):
    """The little-endian float16 at byte offset ``o`` of uint8 array ``src``, as float32."""
    return _f16_to_f32(np.uint32(src[o]) | (np.uint32(src[o + 1]) << 8))


# ---------------------------------------------------------------------------------------
# Row dequantizers: src is one C-contiguous uint8 row of whole blocks, dst its float32 row.
# ---------------------------------------------------------------------------------------

@njit(cache=True, fastmath=False)
def _deq_row_f32(src, dst):
    dst.view(np.uint32)[:] = src.view(np.uint32)


@njit(cache=True, fastmath=False)
def _deq_row_f16(src, dst):
    h = src.view(np.uint16)
    for i in range(dst.shape[0]):
        dst[i] = _f16_to_f32(h[i])


@njit(cache=True, fastmath=False)
def _deq_row_bf16(src, dst):
    h = src.view(np.uint16)
    u = dst.view(np.uint32)
    for i in range(u.shape[0]):
        u[i] = np.uint32(h[i]) << 16


@njit(cache=True, fastmath=False)
def _deq_row_q8_0(src, dst):
    # block (34 B): d f16 | qs int8[32];  y[j] = qs[j] * d
    qs = src.view(np.int8)
    for b in range(dst.shape[0] // 32):
        o = b * 34
        d = _f16_at(src, o)
        for j in range(32):
            dst[b * 32 + j] = np.float32(qs[o + 2 + j]) * d


@njit(cache=True, fastmath=False)
def _deq_row_q4_0(src, dst):
    # block (18 B): d f16 | qs u8[16];  y[j] = d*((qs[j]&15)-8), y[j+16] = d*((qs[j]>>4)-8)
    for b in range(dst.shape[0] // 32):
        o = b * 18
        y = b * 32
        d = _f16_at(src, o)
        for j in range(16):
            q = np.int64(src[o + 2 + j])
            dst[y + j] = d * np.float32((q & 15) - 8)
            dst[y + 16 + j] = d * np.float32((q >> 4) - 8)


@njit(cache=True, fastmath=False)
def _deq_row_q4_1(src, dst):
    # block (20 B): d f16 | m f16 | qs u8[16];  y[j] = d*(qs[j]&15) + m, y[j+16] = d*(qs[j]>>4) + m
    for b in range(dst.shape[0] // 32):
        o = b * 20
        y = b * 32
        d = _f16_at(src, o)
        m = _f16_at(src, o + 2)
        for j in range(16):
            q = np.int64(src[o + 4 + j])
            dst[y + j] = d * np.float32(q & 15) + m
            dst[y + 16 + j] = d * np.float32(q >> 4) + m


@njit(cache=True, fastmath=False)
def _deq_row_q5_0(src, dst):
    # block (22 B): d f16 | qh u32 (bit j = 5th bit of element j) | qs u8[16] (low nibbles:
    # elements 0..15, high nibbles: 16..31);  y = d * (q5 - 16)
    for b in range(dst.shape[0] // 32):
        o = b * 22
        y = b * 32
        d = _f16_at(src, o)
        qh = (np.int64(src[o + 2]) | (np.int64(src[o + 3]) << 8)
              | (np.int64(src[o + 4]) << 16) | (np.int64(src[o + 5]) << 24))
        for j in range(16):
            q = np.int64(src[o + 6 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = d * np.float32(lo - 16)
            dst[y + 16 + j] = d * np.float32(hi - 16)


@njit(cache=True, fastmath=False)
def _deq_row_q5_1(src, dst):
    # block (24 B): d f16 | m f16 | qh u32 | qs u8[16] (as Q5_0);  y = d * q5 + m
    for b in range(dst.shape[0] // 32):
        o = b * 24
        y = b * 32
        d = _f16_at(src, o)
        m = _f16_at(src, o + 2)
        qh = (np.int64(src[o + 4]) | (np.int64(src[o + 5]) << 8)
              | (np.int64(src[o + 6]) << 16) | (np.int64(src[o + 7]) << 24))
        for j in range(16):
            q = np.int64(src[o + 8 + j])
            lo = (q & 15) | (((qh >> j) & 1) << 4)
            hi = (q >> 4) | (((qh >> (j + 16)) & 1) << 4)
            dst[y + j] = d * np.float32(lo) + m
            dst[y + 16 + j] = d * np.float32(hi) + m


@njit(cache=True, fastmath=False)
def _deq_row_q2_k(src, dst):
    # super-block (84 B, 256 elements in 16 sub-blocks of 16):
    #   scales u8[16] @0   low nibble: scale, high nibble: min, of sub-block s
    #   qs     u8[64] @16  2-bit quants; element e = h*128 + k*32 + l (h<2, k<4, l<32)
    #                      is (qs[h*32 + l] >> 2k) & 3
    #   d      f16    @80, dmin f16 @82
    #   y[e] = (d * scale[s]) * q - (dmin * min[s]),  s = e // 16
    for b in range(dst.shape[0] // 256):
        o = b * 84
        y = b * 256
        d = _f16_at(src, o + 80)
        dmin = _f16_at(src, o + 82)
        for s in range(16):
            sc = np.int64(src[o + s])
            dl = d * np.float32(sc & 15)
            ml = dmin * np.float32(sc >> 4)
            h = s >> 3
            shift = ((s >> 1) & 3) * 2
            l0 = (s & 1) * 16
            for i in range(16):
                q = (np.int64(src[o + 16 + h * 32 + l0 + i]) >> shift) & 3
                dst[y + s * 16 + i] = dl * np.float32(q) - ml


@njit(cache=True, fastmath=False)
def _deq_row_q3_k(src, dst):
    # super-block (110 B, 256 elements in 16 sub-blocks of 16):
    #   hmask  u8[32] @0   element e = k*32 + l (k<8) has high bit (hmask[l] >> k) & 1;
    #                      a CLEAR bit subtracts 4
    #   qs     u8[64] @32  low 2 bits, laid out as Q2_K: e = h*128 + k*32 + l
    #                      -> (qs[h*32 + l] >> 2k) & 3
    #   scales u8[12] @96  6-bit scales, 32-biased:
    #                      bytes 0..7: low nibble = scale i (bits 0-3), high nibble = scale i+8
    #                      bytes 8..11: bits 2k..2k+1 of byte 8+j = bits 4-5 of scale 4k+j
    #   d      f16    @108
    #   y[e] = (d * (scale[s] - 32)) * q,  s = e // 16
    for b in range(dst.shape[0] // 256):
        o = b * 110
        y = b * 256
        d = _f16_at(src, o + 108)
        for s in range(16):
            if s < 8:
                lo = np.int64(src[o + 96 + s]) & 15
            else:
                lo = np.int64(src[o + 96 + s - 8]) >> 4
            hi = (np.int64(src[o + 104 + (s & 3)]) >> (2 * (s >> 2))) & 3
            dl = d * np.float32((lo | (hi << 4)) - 32)
            h = s >> 3
            shift = ((s >> 1) & 3) * 2
            l0 = (s & 1) * 16
            k = s >> 1
            for i in range(16):
                l = l0 + i
                q = (np.int64(src[o + 32 + h * 32 + l]) >> shift) & 3
                if ((np.int64(src[o + l]) >> k) & 1) == 0:
                    q -= 4
                dst[y + s * 16 + i] = dl * np.float32(q)


@njit(cache=True, fastmath=False)
def _k_scale_min(src, o, j):
    """Q4_K/Q5_K 6-bit (scale, min) of sub-block j from the 12 bytes at src[o:]:
        bytes 0..3  (j<4): scale j in bits 0-5; bits 6-7 are bits 4-5 of scale j+4
        bytes 4..7  (j<4): min j   in bits 0-5; bits 6-7 are bits 4-5 of min j+4
        bytes 8..11 (j>=4): low nibble = bits 0-3 of scale j, high nibble = bits 0-3 of min j
    """
    if j < 4:
        return np.int64(src[o + j]) & 63, np.int64(src[o + j + 4]) & 63
    sc = (np.int64(src[o + j + 4]) & 15) | ((np.int64(src[o + j - 4]) >> 6) << 4)
    mn = (np.int64(src[o + j + 4]) >> 4) | ((np.int64(src[o + j]) >> 6) << 4)
    return sc, mn


@njit(cache=True, fastmath=False)
def _deq_row_q4_k(src, dst):
    # super-block (144 B, 256 elements in 8 sub-blocks of 32):
    #   d f16 @0, dmin f16 @2, scales u8[12] @4 (see _k_scale_min)
    #   qs u8[128] @16: element e = c*64 + h*32 + l (c<4, h<2) is (qs[c*32 + l] >> 4h) & 15
    #   y[e] = (d * scale[j]) * q - (dmin * min[j]),  j = e // 32
    for b in range(dst.shape[0] // 256):
        o = b * 144
        y = b * 256
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        for j in range(8):
            sc, mn = _k_scale_min(src, o + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(mn)
            base = o + 16 + (j >> 1) * 32
            shift = (j & 1) * 4
            for l in range(32):
                q = (np.int64(src[base + l]) >> shift) & 15
                dst[y + j * 32 + l] = dl * np.float32(q) - ml


@njit(cache=True, fastmath=False)
def _deq_row_q5_k(src, dst):
    # super-block (176 B, 256 elements in 8 sub-blocks of 32):
    #   d f16 @0, dmin f16 @2, scales u8[12] @4 (see _k_scale_min)
    #   qh u8[32] @16: element e = j*32 + l has 5th bit (qh[l] >> j) & 1
    #   qs u8[128] @48: low 4 bits, laid out as Q4_K
    #   y[e] = (d * scale[j]) * q - (dmin * min[j]),  j = e // 32
    for b in range(dst.shape[0] // 256):
        o = b * 176
        y = b * 256
        d = _f16_at(src, o)
        dmin = _f16_at(src, o + 2)
        for j in range(8):
            sc, mn = _k_scale_min(src, o + 4, j)
            dl = d * np.float32(sc)
            ml = dmin * np.float32(mn)
            base = o + 48 + (j >> 1) * 32
            shift = (j & 1) * 4
            for l in range(32):
                q = ((np.int64(src[base + l]) >> shift) & 15) | (((np.int64(src[o + 16 + l]) >> j) & 1) << 4)
                dst[y + j * 32 + l] = dl * np.float32(q) - ml


@njit(cache=True, fastmath=False)
def _deq_row_q6_k(src, dst):
    # super-block (210 B, 256 elements in 16 sub-blocks of 16), two halves h of 128:
    #   ql u8[128] @0:   element h*128 + k*64 + l (k<2, l<64): low 4 bits (ql[h*64 + l] >> 4k) & 15
    #   qh u8[64]  @128: element h*128 + k*32 + l (k<4, l<32): high 2 bits (qh[h*32 + l] >> 2k) & 3
    #   scales i8[16] @192, d f16 @208
    #   y[e] = (d * scale[s]) * (q - 32),  s = e // 16
    scales = src.view(np.int8)
    for b in range(dst.shape[0] // 256):
        o = b * 210
        y = b * 256
        d = _f16_at(src, o + 208)
        for s in range(16):
            dl = d * np.float32(scales[o + 192 + s])
            for i in range(16):
                t = (s & 7) * 16 + i            # position inside half h
                h = s >> 3
                lo = (np.int64(src[o + h * 64 + (t & 63)]) >> (4 * (t >> 6))) & 15
                hi = (np.int64(src[o + 128 + h * 32 + (t & 31)]) >> (2 * (t >> 5))) & 3
                dst[y + s * 16 + i] = dl * np.float32((lo | (hi << 4)) - 32)


def _deq_row_of(mask, code, src, dst):
    """`_deq_row`'s branches, those of the types of `mask` (the overload below)."""


@overload(_deq_row_of, prefer_literal=True, jit_options={"fastmath": False})
def _deq_row_of_jit(mask, code, src, dst):
    f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k = _type_flags(mask)

    def impl(mask, code, src, dst):
        if q4_1 and code == _Q4_1:
            _deq_row_q4_1(src, dst)
        elif q8_0 and code == _Q8_0:
            _deq_row_q8_0(src, dst)
        elif q4_0 and code == _Q4_0:
            _deq_row_q4_0(src, dst)
        elif f32 and code == _F32:
            _deq_row_f32(src, dst)
        elif f16 and code == _F16:
            _deq_row_f16(src, dst)
        elif bf16 and code == _BF16:
            _deq_row_bf16(src, dst)
        elif q5_0 and code == _Q5_0:
            _deq_row_q5_0(src, dst)
        elif q5_1 and code == _Q5_1:
            _deq_row_q5_1(src, dst)
        elif q2_k and code == _Q2_K:
            _deq_row_q2_k(src, dst)
        elif q3_k and code == _Q3_K:
            _deq_row_q3_k(src, dst)
        elif q4_k and code == _Q4_K:
            _deq_row_q4_k(src, dst)
        elif q5_k and code == _Q5_K:
            _deq_row_q5_k(src, dst)
        elif q6_k and code == _Q6_K:
            _deq_row_q6_k(src, dst)
        else:
            dst[:] = np.nan

    return impl


@njit(cache=True, fastmath=False)
def _deq_row(mask, code, src, dst):
    """Dequantize one row of type ``code`` (= int(GGMLQuantizationType)), one of the types of
    ``mask`` (a TypeMask: only their code is compiled); any other code fills dst with NaN."""
    _deq_row_of(mask, code, src, dst)


@njit(parallel=True, cache=True, fastmath=False)
def _dequantize_rows(mask, code, src, dst):
    """Row-parallel dequantization of uint8 rows ``src`` into float32 rows ``dst`` (``_deq_row``)."""
    for r in prange(src.shape[0]):
        _deq_row(mask, code, src[r], dst[r])


# ---------------------------------------------------------------------------------------
# Decode products: out[r] = dot(dequantized row r of data, x), the direct block dots as LLVM IR
#
# One block (32 elements) or super-block (256) per step: its quants unpacked with
# byte-vector operations into runs of 32 consecutive elements (signed: biases are subtracted
# in integers) and widened to floats. (Plain loops over a block's quants get fully unrolled
# by LLVM, which then vectorises across blocks with gathers.)
# - 32-element blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): a block's products fold in halves into
#   16 lanes (`_ir_pair_dot`), are scaled by its d and added into one of _UNROLL
#   accumulators, the loop taking _UNROLL blocks a step (independent chains).
# - Q4_K/Q5_K: each 32-element run's folded products times its sub-block scale d * sc, into
#   one of _N_ACC accumulators in turn.
# - Q6_K/Q3_K/Q2_K (16-element sub-blocks): a run's quants times its two sub-blocks' scales
#   (a vector of two halves), multiply-added with x into one of _N_ACC <32 x float>
#   accumulators in turn.
# Per 32 weights that is about eight 512-bit operations (widen the quants, convert, multiply,
# fold, scale), which is what bounds these dots on a 2-core AMD EPYC (Zen 4): ~6-8 cycles
# per 32 weights with the data in cache, where a 32-element float32 dot alone is 2.
# Minimum terms (Q4_1/Q5_1: m * sum of the block; Q4_K/Q5_K: dmin * min_j * sum of x over
# sub-block j) come from the caller's 32-element block sums of x (``_block_sums``); Q2_K's
# 16-element sub-blocks subtract their minimum from each weight (w = dl q - ml), then dot.
# Each dot has the signature (row, x, xsum, nb): nb blocks of the type (32 or 256
# elements); types without a minimum ignore xsum.
# ---------------------------------------------------------------------------------------

def _vec(ty, n):
    return ir.VectorType(ty, n)


def _const_vec(ty, n, v):
    return ir.Constant(_vec(ty, n), v if isinstance(v, list) else [v] * n)


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, ir.Constant(_vec(_I32, len(idx)), idx))


def _ir_tree_sum(builder, terms):
    """Sum of float vectors as a balanced tree (short dependency chains)."""
    while len(terms) > 1:
        terms = [builder.fadd(terms[i], terms[i + 1], flags=_IR_FLAGS) if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
    return terms[0]


def _ir_b8(builder, v, op, k):
    """An i8-vector operation with a splat constant: op in and/or/lshr/shl/sub/add."""
    c = _const_vec(_I8, v.type.count, k)
    return {"and": builder.and_, "or": builder.or_, "lshr": builder.lshr, "shl": builder.shl,
            "sub": builder.sub, "add": builder.add}[op](v, c)


def _ir_nib32(builder, rp, o):
    """<32 x i8>: the low nibbles of the 16 bytes at rp[o:], then their high nibbles."""
    q = _ir_load(builder, rp, o, _vec(_I8, 16), 1)
    return _shuffle(builder, _ir_b8(builder, q, "and", 15), _ir_b8(builder, q, "lshr", 4), list(range(32)))


def _ir_qh_bits(builder, rp, o):
    """<32 x i8>: 16 where bit j of the little-endian uint32 at rp[o:] is set, else 0 (Q5_0/Q5_1's
    fifth bits, element j): the bits as a <32 x i1> mask (AVX-512: one kmov and a masked move)."""
    on = builder.bitcast(_ir_load(builder, rp, o, _I32, 1), _vec(ir.IntType(1), 32))
    return builder.select(on, _const_vec(_I8, 32, 16), _const_vec(_I8, 32, 0))


def _ir_bit_select(builder, v, bit, value):
    """<32 x i8>: ``value`` where bit ``bit`` of byte vector v is set, else 0 (a vptestmb and a
    masked move where AVX-512BW has them)."""
    on = builder.icmp_unsigned("!=", _ir_b8(builder, v, "and", 1 << bit), _const_vec(_I8, 32, 0))
    return builder.select(on, _const_vec(_I8, 32, value), _const_vec(_I8, 32, 0))


def _ir_fma_x(builder, acc, w, xp, xo):
    """acc += w * x[xo : xo + 32] (acc: a pointer to a <32 x float>)."""
    _ir_accumulate(builder, acc, builder.fmul(w, _ir_load(builder, xp, xo, _vec(_F32T, 32), 4), flags=_IR_FLAGS))


def _ir_k_scales(builder, rp, o):
    """Q4_K/Q5_K's 6-bit (scales, mins) of the 8 sub-blocks, as two <8 x i32>, from the 12
    bytes at rp[o:] (see _k_scale_min)."""
    a = _ir_load(builder, rp, o, _vec(_I8, 8), 1)                                  # bytes 0..7
    b = _ir_load(builder, rp, builder.add(o, ir.Constant(o.type, 4)), _vec(_I8, 8), 1)  # bytes 4..11
    v = _vec(_I32, 8)

    def pick(idx):
        return builder.zext(_shuffle(builder, a, b, idx), v)

    A, B = pick([0, 1, 2, 3, 12, 13, 14, 15]), pick([4, 5, 6, 7, 12, 13, 14, 15])
    C, D = pick([0, 1, 2, 3, 0, 1, 2, 3]), pick([4, 5, 6, 7, 4, 5, 6, 7])
    k = lambda x: _const_vec(_I32, 8, x)  # noqa: E731
    first = ir.Constant(_vec(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])
    top = lambda w: builder.shl(builder.lshr(w, k(6)), k(4))  # noqa: E731
    sc = builder.select(first, builder.and_(A, k(63)), builder.or_(builder.and_(A, k(15)), top(C)))
    mn = builder.select(first, builder.and_(B, k(63)), builder.or_(builder.lshr(B, k(4)), top(D)))
    return sc, mn


def _ir_halves(builder, scales, s):
    """<32 x float>: lanes 0-15 scales[s], lanes 16-31 scales[s + 1]."""
    return _shuffle(builder, scales, scales, [s] * 16 + [s + 1] * 16)


def _ir_i2f(builder, v, scale):
    """float vector scale * float(v), for an integer vector v."""
    f = builder.sitofp(v, _vec(_F32T, v.type.count))
    return builder.fmul(_ir_splat(builder, scale, v.type.count), f, flags=_IR_FLAGS)


def _ir_q5_halves(builder, rp, o, bias):
    """Two <16 x float>: the quants of a Q5_0/Q5_1 block whose qh (uint32) is at rp[o:] and
    nibbles at rp[o + 4:], minus ``bias``: elements 0-15, then 16-31. Each half (16 nibbles
    with 16 fifth bits as a <16 x i1> mask) is widened on its own, where joining the bytes
    first would cost two cross-lane shuffles."""
    c = lambda v: ir.Constant(o.type, v)  # noqa: E731
    nib = _ir_load(builder, rp, builder.add(o, c(4)), _vec(_I8, 16), 1)
    halves = []
    for h in range(2):
        q = _ir_b8(builder, nib, "and", 15) if h == 0 else _ir_b8(builder, nib, "lshr", 4)
        on = builder.bitcast(_ir_load(builder, rp, builder.add(o, c(2 * h)), _I16, 1), _vec(ir.IntType(1), 16))
        q = builder.or_(q, builder.select(on, _const_vec(_I8, 16, 16), _const_vec(_I8, 16, 0)))
        halves.append(builder.sitofp(_ir_b8(builder, q, "sub", bias) if bias else q, _vec(_F32T, 16)))
    return halves


def _ir_block_term(builder, acc, d, lo, hi, xp, b):
    """acc[0] += d * (lo * x[32b : 32b + 16] + hi * x[32b + 16 : 32b + 32]): a 32-element
    block's products (lo, hi: its quants as two <16 x float>)."""
    xo = builder.mul(b, ir.Constant(b.type, 32))
    _ir_accumulate(builder, acc[0], _ir_scaled(builder, d, _ir_pair_dot(builder, lo, hi, xp, xo)))


def _ir_min_term(builder, acc_m, m, sp, b):
    """Lane 0 of the <8 x float> at acc_m += m * xsum[b]: a block minimum's term."""
    mx = builder.fmul(m, _ir_load(builder, sp, b, _F32T, 4), flags=_IR_FLAGS)
    _ir_accumulate(builder, acc_m, builder.insert_element(_ir_vec_zero(8), mx, _ir_i32(0)))


def _ir_bytes(builder, rp, o):
    """Two <16 x float>: the signed bytes rp[o : o + 16] and rp[o + 16 : o + 32] (Q8_0's quants)."""
    return [builder.sitofp(_ir_load(builder, rp, builder.add(o, ir.Constant(o.type, 16 * h)), _vec(_I8, 16), 1),
                           _vec(_F32T, 16)) for h in range(2)]


def _block_32(size, has_m, unpack):
    """The emitter of a 32-element block type: ``size`` bytes, d f16 (then m f16 where
    ``has_m``: w = d q + m), then the quants, which ``unpack(builder, rp, o)`` turns into two
    <16 x float> halves (biases subtracted: w = d (q - bias))."""
    def block(builder, rp, xp, sp, b, acc, acc_m):
        o = builder.mul(b, ir.Constant(b.type, size))
        d = _ir_f16_fast(builder, _ir_load_f16(builder, rp, o))
        lo, hi = unpack(builder, rp, builder.add(o, ir.Constant(o.type, 4 if has_m else 2)))
        _ir_block_term(builder, acc, d, lo, hi, xp, b)
        if has_m:
            m = _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, ir.Constant(o.type, 2))))
            _ir_min_term(builder, acc_m, m, sp, b)
    return block


# Q8_0 (34 B): d | qs int8[32]. Q4_0 (18 B): d | 16 bytes, element j the low nibble of byte j,
# element j + 16 its high nibble, bias 8. Q4_1 (20 B): d | m | nibbles as Q4_0. Q5_0 (22 B):
# d | qh u32 | nibbles as Q4_0, q = nibble | bit j of qh << 4, bias 16. Q5_1 (24 B): d | m |
# qh | nibbles.
_block_q8_0 = _block_32(34, False, _ir_bytes)
_block_q4_0 = _block_32(18, False, lambda builder, rp, o: _ir_nibbles(builder, rp, o, 8))
_block_q4_1 = _block_32(20, True, lambda builder, rp, o: _ir_nibbles(builder, rp, o, 0))
_block_q5_0 = _block_32(22, False, lambda builder, rp, o: _ir_q5_halves(builder, rp, o, 16))
_block_q5_1 = _block_32(24, True, lambda builder, rp, o: _ir_q5_halves(builder, rp, o, 0))


def _block_k_4_5(builder, rp, xp, sp, b, acc, acc_m, five):
    # Q4_K (144 B): d f16 | dmin f16 | scales 12 B | qs 128 B;  Q5_K (176 B): the same with
    # qh 32 B before qs. Sub-block j = 2c + h holds the nibbles h of qs[32c : 32c + 32] (| the
    # fifth bits (qh >> j) & 1); w = d sc_j q - dmin min_j
    c = lambda v: ir.Constant(b.type, v)  # noqa: E731
    o = builder.mul(b, c(176 if five else 144))
    d = _ir_f16_fast(builder, _ir_load_f16(builder, rp, o))
    dmin = _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, c(2))))
    sc, mn = _ir_k_scales(builder, rp, builder.add(o, c(4)))
    dl = _ir_i2f(builder, sc, d)
    ml = _ir_i2f(builder, mn, dmin)
    xs = _ir_load(builder, sp, builder.mul(b, c(8)), _vec(_F32T, 8), 4)
    builder.store(builder.fsub(builder.load(acc_m), builder.fmul(ml, xs, flags=_IR_FLAGS), flags=_IR_FLAGS),
                  acc_m)
    x0 = builder.mul(b, c(256))
    for j, q in enumerate(_ir_k_quants(builder, rp, o, five)):
        f = builder.sitofp(q, _vec(_F32T, 32))
        lo, hi = (_shuffle(builder, f, f, list(range(16 * h, 16 * h + 16))) for h in range(2))
        p = _ir_pair_dot(builder, lo, hi, xp, builder.add(x0, c(32 * j)))
        _ir_accumulate(builder, acc[j % len(acc)], _ir_scaled(builder, builder.extract_element(dl, _ir_i32(j)), p))


def _ir_k_quants(builder, rp, o, five):
    """The quants of the eight 32-element sub-blocks of the Q4_K (Q5_K with `five`) super-block
    at byte o of row rp, as <32 x i8> vectors in element order: sub-block j = 2c + h holds the
    nibbles h of qs[32c : 32c + 32], with Q5_K's fifth bits (qh >> j) & 1 as 16."""
    c = lambda v: ir.Constant(o.type, v)  # noqa: E731
    qh = _ir_load(builder, rp, builder.add(o, c(16)), _vec(_I8, 32), 1) if five else None
    out = []
    for k in range(4):
        v = _ir_load(builder, rp, builder.add(o, c((48 if five else 16) + 32 * k)), _vec(_I8, 32), 1)
        for h in range(2):
            q = _ir_b8(builder, v, "and", 15) if h == 0 else _ir_b8(builder, v, "lshr", 4)
            if five:
                q = builder.or_(q, _ir_bit_select(builder, qh, 2 * k + h, 16))
            out.append(q)
    return out


def _block_q4_k(builder, rp, xp, sp, b, acc, acc_m):
    _block_k_4_5(builder, rp, xp, sp, b, acc, acc_m, False)


def _block_q5_k(builder, rp, xp, sp, b, acc, acc_m):
    _block_k_4_5(builder, rp, xp, sp, b, acc, acc_m, True)


def _ir_q6_k(builder, rp, o):
    """The Q6_K super-block at byte o of row rp (210 B: ql 128 B | qh 64 B | scales i8[16] |
    d f16): its 16 sub-block scales d sc_s (<16 x float>), and a generator of its 8 runs of 32
    elements, each (first element, first sub-block s, quants q - 32 as <32 x float>): run k of
    half h starts at 128h + 32k, s = 8h + 2k (s + 1 for its second 16), low bits from
    ql[64h + 32(k & 1) :] (nibble k >> 1), high bits (qh[32h :] >> 2k) & 3."""
    c = lambda v: ir.Constant(o.type, v)  # noqa: E731
    d = _ir_splat(builder, _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, c(208)))), 16)
    sc = builder.sext(_ir_load(builder, rp, builder.add(o, c(192)), _vec(_I8, 16), 1), _vec(_I32, 16))

    def runs():
        for h in range(2):
            ql = [_ir_load(builder, rp, builder.add(o, c(64 * h + 32 * i)), _vec(_I8, 32), 1) for i in range(2)]
            qh = _ir_load(builder, rp, builder.add(o, c(128 + 32 * h)), _vec(_I8, 32), 1)
            for k in range(4):
                lo = _ir_b8(builder, ql[k & 1], "and", 15) if k < 2 else _ir_b8(builder, ql[k & 1], "lshr", 4)
                hi = _ir_b8(builder, _ir_b8(builder, _ir_b8(builder, qh, "lshr", 2 * k), "and", 3), "shl", 4)
                q = _ir_b8(builder, builder.or_(lo, hi), "sub", 32)
                yield 128 * h + 32 * k, 8 * h + 2 * k, builder.sitofp(q, _vec(_F32T, 32))

    return builder.fmul(d, builder.sitofp(sc, _vec(_F32T, 16))), runs()


def _block_q6_k(builder, rp, xp, sp, b, acc, acc_m):
    # w = d sc_s (q - 32) for the runs of _ir_q6_k
    dl, runs = _ir_q6_k(builder, rp, builder.mul(b, ir.Constant(b.type, 210)))
    x0 = builder.mul(b, ir.Constant(b.type, 256))
    for k, (e0, s, q) in enumerate(runs):
        w = builder.fmul(_ir_halves(builder, dl, s), q, flags=_IR_FLAGS)
        _ir_fma_x(builder, acc[k % len(acc)], w, xp, builder.add(x0, ir.Constant(b.type, e0)))


def _block_q3_k(builder, rp, xp, sp, b, acc, acc_m):
    # super-block (110 B): hmask 32 B | qs 64 B | scales 12 B | d f16. Run k (elements 32k..):
    # low bits (qs[32(k >> 2) :] >> 2(k & 3)) & 3, minus 4 where bit k of hmask[l] is clear;
    # w = d (sc_s - 32) q with the 6-bit scales of _deq_row_q3_k
    c = lambda v: ir.Constant(b.type, v)  # noqa: E731
    o = builder.mul(b, c(110))
    d = _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, c(108))))
    v16 = _vec(_I32, 16)
    lo8 = _ir_load(builder, rp, builder.add(o, c(96)), _vec(_I8, 8), 1)
    hi4 = _ir_load(builder, rp, builder.add(o, c(104)), _vec(_I8, 4), 1)
    lo = builder.zext(_shuffle(builder, lo8, lo8, list(range(8)) * 2), v16)
    lo = builder.and_(builder.lshr(lo, _const_vec(_I32, 16, [0] * 8 + [4] * 8)), _const_vec(_I32, 16, 15))
    hi = builder.zext(_shuffle(builder, hi4, hi4, [s & 3 for s in range(16)]), v16)
    hi = builder.and_(builder.lshr(hi, _const_vec(_I32, 16, [2 * (s >> 2) for s in range(16)])), _const_vec(_I32, 16, 3))
    sc = builder.sub(builder.or_(lo, builder.shl(hi, _const_vec(_I32, 16, 4))), _const_vec(_I32, 16, 32))
    dl = _ir_i2f(builder, sc, d)
    hm = _ir_load(builder, rp, o, _vec(_I8, 32), 1)
    x0 = builder.mul(b, c(256))
    for h in range(2):
        qs = _ir_load(builder, rp, builder.add(o, c(32 + 32 * h)), _vec(_I8, 32), 1)
        for kk in range(4):
            k = 4 * h + kk
            low = _ir_b8(builder, _ir_b8(builder, qs, "lshr", 2 * kk), "and", 3)
            high = _ir_bit_select(builder, hm, k, 4)
            q = _ir_b8(builder, builder.or_(low, high), "sub", 4)
            w = builder.fmul(_ir_halves(builder, dl, 2 * k), builder.sitofp(q, _vec(_F32T, 32)), flags=_IR_FLAGS)
            _ir_fma_x(builder, acc[k % len(acc)], w, xp, builder.add(x0, c(32 * k)))


def _block_q2_k(builder, rp, xp, sp, b, acc, acc_m):
    # super-block (84 B): scales 16 B (low nibble: scale, high: min of sub-block s) | qs 64 B |
    # d f16 | dmin f16. Run k of half h (elements 128h + 32k ..): (qs[32h :] >> 2k) & 3;
    # w = d sc_s q - dmin min_s
    c = lambda v: ir.Constant(b.type, v)  # noqa: E731
    o = builder.mul(b, c(84))
    d = _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, c(80))))
    dmin = _ir_f16_fast(builder, _ir_load_f16(builder, rp, builder.add(o, c(82))))
    sb = builder.zext(_ir_load(builder, rp, o, _vec(_I8, 16), 1), _vec(_I32, 16))
    dl = _ir_i2f(builder, builder.and_(sb, _const_vec(_I32, 16, 15)), d)
    ml = _ir_i2f(builder, builder.lshr(sb, _const_vec(_I32, 16, 4)), dmin)
    x0 = builder.mul(b, c(256))
    vf = _vec(_F32T, 32)
    for h in range(2):
        qs = _ir_load(builder, rp, builder.add(o, c(16 + 32 * h)), _vec(_I8, 32), 1)
        for k in range(4):
            s = 8 * h + 2 * k
            q = builder.sitofp(_ir_b8(builder, _ir_b8(builder, qs, "lshr", 2 * k), "and", 3), vf)
            w = builder.fsub(builder.fmul(_ir_halves(builder, dl, s), q, flags=_IR_FLAGS),
                             _ir_halves(builder, ml, s), flags=_IR_FLAGS)
            _ir_fma_x(builder, acc[k % len(acc)], w, xp, builder.add(x0, c(128 * h + 32 * k)))


_N_ACC = 4   # accumulators of a super-block's runs (the K-quants' runs take turns)
_UNROLL = 4  # 32-element blocks a loop step of their dots, each into an accumulator of its own


def _make_block_dot(name, block, doc, unroll=1, lanes=32):
    """A row-dot intrinsic ``(row, x, xsum, nb) -> float32`` from a per-block IR emitter
    ``block(builder, rp, xp, sp, b, acc, acc_m)`` (acc: a list of <lanes x float>
    accumulators, acc_m: an <8 x float> one; the result is the sum of all). With ``unroll``
    > 1 (32-element blocks), the loop takes that many blocks a step and block b of a step gets
    accumulators of its own, ``[acc[u]]`` and ``acc_m[u]``; else every block gets all _N_ACC."""
    def typer(typingctx, row, x, xsum, nb):
        if not (_is_c_array(row, types.uint8) and _is_c_array(x, types.float32)
                and _is_c_array(xsum, types.float32) and isinstance(nb, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            rp, xp, sp = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args[:3], args[:3]))
            acc = [cgutils.alloca_once_value(builder, _ir_vec_zero(lanes)) for _ in range(max(unroll, _N_ACC))]
            acc_m = [cgutils.alloca_once_value(builder, _ir_vec_zero(8)) for _ in range(unroll)]
            if unroll > 1:
                step = lambda b, u: block(builder, rp, xp, sp, b, [acc[u]], acc_m[u])  # noqa: E731
            else:
                step = lambda b, u: block(builder, rp, xp, sp, b, acc, acc_m[0])  # noqa: E731
            _ir_blocks(context, builder, args[3], sig.args[3], step, unroll)
            total = _ir_tree_sum(builder, [builder.load(a) for a in acc])
            mins = _ir_tree_sum(builder, [builder.load(a) for a in acc_m])
            return builder.fadd(_ir_hsum(builder, total), _ir_hsum(builder, mins), flags=_IR_FLAGS)

        return types.float32(row, x, xsum, nb), codegen

    typer.__name__ = typer.__qualname__ = name
    typer.__doc__ = doc
    return intrinsic(typer)


def _block_dot(name, block, doc):
    """The row dot of a 32-element block type (`_make_block_dot`, _UNROLL blocks a step, 16 lanes)."""
    return _make_block_dot(name, block, doc, _UNROLL, 16)


_dot_row_q8_0 = _block_dot("_dot_row_q8_0", _block_q8_0,
                           "Dot of a Q8_0 row of nb blocks with x[:32 nb] (xsum unused).")
_dot_row_q4_0 = _block_dot("_dot_row_q4_0", _block_q4_0,
                           "Dot of a Q4_0 row of nb blocks with x[:32 nb] (xsum unused).")
_dot_row_q4_1 = _block_dot("_dot_row_q4_1", _block_q4_1,
                           "Dot of a Q4_1 row of nb blocks with x[:32 nb]; xsum: block sums of x.")
_dot_row_q5_0 = _block_dot("_dot_row_q5_0", _block_q5_0,
                           "Dot of a Q5_0 row of nb blocks with x[:32 nb] (xsum unused).")
_dot_row_q5_1 = _block_dot("_dot_row_q5_1", _block_q5_1,
                           "Dot of a Q5_1 row of nb blocks with x[:32 nb]; xsum: block sums of x.")
_dot_row_q4_k = _make_block_dot("_dot_row_q4_k", _block_q4_k,
                                "Dot of a Q4_K row of nb super-blocks with x[:256 nb]; xsum: block sums of x.",
                                lanes=16)
_dot_row_q5_k = _make_block_dot("_dot_row_q5_k", _block_q5_k,
                                "Dot of a Q5_K row of nb super-blocks with x[:256 nb]; xsum: block sums of x.",
                                lanes=16)
_dot_row_q6_k = _make_block_dot("_dot_row_q6_k", _block_q6_k,
                                "Dot of a Q6_K row of nb super-blocks with x[:256 nb] (xsum unused).")
_dot_row_q3_k = _make_block_dot("_dot_row_q3_k", _block_q3_k,
                                "Dot of a Q3_K row of nb super-blocks with x[:256 nb] (xsum unused).")
_dot_row_q2_k = _make_block_dot("_dot_row_q2_k", _block_q2_k,
                                "Dot of a Q2_K row of nb super-blocks with x[:256 nb] (xsum unused).")


# ---------------------------------------------------------------------------------------
# Dequantization of a row as LLVM IR, for the prefill's row kernels (rows.py), which
# dequantize a few weight rows into float32 and dot each with every activation row. A
# block's quants are unpacked as in the dots above; w = d q (+ m) then takes gguf's float32
# roundings (a multiply, then an add: no fused multiply-add, no fast-math flags), so the
# values are exactly _deq_row's, 16 or 32 floats a store, where _deq_row's loops run about
# one element a cycle.
# ---------------------------------------------------------------------------------------
def _ir_store(builder, base, offset, v):
    """Store the vector v at element ``offset`` of the float32 pointer ``base``."""
    builder.store(v, builder.bitcast(builder.gep(base, [offset]), v.type.as_pointer()), align=4)


def _deq_32(size, has_m, unpack):
    """The dequantizer of one block of a 32-element block type (see _block_32)."""
    def block(builder, rp, dp, b):
        c = lambda v: ir.Constant(b.type, v)  # noqa: E731
        o = builder.mul(b, c(size))
        f16 = lambda at: _ir_splat(builder, _ir_f16_fast(builder, _ir_load_f16(builder, rp, at)), 16)  # noqa: E731
        d = f16(o)
        m = f16(builder.add(o, c(2))) if has_m else None
        for h, q in enumerate(unpack(builder, rp, builder.add(o, c(4 if has_m else 2)))):
            w = builder.fmul(d, q)
            _ir_store(builder, dp, builder.add(builder.mul(b, c(32)), c(16 * h)), builder.fadd(w, m) if has_m else w)
    return block


def _deq_k_4_5(five):
    """The dequantizer of one Q4_K (Q5_K with ``five``) super-block: w = (d sc_j) q - dmin min_j."""
    def block(builder, rp, dp, b):
        c = lambda v: ir.Constant(b.type, v)  # noqa: E731
        o = builder.mul(b, c(176 if five else 144))
        f16 = lambda at: _ir_splat(builder, _ir_f16_fast(builder, _ir_load_f16(builder, rp, at)), 8)  # noqa: E731
        sc, mn = _ir_k_scales(builder, rp, builder.add(o, c(4)))
        dl = builder.fmul(f16(o), builder.sitofp(sc, _vec(_F32T, 8)))
        ml = builder.fmul(f16(builder.add(o, c(2))), builder.sitofp(mn, _vec(_F32T, 8)))
        for j, q in enumerate(_ir_k_quants(builder, rp, o, five)):
            w = builder.fmul(_ir_splat(builder, builder.extract_element(dl, _ir_i32(j)), 32),
                             builder.sitofp(q, _vec(_F32T, 32)))
            w = builder.fsub(w, _ir_splat(builder, builder.extract_element(ml, _ir_i32(j)), 32))
            _ir_store(builder, dp, builder.add(builder.mul(b, c(256)), c(32 * j)), w)
    return block


def _deq_q6_k(builder, rp, dp, b):
    """The dequantizer of one Q6_K super-block (_ir_q6_k): w = (d sc_s) (q - 32)."""
    dl, runs = _ir_q6_k(builder, rp, builder.mul(b, ir.Constant(b.type, 210)))
    for e0, s, q in runs:
        at = builder.add(builder.mul(b, ir.Constant(b.type, 256)), ir.Constant(b.type, e0))
        _ir_store(builder, dp, at, builder.fmul(_ir_halves(builder, dl, s), q))


def _make_deq(name, block, elements):
    """A row-dequantizing intrinsic ``(src, dst) -> None``: the dst.shape[0] // ``elements``
    blocks of the uint8 row src into float32 dst (both C-contiguous), by the per-block IR
    emitter ``block(builder, rp, dp, b)``."""
    def typer(typingctx, src, dst):
        if not (_is_c_array(src, types.uint8) and _is_c_array(dst, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            rp, dp = (context.make_array(t)(context, builder, a).data for t, a in zip(sig.args, args))
            n = builder.extract_value(context.make_array(sig.args[1])(context, builder, args[1]).shape, 0)
            with cgutils.for_range(builder, builder.udiv(n, ir.Constant(n.type, elements))) as loop:
                block(builder, rp, dp, loop.index)
            return context.get_dummy_value()

        return types.none(src, dst), codegen

    typer.__name__ = typer.__qualname__ = name
    return intrinsic(typer)


_deq_vec_q8_0 = _make_deq("_deq_vec_q8_0", _deq_32(34, False, _ir_bytes), 32)
_deq_vec_q4_0 = _make_deq("_deq_vec_q4_0", _deq_32(18, False, lambda builder, rp, o: _ir_nibbles(builder, rp, o, 8)), 32)
_deq_vec_q4_1 = _make_deq("_deq_vec_q4_1", _deq_32(20, True, lambda builder, rp, o: _ir_nibbles(builder, rp, o, 0)), 32)
_deq_vec_q5_0 = _make_deq("_deq_vec_q5_0", _deq_32(22, False, lambda builder, rp, o: _ir_q5_halves(builder, rp, o, 16)),
                          32)
_deq_vec_q5_1 = _make_deq("_deq_vec_q5_1", _deq_32(24, True, lambda builder, rp, o: _ir_q5_halves(builder, rp, o, 0)),
                          32)
_deq_vec_q4_k = _make_deq("_deq_vec_q4_k", _deq_k_4_5(False), 256)
_deq_vec_q5_k = _make_deq("_deq_vec_q5_k", _deq_k_4_5(True), 256)
_deq_vec_q6_k = _make_deq("_deq_vec_q6_k", _deq_q6_k, 256)


def _deq_row_vec_of(mask, code, src, dst):
    """`_deq_row_vec`'s branches, those of the types of `mask` (the overload below)."""


@overload(_deq_row_vec_of, prefer_literal=True, jit_options={"fastmath": False})
def _deq_row_vec_of_jit(mask, code, src, dst):
    _, _, _, q8_0, q4_0, q4_1, q5_0, q5_1, _, _, q4_k, q5_k, q6_k = _type_flags(mask)

    def impl(mask, code, src, dst):
        if q4_1 and code == _Q4_1:
            _deq_vec_q4_1(src, dst)
        elif q8_0 and code == _Q8_0:
            _deq_vec_q8_0(src, dst)
        elif q4_0 and code == _Q4_0:
            _deq_vec_q4_0(src, dst)
        elif q5_0 and code == _Q5_0:
            _deq_vec_q5_0(src, dst)
        elif q5_1 and code == _Q5_1:
            _deq_vec_q5_1(src, dst)
        elif q4_k and code == _Q4_K:
            _deq_vec_q4_k(src, dst)
        elif q5_k and code == _Q5_K:
            _deq_vec_q5_k(src, dst)
        elif q6_k and code == _Q6_K:
            _deq_vec_q6_k(src, dst)
        else:
            _deq_row(mask, code, src, dst)

    return impl


@njit(cache=True, fastmath=False)
def _deq_row_vec(mask, code, src, dst):
    """Dequantize one row as `_deq_row` does, bit for bit, by the vector code above for Q8_0,
    Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (src, dst: C-contiguous), else by _deq_row;
    the code of the types of ``mask`` only (`_deq_row`'s NaN for others). Without fast-math
    flags of its own, it would take its first caller's (the row kernels'), which would fuse
    d q + m into one rounding."""
    _deq_row_vec_of(mask, code, src, dst)


def _ir_prefetch(builder, ptr):
    """llvm.prefetch of the cache line at the i8 pointer ``ptr``: read, highest locality, data."""
    _ir_call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [ptr, _ir_i32(0), _ir_i32(3), _ir_i32(1)])


@intrinsic
def _prefetch(typingctx, data, i):
    """Ask the CPU to bring the cache line of byte ``i`` of the C-contiguous uint8 array
    ``data`` (any shape) into its caches (llvm.prefetch: read, highest locality). A prefetch
    never faults and changes no value, so ``i`` may lie past the end of ``data``."""
    if not (isinstance(data, types.Array) and data.layout == "C" and data.dtype == types.uint8
            and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        base = context.make_array(sig.args[0])(context, builder, args[0]).data
        _ir_prefetch(builder, builder.gep(base, [context.cast(builder, args[1], sig.args[1], types.intp)]))
        return context.get_dummy_value()

    return types.none(data, i), codegen


@intrinsic
def _touch_lines(typingctx, a):
    """Load one byte of every 64-byte line of the contiguous array ``a`` (any dtype and shape;
    a view such as a KV record) and drop it: loads that bring the lines into the caches where
    `_prefetch` hints did not help (atomic ones, which the compiler keeps though unused; on
    x86 and AArch64 a plain byte load)."""
    if not (isinstance(a, types.Array) and a.layout == "C"):
        return None

    def codegen(context, builder, sig, args):
        ary = context.make_array(sig.args[0])(context, builder, args[0])
        base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
        nbytes = builder.mul(ary.nitems, ary.itemsize)
        zero, line = ir.Constant(nbytes.type, 0), ir.Constant(nbytes.type, 64)
        with cgutils.for_range_slice(builder, zero, nbytes, line, inc=True) as (at, _):
            builder.load_atomic(builder.gep(base, [at]), "monotonic", 1)
        return context.get_dummy_value()

    return types.none(a), codegen


_PREFETCH_AHEAD = 2048
"""Bytes ahead of the weight row being dotted that the row loops prefetch. With the hardware
prefetcher alone the int8 products over a decode step's 66 MB of layer weights ran at 34 GB/s
where a plain sum read the same bytes at 50-100 GB/s; prefetching 2 KB ahead made that sweep
5% faster and int8 decode 3-5% faster (same-process A/B; 1, 3 and 4 KB did no better, 8 KB
less well); float32 decode, more compute-bound, +1%."""


@njit(cache=True)
def _prefetch_ahead(data, r):
    """Prefetch the bytes ``_PREFETCH_AHEAD`` past row ``r`` of the (rows, row bytes) uint8
    array ``data`` (a row the loop dots a few rows later, or the next weight's first rows)."""
    rb = data.shape[1]
    for i in range(r * rb + _PREFETCH_AHEAD, (r + 1) * rb + _PREFETCH_AHEAD, 64):
        _prefetch(data, i)


@njit(cache=True, fastmath=_FAST)
def _block_sums(x, xsum):
    """xsum[b] = sum of x[32b : 32b + 32], the term of Q4_1's block minimum in its dots."""
    for b in range(xsum.shape[0]):
        s = np.float32(0.0)
        for j in range(32):
            s += x[b * 32 + j]
        xsum[b] = s


@njit(cache=True)
def _has_dot(code):
    """Whether rows of type ``code`` have a direct dot (``_dot_row``)."""
    return (code == _Q4_1 or code == _Q8_0 or code == _Q4_0 or code == _Q5_0 or code == _Q5_1 or code == _Q4_K
            or code == _Q5_K or code == _Q6_K or code == _Q3_K or code == _Q2_K)


def _dot_row_of(mask, code, row, x, xsum):
    """`_dot_row`'s branches, those of the types of `mask` (the overload below)."""


@overload(_dot_row_of, prefer_literal=True)
def _dot_row_of_jit(mask, code, row, x, xsum):
    _, _, _, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k = _type_flags(mask)

    def impl(mask, code, row, x, xsum):
        n = x.shape[0]
        if q4_1 and code == _Q4_1:
            return _dot_row_q4_1(row, x, xsum, n // 32)
        elif q8_0 and code == _Q8_0:
            return _dot_row_q8_0(row, x, xsum, n // 32)
        elif q4_0 and code == _Q4_0:
            return _dot_row_q4_0(row, x, xsum, n // 32)
        elif q5_0 and code == _Q5_0:
            return _dot_row_q5_0(row, x, xsum, n // 32)
        elif q4_k and code == _Q4_K:
            return _dot_row_q4_k(row, x, xsum, n // 256)
        elif q6_k and code == _Q6_K:
            return _dot_row_q6_k(row, x, xsum, n // 256)
        elif q5_k and code == _Q5_K:
            return _dot_row_q5_k(row, x, xsum, n // 256)
        elif q5_1 and code == _Q5_1:
            return _dot_row_q5_1(row, x, xsum, n // 32)
        elif q3_k and code == _Q3_K:
            return _dot_row_q3_k(row, x, xsum, n // 256)
        elif q2_k and code == _Q2_K:
            return _dot_row_q2_k(row, x, xsum, n // 256)
        return np.float32(np.nan)

    return impl


@njit(cache=True)
def _dot_row(mask, code, row, x, xsum):
    """dot(row, x) by the direct dot of type ``code`` (one of ``_has_dot``, and of ``mask``'s
    types; else NaN): ``row`` one uint8 weight row of n = x.shape[0] elements, ``xsum`` the
    block sums of x (``_block_sums``)."""
    return _dot_row_of(mask, code, row, x, xsum)


def _rows_f32_of(mask, code, data, r0, r1, x, xsum, row, out):
    """`_rows_f32`'s branches, those of the types of `mask` (the overload below)."""


@overload(_rows_f32_of, prefer_literal=True, jit_options={"fastmath": _FAST})
def _rows_f32_of_jit(mask, code, data, r0, r1, x, xsum, row, out):
    f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k = _type_flags(mask)
    floats = f32 or f16 or bf16

    def impl(mask, code, data, r0, r1, x, xsum, row, out):
        nb = x.shape[0] // 32
        if q4_1 and code == _Q4_1:  # one loop per type: the dispatch stays out of the row loop
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_1(data[r], x, xsum, nb)
        elif q8_0 and code == _Q8_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q8_0(data[r], x, xsum, nb)
        elif q4_0 and code == _Q4_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_0(data[r], x, xsum, nb)
        elif q5_0 and code == _Q5_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_0(data[r], x, xsum, nb)
        elif q4_k and code == _Q4_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_k(data[r], x, xsum, nb // 8)
        elif q6_k and code == _Q6_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q6_k(data[r], x, xsum, nb // 8)
        elif q5_k and code == _Q5_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_k(data[r], x, xsum, nb // 8)
        elif q5_1 and code == _Q5_1:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_1(data[r], x, xsum, nb)
        elif q3_k and code == _Q3_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q3_k(data[r], x, xsum, nb // 8)
        elif q2_k and code == _Q2_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q2_k(data[r], x, xsum, nb // 8)
        elif floats and (code == _F32 or code == _F16 or code == _BF16):
            row = row[:x.shape[0]]
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                _deq_row(mask, code, data[r], row)
                acc = np.float32(0.0)
                for i in range(x.shape[0]):
                    acc += row[i] * x[i]
                out[r] = acc
        else:
            out[r0:r1] = np.nan

    return impl


@njit(cache=True, fastmath=_FAST)
def _rows_f32(mask, code, data, r0, r1, x, xsum, row, out):
    """out[r] = dot(row r of ``data``, x) for r in r0..r1-1, on the calling thread, by the code
    of the types of ``mask`` (NaN for another ``code``). ``xsum``: ``_block_sums(x)`` (read
    for Q4_1, Q5_1, Q4_K, Q5_K). Types without a direct dot (the floats) dequantize each row
    into ``row`` (float32, at least as long as x) first."""
    _rows_f32_of(mask, code, data, r0, r1, x, xsum, row, out)


_MATVEC_ROWS = 16   # fewest rows per parallel task of a row-parallel product
_MATVEC_TASKS = 16  # tasks a larger weight is split into (a few per thread, for balance)


@njit(cache=True)
def _task_rows(rows):
    """Rows per parallel task of a row-parallel product over ``rows`` rows."""
    return max(_MATVEC_ROWS, rows // _MATVEC_TASKS)


@njit(parallel=True, cache=True)
def _matvec(mask, code, data, x, out):
    """out[r] = dot(row r of the (rows, row_bytes) uint8 weight ``data``, x), for any type of
    ``mask``: ``_rows_f32`` on tasks of rows in parallel."""
    rows = data.shape[0]
    xsum = np.empty(x.shape[0] // 32, np.float32)  # block sums of x, shared by all rows
    _block_sums(x, xsum)
    per = _task_rows(rows)
    for c in prange((rows + per - 1) // per):
        row = np.empty(x.shape[0], np.float32)  # read only by types without a direct row dot
        _rows_f32(mask, code, data, c * per, min(rows, (c + 1) * per), x, xsum, row, out)


# ---------------------------------------------------------------------------------------
# Python-level API
# ---------------------------------------------------------------------------------------

class _Spec(NamedTuple):
    qtype: QT
    block_size: int
    type_size: int
    row_fn: object       # njit row dequantizer (src_u8_row, dst_f32_row)


_KERNELS = {
    QT.F32: _deq_row_f32,
    QT.F16: _deq_row_f16,
    QT.BF16: _deq_row_bf16,
    QT.Q8_0: _deq_row_q8_0,
    QT.Q4_0: _deq_row_q4_0,
    QT.Q4_1: _deq_row_q4_1,
    QT.Q5_0: _deq_row_q5_0,
    QT.Q5_1: _deq_row_q5_1,
    QT.Q2_K: _deq_row_q2_k,
    QT.Q3_K: _deq_row_q3_k,
    QT.Q4_K: _deq_row_q4_k,
    QT.Q5_K: _deq_row_q5_k,
    QT.Q6_K: _deq_row_q6_k,
}

_REGISTRY: dict[QT, _Spec] = {
    qt: _Spec(qt, *BLOCK_SIZES[qt], row_fn) for qt, row_fn in _KERNELS.items()
}

SUPPORTED_TYPES: tuple[QT, ...] = tuple(_REGISTRY)

_DEQ_CHUNK_ELEMS = 4096   # elements per parallel work item in dequantize()
_TILE_BYTES = 1 << 20     # float32 scratch per prefill tile


def _spec(qtype) -> _Spec:
    try:
        return _REGISTRY[qtype]  # GGMLQuantizationType is an IntEnum: its int values hit too
    except (KeyError, TypeError):
        pass
    supported = ", ".join(t.name for t in SUPPORTED_TYPES)
    try:
        name = type_name(int(qtype))
    except (TypeError, ValueError):
        name = None
    if name is None:
        raise ValueError(f"unknown quantization type {qtype!r}; supported types: {supported}")
    raise ValueError(f"quantization type {name} is not supported; supported types: {supported}")


def row_elems(qtype, row_bytes: int) -> int:
    """Elements in a row of ``row_bytes`` bytes of type ``qtype``."""
    s = _spec(qtype)
    if row_bytes < 0 or row_bytes % s.type_size:
        raise ValueError(f"a {s.qtype.name} row must hold a whole number of {s.type_size}-byte blocks, "
                         f"got {row_bytes} bytes")
    return row_bytes // s.type_size * s.block_size


def row_bytes(qtype, n: int) -> int:
    """Bytes in a row of ``n`` elements of type ``qtype``."""
    s = _spec(qtype)
    if n < 0 or n % s.block_size:
        raise ValueError(f"a {s.qtype.name} row must hold a whole number of {s.block_size}-element blocks, "
                         f"got {n} elements")
    return n // s.block_size * s.type_size


def _as_byte_rows(data, s: _Spec) -> np.ndarray:
    """``data`` as a C-contiguous uint8 array (copied only if it was not contiguous)."""
    arr = np.asarray(data)
    if arr.ndim == 0:
        raise ValueError(f"{s.qtype.name} data must have at least one dimension")
    arr = np.ascontiguousarray(arr).view(np.uint8)
    if arr.shape[-1] % s.type_size:
        raise ValueError(f"{s.qtype.name} rows of {arr.shape[-1]} bytes are not a whole number of "
                         f"{s.type_size}-byte blocks")
    return arr


def dequantize(data, qtype) -> np.ndarray:
    """Dequantize GGUF block data to float32, bit-exact with ``gguf.quants.dequantize``.

    ``data``: uint8 of shape (..., row_bytes), or the float32/float16 array GGUFReader gives
    for F32/F16 tensors (any dtype is read as its raw bytes). Non-contiguous input is copied
    to a contiguous one first. Returns a new float32 array of shape (..., row_elems).
    """
    s = _spec(qtype)
    arr = _as_byte_rows(data, s)
    if s.qtype in (QT.F32, QT.F16, QT.BF16):
        return _floats(arr, s.qtype)
    n = arr.shape[-1] // s.type_size * s.block_size
    out = np.empty(arr.shape[:-1] + (n,), np.float32)
    if out.size:
        # Work items of k whole blocks, so a few long rows still spread over all threads.
        k = math.gcd(arr.size // s.type_size, max(1, _DEQ_CHUNK_ELEMS // s.block_size))
        _dequantize_rows(kernel_types([s.qtype]), int(s.qtype), arr.reshape(-1, k * s.type_size),
                         out.reshape(-1, k * s.block_size))
    return out


def _floats(arr: np.ndarray, qtype) -> np.ndarray:
    """A new float32 array of the F32, F16 or BF16 values in the C-contiguous bytes `arr` (rows
    of whole values), by NumPy: every conversion is exact, so the bits are the kernels', and a
    model's opening (its norms are F32) compiles nothing for them."""
    if qtype == QT.F32:
        return arr.view(np.float32).copy()
    if qtype == QT.F16:
        return arr.view(np.float16).astype(np.float32)
    return (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _product_args(data, qtype, x, out, x_ndims):
    """Checked arguments of a product with a GGUF weight: (spec, (rows, row_bytes) uint8 rows,
    C-contiguous float32 x with x.ndim in `x_ndims`, output array of shape x.shape[:-1] + (rows,))."""
    s = _spec(qtype)
    w = _as_byte_rows(data, s)
    if w.ndim != 2:
        raise ValueError(f"weight data must be 2-D (rows, row_bytes), got shape {np.shape(data)}")
    rows = w.shape[0]
    n = w.shape[1] // s.type_size * s.block_size
    x = np.asarray(x)
    if x.ndim not in x_ndims:
        raise ValueError(f"x must have shape {' or '.join(('(n,)', '(S, n)')[d - 1] for d in x_ndims)}, got {x.shape}")
    if x.shape[-1] != n:
        raise ValueError(f"x has {x.shape[-1]} features but the {s.qtype.name} weight rows have {n} elements")
    x = np.ascontiguousarray(x, dtype=np.float32)
    shape = x.shape[:-1] + (rows,)
    if out is None:
        out = np.empty(shape, np.float32)
    elif (not isinstance(out, np.ndarray) or out.shape != shape or out.dtype != np.float32
          or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous float32 array of shape {shape}")
    return s, w, x, out


def matmul(data, qtype, x, out=None) -> np.ndarray:
    """Product with a GGUF weight ``data`` of shape (rows, row_bytes) = W of shape (rows, n).

    ``x`` of shape (n,) gives ``W @ x`` of shape (rows,), computed by row-parallel Numba
    kernels on the block data (so is ``x`` of shape (1, n)); ``x`` of shape (S, n) gives
    ``x @ W.T`` of shape (S, rows): tiles of W are dequantized into a scratch buffer and
    multiplied by single-threaded BLAS (OpenBLAS's own threads spin long after each call and
    stall the Numba kernels that follow). ``x`` is converted to C-contiguous float32 as
    needed; ``data`` is copied only if it is not C-contiguous. ``out``, if given, must be a
    C-contiguous float32 array of the result's shape.
    """
    s, w, x, out = _product_args(data, qtype, x, out, (1, 2))
    rows, n = out.shape[-1], x.shape[-1]
    if out.size == 0:
        return out
    if n == 0:
        out.fill(0.0)
        return out

    if x.ndim == 1 or x.shape[0] == 1:
        _matvec(kernel_types([s.qtype]), int(s.qtype), w, x.reshape(n), out.reshape(rows))
    else:
        with single_threaded_blas():
            if s.qtype == QT.F32:
                np.matmul(x, w.view(np.float32).T, out=out)
            else:
                tile_rows = min(rows, max(16, _TILE_BYTES // (4 * n)))
                tile = np.empty((tile_rows, n), np.float32)
                for r0 in range(0, rows, tile_rows):
                    t = tile[:min(tile_rows, rows - r0)]
                    _dequantize_rows(kernel_types([s.qtype]), int(s.qtype), w[r0:r0 + t.shape[0]], t)
                    np.matmul(x, t.T, out=out[:, r0:r0 + t.shape[0]])
    return out
