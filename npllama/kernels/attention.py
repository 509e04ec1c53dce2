"""Causal multi-head attention over the interleaved KV cache, with an online softmax.

The kernels read keys and values straight from a KV-cache layer buffer,

    kv: (capacity, n_kv_heads, 2, head_dim)   [:, :, 0, :] = K, [:, :, 1, :] = V

without copying it and without repeating KV heads: query head h reads KV head
h // (n_heads // n_kv_heads) (grouped-query attention). Keys are processed in blocks with a
running maximum, running sum and running output per query head (flash attention), so the
(queries x keys) score matrix never exists; everything accumulates in float32. The buffer
may store float16 (read through npllama.f16, converted to float32 as it is read).

Two kernels share the block routine:
  * decode (one query): (KV head, chunk of keys) pairs run in parallel, each handling all
    query heads of its group so every K/V row is read once, and the chunks' states are
    merged at the end (split-K, "flash decoding");
  * prefill (several queries): (block of _ROWS queries, KV head) pairs run in parallel over
    the keys their queries see, sharing every K/V row read among the block's queries.

Every path (these kernels, the paged attention of a batched pass, the fused decode step in
int8 mode) folds a query's keys in blocks of _BLOCK from multiples of _BLOCK, in chunks of
_CHUNK keys from multiples of _CHUNK, each chunk from a fresh state, and merges the chunks'
states in order (`_merge_head`): so a query gets the same bits whatever its task, its
neighbours or the number of threads, and a batched pass equals a session's steps. A block's
sums are grouped the same in every path: the paged attention of a decoding query reads its
keys and values straight from the records (`_score_records`, `_add_records`), where the
others convert each block into float32 scratch first (`_score_block`, `_add_values`).

Query i sits at absolute position p = offset + i and sees the keys at positions t with
t <= p (and t > p - window when window > 0), t < kv_len. A key is scored as

    x = scale * q.k;  x = softcap * tanh(x / softcap) if softcap > 0;
    x += slope[h] * (t - p) with ALiBi;  x += mask[i, t] with a mask,

and a mask entry at or below -1e30 (including -inf) removes the key. A query that sees no
key at all (a fully masked row, say) gets a zero output, never NaN. Bidirectional attention (an
encoder's, `causal=False`) places every query past the last key, so that each sees them all.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .aligned import _empty
from .cpu import FEATURES
from .f16 import _ld, _ld_row, bits
from .nn import _exp, _ir_exp
from .quants import _F32T, _HW_F16, _IR_FLAGS, _ir_call, _ir_hsum, _ir_load, _ir_splat, _is_c_array, _shuffle, _vec

# No 'nnan' / 'ninf': the kernels rely on -inf for removed keys and empty running maxima.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp", "afn"}
_BLOCK = 32            # keys scored together before the running state is rescaled
_ROWS = 16             # queries one prefill task handles together, sharing each K/V row read (and its
                       # conversion: 512 queries 4,000 keys deep took 0.93-0.95x the time of 8)
_CHUNK = 512           # keys folded from a fresh state before the chunks are merged (a multiple of _BLOCK)
MASKED = -1e30         # mask entries at or below this remove the key
_NO_MASK = np.zeros((0, 0), dtype=np.float32)  # stand-ins for absent options, typed like the real ones
_NO_ALIBI = np.zeros(0, dtype=np.float32)
_RESCALE_ROWS = 64     # (row, head) pairs `_rescale_rows` takes through its phases at a time


@intrinsic
def _rescale_rows(typingctx, s, n, m, l, acc):
    """`_rescale` as LLVM IR, in phases over up to _RESCALE_ROWS (row, head) pairs at a time,
    each phase a loop of small independent steps that the CPU overlaps: (1) each pair's block
    maximum, new running maximum, and the exponent of its correction, m_old - m_new; (2) the
    corrections, eight pairs a vector; (3) the weights exp(s - m_new), a pair a step; (4) each
    pair's sum of weights, running sum and rescaled output. Straight-line code for four pairs
    at a time (before) kept sixteen vectors of exponentials in flight, which spilled: the step
    took 1.2-1.7x this one's time for 3 to 24 pairs (a decoding query's heads), about the same
    for 48 (a prefill task's: attention 0.96-1.0x the time). A pair that sees no key
    subtracts +inf, so that its weights are exp(-inf) = 0, and keeps its state (correction 1).
    The exponentials are nn._exp's bit for bit (nn._ir_exp); a block's sum of weights is a
    fixed tree over its lanes, the same in every caller."""
    f32 = types.float32
    if not (_is_c_array(s, f32, 3) and isinstance(n, types.Integer) and _is_c_array(m, f32, 2)
            and _is_c_array(l, f32, 2) and _is_c_array(acc, f32, 3)):
        return None

    def codegen(context, builder, sig, args):
        sa, ma, la, aa = (context.make_array(t)(context, builder, a)
                          for t, a in zip((sig.args[0], *sig.args[2:]), (args[0], *args[2:])))
        intp = context.get_value_type(types.intp)
        c = lambda v: ir.Constant(intp, v)  # noqa: E731
        i32 = ir.IntType(32)
        cf = lambda v, k=16: ir.Constant(_vec(_F32T, k), [v] * k)  # noqa: E731
        inf, ninf = float("inf"), float("-inf")
        rows = builder.mul(builder.extract_value(sa.shape, 0), builder.extract_value(sa.shape, 1))
        D = builder.extract_value(aa.shape, 2)
        nn = builder.trunc(context.cast(builder, args[1], sig.args[1], types.intp), i32)
        # per pair of a batch: m_old - m_new, then the correction; the subtrahend of its scores
        # (zeroed once a call: phase 2 takes whole vectors of eight, past a short batch's last pair)
        corr, sub = (builder.bitcast(cgutils.alloca_once(builder, ir.ArrayType(_F32T, _RESCALE_ROWS)),
                                     _F32T.as_pointer()) for _ in range(2))

        def scores(r, v):  # 16 scores of pair r from key 16 v, those past n as -inf
            x = _ir_load(builder, sa.data, builder.add(builder.mul(r, c(_BLOCK)), c(16 * v)), _V16, 4)
            seen = builder.icmp_signed("<", ir.Constant(_vec(i32, 16), list(range(16 * v, 16 * v + 16))),
                                       _ir_splat(builder, nn, 16))
            return builder.select(seen, x, cf(ninf))

        with cgutils.for_range_slice(builder, c(0), rows, c(_RESCALE_ROWS), inc=True) as (b0, _):
            nb = builder.sub(rows, b0)
            nb = builder.select(builder.icmp_signed("<", nb, c(_RESCALE_ROWS)), nb, c(_RESCALE_ROWS))
            with cgutils.for_range(builder, nb) as loop:  # (1)
                r = builder.add(b0, loop.index)
                vs = [scores(r, v) for v in range(_BLOCK // 16)]
                mx = vs[0]
                for x in vs[1:]:
                    mx = builder.select(builder.fcmp_ordered(">", x, mx), x, mx)
                for width in (8, 4, 2, 1):
                    hi = _shuffle(builder, mx, mx, list(range(width, 2 * width)) + [0] * (16 - width))
                    mx = builder.select(builder.fcmp_ordered(">", hi, mx), hi, mx)
                bmax = builder.extract_element(mx, ir.Constant(i32, 0))
                mo = _ir_load(builder, ma.data, r, _F32T, 4)
                mn = builder.select(builder.fcmp_ordered(">", bmax, mo), bmax, mo)
                empty = builder.fcmp_ordered("==", bmax, ir.Constant(_F32T, ninf))
                builder.store(builder.fsub(mo, mn), builder.gep(corr, [loop.index]))
                builder.store(builder.select(empty, ir.Constant(_F32T, inf), mn), builder.gep(sub, [loop.index]))
                builder.store(mn, builder.gep(ma.data, [r]))
            v8 = _vec(_F32T, 8)
            with cgutils.for_range_slice(builder, c(0), nb, c(8), inc=True) as (j0, _):  # (2)
                sv = _ir_load(builder, sub, j0, v8, 4)
                cv = builder.select(builder.fcmp_ordered("==", sv, cf(inf, 8)), cf(1.0, 8),
                                    _ir_exp(builder, _ir_load(builder, corr, j0, v8, 4)))
                builder.store(cv, builder.bitcast(builder.gep(corr, [j0]), v8.as_pointer()), align=4)
            with cgutils.for_range(builder, nb) as loop:  # (3)
                r = builder.add(b0, loop.index)
                ms = _ir_splat(builder, builder.load(builder.gep(sub, [loop.index])), 16)
                for v in range(_BLOCK // 16):
                    p = _ir_exp(builder, builder.fsub(scores(r, v), ms))
                    at = builder.add(builder.mul(r, c(_BLOCK)), c(16 * v))
                    builder.store(p, builder.bitcast(builder.gep(sa.data, [at]), _V16.as_pointer()), align=4)
            d16 = builder.mul(builder.udiv(D, c(16)), c(16))
            with cgutils.for_range(builder, nb) as loop:  # (4)
                r = builder.add(b0, loop.index)
                ps = [_ir_load(builder, sa.data, builder.add(builder.mul(r, c(_BLOCK)), c(16 * v)), _V16, 4)
                      for v in range(_BLOCK // 16)]
                total = ps[0]
                for p in ps[1:]:
                    total = builder.fadd(total, p)
                cu = builder.load(builder.gep(corr, [loop.index]))
                lo = _ir_load(builder, la.data, r, _F32T, 4)
                builder.store(builder.fadd(builder.fmul(lo, cu), _ir_hsum(builder, total)), builder.gep(la.data, [r]))
                for lo_d, hi_d, step, ty in ((c(0), d16, 16, _V16), (d16, D, 1, _F32T)):  # acc *= corr
                    k = _ir_splat(builder, cu, 16) if step == 16 else cu
                    with cgutils.for_range_slice(builder, lo_d, hi_d, c(step), inc=True) as (d, _):
                        a = builder.add(builder.mul(r, D), d)
                        x = _ir_load(builder, aa.data, a, ty, 4)
                        builder.store(builder.fmul(x, k), builder.bitcast(builder.gep(aa.data, [a]), ty.as_pointer()),
                                      align=4)
        return context.get_dummy_value()

    return types.none(s, n, m, l, acc), codegen


@njit(fastmath=False, cache=True)
def _rescale(s, n, m, l, acc):
    """One online-softmax step: fold the scores s[:, :, :n] of a block of keys into the running
    max m and sum l (R, G), rescale the running output acc (R, G, D), and turn s (R, G,
    _BLOCK) into the block's weights exp(s - m). A row that sees no key of the block gets
    zero weights. By `_rescale_rows`, in a function of its own without fast-math flags, which
    Numba would otherwise add to the IR's every float operation: nn._exp's results depend on
    its roundings.

    Every row runs over the whole scratch (_BLOCK keys), those past n weighing 0: so a row's
    sums are grouped the same however many keys the block holds, and its results do not
    depend on how many rows share its task (a query alone, or in a prefill block)."""
    _rescale_rows(s, n, m, l, acc)


# ---------------------------------------------------------------------------------------
# A block's scores and weighted values, as LLVM IR where the head size allows (16-lane
# vectors): the scores of several keys at a time (16 with AVX-512, 4 with AVX2) in an
# accumulator each (its lanes partial sums over the head dimension) reduced together by a
# fixed tree of shuffles and adds, where a horizontal sum per key would cost ~9 operations;
# the weighted values in registers across the block's keys (two FMA chains a column, 64 or
# 32 columns at a time), where the loop over four keys at a time loaded and stored the
# output for every four. Both group a sum the same way in every caller.
# ---------------------------------------------------------------------------------------

_V16 = _vec(_F32T, 16)


def _ir_fma16(builder, a, b, c):
    return _ir_call(builder, "llvm.fma.v16f32", _V16, [a, b, c])


def _ir_fold_keys(builder, vs):
    """<n x float> whose lane k is the sum of the lanes of vs[k] (n = 1, 2, 4, 8 or 16 vectors of 16):
    at each level, pairs of vectors whose lanes come in runs of `width` partial sums per key
    are folded into one with runs half as long (two two-source shuffles and an add; 15 adds
    for 16 keys), and the last vector, while its runs are longer than one, on itself. Each
    key's lanes are added in the same pairs (i with i + 8, then i + 4, i + 2, i + 1) whatever
    n, so its sum has the same bits."""
    width = 8
    while len(vs) > 1:
        folded = []
        for a, b in zip(vs[0::2], vs[1::2]):
            lo, hi = [], []
            for src in (0, 16):
                for r in range(0, 16, 2 * width):
                    lo += [src + r + i for i in range(width)]
                    hi += [src + r + width + i for i in range(width)]
            folded.append(builder.fadd(_shuffle(builder, a, b, lo), _shuffle(builder, a, b, hi), flags=_IR_FLAGS))
        vs, width = folded, width // 2
    v, lanes = vs[0], 16
    while width >= 1:
        lo = [r + i for r in range(0, lanes, 2 * width) for i in range(width)]
        v = builder.fadd(_shuffle(builder, v, v, lo), _shuffle(builder, v, v, [i + width for i in lo]), flags=_IR_FLAGS)
        lanes, width = lanes // 2, width // 2
    return v


def _make_score_rows(keys: int):
    """`_score_rows` scoring `keys` (4, 8 or 16) keys a pass: the same sums whatever `keys`."""

    @intrinsic
    def score_rows(typingctx, qv, kb, sv):
        """sv[j] = dot(qv, kb[j]) for every row j of kb (keys, D), keys a multiple of 16 and D
        of 16 (C-contiguous float32): each key's 16 lanes accumulated over D, then folded
        (`_ir_fold_keys`), so that its sum is the same however many keys a pass takes."""
        if not (_is_c_array(qv, types.float32) and _is_c_array(kb, types.float32, 2)
                and _is_c_array(sv, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            qa, ka, sa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
            D = builder.extract_value(qa.shape, 0)
            c = lambda v: ir.Constant(D.type, v)  # noqa: E731
            n_keys = builder.extract_value(ka.shape, 0)
            with cgutils.for_range_slice(builder, c(0), n_keys, c(keys), inc=True) as (j0, _):
                acc = [cgutils.alloca_once_value(builder, ir.Constant(_V16, [0.0] * 16)) for _ in range(keys)]
                with cgutils.for_range(builder, builder.udiv(D, c(16))) as loop:
                    d0 = builder.mul(loop.index, c(16))
                    q = _ir_load(builder, qa.data, d0, _V16, 4)
                    for j in range(keys):
                        k = _ir_load(builder, ka.data, builder.add(builder.mul(builder.add(j0, c(j)), D), d0), _V16, 4)
                        builder.store(_ir_fma16(builder, q, k, builder.load(acc[j])), acc[j])
                out = builder.bitcast(builder.gep(sa.data, [j0]), _vec(_F32T, keys).as_pointer())
                builder.store(_ir_fold_keys(builder, [builder.load(a) for a in acc]), out, align=4)
            return context.get_dummy_value()

        return types.none(qv, kb, sv), codegen

    return score_rows


def _ir_add_rows(builder, rows, vp, D, n_keys, cols):
    """The IR of `_add_rows` for the output rows `rows`, pairs (a, pv) of pointers (each a's D
    floats and pv's n_keys weights), sharing each load of the value rows vp (n_keys, D):
    per row and column, even and odd keys in two chains (the first from a, the second from
    0) added at the end, whatever the number of rows."""
    nv = cols // 16
    c = lambda v: ir.Constant(D.type, v)  # noqa: E731
    with cgutils.for_range_slice(builder, c(0), D, c(cols), inc=True) as (d0, _):
        acc = [[cgutils.alloca_once_value(builder, _ir_load(builder, a, builder.add(d0, c(16 * k)), _V16, 4)
                                          if e == 0 else ir.Constant(_V16, [0.0] * 16))
                for e in range(2) for k in range(nv)] for a, _ in rows]
        with cgutils.for_range_slice(builder, c(0), n_keys, c(2), inc=True) as (j0, _):
            for e in range(2):
                j = builder.add(j0, c(e))
                at = builder.add(builder.mul(j, D), d0)
                vs = [_ir_load(builder, vp, builder.add(at, c(16 * k)), _V16, 4) for k in range(nv)]
                for (_, pv), ra in zip(rows, acc):
                    p = _ir_splat(builder, _ir_load(builder, pv, j, _F32T, 4), 16)
                    for k in range(nv):
                        builder.store(_ir_fma16(builder, p, vs[k], builder.load(ra[nv * e + k])), ra[nv * e + k])
        for (a, _), ra in zip(rows, acc):
            for k in range(nv):
                out = builder.bitcast(builder.gep(a, [builder.add(d0, c(16 * k))]), _V16.as_pointer())
                builder.store(builder.fadd(builder.load(ra[k]), builder.load(ra[nv + k]), flags=_IR_FLAGS),
                              out, align=4)


def _make_add_rows(cols: int):
    """`_add_rows` adding `cols` (a multiple of 16 dividing 64) columns a pass: the same sums
    whatever `cols`."""

    @intrinsic
    def add_rows(typingctx, a, pv, vb):
        """a += sum_j pv[j] vb[j] over the rows of vb (keys, D), keys even and D a multiple of
        64 (C-contiguous float32): per column, even and odd keys in two chains (the first from
        a, the second from 0) added at the end."""
        if not (_is_c_array(a, types.float32) and _is_c_array(pv, types.float32)
                and _is_c_array(vb, types.float32, 2)):
            return None

        def codegen(context, builder, sig, args):
            aa, pa, va = (context.make_array(t)(context, builder, x) for t, x in zip(sig.args, args))
            D = builder.extract_value(aa.shape, 0)
            _ir_add_rows(builder, [(aa.data, pa.data)], va.data, D, builder.extract_value(pa.shape, 0), cols)
            return context.get_dummy_value()

        return types.none(a, pv, vb), codegen

    return add_rows


def _make_add_rows_many(cols: int, group: int):
    """`_add_rows_many` adding `cols` columns a pass for `group` output rows at a time."""

    @intrinsic
    def add_rows_many(typingctx, a, pv, vb):
        """a[i] += sum_j pv[i, j] vb[j] for every row i of a (N, D) and pv (N, keys), keys even
        and D a multiple of 64 (C-contiguous float32): `_add_rows` for each row, `group` rows
        sharing each load of a value row (a row's sums are `_add_rows`', so the same bits)."""
        if not (_is_c_array(a, types.float32, 2) and _is_c_array(pv, types.float32, 2)
                and _is_c_array(vb, types.float32, 2)):
            return None

        def codegen(context, builder, sig, args):
            aa, pa, va = (context.make_array(t)(context, builder, x) for t, x in zip(sig.args, args))
            N, D = (builder.extract_value(aa.shape, i) for i in range(2))
            n_keys = builder.extract_value(pa.shape, 1)
            c = lambda v: ir.Constant(D.type, v)  # noqa: E731

            def rows_from(i0, k):
                return [(builder.gep(aa.data, [builder.mul(builder.add(i0, c(r)), D)]),
                         builder.gep(pa.data, [builder.mul(builder.add(i0, c(r)), n_keys)])) for r in range(k)]

            whole = builder.mul(builder.sdiv(N, c(group)), c(group))
            with cgutils.for_range_slice(builder, c(0), whole, c(group), inc=True) as (i0, _):
                _ir_add_rows(builder, rows_from(i0, group), va.data, D, n_keys, cols)
            with cgutils.for_range_slice(builder, whole, N, c(1), inc=True) as (i0, _):
                _ir_add_rows(builder, rows_from(i0, 1), va.data, D, n_keys, cols)
            return context.get_dummy_value()

        return types.none(a, pv, vb), codegen

    return add_rows_many


# Keys a pass of `_score_rows` scores and columns a pass of `_add_rows` adds: their
# accumulators (16 lanes each) fit AVX-512's 32 vector registers at 16 keys and 64 columns;
# with AVX2's 16 registers of half the width LLVM spilled those, and 4 keys and 32 columns
# ran a 4,000-token prompt's attention in 0.72-0.76x the time (bench/RESULTS.md)
#
# `_add_rows_many` takes three rows at a time with AVX-512 (their 24 accumulators, the value
# row's four vectors and the three weights: 31 of the 32 registers), two with AVX2. On an Intel
# Xeon (one thread, a prefill block's 48 rows and heads, scratch on cache lines) the values
# took 0.83x the time of a row at a time with three, 0.89x with two and 1.07x with four.
_WIDE = "avx512f" in FEATURES
_score_rows = _make_score_rows(16 if _WIDE else 4)
_add_rows = _make_add_rows(64 if _WIDE else 32)
_add_rows_many = _make_add_rows_many(64, 3) if _WIDE else _make_add_rows_many(32, 2)


# ---------------------------------------------------------------------------------------
# A block's scores and weighted values read straight from the records of a KV buffer, for
# a query row's G heads at once (a decoding query: nothing to share a converted block with).
# Each key or value row is loaded and converted once for a group of up to four heads (two
# for the values with AVX2), where the routines above read a block converted into float32
# scratch once per head; the sums are theirs, grouped the same, so either path gives the
# same bits.
# ---------------------------------------------------------------------------------------

def _records_fit(kv):
    """Whether `_score_records` and `_add_records` read the records of ``kv`` (float32, or
    float16 bits where the hardware converts halves)."""
    return kv.dtype == types.float32 or (kv.dtype == types.uint16 and _HW_F16)


def _ir_record_row(builder, kv, kv_ty, off, c):
    """Columns 16c .. 16c + 15 of the row at element ``off`` of the buffer ``kv`` as <16 x
    float> (float16 bits converted by the hardware)."""
    at = builder.add(off, builder.mul(c, ir.Constant(c.type, 16)))
    if kv_ty.dtype == types.float32:
        return _ir_load(builder, kv.data, at, _V16, 4)
    ptr = builder.bitcast(builder.gep(kv.data, [at]), _vec(ir.HalfType(), 16).as_pointer())
    return builder.fpext(builder.load(ptr, align=2), _V16)


def _ir_head_groups(builder, G, emit, most=4):
    """emit(h0, n) for the query heads in groups of `most` from h0 = 0, then the rest (1 to
    most - 1)."""
    c = lambda v: ir.Constant(G.type, v)  # noqa: E731
    full = builder.mul(builder.udiv(G, c(most)), c(most))
    with cgutils.for_range_slice(builder, c(0), full, c(most), inc=True) as (h0, _):
        emit(h0, most)
    rest = builder.sub(G, full)
    for n in range(1, most):
        with builder.if_then(builder.icmp_unsigned("==", rest, c(n))):
            emit(full, n)


def _make_score_records(keys_for: tuple):
    """`_score_records` scoring keys_for[n - 1] keys a pass for a group of n heads (n = 1..4:
    n times as many accumulators): the same sums whatever the keys a pass."""

    @intrinsic
    def score_records(typingctx, q, kv, offs, s):
        """s[h, j] = dot(q[h], kv's row at element offs[j]) for the G query heads q (G, D), D a
        multiple of 16, and the keys j < _BLOCK (every offs[j] a row of D elements of kv, a
        C-contiguous float32 buffer or float16 bits): `_score_rows`' sums, a pass of keys
        (keys_for) at a time for a group of up to four heads."""
        if not (_is_c_array(q, types.float32, 2) and isinstance(kv, types.Array) and kv.layout == "C"
                and _records_fit(kv) and _is_c_array(offs, types.int64) and _is_c_array(s, types.float32, 2)):
            return None

        def codegen(context, builder, sig, args):
            qa, ka, oa, sa = (context.make_array(t)(context, builder, a) for t, a in zip(sig.args, args))
            G, D = (builder.extract_value(qa.shape, i) for i in range(2))
            nb = builder.extract_value(sa.shape, 1)
            c = lambda v: ir.Constant(D.type, v)  # noqa: E731

            def group(h0, n):
                keys = keys_for[n - 1]
                with cgutils.for_range_slice(builder, c(0), nb, c(keys), inc=True) as (j0, _):
                    offs_j = [_ir_load(builder, oa.data, builder.add(j0, c(j)), ir.IntType(64), 8) for j in range(keys)]
                    acc = [[cgutils.alloca_once_value(builder, ir.Constant(_V16, [0.0] * 16)) for _ in range(keys)]
                           for _ in range(n)]
                    with cgutils.for_range(builder, builder.udiv(D, c(16))) as loop:
                        qs = [_ir_load(builder, qa.data, builder.add(builder.mul(builder.add(h0, c(h)), D),
                                                                     builder.mul(loop.index, c(16))), _V16, 4)
                              for h in range(n)]
                        for j in range(keys):
                            k = _ir_record_row(builder, ka, sig.args[1], offs_j[j], loop.index)
                            for h in range(n):
                                builder.store(_ir_fma16(builder, qs[h], k, builder.load(acc[h][j])), acc[h][j])
                    for h in range(n):
                        at = builder.add(builder.mul(builder.add(h0, c(h)), nb), j0)
                        out = builder.bitcast(builder.gep(sa.data, [at]), _vec(_F32T, keys).as_pointer())
                        builder.store(_ir_fold_keys(builder, [builder.load(a) for a in acc[h]]), out, align=4)

            _ir_head_groups(builder, G, group)
            return context.get_dummy_value()

        return types.none(q, kv, offs, s), codegen

    return score_records


# keys a pass for 1, 2, 3 or 4 heads: 8 of them (4 for four heads) fit AVX-512's registers;
# with AVX2's, as `_score_rows`, fewer (bench/RESULTS.md)
_score_records = _make_score_records((8, 8, 8, 4) if _WIDE else (4, 4, 2, 2))


def _make_add_records(cols: int, most: int):
    """`_add_records` adding `cols` (16 or 32) columns a pass for groups of up to `most` (4, 2
    or 1) heads: the same sums whatever the pass."""
    nv = cols // 16

    @intrinsic
    def add_records(typingctx, a, pv, kv, offs, n):
        """a[h] += sum_j pv[h, j] row_j for the G heads' running outputs a (G, D), D a multiple
        of 64, and their weights pv (G, keys), keys even, over the value rows at elements
        offs[j] of kv (as `_score_records`); rows j >= n read as zeros (their weights are 0).
        `_add_rows`' sums: per column, even and odd keys in two chains (the first from a, the
        second from 0) added at the end."""
        if not (_is_c_array(a, types.float32, 2) and _is_c_array(pv, types.float32, 2)
                and isinstance(kv, types.Array) and kv.layout == "C" and _records_fit(kv)
                and _is_c_array(offs, types.int64) and isinstance(n, types.Integer)):
            return None

        def codegen(context, builder, sig, args):
            aa, pa, ka, oa = (context.make_array(t)(context, builder, x) for t, x in zip(sig.args[:4], args[:4]))
            G, D = (builder.extract_value(aa.shape, i) for i in range(2))
            nb = builder.extract_value(pa.shape, 1)
            c = lambda v: ir.Constant(D.type, v)  # noqa: E731
            n_keys = context.cast(builder, args[4], sig.args[4], types.intp)
            zero = ir.Constant(_V16, [0.0] * 16)

            def group(h0, nh):
                rows = [builder.mul(builder.add(h0, c(h)), D) for h in range(nh)]
                with cgutils.for_range(builder, builder.udiv(D, c(cols))) as col:
                    d0 = builder.mul(col.index, c(cols))
                    acc = [[[cgutils.alloca_once_value(
                        builder, _ir_load(builder, aa.data, builder.add(rows[h], builder.add(d0, c(16 * k))), _V16, 4)
                        if e == 0 else zero) for k in range(nv)] for e in range(2)] for h in range(nh)]
                    with cgutils.for_range_slice(builder, c(0), nb, c(2), inc=True) as (j0, _):
                        for e in range(2):
                            j = builder.add(j0, c(e))
                            off = _ir_load(builder, oa.data, j, ir.IntType(64), 8)
                            vs = [builder.select(builder.icmp_signed("<", j, n_keys), _ir_record_row(
                                builder, ka, sig.args[2], off, builder.add(builder.mul(col.index, c(nv)), c(k))), zero)
                                for k in range(nv)]
                            for h in range(nh):
                                p = _ir_splat(builder, _ir_load(builder, pa.data, builder.add(builder.mul(builder.add(
                                    h0, c(h)), nb), j), _F32T, 4), 16)
                                for k in range(nv):
                                    builder.store(_ir_fma16(builder, p, vs[k], builder.load(acc[h][e][k])),
                                                  acc[h][e][k])
                    for h in range(nh):
                        for k in range(nv):
                            at = builder.add(rows[h], builder.add(d0, c(16 * k)))
                            out = builder.bitcast(builder.gep(aa.data, [at]), _V16.as_pointer())
                            builder.store(builder.fadd(builder.load(acc[h][0][k]), builder.load(acc[h][1][k]),
                                                       flags=_IR_FLAGS), out, align=4)

            _ir_head_groups(builder, G, group, most)
            return context.get_dummy_value()

        return types.none(a, pv, kv, offs, n), codegen

    return add_records


# AVX2: heads in pairs, which measured faster than fours (whose 8 accumulators spilled) or
# ones (each value row read once per head)
_add_records = _make_add_records(16, 4 if _WIDE else 2)


@njit(fastmath=_FASTMATH, cache=True, inline="always")
def _score_block(qv, kb, sv):
    """sv[j] = dot(qv, kb[j]) for the _BLOCK keys of kb (_BLOCK, D): `_score_rows` where D
    (and _BLOCK) is a multiple of 16, else four keys per pass over qv (one load of the query for
    four dots). A key's sum is grouped the same in any caller."""
    if qv.shape[0] % 16 == 0 and kb.shape[0] % 16 == 0:
        _score_rows(qv, kb, sv)
        return
    for j in range(0, _BLOCK, 4):
        d0 = d1 = d2 = d3 = np.float32(0.0)
        for d in range(qv.shape[0]):
            x = qv[d]
            d0 += x * kb[j, d]
            d1 += x * kb[j + 1, d]
            d2 += x * kb[j + 2, d]
            d3 += x * kb[j + 3, d]
        sv[j] = d0
        sv[j + 1] = d1
        sv[j + 2] = d2
        sv[j + 3] = d3


@njit(fastmath=_FASTMATH, cache=True, inline="always")
def _add_values(a, pv, vb):
    """a += sum_j pv[j] vb[j] over the _BLOCK values of vb (_BLOCK, D): `_add_rows` where D
    is a multiple of 64 (and _BLOCK even), else four values per pass over a (one load and store
    of the output for four rows), quads of zero weights skipped."""
    if a.shape[0] % 64 == 0 and pv.shape[0] % 2 == 0:
        _add_rows(a, pv, vb)
        return
    for j in range(0, _BLOCK, 4):
        p0, p1, p2, p3 = pv[j], pv[j + 1], pv[j + 2], pv[j + 3]
        if p0 == 0 and p1 == 0 and p2 == 0 and p3 == 0:
            continue
        for d in range(a.shape[0]):
            a[d] += p0 * vb[j, d] + p1 * vb[j + 1, d] + p2 * vb[j + 2, d] + p3 * vb[j + 3, d]


@njit(fastmath=_FASTMATH, cache=True, inline="always")
def _add_values_many(a, pv, vb):
    """a[r, g] += sum_j pv[r, g, j] vb[j] for every row r and head g of a (R, G, D) and pv (R, G,
    _BLOCK): `_add_rows_many` where D is a multiple of 64 (sharing each value row's loads among
    rows), else `_add_values` for each: the same bits either way."""
    if a.shape[2] % 64 == 0 and pv.shape[2] % 2 == 0:
        R, G, D = a.shape
        _add_rows_many(a.reshape(R * G, D), pv.reshape(R * G, pv.shape[2]), vb)
        return
    for r in range(a.shape[0]):
        for g in range(a.shape[1]):
            _add_values(a[r, g], pv[r, g], vb)


@njit(fastmath=_FASTMATH, cache=True)
def _accumulate(q, kv, i0, pos0, g, t0, t1, window, scale, softcap, mask, use_mask, alibi, use_alibi,
                m, l, acc, s, kb, vb):
    """Fold keys t0..t1-1 of KV head g into the running state of query rows i0..i0+R-1.

    q: (S, H, D); kv: (cap, KVH, 2, D) float32, or uint16 (float16 bits: npllama.f16); row
    i0 + r sits at position pos0 + r and handles query heads g*G .. g*G+G-1. m, l: (R, G)
    running max / sum; acc: (R, G, D) running unnormalised output; s: (R, G, _BLOCK)
    scratch; kb, vb (_BLOCK, D): float32 scratch for a block's keys and values. Keys a row
    may not see are skipped, so t0..t1 may span the union of the rows' ranges.

    Each block of keys and values is converted once into kb and vb; every query vector then
    scores four keys at a time (one load of q for four dots) and adds the weighted values
    four keys at a time (one load and store of its output for four rows).
    """
    R, G = m.shape
    D = q.shape[2]
    h0 = g * G
    neg_inf = np.float32(-np.inf)
    plain = window <= 0 and softcap <= 0 and not use_alibi and not use_mask
    for b0 in range(t0, t1, _BLOCK):
        n = min(_BLOCK, t1 - b0)
        for j in range(n):
            _ld_row(kv[b0 + j, g, 0], kb[j])
            _ld_row(kv[b0 + j, g, 1], vb[j])
        for j in range(n, _BLOCK):  # past the block's end: finite, and weighted 0 by _rescale
            for d in range(D):
                kb[j, d] = 0.0
                vb[j, d] = 0.0
        for r in range(R):
            i = i0 + r
            qpos = pos0 + r
            for gh in range(G):
                h = h0 + gh
                _score_block(q[i, h], kb, s[r, gh])
                if plain:  # causal only: scaled, and the keys past the row's position removed
                    seen = max(0, min(n, qpos - b0 + 1))
                    for j in range(_BLOCK):
                        s[r, gh, j] = s[r, gh, j] * scale if j < seen else neg_inf
                    continue
                for j in range(n):
                    t = b0 + j
                    if t > qpos or (window > 0 and t <= qpos - window) or (use_mask and mask[i, t] <= MASKED):
                        s[r, gh, j] = neg_inf
                        continue
                    x = s[r, gh, j] * scale
                    if softcap > 0:
                        x = softcap * np.tanh(x / softcap)
                    if use_alibi:
                        x += alibi[h] * np.float32(t - qpos)
                    if use_mask:
                        x += mask[i, t]
                    s[r, gh, j] = x
        _rescale(s, n, m, l, acc)  # running state rescaled, scores turned into weights
        _add_values_many(acc, s, vb)


@njit(cache=True)
def _chunk_span(t0, t1):
    """(c0, n): the keys t0..t1-1 lie in the n chunks c0..c0+n-1 at multiples of _CHUNK (at
    least one chunk, for an empty span)."""
    c0 = t0 // _CHUNK
    return c0, max(1, (t1 - 1) // _CHUNK + 1 - c0)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _decode_kernel(q, kv, t0, t1, qpos, window, scale, softcap, mask, use_mask, alibi, use_alibi, out):
    """One query (S == 1) over keys t0..t1-1 (t0 a multiple of _BLOCK), in chunks at multiples
    of _CHUNK.

    q, out: (1, H, D); kv: (cap, KVH, 2, D); mask: (1, kv_len) or (0, 0); alibi: (H,) or (0,).
    """
    H = q.shape[1]
    D = q.shape[2]
    KVH = kv.shape[1]
    G = H // KVH
    c0, n_chunks = _chunk_span(t0, t1)
    # running state per (chunk, KV head), with the single query row as axis 2
    part_m = np.full((n_chunks, KVH, 1, G), -np.inf, dtype=np.float32)
    part_l = np.zeros((n_chunks, KVH, 1, G), dtype=np.float32)
    part_acc = _empty((n_chunks, KVH, 1, G, D), np.float32)
    part_acc[:] = 0.0
    for task in prange(KVH * n_chunks):
        g = task // n_chunks
        c = task % n_chunks
        # the scratch on cache lines (npllama.aligned): the blocks are read a vector at a time
        s = _empty((1, G, _BLOCK), np.float32)
        kb = _empty((_BLOCK, D), np.float32)
        vb = _empty((_BLOCK, D), np.float32)
        lo = max(t0, (c0 + c) * _CHUNK)
        hi = min(t1, (c0 + c + 1) * _CHUNK)
        _accumulate(q, kv, 0, qpos, g, lo, hi, window, scale, softcap, mask, use_mask, alibi, use_alibi,
                    part_m[c, g], part_l[c, g], part_acc[c, g], s, kb, vb)
    _merge_chunks(part_m.reshape(n_chunks, KVH, G), part_l.reshape(n_chunks, KVH, G),
                  part_acc.reshape(n_chunks, KVH, G, D), out.reshape(KVH, G, D))


@njit(cache=True)
def _merge_chunks(m, l, acc, out):
    """out (KVH, G, D) = every query head's attention output, merged from the running states
    of the chunks of keys: maxima m, sums l (n_chunks, KVH, G) and outputs acc
    (n_chunks, KVH, G, D) (`_merge_head`, per KV head)."""
    for g in range(m.shape[1]):
        _merge_head(m[:, g], l[:, g], acc[:, g], out[g])


@njit(fastmath=False, cache=True, error_model="numpy")
def _merge_head(m, l, acc, out):
    """out (G, D) = the attention output of G query heads from the running states of chunks
    of keys, merged in chunk order: maxima m, sums l (n_chunks, G), unnormalised outputs acc
    (n_chunks, G, D), any layout. Strict IEEE arithmetic (no fast-math flags, so no caller
    contracts it its own way): every path that merges the same states gets the same bits,
    and one chunk gives acc * (1 / l) exactly. Chunks that saw no key are skipped; a head
    that saw none gets zeros."""
    n_chunks, G = m.shape
    D = acc.shape[2]
    for gh in range(G):
        top = np.float32(-np.inf)
        for c in range(n_chunks):
            top = max(top, m[c, gh])
        for d in range(D):
            out[gh, d] = 0.0
        if top == -np.inf:
            continue
        total = np.float32(0.0)
        for c in range(n_chunks):
            if m[c, gh] == -np.inf:
                continue
            w = _exp(m[c, gh] - top)
            total += w * l[c, gh]
            for d in range(D):
                out[gh, d] += w * acc[c, gh, d]
        inv = np.float32(1.0) / total
        for d in range(D):
            out[gh, d] *= inv


@njit(fastmath=_FASTMATH, cache=True)
def _decode_chunk(qs, kv, t0, t1, m, l, acc, s):
    """Fold keys t0..t1-1 of every KV head into the running state of one query, in the plain
    causal case (all of them visible; no mask, window, softcap or ALiBi): the fused decode
    step's attention. Each (position, KV head) record of the cache is read once, in order.

    qs: (KVH, G, D) the query heads grouped by KV head, already multiplied by the scale;
    kv: (cap, KVH, 2, D) float32 or uint16 (float16 bits); m, l: (KVH, G) running max / sum;
    acc: (KVH, G, D) running output; s: (KVH, G, _BLOCK) scratch.
    """
    KVH, G, D = qs.shape
    for b0 in range(t0, t1, _BLOCK):
        n = min(_BLOCK, t1 - b0)
        for j in range(n):
            for g in range(KVH):
                krow = kv[b0 + j, g, 0]
                for gh in range(G):
                    dot = np.float32(0.0)
                    for d in range(D):
                        dot += qs[g, gh, d] * _ld(krow, d)
                    s[g, gh, j] = dot
        _rescale(s, n, m, l, acc)
        # weighted values four keys at a time: a quarter of the loads and stores of acc
        n4 = n - n % 4
        for j in range(0, n4, 4):
            t = b0 + j
            for g in range(KVH):
                v0, v1, v2, v3 = kv[t, g, 1], kv[t + 1, g, 1], kv[t + 2, g, 1], kv[t + 3, g, 1]
                for gh in range(G):
                    p0, p1, p2, p3 = s[g, gh, j], s[g, gh, j + 1], s[g, gh, j + 2], s[g, gh, j + 3]
                    for d in range(D):
                        acc[g, gh, d] += (p0 * _ld(v0, d) + p1 * _ld(v1, d) + p2 * _ld(v2, d) + p3 * _ld(v3, d))
        for j in range(n4, n):
            for g in range(KVH):
                vrow = kv[b0 + j, g, 1]
                for gh in range(G):
                    p = s[g, gh, j]
                    for d in range(D):
                        acc[g, gh, d] += p * _ld(vrow, d)


@njit(parallel=True, fastmath=_FASTMATH, cache=True)
def _prefill_kernel(q, kv, kv_len, offset, window, scale, softcap, mask, use_mask, alibi, use_alibi, out):
    """S queries at positions offset..offset+S-1; one task per (block of _ROWS queries, KV head).

    q, out: (S, H, D); kv: (cap, KVH, 2, D); mask: (S, kv_len) or (0, 0); alibi: (H,) or (0,).
    """
    S = q.shape[0]
    H = q.shape[1]
    D = q.shape[2]
    KVH = kv.shape[1]
    G = H // KVH
    n_blocks = (S + _ROWS - 1) // _ROWS
    for task in prange(n_blocks * KVH):
        g = task // n_blocks
        k = task % n_blocks
        # fold the block order (0, last, 1, last-1, ...) so that the contiguous task ranges
        # of the static schedule mix short and long causal rows
        blk = k >> 1 if k & 1 == 0 else n_blocks - 1 - (k >> 1)
        i0 = blk * _ROWS
        R = min(_ROWS, S - i0)
        pos0 = offset + i0
        t0 = max(0, pos0 - window + 1) // _BLOCK * _BLOCK if window > 0 else 0
        t1 = min(pos0 + R, kv_len)
        c0, n_chunks = _chunk_span(t0, t1)
        m = np.full((n_chunks, R, G), -np.inf, dtype=np.float32)
        l = np.zeros((n_chunks, R, G), dtype=np.float32)
        # the scratch on cache lines (npllama.aligned): the blocks are read a vector at a time
        acc = _empty((n_chunks, R, G, D), np.float32)
        acc[:] = 0.0
        s = _empty((R, G, _BLOCK), np.float32)
        kb = _empty((_BLOCK, D), np.float32)
        vb = _empty((_BLOCK, D), np.float32)
        for c in range(n_chunks):
            lo = max(t0, (c0 + c) * _CHUNK)
            hi = min(t1, (c0 + c + 1) * _CHUNK)
            _accumulate(q, kv, i0, pos0, g, lo, hi, window, scale, softcap, mask, use_mask, alibi, use_alibi,
                        m[c], l[c], acc[c], s, kb, vb)
        for r in range(R):
            _merge_head(m[:, r], l[:, r], acc[:, r], out[i0 + r, g * G:(g + 1) * G])


def _float_array(name: str, a, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != ndim:
        raise ValueError(f"attend: {name} must be {ndim}-D, got shape {a.shape}")
    if not np.issubdtype(a.dtype, np.floating):
        raise ValueError(f"attend: {name} must be a float array, got dtype {a.dtype}")
    return np.ascontiguousarray(a, dtype=np.float32)


def attend(q: np.ndarray, kv: np.ndarray, kv_len: int, *, offset: int | None = None,
           mask: np.ndarray | None = None, softcap: float = 0.0, alibi: np.ndarray | None = None,
           window: int = 0, scale: float | None = None, out: np.ndarray | None = None,
           causal: bool = True) -> np.ndarray:
    """Causal attention of S queries over the first kv_len positions of an interleaved KV buffer
    (with `causal=False`, bidirectional: every query sees every key).

    Args:
        q: (S, H, D) queries, any float dtype and strides (copied to contiguous float32).
        kv: (capacity, KVH, 2, D) C-contiguous float32 or float16 layer buffer, K at [:, :, 0],
            V at [:, :, 1] (e.g. `KVCache.buffer(layer)`); read in place, never copied.
        kv_len: number of valid positions in kv, 0 <= kv_len <= capacity.
        offset: absolute position of the first query; defaults to kv_len - S (the queries are
            the last S cached positions). Query i sees keys t <= offset + i, t < kv_len.
        mask: optional (S, kv_len) additive float mask; entries <= -1e30 (or -inf) remove keys.
        softcap: when > 0, scores become softcap * tanh(score / softcap) (before ALiBi and mask).
        alibi: optional (H,) slopes; head h adds slope[h] * (key_pos - query_pos).
        window: when > 0, query at position p sees only keys in (p - window, p].
        scale: score scale, default 1 / sqrt(D).
        out: optional C-contiguous float32 (S, H, D) array to write into.
        causal: False: no causal mask, each query sees keys 0..kv_len-1 (an encoder's attention;
            offset, window and alibi, which need the queries' positions, must be left out).

    Returns:
        (S, H, D) float32 output (`out` when given). Rows that see no key are zero.
    """
    q = _float_array("q", q, 3)
    S, H, D = q.shape
    if not isinstance(kv, np.ndarray) or kv.ndim != 4 or kv.shape[2] != 2:
        raise ValueError(f"attend: kv must be a (capacity, KVH, 2, D) array, got "
                         f"{getattr(kv, 'shape', type(kv).__name__)}")
    if kv.dtype not in (np.float32, np.float16) or not kv.flags.c_contiguous:
        raise ValueError(f"attend: kv must be C-contiguous float32 or float16, got dtype {kv.dtype}, "
                         f"contiguous={kv.flags.c_contiguous}")
    cap, KVH, _, kv_d = kv.shape
    if kv_d != D:
        raise ValueError(f"attend: head_dim differs: q has D={D}, kv has D={kv_d}")
    if KVH == 0 or H % KVH:
        raise ValueError(f"attend: the number of query heads H={H} must be a multiple of the "
                         f"number of KV heads KVH={KVH}")
    kv_len = int(kv_len)
    if not 0 <= kv_len <= cap:
        raise ValueError(f"attend: kv_len must be in [0, capacity={cap}], got {kv_len}")
    if not causal:
        if offset is not None or window or alibi is not None:
            raise ValueError("attend: causal=False (every query sees every key) takes no offset, window or "
                             "alibi, which place the queries; leave them out")
        offset = max(kv_len - 1, 0)  # every query at or past the last key: it sees them all
    offset = kv_len - S if offset is None else int(offset)
    if offset < 0:
        raise ValueError(f"attend: offset must be >= 0, got {offset} (S={S}, kv_len={kv_len}; "
                         f"by default offset = kv_len - S)")
    if isinstance(window, (bool, np.bool_)) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"attend: window must be an integer >= 0, got {window!r}")
    window = int(window)
    if mask is None:
        mask_arr = _NO_MASK
    else:
        mask_arr = _float_array("mask", mask, 2)
        if mask_arr.shape != (S, kv_len):
            raise ValueError(f"attend: mask must have shape (S, kv_len)=({S}, {kv_len}), got {mask_arr.shape}")
    if alibi is None:
        alibi_arr = _NO_ALIBI
    else:
        alibi_arr = _float_array("alibi", alibi, 1)
        if alibi_arr.shape != (H,):
            raise ValueError(f"attend: alibi must have shape (H,)=({H},), got {alibi_arr.shape}")
    if out is None:
        out = np.empty((S, H, D), dtype=np.float32)
    elif (not isinstance(out, np.ndarray) or out.shape != (S, H, D) or out.dtype != np.float32
          or not out.flags.c_contiguous):
        raise ValueError(f"attend: out must be a C-contiguous float32 ({S}, {H}, {D}) array, got "
                         f"{getattr(out, 'shape', None)} {getattr(out, 'dtype', type(out).__name__)}")
    scale = np.float32(1.0 / math.sqrt(D) if scale is None else scale)
    softcap = np.float32(softcap)
    args = (scale, softcap, mask_arr, mask is not None, alibi_arr, alibi is not None, out)
    if S == 1:
        t1 = min(offset + 1, kv_len)
        t0 = max(0, offset - window + 1) // _BLOCK * _BLOCK if window > 0 else 0
        _decode_kernel(q, bits(kv), t0, t1, offset, window, *args)
    elif S > 0:
        _prefill_kernel(q, bits(kv), kv_len, offset, window, *args)
    return out


def attend_kv(q: np.ndarray, k: np.ndarray, v: np.ndarray, **options) -> np.ndarray:
    """`attend` over separate keys and values, each (KV, KVH, D); builds an interleaved copy.

    Convenient for tests and one-off calls; the inference path should pass the cache buffer
    to `attend` directly. `options` are those of `attend`; kv_len is KV.
    """
    k = _float_array("k", k, 3)
    v = _float_array("v", v, 3)
    if k.shape != v.shape:
        raise ValueError(f"attend_kv: k and v shapes differ: k {k.shape}, v {v.shape}")
    kv = np.stack((k, v), axis=2)  # (KV, KVH, 2, D)
    return attend(q, kv, k.shape[0], **options)
