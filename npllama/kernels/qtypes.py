"""The GGML tensor types that npllama reads: their ids in a GGUF file and their blocks.

The same numbers as gguf-py's `GGMLQuantizationType` and `GGML_QUANT_SIZES` (tests compare
them), written out here so that a process reading a model does not import gguf: its package
builds the enums of every architecture and tensor name that llama.cpp knows, ~0.02 s of a
short `npllama run`. `QT` is an IntEnum, as gguf's is, so gguf's members, these and plain
ints are the same keys of a table. `type_name` names any other id, by gguf's table.
"""
from __future__ import annotations

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
