"""Text <-> token ids for GGUF models, built on the HF `tokenizers` library.

Two vocabulary families are supported, chosen by the metadata key `tokenizer.ggml.model`:

* ``"gpt2"``: byte-level BPE (SmolLM2, Qwen2, Llama 3, GPT-2). The vocabulary and merges come
  from the file; the pre-tokenizer (how text is split before BPE) is chosen by
  `tokenizer.ggml.pre`, mirroring the original HF ``tokenizer.json`` of each family.
* ``"llama"``: SentencePiece-style BPE (Llama 2, TinyLlama, Gemma). Pieces are merged by score,
  as SentencePiece and llama.cpp do: the BPE merge list is derived from the vocabulary, each
  split ``left + right`` of a piece ranked by that piece's score. Spaces become ``▁``, characters
  outside the vocabulary fall back to ``<0xNN>`` byte tokens, and a leading space is added to
  each text segment when `tokenizer.ggml.add_space_prefix` says so.

Token types follow GGUF: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
Control tokens (``<|im_start|>``, ``<start_of_turn>``...) are recognised in text only with
``encode(..., special=True)``; user-defined tokens are always matched as a whole, as llama.cpp
and SentencePiece do.
"""
from __future__ import annotations

import codecs
import operator
import re
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from .chat import format_chat

__all__ = ["Tokenizer", "StreamDecoder", "TOKEN_NORMAL", "TOKEN_UNKNOWN", "TOKEN_CONTROL",
           "TOKEN_USER_DEFINED", "TOKEN_UNUSED", "TOKEN_BYTE"]

TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the original HF tokenizer.json files (llama.cpp's llama-vocab.cpp uses the same);
# the GPT-2 pattern is the one built into the ByteLevel pre-tokenizer.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# `tokenizer.ggml.pre` value -> pre-tokenizer family.
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "phi-2": "gpt2", "olmo": "gpt2", "mpt": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "codeshell": "digits",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "falcon3": "llama3",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
}
# Families whose vocabulary adds BOS by default (llama.cpp's defaults when the key is absent).
_BOS_BY_DEFAULT = {"llama3"}

# Token texts that end a turn, as llama.cpp recognises them, besides EOS and the metadata ids.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
              "<|end_of_text|>", "<EOT>", "<end_of_utterance>")

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPM_SPACE = "\u2581"


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


_GPT2_BYTE_DECODER = _gpt2_byte_decoder()


def _byte_level_bytes(piece: str) -> bytes:
    """The bytes a byte-level BPE piece stands for (characters outside the table pass as UTF-8)."""
    try:
        return bytes(_GPT2_BYTE_DECODER[c] for c in piece)
    except KeyError:
        return piece.encode("utf-8")


def _byte_level_pre_tokenizer(family: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer of a byte-level BPE family, as the original HF tokenizer.json builds it."""
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "digits":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    pattern = _LLAMA3_PATTERN if family == "llama3" else _QWEN2_PATTERN
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _vocab_index(tokens: Sequence[str]) -> dict[str, int]:
    """Piece -> id; a piece listed twice keeps its last id, as llama.cpp's lookup does."""
    return {piece: i for i, piece in enumerate(tokens)}


def _spm_merges(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece's score-ordered merging.

    SentencePiece (and llama.cpp) repeatedly merge the adjacent pair whose concatenation is the
    highest-scoring piece of the vocabulary. Every split ``left + right`` of a piece whose halves
    are both pieces is therefore a merge, ranked by the score of the whole piece.
    """
    ranked: list[tuple[float, str, str]] = []
    for piece, pid in vocab.items():
        score = scores[pid]
        for k in range(1, len(piece)):
            left = piece[:k]
            if left in vocab:
                right = piece[k:]
                if right in vocab:
                    ranked.append((score, left, right))
    ranked.sort(key=lambda m: -m[0])
    return [(left, right) for _, left, right in ranked]


def _meta_list(meta: Mapping[str, Any], key: str) -> list | None:
    """A metadata array as a list of Python values (it may arrive as a list or a numpy array)."""
    value = meta.get(key)
    if value is None:
        return None
    return value.tolist() if hasattr(value, "tolist") else list(value)


def _meta_id(meta: Mapping[str, Any], key: str, n_vocab: int) -> int | None:
    """A token id from metadata, or None when absent or out of range."""
    value = meta.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < n_vocab else None


class Tokenizer:
    """Encodes text to token ids and decodes them back, for one GGUF vocabulary.

    Build it with `Tokenizer.from_metadata`. Attributes: `model` ("gpt2" or "llama"), `pre`,
    `n_vocab`, `bos_id`, `eos_id` (None when the model has none), `eot_ids` (ids that end a
    turn), `add_bos` (the default of `encode`), `add_space_prefix`, `chat_template` (or None).
    """

    def __init__(self, *, model: str, pre: str | None, tokens: Sequence[str], token_types: Sequence[int],
                 hf: _HFTokenizer, bos_id: int | None, eos_id: int | None, eot_ids: frozenset[int],
                 add_bos: bool, add_space_prefix: bool, chat_template: str | None):
        self.model = model
        self.pre = pre
        self.n_vocab = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.eot_ids = eot_ids
        self.add_bos = add_bos
        self.add_space_prefix = add_space_prefix
        self.chat_template = chat_template
        self._tokens = list(tokens)
        self._types = list(token_types)
        self._hf = hf
        self._lock = threading.Lock()
        self._control = frozenset(i for i, t in enumerate(self._types) if t == TOKEN_CONTROL)
        self._bytes = [self._piece_bytes(i) for i in range(self.n_vocab)]

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer from GGUF metadata (key -> plain Python value).

        Reads `tokenizer.ggml.*` (model, pre, tokens, token_type, scores, merges, bos/eos/unknown/
        eot/eom ids, add_bos_token, add_space_prefix) and `tokenizer.chat_template`.
        Raises ValueError for a missing vocabulary or an unsupported tokenizer model or pre-tokenizer.
        """
        model = meta.get("tokenizer.ggml.model")
        tokens = _meta_list(meta, "tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no vocabulary")
        n_vocab = len(tokens)
        types = _meta_list(meta, "tokenizer.ggml.token_type") or [TOKEN_NORMAL] * n_vocab
        if len(types) != n_vocab:
            raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {n_vocab} tokens")
        types = [int(t) for t in types]
        bos_id = _meta_id(meta, "tokenizer.ggml.bos_token_id", n_vocab)
        eos_id = _meta_id(meta, "tokenizer.ggml.eos_token_id", n_vocab)
        unk_id = _meta_id(meta, "tokenizer.ggml.unknown_token_id", n_vocab)
        if "tokenizer.ggml.token_type" not in meta:  # old files: only the declared specials are control
            for tid in (bos_id, eos_id, unk_id):
                if tid is not None:
                    types[tid] = TOKEN_CONTROL

        index = _vocab_index(tokens)
        pre = meta.get("tokenizer.ggml.pre")
        if model == "gpt2":
            family = _PRE_FAMILIES.get(pre or "default")
            if family is None:
                raise ValueError(f"unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; "
                                 f"supported: {', '.join(sorted(_PRE_FAMILIES))}")
            add_bos_default, add_space_prefix = family in _BOS_BY_DEFAULT, False
            hf = cls._build_byte_level(index, meta, family)
        elif model == "llama":
            scores = _meta_list(meta, "tokenizer.ggml.scores")
            if scores is None or len(scores) != n_vocab:
                raise ValueError("a 'llama' (SentencePiece) vocabulary needs tokenizer.ggml.scores, one per token")
            add_bos_default, add_space_prefix = True, bool(meta.get("tokenizer.ggml.add_space_prefix", True))
            hf = cls._build_spm(index, scores, tokens[unk_id] if unk_id is not None else None, add_space_prefix)
        else:
            raise ValueError(f"unsupported tokenizer model tokenizer.ggml.model={model!r}; "
                             "supported: 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")

        # Matched as a whole before BPE (on the raw text); control ones only with special=True.
        hf.add_tokens([AddedToken(tokens[i], special=(t == TOKEN_CONTROL), normalized=False)
                       for i, t in enumerate(types) if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED)])

        eot = {eos_id} if eos_id is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            tid = _meta_id(meta, key, n_vocab)
            if tid is not None:
                eot.add(tid)
        eot.update(index[text] for text in _EOT_TEXTS if text in index)

        return cls(model=model, pre=pre, tokens=tokens, token_types=types, hf=hf, bos_id=bos_id, eos_id=eos_id,
                   eot_ids=frozenset(eot),
                   add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_space_prefix=add_space_prefix,
                   chat_template=meta.get("tokenizer.chat_template"))

    @staticmethod
    def _build_byte_level(vocab: dict[str, int], meta: Mapping[str, Any], family: str) -> _HFTokenizer:
        merges = [tuple(m.split(" ", 1)) for m in _meta_list(meta, "tokenizer.ggml.merges") or []]
        bpe = models.BPE(vocab, merges, ignore_merges=(family == "llama3"))
        hf = _HFTokenizer(bpe)
        if family == "qwen2":
            hf.normalizer = normalizers.NFC()
        hf.pre_tokenizer = _byte_level_pre_tokenizer(family)
        return hf

    @staticmethod
    def _build_spm(vocab: dict[str, int], scores: Sequence[float], unk_token: str | None,
                   add_space_prefix: bool) -> _HFTokenizer:
        bpe = models.BPE(vocab, _spm_merges(vocab, scores), byte_fallback=True, fuse_unk=True, unk_token=unk_token)
        hf = _HFTokenizer(bpe)
        steps = [normalizers.Prepend(_SPM_SPACE)] if add_space_prefix else []
        hf.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPM_SPACE)])
        return hf

    def _piece_bytes(self, tid: int) -> bytes:
        """The bytes token `tid` stands for in text (computed once per token at construction)."""
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
        return self._bytes[self._check_id(tid)]

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
        HF tokenizer does (the space that `encode` added).
        """
        parts = []
        for pos, tid in enumerate(ids):
            tid = self._check_id(tid, pos)
            if not (skip_special and tid in self._control):
                parts.append(self._bytes[tid])
        text = b"".join(parts).decode("utf-8", errors="replace")
        if self.add_space_prefix and text.startswith(" "):
            text = text[1:]
        return text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render `messages` with the model's chat template (ChatML when it has none); see
        `npllama.chat.format_chat`. `bos_token`/`eos_token` default to this vocabulary's."""
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
