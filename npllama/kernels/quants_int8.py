"""Decode products with int8 activations: an opt-in fast mode, as llama.cpp's q8_0/q8_1 dots.

The activation vector x (float32, length n, a multiple of 32) is quantized per block of 32 to
int8 with one float32 scale per block (Q8_0-style), once per distinct x:

    d = max_j |x_j| / 127,   q_j = rint(x_j * (1 / d))   (round half to even),
    s = d * sum_j q_j        (the block sum for Q4_1's min term, as llama.cpp's q8_1)

all in float32, in that order (q = 0 where 1 / d is not finite; see ``_quantize_x_q8``). A
weight row is then dotted block by block with integer dot products, scaled by d_w * d_x and
accumulated in float32:

    Q8_0:  sum_b d_w d_x sum_j w_j q_j
    Q4_0:  sum_b d_w d_x sum_j (nib_j - 8) q_j
    Q4_1:  sum_b d_w d_x sum_j nib_j q_j + m_w s
    Q5_0, Q5_1: as Q4_0 (bias 16), Q4_1, with the fifth bits
    K-quants: per super-block of 256 (8 blocks of x), per x block b
           d_w d_x sum_j sc_j q_j xq_j  (sc_j: the integer scale of j's sub-block)
           - dmin_w d_x sum_j min_j xq_j  (Q4_K, Q5_K, Q2_K)

The K-quants use the same x blocks of 32 as the other types (llama.cpp quantizes x per 256
for them, Q8_K): the fused decode step quantizes each activation once for every type, and
the finer blocks lose less to x's outliers.

The integer block sums are exact; only the scaling and the float accumulation round. The
result differs from the float32-activation product (``npllama.quants._matvec``) by the
quantization error of x: about 0.5% of the output norm for Gaussian activations, ~1% with
a few large outlier features.

Njit level (C-contiguous arrays; nothing raises; ``code`` is ``int(qtype)``, ``mask`` a
``qtypes.TypeMask``: the code of its types only, as in quants.py):

* ``_quantize_x_q8(x, qs, d, s)``: x float32 (n,) -> qs int8 (n,), d, s float32 (n // 32,).
* ``_dot_row_q8_0_i8(row, qs, d, nb)``, ``_dot_row_q4_0_i8(row, qs, d, s, nb)``,
  ``_dot_row_q4_1_i8(row, qs, d, s, nb)``: float32 dot of one uint8 weight row of ``nb``
  blocks with the quantized x (Q4_0 ignores s).
* ``_dot_row_q5_0_i8``, ``_dot_row_q5_1_i8`` (row, qs, d, s, nb): the same for Q5_0/Q5_1;
  ``_dot_row_<k>_i8(row, qs, d, s, nb)`` for Q4_K, Q5_K, Q6_K, Q3_K, Q2_K (nb super-blocks).
* ``_has_i8(code)``: whether type ``code`` has an int8 kernel.
* ``_rows_i8(mask, code, data, r0, r1, qs, d, s, out)``: ``out[r] = dot(row r of data, x)``
  for rows r0..r1-1 by the int8 kernel of a type with one, on the calling thread (the fused
  decode step's work items). The caller quantizes each distinct x once and reuses qs/d/s.
* ``_matvec_i8(mask, code, data, x, qs, d, s, out)``: the same for all rows, row-parallel,
  else (a type without an int8 kernel) ``npllama.quants._matvec(mask, code, data, x, out)`` on x.

Python level: ``quantize_x(x)`` and ``matmul_int8(data, qtype, x, out=None)`` (decode: x of
shape (n,)), for tests and benchmarks.

Code generation: the row dots are LLVM IR, for the instruction set ``DOT_ISA`` chosen at
import from the CPU features of numba's target (NUMBA_CPU_FEATURES, else the host's):
"vnni512" (AVX512-VNNI/VL/BW: vpdpbusd, nibbles split by vpsrlvw), "vnni256" (AVX-VNNI or
AVX512-VNNI/VL: vpdpbusd), "avx2" (vpmaddubsw + vpmaddwd) or "generic" (portable widening
multiplies, any LLVM target). Signed x signed products (Q8_0, Q4_0) go through the
unsigned x signed instructions as |w| x (q * sign(w)), as llama.cpp does.
``_make_row_dots(isa)`` builds the dots of any of them (tests run all the CPU can).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .cpu import FEATURES
from .qtypes import QT, kernel_types
from .quants import (_F32T, _IR_FLAGS, _HW_F16, _I8, _I16, _I32, _Q2_K, _Q3_K, _Q4_0, _Q4_1, _Q4_K, _Q5_0,
                     _Q5_1, _Q5_K, _Q6_K, _Q8_0, _const_vec, _ir_accumulate, _ir_b8, _ir_bit_select, _ir_call, _ir_f16_exact,
                     _ir_f16_fast, _ir_hsum, _ir_i32, _ir_k_quants, _ir_k_scales, _ir_load, _ir_load_f16, _ir_qh_bits, _ir_splat,
                     _ir_vec_zero, _is_c_array, _matvec, _prefetch_ahead, _product_args, _shuffle, _task_rows,
                     _type_flags, _vec)

__all__ = ["DOT_ISA", "INT8_TYPES", "VNNI", "matmul_int8", "quantize_x"]


def _dot_isa(features) -> str:
    """How the int8 dots are emitted for a target with these CPU features."""
    if {"avx512vnni", "avx512vl", "avx512bw"} <= features:
        return "vnni512"     # vpdpbusd; nibbles split by vpsrlvw (AVX512BW+VL)
    if "avxvnni" in features or {"avx512vnni", "avx512vl"} <= features:
        return "vnni256"     # vpdpbusd
    if "avx2" in features:
        return "avx2"        # vpmaddubsw + vpmaddwd
    return "generic"         # portable IR: widening multiplies


DOT_ISA: str = _dot_isa(FEATURES)
"""How the int8 dots are compiled here: "vnni512", "vnni256", "avx2" or "generic"."""

VNNI: bool = DOT_ISA.startswith("vnni")
"""Whether the int8 dots use vpdpbusd."""

INT8_TYPES: tuple[QT, ...] = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K,
                              QT.Q2_K)
"""Weight types with an int8-activation kernel; the others fall back to the float32 kernels."""


# ---------------------------------------------------------------------------------------
# LLVM IR helpers
# ---------------------------------------------------------------------------------------

def _ir_opaque(builder, v):
    """``v`` through an empty inline asm: the same value, which the optimizer cannot see through."""
    return builder.asm(ir.FunctionType(v.type, [v.type]), "", "=r,0", [v], side_effect=False)


def _ir_f16_vec(builder, h):
    """float32 vector from a vector of float16 bits (i16 lanes)."""
    n = h.type.count
    if _HW_F16:
        return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), n)), _vec(_F32T, n))
    v = ir.Constant(_vec(_F32T, n), ir.Undefined)
    for i in range(n):
        e = _ir_f16_exact(builder, builder.zext(builder.extract_element(h, _ir_i32(i)), _I32))
        v = builder.insert_element(v, e, _ir_i32(i))
    return v


# ---------------------------------------------------------------------------------------
# Quantization of the activation vector
# ---------------------------------------------------------------------------------------

@intrinsic
def _quantize_blocks_q8(typingctx, x, qs, d, s):
    """The loop of _quantize_x_q8, one block of 32 per iteration in vector IR (exact IEEE
    float32 arithmetic: no fast-math flags)."""
    if not (_is_c_array(x, types.float32) and _is_c_array(qs, types.int8) and _is_c_array(d, types.float32)
            and _is_c_array(s, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        xa, qa, da, sa = (context.make_array(ty)(context, builder, v) for ty, v in zip(sig.args, args))
        xp, qp, dp, sp = xa.data, qa.data, da.data, sa.data
        n = builder.extract_value(xa.shape, 0)
        nb = builder.sdiv(n, ir.Constant(n.type, 32))
        f32 = lambda v: ir.Constant(_F32T, v)  # noqa: E731
        vf, vi = _vec(_F32T, 32), _vec(_I32, 32)

        def reduce(name, v):
            return _ir_call(builder, f"llvm.vector.reduce.{name}.v32i32", _I32, [v])

        with cgutils.for_range(builder, nb) as loop:
            b = loop.index
            o = builder.mul(b, ir.Constant(b.type, 32))
            v = _ir_load(builder, xp, o, vf, 4)
            # max |x_j| as the largest bit pattern without the sign bit: a NaN (above inf) sticks
            mag = builder.and_(builder.bitcast(v, vi), _const_vec(_I32, 32, 0x7FFFFFFF))
            amax = builder.bitcast(reduce("umax", mag), _F32T)
            db = builder.fdiv(amax, f32(127.0))
            idb = builder.select(builder.fcmp_ordered(">", db, f32(0.0)), builder.fdiv(f32(1.0), db), f32(0.0))
            ok = builder.and_(builder.fcmp_ordered("<", db, f32(math.inf)),     # false for NaN
                              builder.fcmp_ordered("<", idb, f32(math.inf)))
            v = builder.select(ok, v, ir.Constant(vf, [0.0] * 32))             # no inf/NaN below
            r = _ir_call(builder, "llvm.rint.v32f32", vf, [builder.fmul(v, _ir_splat(builder, idb, 32))])
            q = builder.fptosi(r, vi)                                           # |q| <= 127
            qptr = builder.bitcast(builder.gep(qp, [o]), _vec(_I8, 32).as_pointer())
            builder.store(builder.trunc(q, _vec(_I8, 32)), qptr, align=1)
            builder.store(db, builder.gep(dp, [b]))
            builder.store(builder.fmul(db, builder.sitofp(reduce("add", q), _F32T)), builder.gep(sp, [b]))
        return context.get_dummy_value()

    return types.none(x, qs, d, s), codegen


@njit(cache=True, fastmath=False)
def _quantize_x_q8(x, qs, d, s):
    """Quantize x (float32, n a multiple of 32) to int8 blocks of 32: qs (n,) int8, scales
    d (n // 32,) and block sums s = d * sum(qs of the block) (n // 32,), in float32:

        d = max|x_j| / 127,  q_j = rint(x_j * (1 / d))  (round half to even)

    where 1 / d is finite (else q = 0: an all-zero block, or one so small that 1 / d
    overflows, contributes 0; a block with an inf or NaN gets d = inf or NaN, q = 0 and
    s = NaN, so the products come out NaN as with float32 activations)."""
    _quantize_blocks_q8(x, qs, d, s)


# ---------------------------------------------------------------------------------------
# Row dots
#
# A row is processed in groups of 4 blocks (the last blocks in groups of 2 and 1). A group's
# float16 d_w (and m_w) come from one load and a word permute (vpermw), are converted together
# and multiplied by d_x (and s_x). Each block: its 32 quants (nibbles split within 128-bit
# lanes: a broadcast load, a per-half shift vpsrlvw and a mask) dotted with the 32 bytes of the
# quantized x into 8 int32 lanes (one vpdpbusd); the 4 blocks' lanes are then summed pairwise
# (3 vphaddd) into one vector [b0 b1 b2 b3 | b0 b1 b2 b3] of partial sums, converted and
# multiplied-added with the scales [s0 s1 s2 s3 | s0 s1 s2 s3] into a float accumulator,
# summed once per row. Shuffles are the scarce resource on AMD Zen 4 (and a broadcast scale
# per block costs about as much as the integer dot): hence one conversion and one FMA per 4
# blocks, and no cross-lane shuffles in the per-block work.
# ---------------------------------------------------------------------------------------

_BLOCKS = {  # kind: (block bytes, offset of the quants, whether an m follows d)
    "q8_0": (34, 2, False),
    "q4_0": (18, 2, False),
    "q4_1": (20, 4, True),
    "q5_0": (22, 6, False),   # fifth bits: the uint32 at offset 2
    "q5_1": (24, 8, True),    # fifth bits: the uint32 at offset 4
}


def _ir_widening_dot(builder, a, b):
    """<16 x i32> whose lanes sum to sum_j a_j b_j, for <32 x i16> a, b whose products fit in
    i16 (portable IR: widening multiplies)."""
    p = builder.mul(a, b, flags=["nsw"])
    vt = _vec(_I32, 16)
    lo = builder.sext(_shuffle(builder, p, p, list(range(16))), vt)
    hi = builder.sext(_shuffle(builder, p, p, list(range(16, 32))), vt)
    return builder.add(lo, hi, flags=["nsw"])


def _ir_dot_us(builder, u, s, isa):
    """i32 vector whose lanes sum to sum_j u_j s_j, for <32 x i8> u (unsigned, u_j s_j in i16
    range in pairs: u_j <= 128) and s (signed): 8 lanes from vpdpbusd (VNNI) or vpmaddubsw +
    vpmaddwd (AVX2), else 16 lanes of widened products."""
    if isa in ("vnni512", "vnni256"):
        vt = _vec(_I32, 8)
        return _ir_call(builder, "llvm.x86.avx512.vpdpbusd.256", vt,
                       [_const_vec(_I32, 8, 0), builder.bitcast(u, vt), builder.bitcast(s, vt)])
    if isa == "avx2":  # u8 x s8 pair sums in i16 (|sum| <= 2 * 128 * 127: no saturation), then pairs in i32
        pairs = _ir_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_I16, 16), [u, s])
        return _ir_call(builder, "llvm.x86.avx2.pmadd.wd", _vec(_I32, 8), [pairs, _const_vec(_I16, 16, 1)])
    return _ir_widening_dot(builder, builder.zext(u, _vec(_I16, 32)), builder.sext(s, _vec(_I16, 32)))


def _ir_dot_ss(builder, w, s, isa):
    """As _ir_dot_us for signed w and s in [-127, 127]; on x86 as |w| x (s * sign(w))."""
    if isa == "generic":
        return _ir_widening_dot(builder, builder.sext(w, _vec(_I16, 32)), builder.sext(s, _vec(_I16, 32)))
    zero = _const_vec(_I8, 32, 0)
    aw = builder.select(builder.icmp_signed("<", w, zero), builder.sub(zero, w), w)  # |-128| = 128 as unsigned
    sw = _ir_call(builder, "llvm.x86.avx2.psign.b", w.type, [s, w])  # s * sign(w), 0 where w = 0
    return _ir_dot_us(builder, aw, sw, isa)


def _ir_nibbles(builder, rp, o, isa):
    """<32 x i8>: the low nibbles of the 16 bytes at rp[o:], then their high nibbles."""
    q = _ir_load(builder, rp, o, _vec(_I8, 16), 1)
    if isa == "vnni512":  # AVX512BW+VL: a broadcast load, then vpsrlvw by 0 (low half) and 4 (high half)
        qq = builder.bitcast(_shuffle(builder, q, q, list(range(16)) * 2), _vec(_I16, 16))
        qq = builder.lshr(qq, _const_vec(_I16, 16, [0] * 8 + [4] * 8))
        return builder.and_(builder.bitcast(qq, _vec(_I8, 32)), _const_vec(_I8, 32, 15))
    lo = builder.and_(q, _const_vec(_I8, 16, 15))
    hi = builder.lshr(q, _const_vec(_I8, 16, 4))
    return _shuffle(builder, lo, hi, list(range(32)))


def _ir_block_dot(builder, rp, qp, b, kind, isa):
    """i32 dot lanes of block b of a row with block b of the quantized x."""
    size, qoff, _ = _BLOCKS[kind]
    c = lambda v: ir.Constant(b.type, v)  # noqa: E731
    xq = _ir_load(builder, qp, builder.mul(b, c(32)), _vec(_I8, 32), 1)
    qo = builder.add(builder.mul(b, c(size)), c(qoff))
    if kind == "q8_0":
        return _ir_dot_ss(builder, _ir_load(builder, rp, qo, _vec(_I8, 32), 1), xq, isa)
    if kind == "q4_0":
        return _ir_dot_ss(builder, builder.sub(_ir_nibbles(builder, rp, qo, isa), _const_vec(_I8, 32, 8)), xq, isa)
    q = _ir_nibbles(builder, rp, qo, isa)
    if kind in ("q5_0", "q5_1"):  # | the fifth bits (16 or 0), from the uint32 before the nibbles
        q = builder.or_(q, _ir_qh_bits(builder, rp, builder.sub(qo, c(4))))
    return _ir_dot_us(builder, q, xq, isa)


def _ir_scales(builder, rp, dp, sp, b, g, kind):
    """Blocks b .. b+g-1 of a row: (<g x float> d_w d_x, and for Q4_1 <g x float> m_w s_x).

    The float16 d (and m) of the g blocks come from one load of the words from the first
    block's d to the last block's d (or m), permuted (x86: one vpermd/vpermw)."""
    size, _, has_m = _BLOCKS[kind]
    step = size // 2
    # through a pointer LLVM cannot relate to rp: else it merges this load with the loads of
    # the quants it overlaps and extracts those by shuffles
    base = _ir_opaque(builder, builder.gep(rp, [builder.mul(b, ir.Constant(b.type, size))]))
    run = _ir_load(builder, base, ir.Constant(b.type, 0), _vec(_I16, (g - 1) * step + (2 if has_m else 1)), 1)
    dw = _ir_f16_vec(builder, _shuffle(builder, run, run, [i * step for i in range(g)]))
    scale = builder.fmul(dw, _ir_load(builder, dp, b, _vec(_F32T, g), 4), flags=_IR_FLAGS)
    if kind == "q5_0":  # sum_j (q_j - 16) x_j = sum_j q_j x_j - 16 s_x: an m_w of -16 d_w
        m16 = builder.fmul(dw, _const_vec(_F32T, g, -16.0), flags=_IR_FLAGS)
        return scale, builder.fmul(m16, _ir_load(builder, sp, b, _vec(_F32T, g), 4), flags=_IR_FLAGS)
    if not has_m:
        return scale, None
    mw = _ir_f16_vec(builder, _shuffle(builder, run, run, [i * step + 1 for i in range(g)]))
    return scale, builder.fmul(mw, _ir_load(builder, sp, b, _vec(_F32T, g), 4), flags=_IR_FLAGS)


def _make_row_dots(isa: str, group: int = 4, n_acc: int = 2, hadd: bool | None = None):
    """(_dot_row_q8_0_i8, _dot_row_q4_0_i8, _dot_row_q4_1_i8) intrinsics for ``isa`` (see
    ``_dot_isa``; all but "generic" only compile and run where the CPU has the instructions).

    A row is processed in groups of ``group`` blocks (a power of two; the last blocks in
    groups of group/2, ..., 1), the group's scales d_w d_x (and Q4_1 min terms) computed as
    one vector. With ``hadd`` (default: on x86), groups of 4 and 2 blocks sum their int32
    lanes pairwise (vphaddd) into one vector of partial block sums, converted and scaled by
    one multiply-add; other groups store their scales to a stack slot and add each block
    scaled by a broadcast load of its scale into accumulator (block index mod ``n_acc``).
    The defaults are the fastest measured on AMD Zen 4."""
    lanes = 16 if isa == "generic" else 8
    sizes = [group >> i for i in range(group.bit_length())]
    if hadd is None:
        hadd = isa != "generic"

    def ok(row, qs, d, s, nb):
        return (_is_c_array(row, types.uint8) and _is_c_array(qs, types.int8) and _is_c_array(d, types.float32)
                and (s is None or _is_c_array(s, types.float32)) and isinstance(nb, types.Integer))

    def make_codegen(kind):
        has_m = _BLOCKS[kind][2] or kind == "q5_0"  # Q5_0: unsigned quants, the bias as a minimum

        def codegen(context, builder, sig, args):
            ptrs = [context.make_array(ty)(context, builder, a).data for ty, a in zip(sig.args[:-1], args[:-1])]
            rp, qp, dp = ptrs[:3]
            sp = ptrs[3] if has_m else None
            nb = context.cast(builder, args[-1], sig.args[-1], types.intp)
            c = lambda v: ir.Constant(nb.type, v)  # noqa: E731
            accs = [cgutils.alloca_once_value(builder, _ir_vec_zero(lanes)) for _ in range(n_acc)]
            acc_m = {g: cgutils.alloca_once_value(builder, _ir_vec_zero(g)) for g in sizes} if has_m else None
            slot = cgutils.alloca_once(builder, _vec(_F32T, group))
            slot_f = builder.bitcast(slot, _F32T.as_pointer())

            def add_group_hadd(b0, g, scales):
                # the g (2 or 4) blocks' int32 lanes summed pairwise (vphaddd) into one vector
                # of partial block sums, then one conversion and one multiply-add for them all
                v8 = _vec(_I32, 8)
                dots = [_ir_block_dot(builder, rp, qp, builder.add(b0, c(i)), kind, isa) for i in range(g)]
                h = _ir_call(builder, "llvm.x86.avx2.phadd.d", v8, dots[0:2])  # [b0 b0 b1 b1 | b0 b0 b1 b1]
                idx = [0, 0, 1, 1, 0, 0, 1, 1]
                if g == 4:
                    h23 = _ir_call(builder, "llvm.x86.avx2.phadd.d", v8, dots[2:4])
                    h = _ir_call(builder, "llvm.x86.avx2.phadd.d", v8, [h, h23])  # [b0 b1 b2 b3 | b0 b1 b2 b3]
                    idx = [0, 1, 2, 3, 0, 1, 2, 3]
                sc = _shuffle(builder, scales, scales, idx)
                _ir_accumulate(builder, accs[0], builder.fmul(sc, builder.sitofp(h, _vec(_F32T, 8)), flags=_IR_FLAGS))

            def add_group(b0, g):
                scales, mterms = _ir_scales(builder, rp, dp, sp, b0, g, kind)
                if has_m:
                    _ir_accumulate(builder, acc_m[g], mterms)
                if hadd and g in (2, 4) and lanes == 8:
                    add_group_hadd(b0, g, scales)
                    return
                slot_g = builder.bitcast(slot, scales.type.as_pointer())
                builder.store(scales, slot_g)
                # an empty asm that may read the slot: the store stays a store and the loads
                # below are loads (else LLVM forwards the vector and broadcasts its lanes by
                # shuffles, the scarcer resource)
                builder.asm(ir.FunctionType(ir.VoidType(), [slot_g.type]), "", "r,~{memory}", [slot_g],
                            side_effect=True)
                for i in range(g):
                    scale = builder.load(builder.gep(slot_f, [_ir_i32(i)]))
                    dot = _ir_block_dot(builder, rp, qp, builder.add(b0, c(i)), kind, isa)
                    term = builder.fmul(_ir_splat(builder, scale, lanes), builder.sitofp(dot, _vec(_F32T, lanes)),
                                        flags=_IR_FLAGS)
                    _ir_accumulate(builder, accs[i % n_acc], term)

            shift = c(group.bit_length() - 1)
            with cgutils.for_range(builder, builder.ashr(nb, shift)) as loop:
                add_group(builder.shl(loop.index, shift), group)
            for g in sizes[1:]:
                with builder.if_then(builder.icmp_signed("!=", builder.and_(nb, c(g)), c(0))):
                    add_group(builder.and_(nb, c(-2 * g)), g)
            acc = builder.load(accs[0])
            for a in accs[1:]:
                acc = builder.fadd(acc, builder.load(a), flags=_IR_FLAGS)
            total = _ir_hsum(builder, acc)
            if has_m:
                for g in sizes:
                    total = builder.fadd(total, _ir_hsum(builder, builder.load(acc_m[g])), flags=_IR_FLAGS)
            return total

        return codegen

    @intrinsic
    def _dot_row_q8_0_i8(typingctx, row, qs, d, nb):
        """Dot of a Q8_0 row of ``nb`` blocks with the int8-quantized x (qs, d).
        Block (34 B): d f16 | qs int8[32];  sum_b d_w d_x sum_j w_j q_j."""
        if not ok(row, qs, d, None, nb):
            return None
        return types.float32(row, qs, d, nb), make_codegen("q8_0")

    @intrinsic
    def _dot_row_q4_0_i8(typingctx, row, qs, d, s, nb):
        """Dot of a Q4_0 row of ``nb`` blocks with the int8-quantized x (qs, d; s is unused).
        Block (18 B): d f16 | 16 bytes of nibbles (element j: low nibble of byte j, j + 16: high);
        sum_b d_w d_x sum_j (nib_j - 8) q_j."""
        if not ok(row, qs, d, s, nb):
            return None
        return types.float32(row, qs, d, s, nb), make_codegen("q4_0")

    @intrinsic
    def _dot_row_q4_1_i8(typingctx, row, qs, d, s, nb):
        """Dot of a Q4_1 row of ``nb`` blocks with the int8-quantized x (qs, d, block sums s).
        Block (20 B): d f16 | m f16 | 16 bytes of nibbles (as Q4_0);
        sum_b d_w d_x sum_j nib_j q_j + m_w s_b."""
        if not ok(row, qs, d, s, nb):
            return None
        return types.float32(row, qs, d, s, nb), make_codegen("q4_1")

    @intrinsic
    def _dot_row_q5_0_i8(typingctx, row, qs, d, s, nb):
        """Dot of a Q5_0 row of ``nb`` blocks with the int8-quantized x (qs, d, block sums s).
        Block (22 B): d f16 | qh u32 (bit j: fifth bit of element j) | 16 bytes of nibbles (as
        Q4_0);  sum_b d_w d_x sum_j (q5_j - 16) q_j, as sum_b d_w d_x sum_j q5_j q_j - 16 d_w s_b."""
        if not ok(row, qs, d, s, nb):
            return None
        return types.float32(row, qs, d, s, nb), make_codegen("q5_0")

    @intrinsic
    def _dot_row_q5_1_i8(typingctx, row, qs, d, s, nb):
        """Dot of a Q5_1 row of ``nb`` blocks with the int8-quantized x (qs, d, block sums s).
        Block (24 B): d f16 | m f16 | qh u32 | 16 bytes of nibbles;
        sum_b d_w d_x sum_j q5_j q_j + m_w s_b."""
        if not ok(row, qs, d, s, nb):
            return None
        return types.float32(row, qs, d, s, nb), make_codegen("q5_1")

    return _dot_row_q8_0_i8, _dot_row_q4_0_i8, _dot_row_q4_1_i8, _dot_row_q5_0_i8, _dot_row_q5_1_i8


_dot_row_q8_0_i8, _dot_row_q4_0_i8, _dot_row_q4_1_i8, _dot_row_q5_0_i8, _dot_row_q5_1_i8 = _make_row_dots(DOT_ISA)


def _ir_lane_sums(builder, dots, x86):
    """<g x i32>: the lane sums of g (1, 2, 4 or 8) i32 dot vectors, in order. On x86 (8-lane
    dots) by pairwise vphaddd, else each by a reduction."""
    g = len(dots)
    if not x86 or g == 1:
        sums = [_ir_call(builder, f"llvm.vector.reduce.add.v{d.type.count}i32", _I32, [d]) for d in dots]
        v = ir.Constant(_vec(_I32, g), ir.Undefined)
        for i, e in enumerate(sums):
            v = builder.insert_element(v, e, _ir_i32(i))
        return v

    def phadd(a, b):
        return _ir_call(builder, "llvm.x86.avx2.phadd.d", _vec(_I32, 8), [a, b])

    if g == 2:
        h = phadd(dots[0], dots[1])
        h = phadd(h, h)                                     # [a b a b | a b a b] (half sums)
        return builder.add(_shuffle(builder, h, h, [0, 1]), _shuffle(builder, h, h, [4, 5]))
    quads = [phadd(phadd(dots[i], dots[i + 1]), phadd(dots[i + 2], dots[i + 3])) for i in range(0, g, 4)]
    a = quads[0]                                            # [b0 b1 b2 b3 | b0 b1 b2 b3] (half sums)
    if g == 4:
        return builder.add(_shuffle(builder, a, a, [0, 1, 2, 3]), _shuffle(builder, a, a, [4, 5, 6, 7]))
    b = quads[1]
    return builder.add(_shuffle(builder, a, b, [0, 1, 2, 3, 12, 13, 14, 15]),
                       _shuffle(builder, a, b, [4, 5, 6, 7, 8, 9, 10, 11]))


# ---------------------------------------------------------------------------------------
# K-quant rows with the int8 x
#
# The x blocks of 32 are the same as for the other types (one float32 scale d_x and sum s_x
# per block); a super-block of 256 weights meets 8 of them. Its runs of 32 quants (unpacked as
# in the float32 dots of npllama.quants) are dotted with those blocks into int32 lanes: Q4_K
# and Q5_K's 32-element sub-blocks as they are, their 8 lane sums (vphaddd) converted at once
# and scaled by d_w sc_j d_x, their minimums dmin min_j s_x one 8-lane multiply-add; the
# 16-element sub-blocks of Q6_K, Q3_K and Q2_K multiply each half of a run's lanes by its
# integer scale before the lane sums (Q2_K's minimums: the same with the 16-element sums of x's
# quants, a dot with ones). One multiply-add per super-block and accumulator.
# ---------------------------------------------------------------------------------------

def _ir_dot_halves(builder, q, xq, signed, isa):
    """i32 lanes whose first half sums to dot(q[:16], xq[:16]) and second half to
    dot(q[16:], xq[16:]), for <32 x i8> q (signed: in [-127, 127]; else unsigned <= 128)."""
    if isa != "generic":  # vpdpbusd / vpmaddubsw+vpmaddwd lane i sums bytes 4i..4i+3
        return (_ir_dot_ss if signed else _ir_dot_us)(builder, q, xq, isa)
    v16, v8 = _vec(_I16, 32), _vec(_I32, 8)
    p = builder.mul((builder.sext if signed else builder.zext)(q, v16), builder.sext(xq, v16), flags=["nsw"])
    part = [builder.sext(_shuffle(builder, p, p, list(range(i, i + 8))), v8) for i in (0, 8, 16, 24)]
    return _shuffle(builder, builder.add(part[0], part[1]), builder.add(part[2], part[3]), list(range(16)))


def _make_k_dots(isa: str):
    """The int8 dot intrinsics ``(row, qs, d, s, nb) -> float32`` of Q4_K, Q5_K, Q6_K, Q3_K and
    Q2_K rows of ``nb`` super-blocks for ``isa``."""
    x86 = isa != "generic"

    def codegen_for(kind):
        def codegen(context, builder, sig, args):
            rp, qp, dp, sp = (context.make_array(ty)(context, builder, a).data for ty, a in zip(sig.args[:-1], args[:-1]))
            nb = context.cast(builder, args[-1], sig.args[-1], types.intp)
            c = lambda v: ir.Constant(nb.type, v)  # noqa: E731
            acc = cgutils.alloca_once_value(builder, _ir_vec_zero(8))
            acc_m = cgutils.alloca_once_value(builder, _ir_vec_zero(8))
            v8f = _vec(_F32T, 8)

            def f16(o):
                return _ir_f16_fast(builder, _ir_load_f16(builder, rp, o))

            def scaled_halves(lanes, sc16, s):  # lanes * [sc16[s] (first half), sc16[s + 1] (second)]
                n = lanes.type.count
                return builder.mul(lanes, _shuffle(builder, sc16, sc16, [s] * (n // 2) + [s + 1] * (n // 2)))

            with cgutils.for_range(builder, nb) as loop:
                b = loop.index
                xq = [_ir_load(builder, qp, builder.add(builder.mul(b, c(256)), c(32 * j)), _vec(_I8, 32), 1)
                      for j in range(8)]
                dx = _ir_load(builder, dp, builder.mul(b, c(8)), v8f, 4)
                if kind in ("q4_k", "q5_k"):
                    five = kind == "q5_k"
                    o = builder.mul(b, c(176 if five else 144))
                    d, dmin = f16(o), f16(builder.add(o, c(2)))
                    sc, mn = _ir_k_scales(builder, rp, builder.add(o, c(4)))
                    dots = [_ir_dot_us(builder, q, xq[j], isa)
                            for j, q in enumerate(_ir_k_quants(builder, rp, o, five))]
                    sums = builder.sitofp(_ir_lane_sums(builder, dots, x86), v8f)
                    dl = builder.fmul(_ir_splat(builder, d, 8), builder.sitofp(sc, v8f), flags=_IR_FLAGS)
                    _ir_accumulate(builder, acc, builder.fmul(builder.fmul(dl, dx, flags=_IR_FLAGS), sums,
                                                              flags=_IR_FLAGS))
                    ml = builder.fmul(_ir_splat(builder, dmin, 8), builder.sitofp(mn, v8f), flags=_IR_FLAGS)
                    sx = _ir_load(builder, sp, builder.mul(b, c(8)), v8f, 4)
                    _ir_accumulate(builder, acc_m, builder.fmul(ml, sx, flags=_IR_FLAGS))
                else:
                    runs, mins = [], None  # runs: (quants of elements 32r.., signed); scales: <16 x i32>
                    v16 = _vec(_I32, 16)
                    if kind == "q6_k":
                        o = builder.mul(b, c(210))
                        d = f16(builder.add(o, c(208)))
                        sc16 = builder.sext(_ir_load(builder, rp, builder.add(o, c(192)), _vec(_I8, 16), 1), v16)
                        for h in range(2):
                            ql = [_ir_load(builder, rp, builder.add(o, c(64 * h + 32 * i)), _vec(_I8, 32), 1)
                                  for i in range(2)]
                            qh = _ir_load(builder, rp, builder.add(o, c(128 + 32 * h)), _vec(_I8, 32), 1)
                            for k in range(4):
                                lo = _ir_b8(builder, ql[k & 1], "and" if k < 2 else "lshr", 15 if k < 2 else 4)
                                hi = _ir_b8(builder, _ir_b8(builder, _ir_b8(builder, qh, "lshr", 2 * k), "and", 3),
                                            "shl", 4)
                                runs.append((_ir_b8(builder, builder.or_(lo, hi), "sub", 32), True))
                    elif kind == "q3_k":
                        o = builder.mul(b, c(110))
                        d = f16(builder.add(o, c(108)))
                        lo8 = _ir_load(builder, rp, builder.add(o, c(96)), _vec(_I8, 8), 1)
                        hi4 = _ir_load(builder, rp, builder.add(o, c(104)), _vec(_I8, 4), 1)
                        lo = builder.zext(_shuffle(builder, lo8, lo8, list(range(8)) * 2), v16)
                        lo = builder.and_(builder.lshr(lo, _const_vec(_I32, 16, [0] * 8 + [4] * 8)),
                                          _const_vec(_I32, 16, 15))
                        hi = builder.zext(_shuffle(builder, hi4, hi4, [t & 3 for t in range(16)]), v16)
                        hi = builder.and_(builder.lshr(hi, _const_vec(_I32, 16, [2 * (t >> 2) for t in range(16)])),
                                          _const_vec(_I32, 16, 3))
                        sc16 = builder.sub(builder.or_(lo, builder.shl(hi, _const_vec(_I32, 16, 4))),
                                           _const_vec(_I32, 16, 32))
                        hm = _ir_load(builder, rp, o, _vec(_I8, 32), 1)
                        for h in range(2):
                            qs_ = _ir_load(builder, rp, builder.add(o, c(32 + 32 * h)), _vec(_I8, 32), 1)
                            for kk in range(4):
                                low = _ir_b8(builder, _ir_b8(builder, qs_, "lshr", 2 * kk), "and", 3)
                                high = _ir_bit_select(builder, hm, 4 * h + kk, 4)
                                runs.append((_ir_b8(builder, builder.or_(low, high), "sub", 4), True))
                    else:  # q2_k
                        o = builder.mul(b, c(84))
                        d, dmin = f16(builder.add(o, c(80))), f16(builder.add(o, c(82)))
                        sb = builder.zext(_ir_load(builder, rp, o, _vec(_I8, 16), 1), v16)
                        sc16 = builder.and_(sb, _const_vec(_I32, 16, 15))
                        mins = builder.lshr(sb, _const_vec(_I32, 16, 4))
                        for h in range(2):
                            qs_ = _ir_load(builder, rp, builder.add(o, c(16 + 32 * h)), _vec(_I8, 32), 1)
                            for k in range(4):
                                runs.append((_ir_b8(builder, _ir_b8(builder, qs_, "lshr", 2 * k), "and", 3), False))
                    dots = [scaled_halves(_ir_dot_halves(builder, q, xq[r], signed, isa), sc16, 2 * r)
                            for r, (q, signed) in enumerate(runs)]
                    sums = builder.sitofp(_ir_lane_sums(builder, dots, x86), v8f)
                    ddx = builder.fmul(_ir_splat(builder, d, 8), dx, flags=_IR_FLAGS)
                    _ir_accumulate(builder, acc, builder.fmul(ddx, sums, flags=_IR_FLAGS))
                    if mins is not None:  # sum over the 16-element sub-blocks of min_s * (sum of x's quants)
                        ones = _const_vec(_I8, 32, 1)
                        mdots = [scaled_halves(_ir_dot_halves(builder, ones, xq[r], False, isa), mins, 2 * r)
                                 for r in range(8)]
                        msums = builder.sitofp(_ir_lane_sums(builder, mdots, x86), v8f)
                        mdx = builder.fmul(_ir_splat(builder, dmin, 8), dx, flags=_IR_FLAGS)
                        _ir_accumulate(builder, acc_m, builder.fmul(mdx, msums, flags=_IR_FLAGS))
            return builder.fsub(_ir_hsum(builder, builder.load(acc)), _ir_hsum(builder, builder.load(acc_m)),
                                flags=_IR_FLAGS)

        return codegen

    def make(kind, doc):
        def typer(typingctx, row, qs, d, s, nb):
            if not (_is_c_array(row, types.uint8) and _is_c_array(qs, types.int8) and _is_c_array(d, types.float32)
                    and _is_c_array(s, types.float32) and isinstance(nb, types.Integer)):
                return None
            return types.float32(row, qs, d, s, nb), codegen_for(kind)

        typer.__name__ = typer.__qualname__ = f"_dot_row_{kind}_i8"
        typer.__doc__ = doc
        return intrinsic(typer)

    return tuple(make(kind, f"Dot of a {kind.upper()} row of nb super-blocks with the int8-quantized x (qs, d, "
                            f"block sums s).") for kind in ("q4_k", "q5_k", "q6_k", "q3_k", "q2_k"))


_dot_row_q4_k_i8, _dot_row_q5_k_i8, _dot_row_q6_k_i8, _dot_row_q3_k_i8, _dot_row_q2_k_i8 = _make_k_dots(DOT_ISA)


# ---------------------------------------------------------------------------------------
# Row-parallel kernels and the dispatcher
# ---------------------------------------------------------------------------------------

@njit(cache=True)
def _has_i8(code):
    """Whether weights of type ``code`` have an int8-activation kernel."""
    return (code == _Q4_1 or code == _Q8_0 or code == _Q4_0 or code == _Q5_0 or code == _Q5_1
            or code == _Q4_K or code == _Q5_K or code == _Q6_K or code == _Q3_K or code == _Q2_K)


def _rows_i8_of(mask, code, data, r0, r1, qs, d, s, out):
    """`_rows_i8`'s branches, those of the types of `mask` (the overload below)."""


@overload(_rows_i8_of, prefer_literal=True)
def _rows_i8_of_jit(mask, code, data, r0, r1, qs, d, s, out):
    _, _, _, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k = _type_flags(mask)

    def impl(mask, code, data, r0, r1, qs, d, s, out):
        nb = qs.shape[0] // 32
        if q4_1 and code == _Q4_1:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_1_i8(data[r], qs, d, s, nb)
        elif q8_0 and code == _Q8_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q8_0_i8(data[r], qs, d, nb)
        elif q5_0 and code == _Q5_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_0_i8(data[r], qs, d, s, nb)
        elif q4_k and code == _Q4_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_k_i8(data[r], qs, d, s, nb // 8)
        elif q6_k and code == _Q6_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q6_k_i8(data[r], qs, d, s, nb // 8)
        elif q5_k and code == _Q5_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_k_i8(data[r], qs, d, s, nb // 8)
        elif q5_1 and code == _Q5_1:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q5_1_i8(data[r], qs, d, s, nb)
        elif q3_k and code == _Q3_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q3_k_i8(data[r], qs, d, s, nb // 8)
        elif q2_k and code == _Q2_K:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q2_k_i8(data[r], qs, d, s, nb // 8)
        elif q4_0 and code == _Q4_0:
            for r in range(r0, r1):
                _prefetch_ahead(data, r)
                out[r] = _dot_row_q4_0_i8(data[r], qs, d, s, nb)
        else:
            out[r0:r1] = np.nan

    return impl


@njit(cache=True)
def _rows_i8(mask, code, data, r0, r1, qs, d, s, out):
    """out[r] = dot(row r of ``data``, x) for r in r0..r1-1, on the calling thread, by the
    int8 kernel of type ``code`` (one of ``_has_i8``, and of ``mask``'s types; else NaN) on
    the quantized x (qs, d, s)."""
    _rows_i8_of(mask, code, data, r0, r1, qs, d, s, out)


@njit(parallel=True, cache=True)
def _matvec_i8(mask, code, data, x, qs, d, s, out):
    """out[r] = dot(row r of ``data``, x): by the int8 kernel of type ``code`` on the quantized
    x (qs, d, s from ``_quantize_x_q8(x, ...)``), row-parallel, else by the float32 kernel
    on x (the code of ``mask``'s types only)."""
    if not _has_i8(code):
        _matvec(mask, code, data, x, out)
        return
    rows = data.shape[0]
    per = _task_rows(rows)
    for c in prange((rows + per - 1) // per):
        _rows_i8(mask, code, data, c * per, min(rows, (c + 1) * per), qs, d, s, out)


# ---------------------------------------------------------------------------------------
# Python-level API
# ---------------------------------------------------------------------------------------

def quantize_x(x) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(qs int8 (n,), d float32 (n // 32,), s float32 (n // 32,)) of a 1-D x, n a multiple of 32."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % 32:
        raise ValueError(f"x must have shape (n,) with n a multiple of 32, got {x.shape}")
    nb = x.shape[0] // 32
    qs = np.empty(x.shape[0], np.int8)
    d = np.empty(nb, np.float32)
    s = np.empty(nb, np.float32)
    _quantize_x_q8(x, qs, d, s)
    return qs, d, s


def matmul_int8(data, qtype, x, out=None) -> np.ndarray:
    """``W @ x`` for a GGUF weight ``data`` of shape (rows, row_bytes) and x of shape (n,), with
    x quantized to int8 blocks for the types in ``INT8_TYPES`` (others: as ``quants.matmul``).

    ``x`` is converted to C-contiguous float32 as needed; ``data`` is copied only if it is not
    C-contiguous. ``out``, if given, must be a C-contiguous float32 array of shape (rows,).
    """
    sp, w, x, out = _product_args(data, qtype, x, out, (1,))
    if out.size == 0:
        return out
    if x.shape[0] == 0:
        out.fill(0.0)
        return out
    code = int(sp.qtype)
    if sp.qtype in INT8_TYPES:
        qs, d, s = quantize_x(x)
    else:
        qs, d, s = np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.float32)
    _matvec_i8(kernel_types([sp.qtype]), code, w, x, qs, d, s, out)
    return out
