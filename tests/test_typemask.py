"""The kernels' type masks (kernels/qtypes.py): a kernel compiled for a mask of a few types
gives the bits of the one compiled for every type (qtypes.ALL_TYPES) on those types, holds
no code for the others (a code outside its mask gives NaN), and takes no plain int; a
model's mask has the groups of its weights' types."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from numba.core.errors import TypingError

import npllama
from npllama.engine import block
from npllama.kernels import panels, quants, quants_int8, rows
from npllama.kernels.qtypes import ALL_TYPES, KERNEL_TYPES, kernel_types, type_mask
from test_products import weight
from tinygguf import write_tiny_llama

TYPES = [QT.Q4_1, QT.Q6_K, QT.F16]  # one of each group


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def products(mask, qtype, data, x, rows_x):
    """A weight's products and dequantized rows by the njit kernels of `mask`."""
    code, n = int(qtype), x.shape[0]
    out = {}
    out["deq"] = np.empty((data.shape[0], n), np.float32)
    quants._dequantize_rows(mask, code, data, out["deq"])
    out["matvec"] = np.empty(data.shape[0], np.float32)
    quants._matvec(mask, code, data, x, out["matvec"])
    qs, d, s = quants_int8.quantize_x(x)
    out["int8"] = np.empty(data.shape[0], np.float32)
    quants_int8._matvec_i8(mask, code, data, x, qs, d, s, out["int8"])
    for T in (2, 7):  # the direct dots, the dequantized tiles
        out[f"rows{T}"] = np.empty((T, data.shape[0]), np.float32)
        rows._matmul_rows(mask, code, data, rows_x[:T], out[f"rows{T}"])
    if panels.has_panels(qtype):
        pw = panels.pack_panels(data, qtype)
        for T in (1, 5):
            for int8 in (True, False):
                out[f"panels{T}{int8}"] = np.empty((T, data.shape[0]), np.float32)
                panels._matmul_panels(mask, code, pw, data.shape[0], panels.activation_rows(rows_x[:T], int8),
                                      out[f"panels{T}{int8}"])
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_kernel_for_a_types_group_gives_the_bits_of_the_one_for_every_type(qtype):
    rng = np.random.default_rng(int(qtype) + 3)
    data = weight(qtype, 21, rng, blocks=8 if qtype == QT.F16 else 2)
    n = quants.row_elems(qtype, data.shape[1])
    x = rng.normal(size=n).astype(np.float32)
    rows_x = rng.normal(size=(7, n)).astype(np.float32)
    mine, every = products(type_mask([qtype]), qtype, data, x, rows_x), products(ALL_TYPES, qtype, data, x, rows_x)
    assert set(mine) == set(every)
    for k in mine:
        assert np.isfinite(mine[k]).all(), k
        assert same_bits(mine[k], every[k]), k


def test_a_code_outside_the_mask_gives_nan():
    """The Q4_1 group's kernels hold no Q6_K code: its products and rows come out NaN (no
    caller passes such a code; each computes its mask from the types it reads)."""
    rng = np.random.default_rng(9)
    data = weight(QT.Q6_K, 21, rng, blocks=1)
    n = quants.row_elems(QT.Q6_K, data.shape[1])
    out = products(type_mask([QT.Q4_1]), QT.Q6_K, data, rng.normal(size=n).astype(np.float32),
                   rng.normal(size=(7, n)).astype(np.float32))
    for k, v in out.items():
        assert np.isnan(v).all(), k


def test_a_plain_int_is_no_mask():
    data = np.zeros((2, 20), np.uint8)
    with pytest.raises(TypingError, match="TypeMask"):
        quants._matvec(int(type_mask([QT.Q4_1])), int(QT.Q4_1), data, np.zeros(32, np.float32),
                       np.empty(2, np.float32))


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.F16])
def test_a_models_mask_has_the_groups_of_its_weights(tmp_path, monkeypatch, qtype):
    """The norms (F32) are no product's: a Q4_1 model's kernels leave the float types out
    (the default; the suite compiles every type's code, conftest.py)."""
    monkeypatch.setenv(KERNEL_TYPES, "model")
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype))
    assert block.kernel_mask(m) == type_mask([qtype]) == m.decode_plan.mask


def test_every_types_code_where_the_environment_says_and_a_bad_value_refused(monkeypatch):
    monkeypatch.setenv(KERNEL_TYPES, "all")
    assert kernel_types([QT.Q4_1]) == ALL_TYPES
    monkeypatch.delenv(KERNEL_TYPES)
    assert kernel_types([QT.Q4_1]) == type_mask([QT.Q4_1])
    monkeypatch.setenv(KERNEL_TYPES, "some")
    with pytest.raises(ValueError, match="NPLLAMA_KERNEL_TYPES='some'.*'model'.*'all'"):
        kernel_types([QT.Q4_1])


@pytest.mark.slow
def test_a_model_compiled_for_its_groups_gives_the_bits_of_every_types_code(tmp_path, monkeypatch):
    """A model's default kernels (its groups' code: the fused decode step and the compiled
    layers) against those of every type, on one Q4_1 model: the prompt's logits and a decoded
    token's, bit for bit."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1)
    ids = [(7 * i) % 250 for i in range(9)]
    runs = []
    for choice in ("model", "all"):
        monkeypatch.setenv(KERNEL_TYPES, choice)
        m = npllama.Model(path)
        s = m.session()
        runs.append((block.kernel_mask(m), s.feed(ids[:-1]).copy(), s.feed(ids[-1:]).copy()))
    (mine, *got), (every, *want) = runs
    assert mine == type_mask([QT.Q4_1]) and every == ALL_TYPES
    for a, b in zip(got, want):
        assert same_bits(a, b)
