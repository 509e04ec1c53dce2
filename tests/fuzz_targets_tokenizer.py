"""Fuzz target for the tokenizer built from GGUF metadata (issue 20, section 3).

`fuzz_tokenizer_one_input(data)` turns fuzz bytes into tokenizer metadata, builds
`Tokenizer.from_metadata` from it and, when that succeeds, encodes and decodes a few texts. The
allowed outcomes are success or a ValueError (GGUFError and npllama's other errors subclass it);
any other exception escaping, or a failed invariant (AssertionError), is a finding.

The first byte of `data` chooses how the rest is read:
* even: ``data[1:]`` is a whole GGUF file (header and metadata, no tensors), read with
  `npllama.gguf.reader.read_metadata`. `tokenizer_seeds()` gives valid files of each vocabulary kind
  to start from; byte mutations of them flip token texts, lengths and types as a damaged file would.
* odd: ``data[1:]`` drives structured edits of a tiny vocabulary's metadata: a flipped byte in a
  token text (invalid UTF-8 arrives as lone surrogates), duplicated tokens, arrays of different
  lengths, token types outside 1..6, merges without a space or naming missing tokens, ids and
  flags of the wrong type, unknown models and pre-tokenizers. What is left after the edits is
  also encoded as text.

The bytes are read with `_Reader`, a small deterministic reader owned here, so that a committed
input means the same with or without atheris. Run as a script, this module is an atheris worker:
    python tests/fuzz_targets_tokenizer.py [libFuzzer flags] [corpus dirs]
(tests/fuzz_corpus/tokenizer holds its seeds, `--write-seeds` rewrites them, and its regressions).
"""
from __future__ import annotations

import functools
import math
import os
import sys
import tempfile
import unicodedata
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# Modules whose coverage guides the target under atheris (the `tokenizers` library is Rust).
INSTRUMENT = ["npllama.text.tokenizer", "npllama.gguf.reader"]

TEXTS = ("", "hello world", " the end", "Hello,  world!\n\n\tx", "1234567 3.14", "é日本🦙", "a\u0301",
         "<|im_start|>user\nhi<|im_end|>", "<s>x</s>", "\x00\x7f\u202e\ufeff", "   ", "don't WE'LL")

_SPM_PIECES = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
               "ll": -3.0, "▁h": -4.0, "▁he": -5.0, "▁hell": -6.0, "▁hello": -7.0, "▁w": -8.0, "or": -9.0,
               "▁wor": -10.0, "ld": -10.5, "▁world": -11.0}
_GEMMA4_MERGES = ["l l", "▁ h", "▁h e", "▁he ll", "▁hell o", "▁ w", "o r", "▁w or", "l d", "▁wor ld"]


def base_metadata(kind: str) -> dict:
    """Valid tokenizer metadata of a tiny vocabulary: 'gpt2', 'llama' (SentencePiece) or 'gemma4'."""
    from tinygguf import CHAT_TEMPLATE, tiny_vocab
    if kind == "gpt2":
        tokens, types, merges = tiny_vocab()
        return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
                "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
                "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.chat_template": CHAT_TEMPLATE}
    pieces = list(_SPM_PIECES) if kind == "llama" else sorted({m.replace(" ", "") for m in _GEMMA4_MERGES}
                                                               | {p for m in _GEMMA4_MERGES for p in m.split()})
    tokens = ["<unk>", "<s>", "</s>", "<|turn|>", "\n"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    meta = {"tokenizer.ggml.model": kind, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [2, 3, 3, 3, 4] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.scores": [0.0] * 261 + [_SPM_PIECES.get(p, 0.0) for p in pieces],
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    if kind == "gemma4":
        meta["tokenizer.ggml.merges"] = list(_GEMMA4_MERGES)
        meta["tokenizer.ggml.add_space_prefix"] = False
    return meta


KINDS = ("gpt2", "llama", "gemma4")


def gguf_bytes(meta: dict) -> bytes:
    """A vocabulary-only GGUF file (no tensors) holding `meta`, as bytes."""
    import gguf
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "vocab.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        for key, value in meta.items():
            if isinstance(value, list) and value and isinstance(value[0], float):
                w.add_array(key, value)  # written as float32
            elif isinstance(value, list) and value and isinstance(value[0], int):
                w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
            elif isinstance(value, bool):
                w.add_bool(key, value)
            elif isinstance(value, int):
                w.add_uint32(key, value)
            else:
                w.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.close()
        return path.read_bytes()


@functools.cache
def tokenizer_seeds() -> dict[str, bytes]:
    """Inputs of the target that load as valid files: name -> bytes (the mode byte, then the file)."""
    seeds = {}
    for kind in KINDS:
        meta = base_metadata(kind)
        seeds[f"file-{kind}"] = b"\x00" + gguf_bytes(meta)
        if kind == "gpt2":
            for pre in ("llama-bpe", "qwen2", "deepseek-llm", "falcon"):
                seeds[f"file-gpt2-{pre}"] = b"\x00" + gguf_bytes({**meta, "tokenizer.ggml.pre": pre})
    return seeds


class _Reader:
    """Reads values from fuzz bytes, deterministically; past the end every byte reads as 0."""

    def __init__(self, data: bytes):
        self.buf, self.pos = data, 0

    def byte(self) -> int:
        b = self.buf[self.pos] if self.pos < len(self.buf) else 0
        self.pos += 1
        return b

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi] (hi - lo < 65536)."""
        return lo + (self.byte() | self.byte() << 8) % (hi - lo + 1)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]

    def rest(self) -> bytes:
        out = self.buf[self.pos:]
        self.pos = len(self.buf)
        return out


_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.scores", "tokenizer.ggml.merges")
_IDS = ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id",
        "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_FLAGS = ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix")
_ODD_VALUES = (None, True, 0, 1, -1, 7, 2**32 - 1, 2**63, 1.5, math.nan, "", "x", "gpt2", b"\x00", [], [1], ["a b"])
_ODD_TEXTS = ("", " ", "a b", "  ", "Ġ", "▁", "<0x41>", "<0xZZ>", "\x00", "\ud800", "a\udcff", "ab", "Ġt", "x" * 300)


def _edit(meta: dict, r: _Reader) -> None:
    """Apply one structured edit, chosen by `r`, to `meta`."""
    from npllama.text.tokenizer import _PRE
    op = r.int(0, 12)
    tokens = meta.get("tokenizer.ggml.tokens")
    n = len(tokens) if isinstance(tokens, list) and tokens else 1
    if op == 0 and isinstance(tokens, list) and tokens:  # flip one byte of a token's UTF-8 text
        i = r.int(0, n - 1)
        raw = bytearray(str(tokens[i]).encode("utf-8", "surrogatepass"))
        if raw:
            raw[r.int(0, len(raw) - 1)] ^= 1 << r.int(0, 7)
        tokens[i] = bytes(raw).decode("utf-8", "surrogateescape")
    elif op == 1 and isinstance(tokens, list) and tokens:  # a token repeated
        tokens[r.int(0, n - 1)] = tokens[r.int(0, n - 1)]
    elif op == 2:  # an entry dropped or added at the end of an array
        key = r.pick(_ARRAYS)
        arr = meta.get(key)
        if isinstance(arr, list):
            if r.byte() & 1 and arr:
                del arr[r.int(0, len(arr) - 1)]
            else:
                arr.append(r.pick((*_ODD_TEXTS, 1, 0.0, 9)))
    elif op == 3 and isinstance(meta.get("tokenizer.ggml.token_type"), list) and meta["tokenizer.ggml.token_type"]:
        types = meta["tokenizer.ggml.token_type"]
        types[r.int(0, len(types) - 1)] = r.int(-2, 9)
    elif op == 4 and isinstance(meta.get("tokenizer.ggml.merges"), list) and meta["tokenizer.ggml.merges"]:
        merges = meta["tokenizer.ggml.merges"]
        i = r.int(0, len(merges) - 1)
        m = str(merges[i])
        merges[i] = r.pick((m.replace(" ", ""), m.replace(" ", "  "), " " + m, m + " ", " ".join(m.split()[::-1]),
                            r.pick(_ODD_TEXTS), merges[r.int(0, len(merges) - 1)]))
    elif op == 5:
        meta[r.pick(_IDS)] = r.pick((*_ODD_VALUES, n, n - 1, r.int(0, n)))
    elif op == 6:
        meta["tokenizer.ggml.pre"] = r.pick((*sorted(_PRE), "mystery", None, 5, ""))
    elif op == 7:
        meta["tokenizer.ggml.model"] = r.pick((*KINDS, "bert", "t5", None, 3))
    elif op == 8:
        meta[r.pick(_FLAGS)] = r.pick(_ODD_VALUES)
    elif op == 9 and isinstance(tokens, list) and tokens:
        tokens[r.int(0, n - 1)] = r.pick(_ODD_TEXTS)
    elif op == 10 and isinstance(meta.get("tokenizer.ggml.scores"), list) and meta["tokenizer.ggml.scores"]:
        scores = meta["tokenizer.ggml.scores"]
        scores[r.int(0, len(scores) - 1)] = r.pick((math.nan, math.inf, -math.inf, 1e308, -0.0, 1e-45))
    elif op == 11:  # a key of the wrong kind, or gone
        key = r.pick((*_ARRAYS, "tokenizer.chat_template"))
        value = r.pick(_ODD_VALUES)
        if value is None:
            meta.pop(key, None)
        else:
            meta[key] = value
    elif op == 12 and isinstance(tokens, list) and tokens:  # a control or user-defined token with odd text
        i = r.int(0, n - 1)
        tokens[i] = r.pick(_ODD_TEXTS)
        if isinstance(meta.get("tokenizer.ggml.token_type"), list) and i < len(meta["tokenizer.ggml.token_type"]):
            meta["tokenizer.ggml.token_type"][i] = r.pick((3, 4))


_scratch_dir: str | None = None


def _metadata_of_file(raw: bytes) -> dict:
    """The metadata of GGUF bytes (GGUFError when malformed), read from a scratch file."""
    from npllama.gguf.reader import read_metadata
    global _scratch_dir
    if _scratch_dir is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _scratch_dir = tempfile.mkdtemp(prefix="npllama-fuzz-tok-", dir=root)
    path = Path(_scratch_dir) / "vocab.gguf"
    path.unlink(missing_ok=True)  # a fresh inode: never rewrite a file that may still be mapped
    path.write_bytes(raw)
    return read_metadata(path)


def fuzz_tokenizer_one_input(data: bytes) -> None:
    """Build a tokenizer from metadata decoded from `data` and use it; raise only on a finding."""
    from npllama.text.tokenizer import StreamDecoder, Tokenizer
    r = _Reader(data)
    texts = list(TEXTS)
    try:
        if r.byte() % 2 == 0:
            meta = _metadata_of_file(r.rest())
        else:
            meta = base_metadata(r.pick(KINDS))
            for _ in range(r.int(0, 4)):
                _edit(meta, r)
            texts.append(r.rest().decode("utf-8", "replace"))
        tok = Tokenizer.from_metadata(meta)
    except ValueError:
        return
    pristine = _is_pristine_gpt2(meta)
    for text in texts:
        for special in (False, True):
            try:
                ids = tok.encode(text, special=special)
            except ValueError:  # add_bos with no BOS token
                ids = tok.encode(text, special=special, add_bos=False)
            assert all(type(i) is int and 0 <= i < tok.n_vocab for i in ids), ids
            decoded = tok.decode(ids)
            assert isinstance(decoded, str) and isinstance(tok.decode(ids, skip_special=True), str)
            stream = StreamDecoder(tok)
            streamed = "".join(stream.feed(i) for i in ids) + stream.flush()
            assert isinstance(streamed, str)
            if pristine and not special and ids[:1] != [tok.bos_id]:
                expected = unicodedata.normalize("NFC", text) if tok.pre in ("qwen2", "deepseek-r1-qwen") else text
                assert decoded == expected, (tok.pre, text, ids, decoded)
    for tid in range(tok.n_vocab):
        tok.id_to_bytes(tid), tok.token_to_piece(tid), tok.token_type(tid), tok.is_special(tid)


def _is_pristine_gpt2(meta: dict) -> bool:
    """Whether `meta` holds the gpt2 base's vocabulary unedited: then any text round-trips."""
    base = base_metadata("gpt2")
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"):
        value = meta.get(key)
        if (value.tolist() if hasattr(value, "tolist") else value) != base[key]:
            return False
    return True


def _worker(argv: list[str]) -> None:
    import atheris
    # Compiled kernels are imported first, as they are: atheris instruments every module of the
    # package imported under it, and would rewrite their bytecode, which Numba compiles.
    import npllama.kernels.splits  # noqa: F401 - a SentencePiece vocabulary's merges
    import npllama.kernels.strings  # noqa: F401 - the GGUF parser's string lengths
    with atheris.instrument_imports(include=INSTRUMENT):
        import npllama.gguf.reader  # noqa: F401 - imports (and so instruments) the modules under test
        import npllama.text.tokenizer  # noqa: F401
    fuzz_tokenizer_one_input(b"")  # warm caches outside the first timed input
    atheris.Setup(argv, fuzz_tokenizer_one_input)
    atheris.Fuzz()


CORPUS = HERE / "fuzz_corpus" / "tokenizer"


def write_seed_corpus() -> None:
    """(Re)write `tokenizer_seeds()` as tests/fuzz_corpus/tokenizer/seed-<name>; the regress-*
    files beside them are inputs that once escaped with another exception type."""
    CORPUS.mkdir(parents=True, exist_ok=True)
    for name, raw in tokenizer_seeds().items():
        (CORPUS / f"seed-{name}").write_bytes(raw)


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-seeds"]:
        write_seed_corpus()
    else:
        _worker(sys.argv)
