"""Structured output: generation constrained to a JSON Schema, a regular expression or a Lark
grammar, with llguidance (the constraint engine llama.cpp, vLLM and SGLang use).

`constraint(model, json_schema=..., regex=..., grammar=...)` checks and compiles the constraint
for the model's vocabulary (ValueError naming the problem, before any token is generated) and
returns a `Constraint`, or None when none of the three is given. Compiled constraints are cached
per vocabulary, so a schema is compiled once. Each generated sequence takes its own `Matcher`
(`Constraint.matcher()`), which masks the logits before sampling (the tokens the constraint
forbids get -inf; end-of-turn/EOS only where the output is complete) and follows the sampled
tokens.

What a constraint means:

* `json_schema` (a dict, or a JSON string of one): the whole output is one JSON value valid under
  the schema (Draft 2020-12, as llguidance implements it; object properties come in the
  schema's order). A keyword llguidance cannot enforce (`uniqueItems`, `contains`, `not`...) is
  an error, never silently dropped. So that a small schema always ends within a modest
  `max_tokens`, whitespace between JSON tokens is at most one space or tab, or one newline and
  up to `INDENT_MAX` spaces or tabs of indentation, at each place; integers without bounds lie within
  +-(2**53 - 1) (where JSON numbers are exact in every implementation); numbers without a
  `multipleOf` are written without an exponent, with at most `FRACTION_DIGITS` decimals, in the
  same range. A schema's own top-level ``"x-guidance"`` options (llguidance's) override the
  whitespace rule.
* `regex` (Python `re` syntax): the whole output matches it (as `re.fullmatch`). `\\d` takes
  ASCII digits only (unless the pattern has `\\D` or a negated class), a subset of Python's.
  Python syntax that llguidance's regex engine lacks (look-around, backreferences, `\\b`, `\\Z`,
  `{,n}`) is an error.
* `grammar`: llguidance's Lark-like grammar text (https://github.com/guidance-ai/llguidance,
  docs/syntax.md); the whole output is a sentence of its `start` rule.
"""
from __future__ import annotations

import json
import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

__all__ = ["Constraint", "Matcher", "constraint", "CONSTRAINT_KEYS"]

CONSTRAINT_KEYS = ("json_schema", "regex", "grammar")  # the generation keywords that constrain output
INDENT_MAX = 20
WHITESPACE = r"(?:[\x20\x09]|\x0D?\x0A[\x20\x09]{0,%d})" % INDENT_MAX  # a space, or a newline and indentation
INT_LIMIT = 2**53 - 1
FRACTION_DIGITS = 10  # llguidance's multipleOf takes at most 1e-10
CACHE_SIZE = 64  # compiled constraints kept per vocabulary

_lock = threading.Lock()
_vocabs: "weakref.WeakKeyDictionary[Any, dict[int, _Vocab]]" = weakref.WeakKeyDictionary()


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured output (json_schema=, regex=, grammar=) needs llguidance: "
                          "pip install 'npllama[structured]'") from None
    return llguidance


class _Tokens:
    """What llguidance.TokenizerWrapper reads from a tokenizer: each id's bytes (empty for the
    ids past the vocabulary that the model's logits still have), the control ids, and encode."""

    def __init__(self, tok, n_vocab: int, eos: int | None):
        n = min(tok.n_vocab, n_vocab)
        self.tokens = [tok.id_to_bytes(i) for i in range(n)] + [b""] * (n_vocab - n + (eos == n_vocab))
        self.eos_token_id = eos
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]
        self._tok = tok

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode_inner(text)


class _Vocab:
    """One model vocabulary as llguidance sees it, with the constraints compiled for it."""

    def __init__(self, tok, n_vocab: int):
        llg = _llguidance()
        eos = sorted(i for i in tok.eot_ids if i < n_vocab)
        # a vocabulary without an end-of-turn token gets a stand-in past the logits, never sampled
        self.eos = eos or [n_vocab]
        self.n_vocab = n_vocab
        self.llt = llg.LLTokenizer(llg.TokenizerWrapper(_Tokens(tok, n_vocab, self.eos[0])), eos_token=self.eos)
        self.words = (self.llt.vocab_size + 31) // 32
        self.compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.lock = threading.Lock()


def _vocab(model) -> _Vocab:
    tok, n_vocab = model.tokenizer, model.config.n_vocab
    with _lock:
        per_tok = _vocabs.setdefault(tok, {})
        v = per_tok.get(n_vocab)
        if v is None:
            v = per_tok[n_vocab] = _Vocab(tok, n_vocab)
    return v


def _bound_numbers(schema):
    """`schema` with digit runs bounded: each number or integer subschema without an enum or
    const gets the bounds it lacks (+-INT_LIMIT, where its other bound allows), and each number
    one without multipleOf gets multipleOf 10**-FRACTION_DIGITS. Values are only ever narrowed:
    what conforms to the result conforms to `schema`. Walks only the keywords that hold
    subschemas (not enum/const data)."""
    if isinstance(schema, list):
        return [_bound_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA or key in _SUBSCHEMA_LISTS:
            out[key] = _bound_numbers(value)
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: _bound_numbers(v) for k, v in value.items()}
        else:
            out[key] = value
    types = out.get("type")
    types = [types] if isinstance(types, str) else types if isinstance(types, list) else []
    types = {t for t in types if isinstance(t, str)}  # anything else is left for llguidance to refuse
    if not {"integer", "number"} & types or "enum" in out or "const" in out:
        return out

    def num(key):
        v = out.get(key)
        return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    lo = num("minimum") if num("minimum") is not None else num("exclusiveMinimum")
    hi = num("maximum") if num("maximum") is not None else num("exclusiveMaximum")
    if "minimum" not in out and "exclusiveMinimum" not in out and (hi is None or hi >= -INT_LIMIT):
        out["minimum"] = -INT_LIMIT
    if "maximum" not in out and "exclusiveMaximum" not in out and (lo is None or lo <= INT_LIMIT):
        out["maximum"] = INT_LIMIT
    if "number" in types and "multipleOf" not in out:
        out["multipleOf"] = float(f"1e-{FRACTION_DIGITS}")
    return out


_SUBSCHEMA = frozenset(["items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                        "unevaluatedItems", "unevaluatedProperties", "additionalItems"])
_SUBSCHEMA_LISTS = frozenset(["allOf", "anyOf", "oneOf", "prefixItems"])  # (and "items" in old drafts)
_SUBSCHEMA_MAPS = frozenset(["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"])


def _show(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _json_schema(schema) -> tuple[str, dict]:
    """(cache key, schema dict) of a json_schema argument; ValueError when it is not one."""
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON Schema object (a dict, or a JSON string of one), "
                         f"got {type(schema).__name__}")
    try:
        key = json.dumps(schema, allow_nan=False)  # property order matters: not sorted
    except (TypeError, ValueError) as e:
        raise ValueError(f"json_schema is not plain JSON data: {e}") from None
    return key, schema


def _regex_grammar(llg, regex: str) -> str:
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"regex {_show(regex)} is not a valid regular expression: {e}") from None
    if "\\D" not in regex and "[^" not in regex:
        # \d as ASCII digits: Python's \d also takes other scripts' digits (a model may start one
        # with a byte token and be forced to finish it); only where that narrows the pattern
        regex = llg.regex_to_lark(regex, "d")
    return llg.LLMatcher.grammar_from_regex(regex)


def _one_line(message: str) -> str:
    """An llguidance message on one line: its "error: ..." lines, else its first line."""
    lines = [ln.strip() for ln in message.strip().splitlines()]
    errors = [ln[len("error:"):].strip() for ln in lines if ln.startswith("error:")]
    return "; ".join(errors) if errors else lines[0] if lines else message


_WHAT = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar (llguidance Lark format)"}


def constraint(model, *, json_schema=None, regex=None, grammar=None) -> "Constraint | None":
    """The compiled constraint for `model` (None when none is given); ValueError for more than
    one, or for a schema, regex or grammar that is invalid or that llguidance cannot enforce."""
    given = {k: v for k, v in zip(CONSTRAINT_KEYS, (json_schema, regex, grammar)) if v is not None}
    if not given:
        return None
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and grammar, not {' and '.join(given)}")
    (kind, value), = given.items()
    try:
        return _compile(model, kind, value)
    except RecursionError:  # a schema (or the JSON text of one) nested past Python's recursion limit
        raise ValueError(f"{_WHAT[kind]} is nested too deeply to compile; flatten it (a JSON Schema can name "
                         f"repeated parts in $defs and refer to them with $ref)") from None


def _compile(model, kind: str, value) -> "Constraint":
    llg = _llguidance()
    if kind == "json_schema":
        key, value = _json_schema(value)
    elif not isinstance(value, str) or not value.strip() and kind == "grammar":
        raise ValueError(f"regex must be a string (a Python regular expression), got {type(value).__name__}"
                         if kind == "regex" else
                         "grammar must be a non-empty string in llguidance's Lark format (start: ...)")
    else:
        key = value
    vocab = _vocab(model)
    with vocab.lock:
        template = vocab.compiled.get((kind, key))
        if template is not None:
            vocab.compiled.move_to_end((kind, key))
            return Constraint(vocab, kind, template)
    if kind == "json_schema":
        try:
            own = value.get("x-guidance")
            own = own if isinstance(own, dict) else {}
            text = llg.LLMatcher.grammar_from_json_schema(
                json.dumps(_bound_numbers(value)),
                defaults=None if {"whitespace_flexible", "whitespace_pattern"} & set(own) else
                {"whitespace_pattern": WHITESPACE})
        except ValueError as e:
            raise ValueError(f"invalid json_schema: {_one_line(str(e))}") from None
    elif kind == "regex":
        text = _regex_grammar(llg, value)
    else:
        text = llg.LLMatcher.grammar_from_lark(value)
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, vocab.llt)
    if messages:
        msg = "; ".join(_one_line(m) for m in messages)
        unsupported = "Unimplemented" in msg or "not supported" in msg or not is_error
        if unsupported:
            msg += (" (npllama constrains output with llguidance, which cannot enforce this; change the "
                    "constraint rather than have part of it ignored)")
        shown = "" if kind == "json_schema" else f" {_show(value)}"
        raise ValueError(f"{'unsupported' if unsupported else 'invalid'} {_WHAT[kind]}{shown}: {msg}")
    template = llg.LLMatcher(vocab.llt, text, log_level=0)
    if template.is_error():
        raise ValueError(f"invalid {_WHAT[kind]}: {_one_line(template.get_error())}")
    with vocab.lock:
        vocab.compiled[(kind, key)] = template
        while len(vocab.compiled) > CACHE_SIZE:
            vocab.compiled.popitem(last=False)
    return Constraint(vocab, kind, template)


class Constraint:
    """A constraint compiled for one vocabulary; `matcher()` starts a sequence under it."""

    def __init__(self, vocab: _Vocab, kind: str, template):
        self._vocab, self.kind, self._template = vocab, kind, template

    def matcher(self) -> "Matcher":
        return Matcher(self)

    def accepts(self, text: str) -> bool:
        """Whether `text` as a whole satisfies the constraint."""
        m = self._template.deep_copy()
        ids = self._vocab.llt.tokenize_str(text)
        return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


class Matcher:
    """One sequence's place in a constraint: `mask(logits)` gives the logits with the tokens the
    constraint forbids at -inf, `consume(tid)` moves past a sampled token. `done` is True once
    the output is complete (no token can follow), `accepting` once it may end here. `conforms`
    is set by the generator when it ends: whether the returned text satisfies the constraint."""

    def __init__(self, constraint: Constraint):
        self.constraint = constraint
        self._m = constraint._template.deep_copy()
        self.n_vocab = constraint._vocab.n_vocab
        self._bits = np.zeros(constraint._vocab.words, dtype=np.int32)
        self._addr, self._nbytes = self._bits.ctypes.data, self._bits.nbytes
        self.conforms: bool | None = None

    def allowed(self) -> np.ndarray:
        """(n_vocab,) bool: the tokens that may come next (EOS/end-of-turn where the output may end)."""
        self._m.unsafe_compute_mask_ptr(self._addr, self._nbytes)
        if self._m.is_error():
            raise RuntimeError(f"llguidance matcher failed: {self._m.get_error()}")
        return np.unpackbits(self._bits.view(np.uint8), count=self.n_vocab, bitorder="little").view(np.bool_)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of `logits` with the forbidden tokens at -inf."""
        allowed = self.allowed()
        out = np.full(len(logits), -np.inf, dtype=logits.dtype)
        np.copyto(out, logits, where=allowed)
        return out

    def consume(self, tid: int) -> None:
        if not self._m.consume_token(int(tid)):
            raise RuntimeError(f"llguidance matcher refused token {tid}: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()
