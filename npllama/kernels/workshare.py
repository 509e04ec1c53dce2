"""Work sharing inside one parallel region: atomic counters that hand out work items.

A fused decode step runs its whole token inside a single ``prange`` over the threads
(one fork/join per token instead of one per product). Each phase of the step (a product,
attention) is a list of items, split into one contiguous range per thread ("home"). A
thread takes items from its home range's counter, then steals from the other ranges; it
adds how many it finished to the phase's done counter, and waits for the done counter to
reach the number of items before reading the phase's results. Each range's counter sits on
its own cache line, so taking from the home range is an uncontended atomic add; the
ranges' counters only become shared at the end of a phase, when threads steal.

This needs no barrier and no thread ids: a thread only waits for items other threads have
already taken and are working on, so a region that runs with fewer threads than asked (or
runs its iterations one after another) still finishes, with the same results.

Njit level. A phase uses ``phase_size(n_ranges)`` int64 slots of a zeroed C-contiguous
``ctr`` array from ``base`` on (one counter per range, then the done counter, each on its
own cache line):

* ``_take(ctr, base, home, n_ranges, n_items)``: the next item (0 .. n_items-1) for the
  thread whose home range is ``home``, or -1 when every item is taken.
* ``_finish(ctr, base, n_ranges, n)``: publish ``n`` finished items.
* ``_wait(ctr, base, n_ranges, total)``: spin until ``total`` items are finished (all their
  writes are then visible).
* ``_fetch_add(ctr, i, v)`` / ``_load_acquire(ctr, i)``: the atomic operations beneath.
"""
from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

STRIDE = 8  # int64 slots between two counters: one 64-byte cache line each

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _slot_pointer(context, builder, sig, args):
    ary = context.make_array(sig.args[0])(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, sig.args[0], ary, [args[1]])


def _is_counter_array(ctr):
    return isinstance(ctr, types.Array) and ctr.ndim == 1 and ctr.dtype == types.int64 and ctr.layout == "C"


@intrinsic
def _fetch_add(typingctx, ctr, i, v):
    if not (_is_counter_array(ctr) and isinstance(i, types.Integer) and isinstance(v, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        ptr = _slot_pointer(context, builder, sig, args)
        val = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, val, "seq_cst")

    return types.int64(ctr, i, v), codegen


@intrinsic
def _load_acquire(typingctx, ctr, i):
    if not (_is_counter_array(ctr) and isinstance(i, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_slot_pointer(context, builder, sig, args), "acquire", 8)

    return types.int64(ctr, i), codegen


@intrinsic
def _pause(typingctx):
    """A spin-wait hint to the CPU (x86 ``pause``; nothing elsewhere)."""

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@njit(cache=True)
def phase_size(n_ranges):
    """int64 slots of ``ctr`` that one phase of ``n_ranges`` ranges uses."""
    return (n_ranges + 1) * STRIDE


@njit(cache=True)
def _take(ctr, base, home, n_ranges, n_items):
    for j in range(n_ranges):
        r = (home + j) % n_ranges
        lo = r * n_items // n_ranges
        i = lo + _fetch_add(ctr, base + r * STRIDE, 1)
        if i < (r + 1) * n_items // n_ranges:
            return i
    return -1


@njit(cache=True)
def _finish(ctr, base, n_ranges, n):
    if n:
        _fetch_add(ctr, base + n_ranges * STRIDE, n)


@njit(cache=True)
def _wait(ctr, base, n_ranges, total):
    while _load_acquire(ctr, base + n_ranges * STRIDE) < total:
        _pause()
