"""The GGML tensor types that npllama reads: their ids in a GGUF file and their blocks.

The same numbers as gguf-py's `GGMLQuantizationType` and `GGML_QUANT_SIZES` (tests compare
them), written out here so that a process reading a model does not import gguf: its package
builds the enums of every architecture and tensor name that llama.cpp knows, ~0.02 s of a
short `npllama run`. `QT` is an IntEnum, as gguf's is, so gguf's members, these and plain
ints are the same keys of a table. `type_name` names any other id, by gguf's table.

Type masks
----------
A compiled kernel that branches on a weight's type holds code only for the types of its type
mask, a `TypeMask`: an int whose bit 1 << id stands for type id. Numba types a TypeMask as
its literal value (kernels/quants.py registers that), so each mask compiles (and caches) a
version of its own. `type_mask` makes the one mask of a set of types, by whole groups
(`GROUPS`: the float types, the 32-element legacy blocks, the K-quants' super-blocks). A model
of one quantization has the types of one or two groups, so its process compiles one version
of each fused kernel. Where many models meet (a server of several, the test suite's tiny
models of every type), `kernel_types` compiles every type's code once instead, as
$NPLLAMA_KERNEL_TYPES=all says. Finer masks would save little more: SmolLM2 Q4_1's decode
step was 1.45 MB of machine code with the legacy group, 1.37 MB with Q4_1 and Q8_0 alone and
no row products, 1.59 MB with every type; its code is mostly attention's and the workers'.
"""
from __future__ import annotations

import os
from enum import IntEnum


class QT(IntEnum):
    """The tensor types npllama reads, by their GGML ids."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    BF16 = 30


# each type's block: (elements, bytes)
BLOCK_SIZES: dict[QT, tuple[int, int]] = {
    QT.F32: (1, 4), QT.F16: (1, 2), QT.BF16: (1, 2),
    QT.Q4_0: (32, 18), QT.Q4_1: (32, 20), QT.Q5_0: (32, 22), QT.Q5_1: (32, 24), QT.Q8_0: (32, 34),
    QT.Q2_K: (256, 84), QT.Q3_K: (256, 110), QT.Q4_K: (256, 144), QT.Q5_K: (256, 176), QT.Q6_K: (256, 210),
}


def type_name(type_id: int) -> str | None:
    """The name of GGML type `type_id`: npllama's, else gguf's (imported for it: only an error
    message asks, for a type npllama does not read), else None for an id neither knows."""
    try:
        return QT(type_id).name
    except ValueError:
        pass
    from gguf.constants import GGMLQuantizationType
    try:
        return GGMLQuantizationType(type_id).name
    except ValueError:
        return None


# the groups of types that a kernel's type mask takes or leaves together (the module's docstring)
FLOATS = (QT.F32, QT.F16, QT.BF16)
LEGACY = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)  # blocks of 32
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)  # super-blocks of 256
GROUPS = (FLOATS, LEGACY, K_QUANTS)


class TypeMask(int):
    """A set of tensor types as an int, bit 1 << id for type id: the types a compiled kernel
    holds code for. Numba types it as its literal value (kernels/quants.py), so that kernels
    compile one version per mask; a plain int reaches them as int64, which they refuse."""
    __slots__ = ()

    def __contains__(self, qtype) -> bool:
        return bool(self >> int(qtype) & 1)

    def __repr__(self) -> str:
        return f"TypeMask({', '.join(t.name for t in QT if t in self) or 'none'})"


def type_mask(qtypes) -> TypeMask:
    """The kernels' type mask for weights of `qtypes`: every type of each group (`GROUPS`) that
    one of them belongs to. ValueError for an id that npllama does not read."""
    bits = 0
    for t in qtypes:
        t = QT(int(t))
        for group in GROUPS:
            if t in group:
                for member in group:
                    bits |= 1 << int(member)
    return TypeMask(bits)


ALL_TYPES = type_mask(QT)  # every type's code: the reference kernels of the tests

KERNEL_TYPES = "NPLLAMA_KERNEL_TYPES"
"""The environment variable that says which types' code the kernels compile: "model" (the
default: the groups of the weights in hand, `type_mask`) or "all" (`ALL_TYPES`: one compile
serves models of every type, for a server of several models or a test suite)."""


def kernel_types(qtypes) -> TypeMask:
    """The type mask that kernels reading weights of `qtypes` compile for, as $NPLLAMA_KERNEL_TYPES
    says (`KERNEL_TYPES`); ValueError for another value."""
    choice = os.environ.get(KERNEL_TYPES, "model")
    if choice == "all":
        return ALL_TYPES
    if choice != "model":
        raise ValueError(f"{KERNEL_TYPES}={choice!r}: use 'model' (the model's types, the default) or 'all'")
    return type_mask(qtypes)
