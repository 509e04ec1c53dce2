"""Text <-> token ids for GGUF models, built on the HF `tokenizers` library.

Three vocabulary kinds are supported, chosen by the metadata key `tokenizer.ggml.model`:

* ``"gpt2"``: byte-level BPE (SmolLM2/3, Qwen2/3, Llama 3, DeepSeek, Falcon, Command-R, GPT-2).
  The vocabulary and merges come from the file; the pre-tokenizer (how text is split before BPE)
  is chosen by `tokenizer.ggml.pre`, mirroring the original HF ``tokenizer.json`` of each family
  (`_PRE` lists the values npllama knows; others are refused).
* ``"llama"``: SentencePiece-style BPE (Llama 2, Phi-3, Gemma 3). Pieces are merged by score,
  as SentencePiece and llama.cpp do: the BPE merge list is derived from the vocabulary, each
  split ``left + right`` of a piece ranked by that piece's score (the splits found by a kernel,
  `kernels/splits.py`: 515k of them in Gemma 3's 262k pieces). Spaces become ``▁``, characters
  outside the vocabulary fall back to ``<0xNN>`` byte tokens, and a leading space is added to
  each text segment when `tokenizer.ggml.add_space_prefix` says so (Gemma 3 says not).
* ``"gemma4"``: BPE with the file's merges on UTF-8 text whose spaces become ``▁``, with byte
  fallback and no leading space.
* ``"bert"``: WordPiece (BERT and the encoders converted from it). llama.cpp's converter stores
  a word-initial piece as ``▁piece`` and a continuation (HF's ``##piece``) as ``piece``; they are
  turned back into HF's form, and the text is split as HF's BERT tokenizer does (its normaliser:
  control characters dropped, CJK characters spaced, lower-casing and accent stripping when
  `tokenizer.ggml.normalizer.lowercase` says so, or, where the file does not say, when the
  vocabulary is uncased (no piece changes under lower-casing); its pre-tokeniser: whitespace
  and punctuation). An encoder's input adds ``[CLS]`` and ``[SEP]`` (`encode_input`).

Every vocabulary is checked when it is built: the token, type and score arrays must agree in
length, token texts must be unique valid text, types must lie in 1..6, and every merge must name
two tokens whose concatenation is a token. Anything else is a GGUFError naming the key and entry.
`check_metadata` runs these checks alone, without building the tokenizer (a model runs it when
it opens a file, and skips the checks that read the whole vocabulary for a file unchanged since
it passed them: gguf/verdicts.py).
llama.cpp's own tokenizer test vectors check each supported kind (tests/llama_vocabs.py).

Token types follow GGUF: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control tokens (``<|im_start|>``, ``<start_of_turn>``...) are recognised in text only with
``encode(..., special=True)``; user-defined tokens are always matched as a whole, as llama.cpp
and SentencePiece do.
"""
from __future__ import annotations

import codecs
import contextlib
import gc
import hashlib
import operator
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import GGUFError
from ..gguf.reader import StringArray
from ..kernels.splits import piece_splits

# The `tokenizers` library and the chat templates' Jinja2 (.chat) are imported when a
# tokenizer is first built and a template first rendered, not with npllama: a process that
# feeds token ids never pays for them.
if TYPE_CHECKING:
    from tokenizers import Tokenizer as _HFTokenizer
    from tokenizers import pre_tokenizers

__all__ = ["Tokenizer", "StreamDecoder", "check_metadata", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_CONTROL",
           "TOKEN_USER_DEFINED", "TOKEN_UNUSED", "TOKEN_BYTE"]

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the original HF tokenizer.json files (llama.cpp's llama-vocab.cpp uses the same);
# the GPT-2 pattern is the one built into the ByteLevel pre-tokenizer.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen3.5: as Qwen2, with combining marks (\p{M}) kept inside words.
_QWEN35_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                   r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek's tokenizer.json files split with a sequence of patterns, each isolating its matches.
_CJK_RUN = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"  # CJK ideographs and Hangul (as listed there)
# DeepSeek LLM's "letters": the cased letters (Unicode Lu, Ll, Lt) as its tokenizer.json enumerates them.
_DEEPSEEK_CASED = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134"
    "\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943")
_DEEPSEEK_LLM_SPLITS = ("[\r\n]", "\\s?[" + _DEEPSEEK_CASED + "]+",
                        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK_RUN)
_DEEPSEEK_CODER_SPLITS = ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_RUN)


def _isolate(*patterns: str) -> list[pre_tokenizers.PreTokenizer]:
    from tokenizers import Regex, pre_tokenizers
    return [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    from tokenizers import pre_tokenizers
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _digits(individual: bool) -> pre_tokenizers.PreTokenizer:
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Digits(individual_digits=individual)


def _punctuation() -> pre_tokenizers.PreTokenizer:
    from tokenizers import pre_tokenizers
    return pre_tokenizers.Punctuation("contiguous")


# How each family splits text before byte-level BPE, as the original HF tokenizer.json builds it.
_SPLITTERS: dict[str, Callable[[], list[pre_tokenizers.PreTokenizer]]] = {
    "gpt2": lambda: [_byte_level(True)],
    "digits": lambda: [_digits(True), _byte_level(True)],
    "llama3": lambda: [*_isolate(_LLAMA3_PATTERN), _byte_level(False)],
    "qwen2": lambda: [*_isolate(_QWEN2_PATTERN), _byte_level(False)],
    "qwen35": lambda: [*_isolate(_QWEN35_PATTERN), _byte_level(False)],
    "deepseek-llm": lambda: [*_isolate(*_DEEPSEEK_LLM_SPLITS), _digits(False), _byte_level(False)],
    "deepseek-coder": lambda: [*_isolate(*_DEEPSEEK_CODER_SPLITS), _digits(True), _byte_level(False)],
    "falcon": lambda: [_punctuation(), _byte_level(True), _digits(False), *_isolate("[0-9][0-9][0-9]")],
}


@dataclass(frozen=True)
class _Pre:
    """A `tokenizer.ggml.pre` value: its split family, whether BPE first looks a whole pre-token
    up in the vocabulary (HF `ignore_merges`), whether BOS is added when `add_bos_token` is absent
    (llama.cpp's default), and whether text is NFC-normalised first."""
    family: str
    ignore_merges: bool = False
    add_bos: bool = False
    nfc: bool = False


_LLAMA3 = _Pre("llama3", ignore_merges=True, add_bos=True)
_PRE: dict[str, _Pre] = {
    **dict.fromkeys(["default", "gpt2", "gpt-2", "phi-2", "olmo", "mpt"], _Pre("gpt2")),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "command-r"], _Pre("digits")),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3"], _LLAMA3),
    # SmolLM3 and DBRX files: Llama 3's split, but BPE applies the merges to every word.
    **dict.fromkeys(["smaug-bpe", "dbrx"], _Pre("llama3")),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen"], _Pre("qwen2", nfc=True)),
    "qwen35": _Pre("qwen35"),  # no NFC: text keeps decomposed accents
    "deepseek-llm": _Pre("deepseek-llm"),
    "deepseek-coder": _Pre("deepseek-coder"),
    "falcon": _Pre("falcon"),
}

# Token texts that end a turn, as llama.cpp recognises them, besides EOS and the metadata ids.
_EOT_TEXTS = frozenset(("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
                        "<|end_of_text|>", "<EOT>", "<end_of_utterance>"))

# The version of this module's checks, for the record of files that passed them (gguf/verdicts.py):
# the hash of its source. None where it cannot be read (no pass is then recorded or believed).
try:
    CHECK_VERSION: str | None = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
except OSError:
    CHECK_VERSION = None

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


def _wordpiece_piece(token: str, kind: int) -> str:
    """HF's WordPiece piece of a GGUF token: llama.cpp's converter writes a word's first piece
    as '▁' + piece and a continuation '##piece' as 'piece'; control tokens, and (in older
    files) bracketed ones such as '[unused0]', are kept as they are."""
    if kind == TOKEN_CONTROL:
        return token
    if token.startswith(_SPM_SPACE):
        return token[1:]
    if token.startswith("[") and token.endswith("]"):
        return token
    return "##" + token


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in table.items()}


# For str.translate: each stand-in character -> the Latin-1 character of its byte, and every other
# character below 256 -> U+FFFF, so that a piece with any character outside the table fails to
# encode as Latin-1 (those above 255 fail by themselves).
_GPT2_TRANSLATE = {**dict.fromkeys(range(256), 0xFFFF), **{ord(c): b for c, b in _gpt2_byte_decoder().items()}}


def _byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level BPE piece stands for (a piece with characters outside the table
    passes whole as UTF-8)."""
    try:
        return piece.translate(_GPT2_TRANSLATE).encode("latin-1")
    except UnicodeEncodeError:
        return piece.encode("utf-8")


_FIX = "the file's vocabulary is corrupt or was written by a broken converter; re-download or re-convert the model"


def _bad(key: str, what: str) -> GGUFError:
    return GGUFError(f"tokenizer metadata {key}: {what}; {_FIX}")


def _strings(meta: Mapping[str, Any], key: str) -> Sequence[str] | None:
    """A metadata array of strings (None when absent); GGUFError for anything else. A file's own
    array (StringArray: UTF-8 text, checked when the file was read) is returned as it is, so a
    model holds no copy of its vocabulary as Python strings until its tokenizer is built."""
    value = meta.get(key)
    if value is None or isinstance(value, StringArray):
        return value
    if not isinstance(value, (list, tuple)):
        raise _bad(key, f"should be an array of strings, not {type(value).__name__}")
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise _bad(key, f"entry #{i} is {type(text).__name__} {text!r}, not a string")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _bad(key, f"entry #{i} {text!r} is not valid UTF-8 text (it holds a lone surrogate)") from None
    return list(value)


def _numbers(meta: Mapping[str, Any], key: str, n_vocab: int, kind: type) -> Sequence | None:
    """A numeric metadata array of one entry per token (None when absent): a file's 1-D array of
    the kind asked for as it is, else a list; GGUFError otherwise."""
    value = meta.get(key)
    if value is None:
        return None
    # a file's array of numbers of the kind asked for is kept as it is (262k of them as a list: ~5 ms)
    own = isinstance(value, np.ndarray) and value.ndim == 1 and value.dtype.kind in ("f" if kind is float else "iu")
    values = value.tolist() if isinstance(value, np.ndarray) and not own else value
    if not isinstance(values, (list, tuple, np.ndarray)):
        raise _bad(key, f"should be an array of numbers, not {type(value).__name__}")
    if len(values) != n_vocab:
        raise _bad(key, f"has {len(values)} entries for {n_vocab} tokens (tokenizer.ggml.tokens); "
                        "there must be one per token")
    if own:
        return value
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
            raise _bad(key, f"entry #{i} is {type(v).__name__} {v!r}, not {'a number' if kind is float else 'an integer'}")
    return [kind(v) for v in values]


def _vocab_index(tokens: Sequence[str]) -> dict[str, int]:
    """Piece -> id; GGUFError when a piece is listed twice (llama.cpp refuses such a file too)."""
    index = dict(zip(tokens, range(len(tokens))))
    if len(index) < len(tokens):  # a piece repeats: name the first repeat
        first: dict[str, int] = {}
        for i, piece in enumerate(tokens):
            if first.setdefault(piece, i) != i:
                raise _bad("tokenizer.ggml.tokens", f"token #{i} {piece!r} repeats token #{first[piece]}")
    return index


def _merge_pairs(merges: Sequence[str], vocab: Mapping[str, int] | None = None) -> list[tuple[str, str]]:
    """The (left, right) pairs of byte-level BPE merges, each checked against `vocab` when given
    (without it, the merges must have been checked with it before).

    A merge is ``"left right"``, split at its first space after the first character (as llama.cpp
    does); both halves and their concatenation must be tokens."""
    # a file's byte-level merges (one space each) split all at once, else one at a time
    pairs = merges.halves(" ") if isinstance(merges, StringArray) else None
    if pairs is None:
        merges = list(merges)  # a file's StringArray decodes on each read
        if any(map(str.startswith, merges, repeat(" "))):  # rare: split past a leading space
            pairs = [(m[:c], m[c + 1:]) if c > 0 else (m,) for m in merges for c in (m.find(" ", 1),)]
        else:
            pairs = list(map(tuple, map(str.split, merges, repeat(" "), repeat(1))))
    if vocab is None:
        return pairs
    ok = min(map(len, pairs), default=2) == 2  # every merge has its space
    if ok:  # and all parts and concatenations are tokens
        lefts, rights, known = [p[0] for p in pairs], [p[1] for p in pairs], vocab.__contains__
        ok = all(map(known, lefts)) and all(map(known, rights)) and all(map(known, map(str.__add__, lefts, rights)))
    if not ok:  # name the first bad merge
        for i, (merge, pair) in enumerate(zip(merges, pairs)):
            if len(pair) != 2:
                raise _bad("tokenizer.ggml.merges", f"merge #{i} {merge!r} has no space between its two parts")
            for part in (pair[0], pair[1], pair[0] + pair[1]):
                if part not in vocab:
                    raise _bad("tokenizer.ggml.merges",
                               f"merge #{i} {merge!r} names {part!r}, which is not in tokenizer.ggml.tokens")
    return pairs


def _meta_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    """A token id from metadata, or None when absent or out of range (llama.cpp ignores such an id too)."""
    value = meta.get(key)
    if value is None:
        return None
    try:
        value = operator.index(value)
    except TypeError:
        raise _bad(key, f"is {type(value).__name__} {value!r}, not a token id") from None
    return value if 0 <= value < n_vocab else None


def _meta_flag(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, (bool, np.bool_)):
        raise _bad(key, f"is {type(value).__name__} {value!r}, not a boolean")
    return bool(value)


def _meta_str(meta: Mapping[str, Any], key: str) -> str | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(key, f"is {type(value).__name__} {value!r}, not a string")
    return value


def _spm_merges(tokens: list[str], scores: Sequence[float], pieces: StringArray | None = None) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging.

    SentencePiece (and llama.cpp) repeatedly merge the adjacent pair whose concatenation is the
    highest-scoring piece of the vocabulary. Every split ``left + right`` of a piece whose halves
    are both pieces is therefore a merge, ranked by the score of the whole piece (among equal
    scores, in the pieces' order, then the split's). The splits are found by a kernel
    (`kernels.splits`) on the file's bytes, `pieces` (`tokens` as a StringArray), else on
    `tokens` laid out as such.
    """
    if pieces is None:
        pieces = StringArray.from_strings(tokens)
    whole, left, right = piece_splits(*pieces.spans())
    order = np.argsort(-np.asarray(scores, np.float64)[whole], kind="stable")
    strings = np.array(tokens, dtype=object)  # indexed by arrays: half the time of a lookup at a time
    return list(zip(strings[left[order]].tolist(), strings[right[order]].tolist()))


@dataclass
class _Vocabulary:
    """Tokenizer metadata, checked: what `Tokenizer.from_metadata` builds from. It holds the
    file's own lists, nothing derived from them: a model keeps it from load (where it is
    checked) until its tokenizer is built, and the piece -> id index and the merge pairs, which
    the check makes too, would hold ~10 MiB for a 49k-token vocabulary all that time."""
    model: str
    pre: str | None
    spec: _Pre | None  # byte-level BPE ("gpt2") only
    tokens: Sequence[str]  # the file's StringArray, or a list
    types: Sequence[int]  # the file's array, or a list
    scores: Sequence[float] | None
    merges: Sequence[str] | None  # "left right", checked; None for SentencePiece and WordPiece
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    sep_id: int | None
    eot_ids: frozenset[int]
    add_bos: bool
    add_eos: bool
    add_sep: bool
    lowercase: bool | None  # WordPiece: tokenizer.ggml.normalizer.lowercase; None: inferred from the pieces
    add_space_prefix: bool
    chat_template: str | None


@contextlib.contextmanager
def _collector_paused():
    """The cyclic garbage collector paused: reading or building a vocabulary makes ~100k-200k
    container objects (lists, merge pairs), none in a cycle, and the collections they would set
    off cost ~20 ms of a 49k-token build (the objects go by reference counting as before)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@_collector_paused()
def check_metadata(meta: Mapping[str, Any], *, passed: bool = False) -> "_Vocabulary":
    """The vocabulary of `meta`, for `Tokenizer.from_vocabulary`; GGUFError (a ValueError)
    unless it is one npllama can tokenize with.

    Checks, without building the tokenizer (a fraction of its cost): a supported
    `tokenizer.ggml.model` and `tokenizer.ggml.pre`; a non-empty array of unique, valid text
    tokens; token_type and scores arrays, when present, with one number per token (scores are
    required by SentencePiece); token types within 1..6; every merge split at a space into two
    tokens whose concatenation is a token; ids, flags and the chat template of the right type.
    Each error names the key and the offending entry.

    `passed`: this metadata passed the check of this `CHECK_VERSION` before (a model file
    unchanged since: gguf/verdicts.py), so the checks that read the whole token and merge
    lists (unique tokens, merges of tokens) are skipped; the others are cheap and run.
    """
    return _read_vocabulary(meta, passed)


def _read_vocabulary(meta: Mapping[str, Any], passed: bool = False) -> _Vocabulary:
    model = _meta_str(meta, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama", "gemma4", "bert"):
        raise GGUFError(f"unsupported tokenizer model tokenizer.ggml.model={model!r}; supported: 'gpt2' "
                        "(byte-level BPE), 'llama' (SentencePiece BPE), 'gemma4' (BPE on UTF-8 text) and "
                        "'bert' (WordPiece)")
    pre = _meta_str(meta, "tokenizer.ggml.pre")
    spec = None
    if model == "gpt2":
        spec = _PRE.get(pre or "default")
        if spec is None:
            raise GGUFError(f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                            f"supported: {', '.join(sorted(_PRE))}")
    tokens = _strings(meta, "tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary")
    n_vocab = len(tokens)
    index = None if passed else _vocab_index(tokens)
    types = _numbers(meta, "tokenizer.ggml.token_type", n_vocab, int)
    scores = _numbers(meta, "tokenizer.ggml.scores", n_vocab, float)
    if types is None:
        types = [TOKEN_NORMAL] * n_vocab
    lo, hi = (types.min(), types.max()) if isinstance(types, np.ndarray) else (min(types), max(types))
    if not TOKEN_NORMAL <= lo <= hi <= TOKEN_BYTE:  # name the first one out of range
        for i, t in enumerate(types):
            if not TOKEN_NORMAL <= t <= TOKEN_BYTE:
                raise _bad("tokenizer.ggml.token_type", f"token #{i} {tokens[i]!r} has type {t}; "
                                                        "GGUF token types are 1 (normal) to 6 (byte)")
    bos_id = _meta_id(meta, "tokenizer.ggml.bos_token_id", n_vocab)
    eos_id = _meta_id(meta, "tokenizer.ggml.eos_token_id", n_vocab)
    unk_id = _meta_id(meta, "tokenizer.ggml.unknown_token_id", n_vocab)
    sep_id = _meta_id(meta, "tokenizer.ggml.seperator_token_id", n_vocab)  # GGUF's spelling
    if model == "bert" and bos_id is None:  # [CLS] starts a WordPiece encoder's input, as BOS does
        bos_id = _meta_id(meta, "tokenizer.ggml.cls_token_id", n_vocab)
    if "tokenizer.ggml.token_type" not in meta:  # old files: only the declared specials are control
        for tid in (bos_id, eos_id, unk_id):
            if tid is not None:
                types[tid] = TOKEN_CONTROL

    merges = None
    if model == "llama":  # SentencePiece: merges follow the scores
        if scores is None:
            raise GGUFError("a 'llama' (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per token")
        add_space_prefix = _meta_flag(meta, "tokenizer.ggml.add_space_prefix", True)
    elif model == "bert":  # WordPiece: the pieces alone
        add_space_prefix = False
        if unk_id is None:
            raise GGUFError("a 'bert' (WordPiece) vocabulary needs tokenizer.ggml.unknown_token_id ([UNK]), "
                            "which stands for every word it cannot split into pieces")
        if sep_id is None:
            raise GGUFError("a 'bert' (WordPiece) vocabulary needs tokenizer.ggml.seperator_token_id ([SEP]), "
                            "which ends every input")
    else:  # byte-level BPE, or gemma4's BPE on UTF-8 text with spaces as '▁': merges from the file
        add_space_prefix = False
        merges = _strings(meta, "tokenizer.ggml.merges") or []
        if index is not None:
            _merge_pairs(merges, index)  # the check; the tokenizer splits them again when it is built

    eot = {eos_id} if eos_id is not None else set()
    for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        tid = _meta_id(meta, key, n_vocab)
        if tid is not None:
            eot.add(tid)
    if index is not None:
        eot.update(index[text] for text in _EOT_TEXTS if text in index)
    elif isinstance(tokens, StringArray):
        eot.update(tokens.indexes_of(_EOT_TEXTS))
    else:
        eot.update(i for i, text in enumerate(tokens) if text in _EOT_TEXTS)
    # the family's default (when the file does not say) applies only to a vocabulary that has a BOS
    default_bos = (spec.add_bos if spec is not None else True) and bos_id is not None
    add_bos = _meta_flag(meta, "tokenizer.ggml.add_bos_token", default_bos)
    add_eos = _meta_flag(meta, "tokenizer.ggml.add_eos_token", model == "bert")
    add_sep = _meta_flag(meta, "tokenizer.ggml.add_sep_token", False) and sep_id is not None
    lowercase = meta.get("tokenizer.ggml.normalizer.lowercase")
    lowercase = _meta_flag(meta, "tokenizer.ggml.normalizer.lowercase", False) if lowercase is not None else None
    return _Vocabulary(model=model, pre=pre, spec=spec, tokens=tokens, types=types, scores=scores,
                       merges=merges, bos_id=bos_id, eos_id=eos_id, unk_id=unk_id, sep_id=sep_id,
                       eot_ids=frozenset(eot), add_bos=add_bos, add_eos=add_eos, add_sep=add_sep,
                       lowercase=lowercase, add_space_prefix=add_space_prefix,
                       chat_template=_meta_str(meta, "tokenizer.chat_template"))


class Tokenizer:
    """Encodes text to token ids and decodes them back, for one GGUF vocabulary.

    Build it with `Tokenizer.from_metadata`. Attributes: `model` ("gpt2", "llama", "gemma4" or
    "bert"), `pre`, `n_vocab`, `bos_id` ([CLS] for WordPiece), `eos_id`, `sep_id` ([SEP]; each
    None when the model has none), `eot_ids` (ids that end a turn), `add_bos` (the default of
    `encode`), `add_eos` and `add_sep` (whether `encode_input` ends a text with EOS ([SEP])
    and puts the separator between a pair's texts),
    `add_space_prefix`, `chat_template` (or None).
    """

    def __init__(self, *, model: str, pre: str | None, tokens: Sequence[str], token_types: Sequence[int],
                 hf: _HFTokenizer, bos_id: int | None, eos_id: int | None, eot_ids: frozenset[int],
                 add_bos: bool, add_space_prefix: bool, chat_template: str | None, sep_id: int | None = None,
                 add_eos: bool = False, add_sep: bool = False):
        self.model = model
        self.pre = pre
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.sep_id = sep_id
        self.eot_ids = eot_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.add_sep = add_sep
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        # a file's StringArray is kept as it is (its bytes: ~3 MiB less than the strings for a
        # 49k-token vocabulary), its pieces decoded one by one as they are asked for
        self._tokens = tokens if isinstance(tokens, (list, StringArray)) else list(tokens)
        types = np.asarray(token_types)  # a file's array as it is
        self._types = types.tolist()
        self._hf = hf
        self._hf_inner: _HFTokenizer | None = None  # without the space prefix: see encode_inner
        self._lock = threading.Lock()
        self._control = frozenset(np.flatnonzero(types == TOKEN_CONTROL).tolist())
        self._bytes: list[bytes | None] = [None] * self.n_vocab  # each token's, made at first use (_token_bytes)
        # the most bytes of text one token can stand for (its piece, or its written form for a
        # control token matched in text): a text of n bytes is at least n / this many tokens. No
        # token's bytes are longer than its piece's UTF-8 (_piece_bytes maps a byte-level character
        # to one byte, '▁' (3 bytes) to a space, '<0xNN>' to one byte), so that is the bound.
        if isinstance(tokens, StringArray):
            longest = int(tokens.byte_lengths().max())  # the vocabulary is not empty (check_metadata)
        else:
            longest = max(map(len, map(str.encode, self._tokens, repeat("utf-8"), repeat("surrogatepass"))))
        self.longest_token_bytes = max(1, longest)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer from GGUF metadata (key -> plain Python value).

        Reads `tokenizer.ggml.*` (model, pre, tokens, token_type, scores, merges, bos/eos/unknown/
        eot/eom ids, add_bos_token, add_space_prefix) and `tokenizer.chat_template`, checked as
        `check_metadata` describes (GGUFError, a ValueError, when they do not pass).
        """
        return cls.from_vocabulary(check_metadata(meta))

    @classmethod
    @_collector_paused()
    def from_vocabulary(cls, v: "_Vocabulary") -> "Tokenizer":
        """Build the tokenizer from a vocabulary `check_metadata` returned (already checked)."""
        from tokenizers import AddedToken
        tokens = list(v.tokens)  # decoded once (a file's StringArray decodes on each read)
        types = np.asarray(v.types)
        index = dict(zip(tokens, range(len(tokens))))  # the pieces are unique: checked
        merges = (_merge_pairs(v.merges) if v.merges is not None else [] if v.model == "bert" else
                  _spm_merges(tokens, v.scores, v.tokens if isinstance(v.tokens, StringArray) else None))
        if v.model == "bert":
            hf = cls._build_wordpiece(tokens, types, v.unk_id, v.lowercase)
        elif v.spec is not None:
            hf = cls._build_byte_level(index, merges, v.spec)
        else:
            unk = tokens[v.unk_id] if v.unk_id is not None else None
            hf = cls._build_spm(index, merges, unk, v.add_space_prefix)
        # Matched as a whole before BPE (on the raw text); control ones only with special=True.
        added = np.flatnonzero((types == TOKEN_CONTROL) | (types == TOKEN_USER_DEFINED)).tolist()
        hf.add_tokens([AddedToken(tokens[i], special=bool(types[i] == TOKEN_CONTROL), normalized=False) for i in added])
        return cls(model=v.model, pre=v.pre, tokens=v.tokens, token_types=v.types, hf=hf, bos_id=v.bos_id,
                   eos_id=v.eos_id, eot_ids=v.eot_ids, add_bos=v.add_bos, add_space_prefix=v.add_space_prefix,
                   chat_template=v.chat_template, sep_id=v.sep_id, add_eos=v.add_eos, add_sep=v.add_sep)

    @staticmethod
    def _build_byte_level(vocab: dict[str, int], merges: list[tuple[str, str]], spec: _Pre) -> _HFTokenizer:
        from tokenizers import Tokenizer as _HFTokenizer, models, normalizers, pre_tokenizers
        hf = _HFTokenizer(models.BPE(vocab, merges, ignore_merges=spec.ignore_merges))
        if spec.nfc:
            hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = pre_tokenizers.Sequence(_SPLITTERS[spec.family]())
        return hf

    @staticmethod
    def _build_wordpiece(tokens: list[str], types: np.ndarray, unk_id: int, lowercase: bool | None) -> _HFTokenizer:
        from tokenizers import Tokenizer as _HFTokenizer, models, normalizers, pre_tokenizers
        pieces = [_wordpiece_piece(t, k) for t, k in zip(tokens, types.tolist())]
        vocab = dict(zip(pieces, range(len(pieces))))
        if len(vocab) < len(pieces):
            first: dict[str, int] = {}
            for i, piece in enumerate(pieces):
                if first.setdefault(piece, i) != i:
                    raise _bad("tokenizer.ggml.tokens", f"token #{i} {tokens[i]!r} is WordPiece's {piece!r}, "
                                                        f"as token #{first[piece]} {tokens[first[piece]]!r} is")
        # as the file says, else uncased when no piece changes under lower-casing (an uncased
        # vocabulary cannot hold one)
        uncased = lowercase if lowercase is not None else \
            all(p == p.lower() for p, k in zip(pieces, types.tolist()) if k != TOKEN_CONTROL)
        hf = _HFTokenizer(models.WordPiece(vocab, unk_token=pieces[unk_id], max_input_chars_per_word=100))
        hf.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True,
                                                   strip_accents=uncased, lowercase=uncased)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return hf

    @staticmethod
    def _build_spm(vocab: dict[str, int], merges: list[tuple[str, str]], unk_token: str | None,
                   add_space_prefix: bool) -> _HFTokenizer:
        from tokenizers import Tokenizer as _HFTokenizer, models, normalizers
        bpe = models.BPE(vocab, merges, byte_fallback=True, fuse_unk=True, unk_token=unk_token)
        hf = _HFTokenizer(bpe)
        steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
        hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
        return hf

    def _token_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for in text (made at its first use)."""
        b = self._bytes[tid]
        if b is None:
            b = self._bytes[tid] = self._piece_bytes(tid)
        return b

    def _piece_bytes(self, tid: int) -> bytes:
        """Token `tid`'s bytes, from its piece and type."""
        piece, kind = self._tokens[tid], self._types[tid]
        if kind in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN):
            return piece.encode("utf-8")
        if self.model == "gpt2":
            return _byte_level_bytes(piece)
        if kind == TOKEN_BYTE:
            m = _BYTE_TOKEN.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
        return piece.replace(_SPM_SPACE, " ").encode("utf-8")

    def encode(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text`.

        `add_bos`: prepend BOS; None follows the model (`tokenizer.ggml.add_bos_token`, else True
        for SentencePiece and Llama-3-style vocabularies, False for other byte-level ones).
        `special`: recognise control tokens written in the text (``<|im_start|>``); when False
        they are tokenized as plain text, so user input cannot inject them.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, not {type(text).__name__}")
        with self._lock:
            self._hf.encode_special_tokens = not special
            try:
                ids = self._hf.encode(text, add_special_tokens=False).ids
            except TypeError:  # a str the Rust side cannot take: it holds lone surrogates
                raise ValueError("text is not valid Unicode: it contains lone surrogate code points") from None
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ValueError("add_bos=True but the model has no BOS token (tokenizer.ggml.bos_token_id)")
            ids.insert(0, self.bos_id)
        return ids

    def encode_input(self, text: str, pair: str | None = None) -> tuple[list[int], list[int]]:
        """(ids, token types) of `text` as an encoder or an embedding model reads it, with the
        special tokens the file says to add (as llama.cpp adds them): BOS ([CLS]) if `add_bos`,
        the text, EOS ([SEP]) if `add_eos`. With `pair`, the two texts as one input (a
        cross-encoder's query and document): BOS, the first, EOS, the separator if `add_sep`,
        the second, EOS; so ``[CLS] a [SEP] b [SEP]`` for BERT, whose second part has token type
        1 (else every type is 0), and ``<s> a </s></s> b </s>`` for RoBERTa. Control tokens
        written in the texts are plain text."""
        first = self.encode(text, add_bos=self.add_bos)
        if self.add_eos:
            first.append(self._end_id())
        if pair is None:
            return first, [0] * len(first)
        if self.add_sep:
            first.append(self.sep_id)
        second = self.encode(pair, add_bos=False) + ([self._end_id()] if self.add_eos else [])
        return first + second, [0] * len(first) + [int(self.model == "bert")] * len(second)

    def _end_id(self) -> int:
        end = self.eos_id if self.eos_id is not None else self.sep_id
        if end is None:
            raise ValueError("tokenizer.ggml.add_eos_token is set but the model has no EOS token "
                             "(tokenizer.ggml.eos_token_id) to end its input with")
        return end

    def encode_inner(self, text: str) -> list[int]:
        """Token ids of `text` as it is tokenized inside a longer text: no BOS, no SentencePiece
        space prefix (`add_space_prefix`), control tokens written in it as plain text. For
        constraint engines, which tokenize pieces of output."""
        if not self.add_space_prefix:
            return self.encode(text, add_bos=False)
        with self._lock:
            if self._hf_inner is None:
                from tokenizers import Tokenizer as _HFTokenizer, normalizers
                self._hf_inner = _HFTokenizer.from_str(self._hf.to_str())
                self._hf_inner.normalizer = normalizers.Replace(" ", _SPM_SPACE)
                self._hf_inner.encode_special_tokens = True
            try:
                return self._hf_inner.encode(text, add_special_tokens=False).ids
            except TypeError:
                raise ValueError("text is not valid Unicode: it contains lone surrogate code points") from None

    def _check_id(self, tid: Any, pos: int | None = None) -> int:
        where = "" if pos is None else f" at position {pos}"
        try:
            tid = operator.index(tid)
        except TypeError:
            raise ValueError(f"token id{where} is {type(tid).__name__} {tid!r}, not an int") from None
        if not 0 <= tid < self.n_vocab:
            raise ValueError(f"token id {tid}{where} is out of range: the vocabulary has {self.n_vocab} tokens")
        return tid

    def id_to_bytes(self, tid: int) -> bytes:
        """The raw bytes token `tid` contributes to decoded text (a byte token may be part of a
        UTF-8 character; control tokens give their own text)."""
        return self._token_bytes(self._check_id(tid))

    def token_to_piece(self, tid: int) -> str:
        """The vocabulary entry of token `tid`, as stored in the file (``Ġthe``, ``▁the``, ``<0x0A>``)."""
        return self._tokens[self._check_id(tid)]

    def token_type(self, tid: int) -> int:
        """The GGUF type of token `tid` (TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_BYTE, ...)."""
        return self._types[self._check_id(tid)]

    def is_special(self, tid: int) -> bool:
        """Whether `tid` is a control token (BOS, EOS, ``<|im_start|>``...), which `skip_special` drops."""
        return self._check_id(tid) in self._control

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        """Text of the token ids. Invalid UTF-8 becomes U+FFFD; `skip_special` drops control tokens.

        For SentencePiece vocabularies with `add_space_prefix`, one leading space is removed, as the
        HF tokenizer does (the space that `encode` added); so for WordPiece (its first word's '▁').
        """
        parts = []
        for pos, tid in enumerate(ids):
            tid = self._check_id(tid, pos)
            if not (skip_special and tid in self._control):
                parts.append(self._token_bytes(tid))
        text = b"".join(parts).decode("utf-8", errors="replace")
        if (self.add_space_prefix or self.model == "bert") and text.startswith(" "):
            text = text[1:]
        return text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's chat template (ChatML when it has none); see
        `npllama.chat.format_chat`. `bos_token`/`eos_token` default to this vocabulary's."""
        from .chat import format_chat
        kwargs.setdefault("bos_token", self._tokens[self.bos_id] if self.bos_id is not None else "")
        kwargs.setdefault("eos_token", self._tokens[self.eos_id] if self.eos_id is not None else "")
        return format_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **kwargs)


class StreamDecoder:
    """Incremental detokenizer: feed generated ids one at a time, get the text they complete.

    Bytes of a UTF-8 character split over several tokens (byte-fallback tokens, byte-level pieces
    of an emoji) are held back until the character is complete, so no chunk contains a broken
    character; invalid sequences become U+FFFD. Unlike `Tokenizer.decode`, no leading space is
    stripped: the stream continues a prompt. Call `flush()` at the end for any held-back bytes.
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special: bool = False):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, tid: int) -> str:
        """Add one token id; return the text it completes ('' while a character is incomplete)."""
        if self.skip_special and self.tokenizer.is_special(tid):
            return ""
        return self._utf8.decode(self.tokenizer.id_to_bytes(tid))

    def flush(self) -> str:
        """Return what is still held back (as U+FFFD if incomplete) and reset for a new stream."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text
