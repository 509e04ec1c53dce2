"""npllama's own copy of the GGUF format's numbers (kernels/qtypes.py, reader.VT) is gguf's:
the tensor types' ids, names and blocks, the metadata value types, the default alignment;
and reading a model does not import gguf, which is why the copy exists."""
import gguf
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from npllama.gguf import reader
from npllama.kernels.qtypes import BLOCK_SIZES, QT, type_name


def test_tensor_types_are_ggufs():
    assert {q.name: int(q) for q in QT} == {q.name: int(GGMLQuantizationType[q.name]) for q in QT}
    assert BLOCK_SIZES == {q: GGML_QUANT_SIZES[GGMLQuantizationType(q)] for q in QT}
    for q in QT:  # gguf's members, ours and ints are the same keys
        assert BLOCK_SIZES[GGMLQuantizationType(q)] == BLOCK_SIZES[int(q)] == BLOCK_SIZES[q]


def test_value_types_and_alignment_are_ggufs():
    assert {v.name: int(v) for v in reader.VT} == {v.name: int(v) for v in GGUFValueType}
    assert reader.DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT


def test_type_name():
    assert type_name(int(QT.Q4_K)) == "Q4_K"
    assert type_name(int(GGMLQuantizationType.IQ2_XXS)) == "IQ2_XXS"  # gguf's, a type npllama does not read
    assert type_name(250) is None


@pytest.mark.model
def test_reading_a_model_imports_no_gguf(reply_modules):
    assert sorted(n for n in reply_modules if n.split(".")[0] == "gguf") == []


def test_type_mask_takes_whole_groups():
    from npllama.kernels.qtypes import ALL_TYPES, FLOATS, GROUPS, K_QUANTS, LEGACY, TypeMask, type_mask
    assert sorted(q for g in GROUPS for q in g) == sorted(QT)  # each type in one group
    for group in GROUPS:
        for q in group:  # a type brings its whole group, and nothing else
            assert type_mask([q]) == type_mask(group) == sum(1 << int(t) for t in group)
            assert set(t for t in QT if t in type_mask([q])) == set(group)
    assert type_mask([QT.Q4_1, QT.Q8_0, QT.F32]) == type_mask(LEGACY + FLOATS)  # SmolLM2 Q4_1's types
    assert type_mask([GGMLQuantizationType.Q4_K, int(QT.Q6_K)]) == type_mask(K_QUANTS)  # gguf's, ints
    assert type_mask([]) == 0 and ALL_TYPES == type_mask(QT) == sum(1 << int(t) for t in QT)
    assert isinstance(type_mask([QT.F16]), TypeMask) and QT.BF16 in type_mask([QT.F16])
    assert QT.Q4_K not in type_mask([QT.Q4_0]) and repr(type_mask([QT.F32])) == "TypeMask(F32, F16, BF16)"
    with pytest.raises(ValueError):
        type_mask([int(GGMLQuantizationType.IQ2_XXS)])  # a type npllama does not read
