"""Every supported architecture against HF transformers in float32 (issue 15).

The fixtures in tests/fixtures/arch/ come from bench/make_arch_fixtures.py: tiny random HF
models (llama, gemma3 with sliding-window layers and a variant with linear RoPE scaling and
a final logit softcap, qwen3, qwen3moe, smollm3 with no-RoPE layers, phi3 with partial
rotary and a LongRoPE variant) converted to F32 GGUF by llama.cpp's own converter, with HF's
logits for a 32-token sequence (teacher-forced, one pass) and HF's greedy continuation of
its first 8 tokens (and for phi3-longrope HF's logits when fed one token per call). See tests/fixtures/arch/README.md for what each GGUF holds.

Each model must match HF through the prefill path, the one-token decode path and the packed
batch path (max |diff| <= 1e-4 of the logit range, the same top-1 at every position), and
int8 activations must agree with HF's top-1 at >= 90% of positions.
"""
import re
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama.engine.batch import decode_alone, decodes_alone, forward_batch
from npllama.errors import GGUFError
from npllama.gguf.reader import SUPPORTED_ARCHS
from npllama.cache.kvpool import KVPool
from tinygguf import write_tiny_llama

FIX = Path(__file__).parent / "fixtures" / "arch"
NAMES = ["llama", "gemma3", "gemma3-linear", "qwen3", "qwen3moe", "smollm3", "phi3", "phi3-longrope"]
REL_TOL = 1e-4   # of the HF logit range
INT8_TOP1 = 0.9  # share of positions where int8 activations must give HF's top-1


@pytest.fixture(scope="module")
def load():
    """(model, fixture) for a name; each model is read once per module, in either mode."""
    cache = {}

    def get(name, activations="f32"):
        if (name, activations) not in cache:
            cache[name, activations] = (npllama.Model(FIX / f"{name}.gguf", activations=activations),
                                        np.load(FIX / f"{name}.npz"))
        return cache[name, activations]
    return get


def assert_matches_hf(got, want, what):
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, HF {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite logits"
    span = float(want.max() - want.min())
    err = float(np.abs(got - want).max())
    worst = int(np.abs(got - want).max(axis=-1).argmax())
    assert err <= REL_TOL * span, (f"{what}: max |diff| {err:.3g} (at position {worst}) > "
                                   f"{REL_TOL:g} x logit range {span:.3g}")
    bad = np.flatnonzero(got.argmax(-1) != want.argmax(-1))
    assert bad.size == 0, f"{what}: top-1 differs from HF at positions {bad.tolist()}"


@pytest.mark.parametrize("name", NAMES)
def test_prefill_matches_hf(load, name):
    model, fix = load(name)
    logits = model.session().feed(fix["ids"], all_logits=True)
    assert_matches_hf(logits, fix["logits"], f"{name} prefill")


@pytest.mark.parametrize("name", NAMES)
def test_decode_one_token_at_a_time_matches_hf(load, name):
    """Against HF fed the same way. That matters for phi3-longrope only: HF chooses LongRoPE's
    factors per forward call, so one token per call with its KV cache (`logits_decode`) keeps
    the short-factor keys of positions 0..15 where one 32-token pass (`logits`) is long
    throughout."""
    model, fix = load(name)
    s = model.session()
    rows = [s.feed([int(t)]) for t in fix["ids"]]
    want = fix["logits_decode"] if "logits_decode" in fix.files else fix["logits"]
    assert_matches_hf(np.stack(rows), want, f"{name} decode")


@pytest.mark.parametrize("name", [n for n in NAMES if n != "qwen3moe"])  # experts take the packed pass
def test_fused_step_over_pool_pages_matches_hf(load, name):
    """The fused decode step over a pool sequence's pages (`decode_alone`: a request decoding
    alone in the continuous batching), one token per call as HF was fed for `logits_decode`;
    pages of 4 positions, so every sequence spans many pages (and Gemma 3 its window)."""
    model, fix = load(name)
    assert decodes_alone(model) and not decodes_alone(load("qwen3moe")[0])
    pool = KVPool.for_model(model, tokens=len(fix["ids"]) + 8, page_size=4)
    seq = pool.new_seq()
    rows = [decode_alone(model, pool, seq, int(t)) for t in fix["ids"]]
    want = fix["logits_decode"] if "logits_decode" in fix.files else fix["logits"]
    assert_matches_hf(np.stack(rows), want, f"{name} fused step over pages")


@pytest.mark.parametrize("name", NAMES)
def test_packed_batch_matches_hf(load, name):
    """Two sequences of different lengths in one pass, then both continued in a second pass.
    (For phi3-longrope both passes reach past position 16, so HF would use the long factors
    for every token of both, as in `logits`.)"""
    model, fix = load(name)
    ids, want = fix["ids"], fix["logits"]
    n = len(ids)
    pool = KVPool.for_model(model, tokens=2 * n + 32, page_size=8)
    a, b = pool.new_seq(), pool.new_seq()
    first = forward_batch(model, pool, [a, b], [ids[:20], ids[:11]], all_logits=True)
    second = forward_batch(model, pool, [a, b], [ids[20:], ids[11:24]], all_logits=True)
    assert_matches_hf(np.concatenate([first[0], second[0]]), want, f"{name} batch, sequence of {n}")
    assert_matches_hf(np.concatenate([first[1], second[1]]), want[:24], f"{name} batch, sequence of 24")


@pytest.mark.parametrize("name", NAMES)
def test_int8_activations_agree_on_top1(load, name):
    model, fix = load(name, "int8")
    logits = model.session().feed(fix["ids"], all_logits=True)
    assert logits.shape == fix["logits"].shape and np.isfinite(logits).all()
    agree = float(np.mean(logits.argmax(-1) == fix["logits"].argmax(-1)))
    assert agree >= INT8_TOP1, f"{name} int8: top-1 agrees with HF at {agree:.0%} of positions"


@pytest.mark.parametrize("name", [n for n in NAMES if n != "phi3-longrope"])
def test_greedy_continuation_matches_hf(load, name):
    """HF's greedy tokens after the first 8 ids, decoding with the KV cache. (Not for
    phi3-longrope: HF's generate recomputes the whole sequence with the long factors when it
    first passes the original context, see bench/make_arch_fixtures.py.)"""
    model, fix = load(name)
    want = fix["greedy"].tolist()
    s = model.session()
    logits = s.feed(fix["ids"][:8])
    got = []
    for _ in want:
        got.append(int(np.argmax(logits)))
        logits = s.feed([got[-1]])
    assert got == want


def test_unknown_architecture_is_a_clear_error(tmp_path):
    path = write_tiny_llama(tmp_path / "odd.gguf", arch="frobnicator")
    with pytest.raises(GGUFError) as info:
        npllama.Model(path)
    msg = str(info.value)
    assert "frobnicator" in msg and "not supported" in msg
    for arch in SUPPORTED_ARCHS:
        assert arch in msg, f"the error does not list the supported architecture {arch!r}: {msg}"


def _rewrite(src, dst, *, drop_tensor=None, drop_key=None):
    """A copy of the GGUF `src` at `dst` without one tensor or one metadata key."""
    from gguf import GGUFReader, GGUFWriter
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), arch=str(r.fields["general.architecture"].contents()))
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", drop_key):
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name != drop_tensor:
            w.add_tensor(t.name, np.asarray(t.data).reshape(tuple(reversed(t.shape.tolist()))), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


# per architecture: a tensor and a metadata key it cannot run without
_REQUIRED = {
    "gemma3": ("blk.2.post_ffw_norm.weight", "gemma3.attention.sliding_window"),
    "qwen3": ("blk.1.attn_k_norm.weight", "qwen3.attention.head_count"),
    "qwen3moe": ("blk.0.ffn_down_exps.weight", "qwen3moe.expert_used_count"),
    "smollm3": ("blk.3.ffn_up.weight", "smollm3.block_count"),
    "phi3": ("blk.0.attn_qkv.weight", "phi3.attention.layer_norm_rms_epsilon"),
}


@pytest.mark.parametrize("name", sorted(_REQUIRED))
def test_missing_tensor_or_key_is_named(tmp_path, name):
    tensor, key = _REQUIRED[name]
    src = FIX / f"{name}.gguf"
    npllama.Model(_rewrite(src, tmp_path / "same.gguf"))  # the copy itself loads
    with pytest.raises(GGUFError, match=f"missing required tensor '{re.escape(tensor)}'"):
        npllama.Model(_rewrite(src, tmp_path / "t.gguf", drop_tensor=tensor))
    with pytest.raises(GGUFError, match=re.escape(key)):
        npllama.Model(_rewrite(src, tmp_path / "k.gguf", drop_key=key))


def test_phi3_longrope_needs_both_factor_tensors(tmp_path):
    src = FIX / "phi3-longrope.gguf"
    with pytest.raises(GGUFError, match="rope_factors_long.*rope_factors_short.*both"):
        npllama.Model(_rewrite(src, tmp_path / "m.gguf", drop_tensor="rope_factors_short.weight"))


def test_a_vocabulary_without_bos_tokenizes_without_one():
    """The SmolLM3 fixture's vocabulary (Llama 3 style, whose family adds BOS) has no BOS id and
    no add_bos_token flag: text is tokenized without BOS instead of failing."""
    m = npllama.Model(FIX / "smollm3.gguf")
    assert m.tokenizer.bos_id is None and not m.tokenizer.add_bos
    ids = m.tokenize("hello world")
    assert ids == m.tokenize("hello world", add_bos=False) and ids
    with pytest.raises(ValueError, match="no BOS token"):
        m.tokenize("hello", add_bos=True)


@pytest.mark.parametrize("n_layer, scale", [(62, 1 / np.sqrt(5376 / 32)), (34, 1 / np.sqrt(128))])
def test_gemma3_attention_scale(n_layer, scale):
    """Gemma 3 scales scores by query_pre_attn_scalar ** -0.5, which its GGUF does not carry:
    n_embd / n_head for the 27B (62 layers; head_dim 128 there, not 168), head_dim otherwise."""
    from types import SimpleNamespace

    from npllama.arch import ARCHS
    from npllama.arch.base import Meta
    g = "gemma3."
    meta = {g + "block_count": n_layer, g + "embedding_length": 5376, g + "attention.head_count": 32,
            g + "attention.head_count_kv": 16, g + "attention.key_length": 128, g + "attention.value_length": 128,
            g + "feed_forward_length": 21504, g + "context_length": 131072,
            g + "attention.layer_norm_rms_epsilon": 1e-6, g + "attention.sliding_window": 1024}
    tensors = {f"t{i}": None for i in range(n_layer)} | {"token_embd.weight": SimpleNamespace(shape=(262144, 5376))}
    fields = ARCHS["gemma3"].configure(Meta("m.gguf", meta, tensors, "gemma3"))
    assert fields["attn_scale"] == pytest.approx(scale)
