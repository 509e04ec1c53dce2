"""Fuzz targets: plain functions `fuzz_<name>_one_input(data: bytes)` that feed hostile input to
one part of npllama and raise only when the outcome is not allowed.

Allowed outcomes are success (with the invariants each target checks) or a ValueError (npllama's
errors all subclass it). Anything else escapes as an exception and counts as a crash: another
exception type, or a failed invariant (AssertionError). Hangs and runaway memory are caught by
the driver (libFuzzer's -timeout and -rss_limit_mb under atheris, a per-input clock otherwise).

The targets decode their bytes with `Data`, a small deterministic reader owned here (not
atheris' FuzzedDataProvider), so that a committed input means the same thing with or without
atheris and across atheris versions.

Run as a script, this module is the atheris worker for one target:
    python tests/fuzz_targets.py <target> [libFuzzer flags] [corpus dirs]
`run_campaign` spawns that worker and parses libFuzzer's statistics; tests/test_fuzz.py and
bench/fuzz.py use it.
"""
from __future__ import annotations

import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS_ROOT = HERE / "fuzz_corpus"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# Modules whose code coverage guides each target (atheris instruments them when they are imported).
INSTRUMENT = {
    "gguf": ["npllama.gguf.reader"],
    "chat": ["npllama.text.chat", "jinja2"],
    "sampling": ["npllama.generation.sampling"],
    "generate": ["npllama.generation.generate", "npllama.generation.api", "npllama.generation.sampling", "npllama.engine.session"],
}
TARGETS = tuple(INSTRUMENT)
try:  # the tokenizer's target lives in its own module; the campaign runs it too
    import fuzz_targets_tokenizer as _tokenizer_target
except ImportError:
    _tokenizer_target = None
else:
    INSTRUMENT["tokenizer"] = list(_tokenizer_target.INSTRUMENT)
CAMPAIGN_TARGETS = TARGETS + (("tokenizer",) if _tokenizer_target else ())
INSTRUMENT.update(selftest_crash=[], selftest_hang=[])  # check the driver itself (not campaign targets)


# --------------------------------------------------------------------------------------------
# Decoding bytes into values


class Data:
    """Reads values from fuzz bytes, deterministically; past the end every byte reads as 0."""

    def __init__(self, data: bytes):
        self.buf, self.pos = data, 0

    def byte(self) -> int:
        b = self.buf[self.pos] if self.pos < len(self.buf) else 0
        self.pos += 1
        return b

    def take(self, n: int) -> bytes:
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out + bytes(n - len(out))

    def int(self, lo: int, hi: int) -> int:
        """An integer in [lo, hi]."""
        span = hi - lo
        if span <= 0:
            return lo
        return lo + int.from_bytes(self.take((span.bit_length() + 7) // 8), "little") % (span + 1)

    def bool(self) -> bool:
        return bool(self.byte() & 1)

    def pick(self, seq):
        return seq[self.int(0, len(seq) - 1)]


SPECIAL_FLOATS = (0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-300, 5e-324, -5e-324, 1e-45, 1e308, -1e308,
                  3.4028235e38, -3.4028235e38, 3.5e38, 65504.0, 1 - 2**-53, 1 + 2**-52,
                  math.nan, -math.nan, math.inf, -math.inf)
SPECIAL_INTS = (0, 1, -1, 2, -2, 3, 40, 64, 255, 256, 2**31 - 1, 2**31, -2**31, 2**32, 2**63 - 1, 2**63,
                -2**63, 2**64, 10**30, -10**30, 10**5000)
TEXT_PIECES = ("", "a", " ", "hi", "\n", "\r\n", "\t", "\x00", "\x7f", "é", "日本", "🦙", "\u202e", "\ufeff",
               "\ud800", "\udfff", "'", '"', "\\", "{{ 7*7 }}", "{% for x in range(10**9) %}", "{#", "}}",
               "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>", "system", "user", "assistant",
               "Ġt", "he", "the", "STOP", "<0x41>")


def float_value(d: Data) -> float:
    """A float: a special value, an arbitrary bit pattern, or a small plain number."""
    mode = d.int(0, 3)
    if mode == 0:
        return d.pick(SPECIAL_FLOATS)
    if mode == 1:
        return struct.unpack("<d", d.take(8))[0]
    return d.int(-512, 512) / 64


def int_value(d: Data) -> int:
    return d.pick(SPECIAL_INTS) if d.bool() else d.int(-300, 300)


def text(d: Data, huge: bool = True) -> str:
    """A string built from awkward pieces (or raw bytes with lone surrogates), sometimes repeated
    up to a megabyte."""
    if d.int(0, 3) == 0:
        s = d.take(d.int(0, 64)).decode("utf-8", "surrogateescape")
    else:
        s = "".join(d.pick(TEXT_PIECES) for _ in range(d.int(0, 8)))
    if huge and d.int(0, 15) == 0:
        s = s * d.pick((2, 1000, 2**16, 2**20))
    return s


class _Opaque:
    """An object no library knows how to handle."""

    def __repr__(self) -> str:
        return "<opaque>"


def hostile(d: Data, depth: int = 0, deep: bool = True):
    """A value of an odd type: scalars of every kind, numpy values, containers (nested, cyclic,
    or, with `deep`, nested past Python's recursion limit), and objects of no known type.

    Keyword parameters get deep=False: a scalar option given a list nested 100000 levels tests
    Python's repr and comparisons rather than npllama; message content keeps it."""
    import numpy as np
    kinds = 26 if depth < 3 else 17
    kind = d.int(0, kinds - 1)
    if kind == 0:
        return None
    if kind == 1:
        return d.bool()
    if kind == 2:
        return int_value(d)
    if kind == 3:
        return float_value(d)
    if kind == 4:
        return text(d)
    if kind == 5:
        return d.take(d.int(0, 8))
    if kind == 6:
        return np.float32(float_value(d)) if d.bool() else np.float64(float_value(d))
    if kind == 7:
        return d.pick((np.int64(int_value(d) % 2**63), np.uint64(2**64 - 1), np.int8(-1), np.bool_(d.bool())))
    if kind == 8:
        return np.str_(text(d, huge=False))
    if kind == 9:
        return complex(float_value(d), float_value(d))
    if kind == 10:
        return Fraction(d.int(-9, 9), d.int(1, 9))
    if kind == 11:
        return _Opaque()
    if kind == 12:
        return d.pick((int, str, print, math, Ellipsis, NotImplemented))
    if kind == 13:
        return bytearray(d.take(d.int(0, 4)))
    if kind == 14:
        return np.arange(d.int(0, 4)) if d.bool() else np.full((2, 2), float_value(d))
    if kind == 15:
        cyclic: list = []
        cyclic.append(cyclic)
        return cyclic
    if kind == 16:
        deep: list | dict = []
        for _ in range(d.pick((10, 1000, 100_000)) if deep else 10):
            deep = [deep] if d.bool() else {"k": deep}
        return deep
    n = d.int(0, 4)
    if kind in (17, 18):
        return [hostile(d, depth + 1, deep) for _ in range(n)]
    if kind == 19:
        return tuple(hostile(d, depth + 1, deep) for _ in range(n))
    if kind in (20, 21, 22):
        out = {}
        for _ in range(n):
            key = d.pick(("role", "content", "name", "type", "function", "arguments", "tool_calls"))
            if d.int(0, 3) == 0:
                key = d.pick((None, 0, 1.5, True, (1, 2), b"k", text(d, huge=False)))
            out[key] = hostile(d, depth + 1, deep)
        return out
    if kind == 23:
        return {hostile_hashable(d) for _ in range(n)}
    if kind == 24:
        return frozenset(hostile_hashable(d) for _ in range(n))
    return range(d.int(0, 5))


def hostile_hashable(d: Data):
    return d.pick((None, True, 0, -1, 2**70, 1.5, math.nan, "k", b"k", (1, "a"), frozenset()))


# --------------------------------------------------------------------------------------------
# GGUF files


# The data section that follows a fuzzed header: as long as the largest seed's tensor data, so
# that a seed header loads, and zeros, which any tensor type accepts.
GGUF_DATA_BYTES = 64 * 1024
_scratch_dir: str | None = None


def _scratch() -> Path:
    global _scratch_dir
    if _scratch_dir is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        _scratch_dir = tempfile.mkdtemp(prefix="npllama-fuzz-", dir=root)
    return Path(_scratch_dir) / "case.gguf"


def fuzz_gguf_one_input(data: bytes) -> None:
    """`data` is a GGUF header, metadata and tensor table; the file is that plus zeroed tensor data.
    GGUFFile must load it (with a consistent result) or raise GGUFError naming the file."""
    from npllama.errors import GGUFError
    from npllama.gguf.reader import GGUFFile

    path = _scratch()
    path.unlink(missing_ok=True)  # a fresh inode: never rewrite a file that may still be mapped
    path.write_bytes(data + bytes(GGUF_DATA_BYTES))
    try:
        gf = GGUFFile(path)
    except GGUFError as e:
        assert str(path) in str(e), f"GGUFError does not name the file: {e}"
        return
    size = len(data) + GGUF_DATA_BYTES
    cfg = gf.config
    for t in gf.tensors.values():
        assert t.data.nbytes == t.n_bytes and gf.data_offset <= t.offset and t.offset + t.n_bytes <= size
    for name in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab", "n_ctx", "rope_dim"):
        value = getattr(cfg, name)
        assert type(value) is int and value > 0, (name, value)
    assert cfg.n_head % cfg.n_head_kv == 0 and cfg.rope_dim <= cfg.head_dim and cfg.rope_dim % 2 == 0
    assert math.isfinite(cfg.rope_base) and cfg.rope_base > 0 and math.isfinite(cfg.rms_eps) and cfg.rms_eps > 0
    tokens = gf.metadata.get("tokenizer.ggml.tokens")
    assert tokens is None or len(tokens) <= cfg.n_vocab
    assert gf.tensor("token_embd.weight").shape == (cfg.n_vocab, cfg.n_embd)


def gguf_seeds() -> dict[str, bytes]:
    """Headers of tiny valid models of each supported shape of file (name -> bytes)."""
    from gguf import GGMLQuantizationType as QT
    from npllama.gguf.reader import GGUFFile
    from tinygguf import write_tiny_llama

    small = dict(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32)
    variants = {
        "llama-q8_0": dict(qtype=QT.Q8_0),
        "llama-f16-untied-rope-linear": dict(qtype=QT.F16, tied=False, extra_kv={
            "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}),
        "qwen2-q4_0": dict(qtype=QT.Q4_0, arch="qwen2", extra_kv={"qwen2.attention.key_length": 16}),
        "mistral-q8_0-ctx32": dict(qtype=QT.Q8_0, arch="mistral", n_ctx=32),
    }
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in variants.items():
            path = write_tiny_llama(Path(tmp) / f"{name}.gguf", **{**small, **kw})
            raw = path.read_bytes()
            head = raw[:GGUFFile(path).data_offset]
            assert len(raw) - len(head) <= GGUF_DATA_BYTES, name
            out[name] = head
    return out


# --------------------------------------------------------------------------------------------
# Chat templates


def _chat_templates() -> list[tuple[str | None, str, str]]:
    """(template or None for the ChatML fallback, bos_token, eos_token) of the fixture templates."""
    fixtures = HERE / "fixtures"
    smollm2 = json.loads((fixtures / "chat_smollm2.json").read_text())
    features = json.loads((fixtures / "chat_features.json").read_text())
    out = [(None, "", ""), (smollm2["template"], smollm2["bos_token"], smollm2["eos_token"])]
    out += [(t, features["bos_token"], "") for t in features["templates"].values()]
    return out


_templates_cache: list | None = None


def _message(d: Data):
    if d.int(0, 7) == 0:
        return hostile(d)
    from npllama.text.chat import ROLES
    msg: dict = {}
    if d.int(0, 15):
        msg["role"] = d.pick(ROLES) if d.int(0, 7) else hostile(d)
    if d.int(0, 15):
        msg["content"] = text(d) if d.int(0, 7) else hostile(d)
    for _ in range(d.int(0, 2)):
        msg[d.pick(("name", "tool_calls", "tool_call_id", "content_parts", "extra"))] = hostile(d)
    if d.int(0, 31) == 0:
        msg = {k: v for k, v in reversed(list(msg.items()))}
    return msg


def fuzz_chat_one_input(data: bytes) -> None:
    """format_chat with a real template and hostile messages must return a str or raise
    ValueError; the ChatML fallback must contain every message's content verbatim."""
    from npllama.text.chat import format_chat
    global _templates_cache
    if _templates_cache is None:
        _templates_cache = _chat_templates()
    d = Data(data)
    template, bos, eos = d.pick(_templates_cache)
    if d.int(0, 15) == 0:
        messages = hostile(d)
    else:
        messages = [_message(d) for _ in range(d.int(0, 6))]
        if d.int(0, 31) == 0:
            messages.append(messages)  # a list that contains itself
    kwargs = {}
    if d.int(0, 3) == 0:
        kwargs["add_generation_prompt"] = hostile(d, deep=False) if d.bool() else d.bool()
    if d.int(0, 3) == 0:
        kwargs[d.pick(("tools", "documents", "date_string"))] = hostile(d)
    if d.int(0, 7) == 0:
        bos, eos = hostile(d, deep=False), hostile(d, deep=False)
    try:
        out = format_chat(template, messages, bos_token=bos, eos_token=eos, **kwargs)
    except ValueError:
        return
    assert isinstance(out, str), type(out)
    if template is None:
        for m in messages:
            assert m["content"] in out


# --------------------------------------------------------------------------------------------
# Sampling parameters

_PLAUSIBLE = {
    "temperature": lambda d: d.int(0, 200) / 100,
    "top_k": lambda d: d.int(0, 300),
    "top_p": lambda d: d.int(1, 100) / 100,
    "min_p": lambda d: d.int(0, 100) / 100,
    "repeat_penalty": lambda d: d.int(1, 200) / 100,
    "repeat_last_n": lambda d: d.int(-1, 100),
    "presence_penalty": lambda d: d.int(-200, 200) / 100,
    "frequency_penalty": lambda d: d.int(-200, 200) / 100,
    "seed": lambda d: d.int(0, 2**32),
}


def _bias(d: Data, n_vocab: int):
    import numpy as np
    if d.int(0, 7) == 0:
        return hostile(d, deep=False)
    out = {}
    for _ in range(d.int(0, 6)):
        mode = d.int(0, 7)
        key = (d.int(0, n_vocab - 1) if mode < 5 else d.int(-2, n_vocab + 2) if mode == 5
               else np.int64(d.int(0, n_vocab - 1)) if d.bool() else hostile_hashable(d))
        mode = d.int(0, 7)
        out[key] = (d.int(-1000, 1000) / 10 if mode < 4 else -math.inf if mode == 4 else float_value(d)
                    if mode == 5 else np.float32(d.int(-10, 10)) if mode == 6 else hostile(d, deep=False))
    return out


def sampling_options(d: Data, n_vocab: int) -> dict:
    """Keyword arguments of SamplingParams: each absent, plausible, extreme or of an odd type."""
    kw = {}
    for name in (*_PLAUSIBLE, "logit_bias"):
        mode = d.int(0, 7)
        if mode < 3:
            continue
        if name == "logit_bias":
            kw[name] = _bias(d, n_vocab)
        elif mode < 6:
            kw[name] = _PLAUSIBLE[name](d)
        elif mode == 6:
            kw[name] = float_value(d) if d.bool() else int_value(d)
        else:
            kw[name] = hostile(d, deep=False)
    return kw


def logits_value(d: Data, n_vocab: int):
    """float32 logits like a model's (finite), with ties and extremes now and then."""
    import numpy as np
    mode = d.int(0, 3)
    if mode == 0:
        return np.random.default_rng(d.int(0, 2**16)).standard_normal(n_vocab).astype(np.float32) * 3
    if mode == 1:
        return np.full(n_vocab, d.int(-5, 5), np.float32)
    values = [d.pick((0.0, 1.0, -1.0, 30.0, -30.0, 3e38, -3e38, 1e-38)) if d.bool() else d.int(-100, 100) / 8
              for _ in range(n_vocab)]
    return np.array(values, np.float32)


def fuzz_sampling_one_input(data: bytes) -> None:
    """SamplingParams(**hostile keywords) must be valid or raise ValueError; its sampler must then
    return a valid id that logit_bias did not ban, leave the logits unchanged, and be greedy
    where the parameters say so."""
    import numpy as np
    from npllama.generation.sampling import SamplingParams, make_sampler

    d = Data(data)
    n_vocab = d.pick((1, 2, 3, 10, 300))
    kw = sampling_options(d, n_vocab)
    try:
        params = SamplingParams(**kw)
        sampler = make_sampler(params)
    except ValueError:
        return
    for _ in range(d.int(1, 3)):
        logits = logits_value(d, n_vocab)
        history = [d.int(0, n_vocab - 1) for _ in range(d.int(0, 8))]
        before = logits.copy()
        try:
            tid = sampler(logits, history)
        except ValueError:
            continue
        assert type(tid) is int and 0 <= tid < n_vocab, tid
        assert np.array_equal(logits, before), "the sampler changed its input logits"
        bias = params.logit_bias or {}
        assert not any(int(k) == tid and float(v) == -math.inf for k, v in bias.items()), \
            f"sampled token {tid}, which logit_bias bans"
        plain = (not bias and params.repeat_penalty == 1 and params.presence_penalty == 0
                 and params.frequency_penalty == 0)
        if plain and (params.temperature == 0 or params.top_k == 1):
            assert logits[tid] == logits.max(), (tid, logits)


# --------------------------------------------------------------------------------------------
# Generation keywords, through the text API over a stand-in model


class _StubCache:
    def __init__(self):
        self.length = 0

    def reset(self):
        self.length = 0

    def truncate(self, n):
        self.length = min(self.length, n)


class _StubModel:
    """The parts of `Model` that the text API uses, with logits from a seeded generator instead of
    a network: the real tokenizer (the tiny test vocabulary), Session and id checks."""

    def __init__(self, tokenizer, n_ctx: int, seed: int, peak: int):
        import numpy as np
        from npllama.model import Model
        from npllama.gguf.reader import ModelConfig
        self.tokenizer = tokenizer
        self.config = ModelConfig(arch="llama", n_layer=1, n_embd=8, n_head=1, n_head_kv=1, head_dim=8, n_ff=8,
                                  n_vocab=tokenizer.n_vocab, n_ctx=n_ctx, rope_base=1e4, rope_dim=8,
                                  rope_scaling_type=None, rope_scaling_factor=1.0, rope_neox=False, rms_eps=1e-5,
                                  tied_output=True, attn_bias=False, has_rope_freqs=False)
        self.threads = None
        self.check_ids = Model.check_ids.__get__(self)
        self.tokenize = Model.tokenize.__get__(self)
        self._rng = np.random.default_rng(seed)
        self._peak = peak

    def session(self, *, ctx=None, threads=None):
        from npllama.engine.session import Session
        return Session(self, ctx=ctx, threads=threads)

    def new_cache(self):
        return _StubCache()

    def check_cache(self, cache):
        pass

    def _run(self, ids, cache, all_logits, output, threads):
        import numpy as np
        assert output == "logits" and not all_logits
        cache.length += len(ids)
        logits = self._rng.standard_normal(self.config.n_vocab).astype(np.float32)
        logits[self._peak % self.config.n_vocab] += 4.0  # a likely token (an end of turn, now and then)
        return logits


_tokenizer_cache = None


def _tiny_tokenizer():
    global _tokenizer_cache
    if _tokenizer_cache is None:
        from npllama.text.tokenizer import Tokenizer
        from tinygguf import CHAT_TEMPLATE, tiny_vocab
        tokens, types, merges = tiny_vocab()
        _tokenizer_cache = Tokenizer.from_metadata({
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.add_bos_token": False, "tokenizer.chat_template": CHAT_TEMPLATE})
    return _tokenizer_cache


def fuzz_generate_one_input(data: bytes) -> None:
    """complete()/generate() with hostile prompts and keywords (max_tokens, stop, logprobs,
    truncate, ctx, every sampling option) must finish with a consistent result or raise ValueError."""
    from npllama.generation import api as textapi
    from npllama.generation.generate import Completion

    d = Data(data)
    tok = _tiny_tokenizer()
    model = _StubModel(tok, n_ctx=d.pick((4, 16, 64, 512)), seed=d.int(0, 255), peak=d.int(0, 3))
    if d.int(0, 3):
        prompt = text(d, huge=False) if d.bool() else [d.int(0, tok.n_vocab - 1) for _ in range(d.int(0, 20))]
    else:
        prompt = d.pick(([-1], [tok.n_vocab], [1.5], [[1]], [True], [2**70])) if d.bool() else hostile(d, deep=False)
        if isinstance(prompt, str):
            prompt = prompt[:10_000]  # tokenizing megabytes is slow, not wrong (the tokenizer target's matter)
    kw = sampling_options(d, tok.n_vocab)
    plausible = {
        "max_tokens": lambda: d.int(0, 40),
        "stop": lambda: (text(d, huge=False) if d.bool()
                         else [text(d, huge=False) for _ in range(d.int(0, 3))]),
        "logprobs": lambda: d.int(0, 5),
        "truncate": lambda: d.bool(),
        "ctx": lambda: d.pick((None, 1, 2, 8, 64)),
    }
    for name, make in plausible.items():
        mode = d.int(0, 7)
        if mode < 2:
            continue
        kw[name] = make() if mode < 6 else int_value(d) if mode == 6 else hostile(d, deep=False)
    call = d.int(0, 2)
    try:
        if call == 0:
            result = textapi.complete_text(model, prompt, **kw)
        else:
            result = textapi.generate(model, prompt, stream=call == 2, **kw)
            if call == 2:
                result = list(result)
    except ValueError:
        return
    if call == 0:
        assert isinstance(result, Completion) and result.finish_reason in ("stop", "length")
        assert len(result.tokens) <= kw.get("max_tokens", 256)
        n = kw.get("logprobs", 0)
        for t in result.tokens:
            assert 0 <= t.id < tok.n_vocab
            if n:
                assert t.logprob <= 0 and len(t.top_logprobs) == min(n, tok.n_vocab)
        out = result.text
    else:
        assert isinstance(result, str) or all(isinstance(p, str) and p for p in result), result
        out = result if isinstance(result, str) else "".join(result)
    stops = kw.get("stop", ())
    for s in [stops] if isinstance(stops, str) else stops:
        assert not s or s not in out, (s, out)


def fuzz_selftest_crash_one_input(data: bytes) -> None:
    """A planted bug, so that a test can check that the driver reports a crash with its input."""
    if data[:1] == b"*":
        raise RuntimeError("planted crash")


def fuzz_selftest_hang_one_input(data: bytes) -> None:
    """A planted hang on any non-empty input, for the same check of the hang detection."""
    if data:
        time.sleep(30)


# --------------------------------------------------------------------------------------------
# Corpus and drivers


def target_function(name: str):
    if name == "tokenizer" and _tokenizer_target:
        return _tokenizer_target.fuzz_tokenizer_one_input
    return globals()[f"fuzz_{name}_one_input"]


def corpus_dir(name: str) -> Path:
    return CORPUS_ROOT / name


def corpus(name: str) -> list[tuple[str, bytes]]:
    """The committed inputs of a target: (file name, bytes), sorted by name."""
    folder = corpus_dir(name)
    return sorted((p.name, p.read_bytes()) for p in folder.iterdir() if p.is_file()) if folder.is_dir() else []


def write_seed_corpus() -> None:
    """(Re)write the generated seeds: GGUF headers; for the other targets a few byte patterns."""
    seeds = {"gguf": gguf_seeds()}
    rnd = random.Random(20)
    for name in ("chat", "sampling", "generate"):
        seeds[name] = {"zeros": bytes(64), "ones": b"\x01" * 64, "ff": b"\xff" * 64,
                       **{f"random-{i}": rnd.randbytes(rnd.choice((16, 64, 256))) for i in range(5)}}
    for name, entries in seeds.items():
        corpus_dir(name).mkdir(parents=True, exist_ok=True)
        for file_name, raw in entries.items():
            (corpus_dir(name) / f"seed-{file_name}").write_bytes(raw)


@dataclass
class CampaignResult:
    target: str
    seconds: float
    executions: int | None
    coverage: int | None      # libFuzzer's "cov": instrumented edges reached
    features: int | None      # libFuzzer's "ft"
    corpus_size: int | None
    crash: bytes | None       # the input that crashed, timed out or ran out of memory
    crash_kind: str | None    # "crash", "timeout", "oom", "leak"
    returncode: int
    output: str


def run_campaign(target: str, seconds: int, *, work_dir: Path, seed: int = 0, timeout_per_input: int = 20,
                 rss_limit_mb: int = 3072, max_len: int = 8192, extra_args: tuple[str, ...] = ()) -> CampaignResult:
    """Run the atheris worker for `target` for `seconds`, on a scratch corpus seeded with the
    committed one (which stays untouched), and return its statistics and any crashing input."""
    work_dir = Path(work_dir)
    scratch = work_dir / f"corpus-{target}"
    scratch.mkdir(parents=True, exist_ok=True)
    artifacts = work_dir / f"artifacts-{target}"
    artifacts.mkdir(parents=True, exist_ok=True)
    max_len = max(max_len, max((len(raw) for _, raw in corpus(target)), default=0) + 1024)
    cmd = [sys.executable, str(Path(__file__).resolve()), target,
           f"-max_total_time={seconds}", f"-timeout={timeout_per_input}", f"-rss_limit_mb={rss_limit_mb}",
           f"-max_len={max_len}", f"-seed={seed}", "-print_final_stats=1",
           f"-artifact_prefix={artifacts}/", *extra_args, str(scratch)]
    if corpus_dir(target).is_dir():
        cmd.append(str(corpus_dir(target)))
    start = time.perf_counter()
    # the worker's own wall clock bound: libFuzzer stops at max_total_time, plus startup and one slow input
    # through a shell that forks it: a process exec'd straight from this one inherits this
    # process's peak RSS (Linux keeps it across fork + exec), which libFuzzer's -rss_limit_mb
    # reads as the worker's own, so a test process that once held gigabytes made every input "oom"
    proc = subprocess.run(["sh", "-c", '"$@"; exit $?', "sh", *cmd], capture_output=True, text=True,
                          errors="replace", timeout=seconds + timeout_per_input + 120)
    elapsed = time.perf_counter() - start
    out = proc.stdout + proc.stderr

    def stat(pattern):
        found = re.findall(pattern, out)
        return int(found[-1]) if found else None

    crash = kind = None
    for p in sorted(artifacts.iterdir()):
        kind = p.name.split("-", 1)[0]
        crash = p.read_bytes()
        break
    return CampaignResult(target, elapsed, stat(r"stat::number_of_executed_units:\s*(\d+)"), stat(r"\bcov: (\d+)"),
                          stat(r"\bft: (\d+)"), stat(r"\bcorp: (\d+)"), crash, kind, proc.returncode, out)


def run_random(target: str, seconds: float, seed: int = 0, max_len: int = 8192) -> tuple[int, bytes | None, str]:
    """The driver without atheris: the committed corpus, then seeded random mutations of it, for
    `seconds`. Returns (executions, the first input that failed or took over 20 s, its error)."""
    fn = target_function(target)
    inputs = [raw for _, raw in corpus(target)] or [b""]
    rnd = random.Random(seed)
    n, end = 0, time.perf_counter() + seconds
    queue = list(inputs)
    while True:
        if queue:
            raw = queue.pop(0)
        else:
            buf = bytearray(rnd.choice(inputs))
            for _ in range(rnd.randint(1, 8)):
                op = rnd.randrange(4)
                at = rnd.randrange(len(buf) + 1)
                if op == 0 and buf:
                    buf[at % len(buf)] = rnd.randrange(256)
                elif op == 1:
                    buf[at:at] = rnd.randbytes(rnd.randint(1, 8))
                elif op == 2:
                    del buf[at:at + rnd.randint(1, 8)]
                else:
                    buf[at:at + 8] = rnd.choice((2**64 - 1, 2**63, 2**32, 0, 1)).to_bytes(8, "little")
            raw = bytes(buf[:max(max_len, len(max(inputs, key=len)))])
        t0 = time.perf_counter()
        try:
            fn(raw)
        except Exception as e:  # noqa: BLE001 - any escape is the finding
            return n + 1, raw, f"{type(e).__name__}: {e}"
        n += 1
        if time.perf_counter() - t0 > 20:
            return n, raw, "took more than 20 s"
        if time.perf_counter() > end and not queue:
            return n, None, ""


def _worker(argv: list[str]) -> None:
    import atheris
    target = argv[1]
    # Compiled kernels are imported first, as they are: atheris would rewrite their bytecode,
    # which Numba compiles (and keys its cache on), and no Python runs inside them to cover.
    import npllama.kernels.strings  # noqa: F401 - the GGUF parser's string lengths
    import npllama.kernels.splits  # noqa: F401 - a SentencePiece vocabulary's merges
    if INSTRUMENT[target]:  # (an empty include list would instrument every module imported)
        with atheris.instrument_imports(include=INSTRUMENT[target]):
            import npllama  # noqa: F401 - imports (and so instruments) the modules under test
            import npllama.text.chat, npllama.gguf.reader, npllama.generation.generate, npllama.generation.sampling, npllama.generation.api  # noqa: E401,F401
            import npllama.text.tokenizer  # noqa: F401
            import jinja2  # noqa: F401
    fn = target_function(target)
    fn(b"")  # warm caches (templates, tokenizer) outside the first timed input
    atheris.Setup([argv[0], *argv[2:]], fn)
    atheris.Fuzz()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--write-seeds":
        write_seed_corpus()
    else:
        _worker(sys.argv)
