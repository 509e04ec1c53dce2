"""float16 storage read and written from compiled code.

Numba has no float16 type, so a float16 array (a KV cache or pool stored in half precision)
reaches a kernel as its raw bits, a uint16 view (`bits`). Kernels access elements through

* ``_ld(row, d)``: row[d] as float32, for float32 rows (as is) and uint16 rows (converted
  exactly: every float16 is a float32);
* ``_st(row, d, value)``: row[d] = value, for float32 rows (as is) and uint16 rows (rounded
  to the nearest float16, ties to even, as NumPy's ``astype(np.float16)``: overflow gives
  inf, NaN stays NaN);
* ``_ld_row(src, dst)``: dst[:] = src as float32 (``_ld`` of every element), for a row src
  and a float32 row dst as long: 16 halves a vector conversion where the hardware converts
  them and both rows are contiguous (attention's copies of a block of keys and values);

so one kernel source serves both storage types, compiled once per type. Where the CPU
converts halves in hardware (x86 F16C, AArch64) each conversion is one instruction that LLVM
vectorizes; elsewhere a portable integer version runs.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .quants import _F32T, _HW_F16, _ir_as_i32, _ir_f16_fast, _is_c_array, _vec

__all__ = ["bits"]


def bits(a: np.ndarray) -> np.ndarray:
    """The array a kernel receives for ``a``: a uint16 view of a float16 array, else ``a``."""
    return a.view(np.uint16) if a.dtype == np.float16 else a


@intrinsic
def _half_bits_to_f32(typingctx, h):
    """float32 from float16 bits (one instruction where the hardware converts halves)."""
    if not isinstance(h, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return _ir_f16_fast(builder, _ir_as_i32(builder, args[0]))

    return types.float32(h), codegen


@intrinsic
def _f32_to_half_hw(typingctx, x):
    """float16 bits (uint16) of float32 x rounded to nearest even, by the hardware conversion."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def _f32_bits(typingctx, x):
    """The IEEE bits of float32 x as uint32."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(x), codegen


@njit(cache=True)
def _f32_to_half_soft(x):
    """float16 bits (uint16) of float32 x rounded to nearest even, in integer arithmetic."""
    b = np.int64(_f32_bits(x))
    sign = (b >> 16) & 0x8000
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    if e == 0xFF:  # inf, or NaN kept quiet with the top of its payload
        return np.uint16(sign | 0x7C00 | ((0x200 | (m >> 13)) if m else 0))
    exp = e - 127
    if exp >= -14:  # a normal half unless rounding carries into inf
        if exp > 15:
            return np.uint16(sign | 0x7C00)
        h = ((exp + 15) << 10) | (m >> 13)
        rest = m & 0x1FFF
        if rest > 0x1000 or (rest == 0x1000 and h & 1):
            h += 1  # a carry out of the mantissa bumps the exponent, up to inf
        return np.uint16(sign | h)
    shift = -exp - 1  # a subnormal half: units of 2**-24 (14 <= shift; zero past 24)
    if shift > 24:
        return np.uint16(sign)
    full = m | 0x800000
    h = full >> shift
    rest = full & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    if rest > half or (rest == half and h & 1):
        h += 1
    return np.uint16(sign | h)


def _ld(row, d):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_ld, inline="always")
def _ld_overload(row, d):
    if row.dtype == types.float32:
        return lambda row, d: row[d]
    if row.dtype == types.uint16:
        return lambda row, d: _half_bits_to_f32(row[d])
    return None


def _st(row, d, value):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_st, inline="always")
def _st_overload(row, d, value):
    if row.dtype == types.float32:
        def store(row, d, value):
            row[d] = value
        return store
    if row.dtype == types.uint16:
        convert = _f32_to_half_hw if _HW_F16 else _f32_to_half_soft

        def store_half(row, d, value):
            row[d] = convert(np.float32(value))
        return store_half
    return None


@intrinsic
def _halves_to_f32(typingctx, src, dst):
    """dst[:] = src converted to float32, src C-contiguous float16 bits (uint16) as long as the
    C-contiguous float32 dst: 16 at a time in one vector conversion, the rest one by one. In
    attention's copies of a key and a value row side by side, LLVM left the loop of `_ld`
    scalar (a load, a conversion and a store a value)."""
    if not (_is_c_array(src, types.uint16) and _is_c_array(dst, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        sa, da = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
        n = builder.extract_value(da.shape, 0)
        c = lambda v: ir.Constant(n.type, v)  # noqa: E731
        n16 = builder.mul(builder.udiv(n, c(16)), c(16))
        for lo, hi, k in ((c(0), n16, 16), (n16, n, 1)):
            half, single = (_vec(ir.HalfType(), k), _vec(_F32T, k)) if k > 1 else (ir.HalfType(), _F32T)
            with cgutils.for_range_slice(builder, lo, hi, c(k), inc=True) as (i, _):
                h = builder.load(builder.bitcast(builder.gep(sa.data, [i]), half.as_pointer()), align=2)
                builder.store(builder.fpext(h, single), builder.bitcast(builder.gep(da.data, [i]), single.as_pointer()),
                              align=4)
        return context.get_dummy_value()

    return types.none(src, dst), codegen


def _ld_row(src, dst):  # pragma: no cover - replaced by the overload in compiled code
    raise NotImplementedError


@overload(_ld_row, inline="always")
def _ld_row_overload(src, dst):
    if src.dtype == types.uint16 and _HW_F16 and src.layout == "C" and dst.layout == "C":
        return lambda src, dst: _halves_to_f32(src, dst)

    def copy(src, dst):
        for d in range(dst.shape[0]):
            dst[d] = _ld(src, d)
    return copy
