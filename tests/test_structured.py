"""Structured output (npllama.generation.structured on llguidance): every output conforms (json.loads and
the `jsonschema` package, or re.fullmatch), whatever the sampling, on the tiny HF-converted
models (real SentencePiece byte-fallback and byte-level BPE tokenizers of 360 tokens) and on
the default model; bad constraints fail before any token; cut-short outputs say so."""
import json
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import llguidance  # noqa: F401 - the test extras install it: a missing one fails here, never skips
import numpy as np
import pytest

import npllama
from npllama.generation.structured import INT_LIMIT, _bound_numbers, constraint
from npllama.text.tokenizer import TOKEN_BYTE

ARCH = Path(__file__).parent / "fixtures" / "arch"
TINY = ["llama", "gemma3", "qwen3"]  # SPM with space prefix, SPM without, byte-level BPE

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 500},
                                      "tag": {"type": "string", "maxLength": 6}},
     "required": ["id", "tag"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["x", "yy", 3, None]}, "minItems": 1, "maxItems": 4},
    {"type": ["number", "null"]},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                      "ok": {"type": "boolean"}},
     "required": ["code", "ok"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, {"const": "none"}]},
    {"type": "object", "properties": {"in": {"type": "object", "properties": {"n": {"type": "integer"}},
                                             "required": ["n"], "additionalProperties": False},
                                      "s": {"type": "string", "minLength": 2, "maxLength": 3}},
     "required": ["in", "s"], "additionalProperties": False},
]
SAMPLINGS = [dict(temperature=0), dict(temperature=1.0, seed=1),
             dict(temperature=2.0, seed=2, top_k=0, top_p=1.0, min_p=0.0),
             dict(temperature=0.7, seed=3, repeat_penalty=1.8, presence_penalty=1.0, frequency_penalty=1.0)]


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    return npllama.Model(ARCH / f"{request.param}.gguf")


def check_json(c, schema):
    assert c.finish_reason == "stop" and not c.incomplete, (c.finish_reason, c.text)
    jsonschema.validate(json.loads(c.text), schema)


def compact(schema):
    """`schema` for compact JSON (llguidance's x-guidance option, which overrides npllama's
    whitespace rule): random tiny models spend whole 128-token contexts on indentation."""
    return {**schema, "x-guidance": {"whitespace_flexible": False}}


@pytest.mark.timeout(120)
def test_json_schemas_on_tiny_models(tiny):
    for i, schema in enumerate(SCHEMAS):
        for kw in SAMPLINGS[:3] if i % 2 else SAMPLINGS[:1] + SAMPLINGS[3:]:
            check_json(tiny.complete("hello world", json_schema=compact(schema), max_tokens=100, **kw), schema)


@pytest.mark.timeout(120)
def test_regex_grammar_and_byte_fallback_on_tiny_models(tiny):
    for rx in [r"\d{3}-\d{2}", r"(yes|no|maybe)", r"[a-f]{2,4}(,[a-f]{1,3}){0,2}", r"(é|ü|😀){2}"]:
        for kw in SAMPLINGS[:3]:
            c = tiny.complete("hello", regex=rx, max_tokens=40, **kw)
            assert re.fullmatch(rx, c.text) and c.finish_reason == "stop" and not c.incomplete, (rx, c.text)
    # characters outside the 360-token vocabularies: SentencePiece spells them with byte tokens
    c = tiny.complete("hello", regex="😀é", max_tokens=20, temperature=0)
    assert c.text == "😀é" and c.finish_reason == "stop"
    if tiny.tokenizer.model == "llama":
        assert sum(tiny.tokenizer.token_type(t.id) == TOKEN_BYTE for t in c.tokens) == 6  # 4 + 2 UTF-8 bytes
    grammar = 'start: num ("+" num)*\nnum: /[0-9]{1,3}/'
    for kw in SAMPLINGS[:3]:
        c = tiny.complete("1", grammar=grammar, max_tokens=40, **kw)
        assert re.fullmatch(r"[0-9]{1,3}(\+[0-9]{1,3})*", c.text), c.text


def test_constraint_ending_mid_word(tiny):
    # "hello world" is a few tokens; the constraint ends inside the second word
    c = tiny.complete("hello", regex="hello wor", max_tokens=20, temperature=0)
    assert c.text == "hello wor" and c.finish_reason == "stop" and not c.incomplete
    assert b"".join(tiny.tokenizer.id_to_bytes(t.id) for t in c.tokens) == b"hello wor"


def test_length_stop_strings_and_eos(tiny):
    schema = SCHEMAS[0]
    c = tiny.complete("hello", json_schema=schema, max_tokens=3, temperature=0)
    assert c.finish_reason == "length" and c.incomplete and len(c.tokens) == 3
    # a stop string that cuts the output: finish "stop", but incomplete
    c = tiny.complete("hello", json_schema=schema, max_tokens=100, temperature=0, stop=['"id"'])
    assert c.finish_reason == "stop" and c.incomplete and '"id"' not in c.text
    # a stop string cutting where the text already conforms: complete
    c = tiny.complete("hello", regex=r"[0-9]{2}(;[a-z]{2})?", max_tokens=20, temperature=0, stop=";")
    assert re.fullmatch("[0-9]{2}", c.text) and c.finish_reason == "stop" and not c.incomplete
    # EOS is only allowed where the output is complete, however much the sampler wants it
    eos = {i: 30.0 for i in tiny.tokenizer.eot_ids}
    for kw in SAMPLINGS[:3]:
        c = tiny.complete("hello", regex=r"[a-z]{3,6}", max_tokens=20, logit_bias=eos, **kw)
        assert re.fullmatch(r"[a-z]{3,6}", c.text) and c.finish_reason == "stop" and not c.incomplete, c.text
        assert len("".join(t.text for t in c.tokens[:-1])) < 3  # ended at the first place it could
    # max_tokens=0: nothing generated, and nothing that conforms
    c = tiny.complete("hello", regex="a+", max_tokens=0)
    assert c.text == "" and c.finish_reason == "length" and c.incomplete
    # unconstrained output is never "incomplete"
    assert not tiny.complete("hello", max_tokens=3, temperature=0).incomplete


def test_streaming_chat_session_and_logprobs(tiny):
    pieces = list(tiny.generate("hello", regex="[0-9]{4}", max_tokens=10, stream=True, temperature=1.0, seed=4))
    assert re.fullmatch("[0-9]{4}", "".join(pieces))
    c = tiny.complete("hello", regex="(ab|cd)", max_tokens=10, temperature=1.0, seed=5, logprobs=3)
    for t in c.tokens:  # logprobs of the constrained distribution: only allowed tokens have mass
        assert np.isfinite(t.logprob) and all(np.isfinite(lp) or lp == -np.inf for _, lp in t.top_logprobs)


def test_batched_each_request_its_own_matcher(tiny):
    prompts = ["hello", "world", "hello world", "the"]
    schema = SCHEMAS[1]
    for kw in SAMPLINGS[:2]:
        cs = npllama.complete_many(tiny, prompts, json_schema=compact(schema), max_tokens=60, max_batch=4, **kw)
        for c in cs:
            check_json(c, schema)
        if kw["temperature"] == 0:  # batched greedy = one by one
            assert [c.text for c in cs] == [tiny.complete(p, json_schema=compact(schema), max_tokens=60, **kw).text
                                            for p in prompts]
    cs = npllama.complete_many(tiny, prompts[:2], regex="[a-z]{8}", max_tokens=3, temperature=0)
    assert all(c.finish_reason == "length" and c.incomplete for c in cs)
    outs = npllama.generate_many(tiny, prompts, regex="(ok|no)", max_tokens=5, temperature=0.9, seed=1)
    assert len(outs) == 4 and set(outs) <= {"ok", "no"}


def _nested(depth):
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def test_bad_constraints_fail_before_any_token(tiny):
    s = tiny.session()
    cases = [
        (dict(json_schema={"type": "string"}, regex="a"), "at most one"),
        (dict(regex="a", grammar="start: /a/"), "at most one"),
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema=[1, 2]), "JSON Schema object"),
        (dict(json_schema={"type": "foo"}), "foo"),
        (dict(json_schema={"type": "array", "uniqueItems": True}), "uniqueItems"),
        (dict(json_schema={"type": "string", "format": "bogus"}), "bogus"),
        (dict(json_schema={"type": "string", "pattern": "(?=a)b"}), "look-around"),
        (dict(json_schema={"type": "integer", "minimum": "x"}), "minimum"),
        (dict(regex="(ab"), "not a valid regular expression"),
        (dict(regex="a{,2}"), "invalid regex"),
        (dict(regex="(?<=a)b"), "look-around"),
        (dict(regex=r"(a)\1"), "backreference"),
        (dict(regex=5), "must be a string"),
        (dict(grammar="start: foo"), "foo"),
        (dict(grammar=""), "non-empty"),
        (dict(json_schema={"type": "integer", "minimum": 10 ** 20}), "integer range"),  # past llguidance's int64
        (dict(json_schema={"type": "integer", "minimum": 5, "maximum": 3}), "Unsatisfiable"),
        (dict(json_schema=_nested(5000)), "nested too deeply"),
        (dict(json_schema='{"type": "array", "items": ' * 5000 + "{}" + "}" * 5000), "nested too deeply"),
        (dict(json_schema={"enum": [f"v{i}" for i in range(100_000)]}), "too big"),
    ]
    for kw, word in cases:
        with pytest.raises(ValueError, match=re.escape(word)):
            tiny.complete("hello", session=s, max_tokens=5, **kw)
        with pytest.raises(ValueError, match=re.escape(word)):
            npllama.complete_many(tiny, ["hello"], max_tokens=5, **kw)
        assert s.pos == 0  # nothing was fed
    with pytest.raises(ValueError, match="unsupported"):
        constraint(tiny, json_schema={"type": "array", "contains": {"type": "integer"}})


def test_json_whitespace_and_digit_runs_are_bounded(tiny):
    rule = constraint(tiny, json_schema={"type": "object", "properties": {"n": {"type": "integer"},
                                                                          "x": {"type": "number"}}})
    assert rule.accepts('{"n": 1, "x": 2.5}') and rule.accepts('{\n  "n": 1,\n  "x": -0.25\n}')
    assert rule.accepts('{"n":\n' + " " * 20 + "1}") and not rule.accepts('{"n":\n' + " " * 21 + "1}")
    assert not rule.accepts('{"n":\n\n1}') and not rule.accepts('{"n":  1}')
    assert rule.accepts(json.dumps({"n": 1, "x": 0.5}, indent=4)) and rule.accepts('{"n":1,"x":0.5}')
    assert rule.accepts('{"n": %d}' % INT_LIMIT) and not rule.accepts('{"n": %d}' % (INT_LIMIT + 1))
    assert rule.accepts('{"x": 1.%s}' % ("1" * 10)) and not rule.accepts('{"x": 1.%s}' % ("1" * 11))
    assert not rule.accepts('{"x": 1e5}')
    # the schema's own bounds and x-guidance options are kept
    assert constraint(tiny, json_schema={"type": "integer", "minimum": 10 ** 17}).accepts(str(10 ** 17 + 1))
    free = {"type": "array", "x-guidance": {"whitespace_flexible": True}}
    assert constraint(tiny, json_schema=free).accepts("[" + " " * 40 + "]")


def test_bound_numbers_narrows_only_number_schemas():
    s = {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": ["number", "null"], "exclusiveMinimum": 0},
        "c": {"type": "integer", "enum": [10 ** 30]}, "d": {"const": {"type": "integer"}},
        "e": {"type": "integer", "minimum": 10 ** 17}},
        "$defs": {"f": {"anyOf": [{"type": "number", "multipleOf": 0.5}]}}}
    out = _bound_numbers(s)
    p = out["properties"]
    assert p["a"] == {"type": "integer", "minimum": -INT_LIMIT, "maximum": INT_LIMIT}
    assert p["b"] == {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": INT_LIMIT, "multipleOf": 1e-10}
    assert p["c"] == s["properties"]["c"] and p["d"] == s["properties"]["d"]
    assert p["e"] == s["properties"]["e"]  # above the limit: no bound added
    assert out["$defs"]["f"]["anyOf"][0] == {"type": "number", "multipleOf": 0.5, "minimum": -INT_LIMIT,
                                             "maximum": INT_LIMIT}
    assert s["properties"]["a"] == {"type": "integer"}  # the caller's schema is untouched


class _NoEOS:  # a tokenizer's look-alike (weak-referenceable, as the constraint cache needs)
    pass


def test_cache_vocab_size_and_no_eos(tiny):
    schema = {"type": "object", "properties": {"k": {"enum": ["v", "w"]}}, "required": ["k"]}
    a, b = constraint(tiny, json_schema=schema), constraint(tiny, json_schema=json.dumps(schema))
    assert a._template is b._template  # compiled once per vocabulary
    tok = tiny.tokenizer
    # logits longer than the vocabulary: the extra ids are never allowed
    wide = SimpleNamespace(tokenizer=tok, config=SimpleNamespace(n_vocab=tok.n_vocab + 7))
    m = constraint(wide, regex="[a-z ]+").matcher()
    allowed = m.allowed()
    assert allowed.shape == (tok.n_vocab + 7,) and not allowed[tok.n_vocab:].any() and allowed.any()
    masked = m.mask(np.zeros(tok.n_vocab + 7, np.float32))
    assert np.isneginf(masked[~allowed]).all() and (masked[allowed] == 0).all()
    # a vocabulary without end-of-turn ids: nothing stands for EOS among the real ids
    no_eos = _NoEOS()
    no_eos.__dict__.update({k: getattr(tok, k) for k in ("n_vocab", "bos_id", "id_to_bytes", "is_special",
                                                         "encode_inner")}, eot_ids=frozenset())
    m = constraint(SimpleNamespace(tokenizer=no_eos, config=tiny.config), regex="a|ab").matcher()
    ids = tok.encode_inner("a")
    for t in ids:
        m.consume(t)
    assert m.accepting and not m.done
    assert not m.allowed()[sorted(tok.eot_ids)].any()


@pytest.mark.timeout(120)
def test_cli_run_with_constraints(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(SCHEMAS[1]))

    def run(*args):
        return subprocess.run([sys.executable, "-m", "npllama", "run", "hello", "--raw", "-m", ARCH / "qwen3.gguf",
                               "--temp", "0", *map(str, args)], capture_output=True, text=True, timeout=120)
    r = run("--json-schema", path, "-n", "60")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), SCHEMAS[1])
    r = run("--regex", r"\d{2}-[a-z]{2}", "-n", "20")
    assert r.returncode == 0 and re.fullmatch(r"\d{2}-[a-z]{2}", r.stdout.rstrip("\n")), r.stderr
    r = run("--json-schema", path, "-n", "2")
    assert r.returncode == 1 and "cut short" in r.stderr and "Traceback" not in r.stderr
    r = run("--regex", "(?<=a)b", "-n", "20")
    assert r.returncode == 1 and r.stderr.startswith("npllama: error: unsupported regex") and \
        len(r.stderr.strip().splitlines()) == 1
    r = run("--regex", "a", "--json-schema", path)
    assert r.returncode == 2 and "not allowed with" in r.stderr


# The default model: real text, chat prompts, the schemas of an extraction pipeline.

PEOPLE = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 30},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "email": {"type": ["string", "null"], "pattern": "^[a-z.]{1,16}@[a-z]{1,12}\\.[a-z]{2,3}$"},
    "skills": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "age", "email", "skills"], "additionalProperties": False}
MODEL_SCHEMAS = [
    PEOPLE,
    {"type": "object", "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["sentiment", "score"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                                 "country": {"type": "string", "maxLength": 20}},
                                "required": ["city", "country"], "additionalProperties": False},
     "minItems": 2, "maxItems": 2},
    {"anyOf": [{"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                "additionalProperties": False},
               {"type": "null"}]},
]
MODEL_PROMPTS = ["Invent a software engineer: name, age, email, skills. Reply in JSON.",
                 "Classify the sentiment of 'I love this phone'. Reply in JSON.",
                 "Name two capital cities and their countries as JSON.",
                 "What is 12 times 12? Answer as JSON."]


@pytest.mark.model
@pytest.mark.timeout(300)
def test_default_model_json_batched_and_alone(default_model):
    m = default_model
    prompts = [m.tokenize(m.format_chat([{"role": "user", "content": p}]), special=True) for p in MODEL_PROMPTS]
    settings = [dict(temperature=0), dict(temperature=0.8, seed=7), dict(temperature=1.3, seed=8, top_k=0, min_p=0),
                dict(temperature=1.0, seed=9, repeat_penalty=1.3, frequency_penalty=0.5)]
    for i, schema in enumerate(MODEL_SCHEMAS):  # each schema on its own prompt and another, batched
        for kw in (settings[0], settings[1 + i % 3]):
            for c in npllama.complete_many(m, [prompts[i], prompts[i - 1]], json_schema=schema, max_tokens=80, **kw):
                check_json(c, schema)
    c = m.chat([{"role": "user", "content": MODEL_PROMPTS[0]}], json_schema=PEOPLE, max_tokens=96, temperature=0)
    jsonschema.validate(json.loads(c), PEOPLE)
    conv = m.chat_session(json_schema=MODEL_SCHEMAS[1], max_tokens=48, temperature=0)
    for text in ["Rate 'great film'.", "Now rate 'awful food'."]:
        jsonschema.validate(json.loads(conv.send(text)), MODEL_SCHEMAS[1])


@pytest.mark.model
@pytest.mark.timeout(300)
def test_default_model_regex_boundaries_and_stops(default_model):
    m = default_model
    chat = m.format_chat([{"role": "user", "content": "When did the first moon landing happen?"}])
    c = m.complete(chat, regex=r"\d{4}-\d{2}-\d{2}", max_tokens=16, temperature=0)
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", c.text) and c.finish_reason == "stop"
    # ends inside a word the model would write as one or more longer tokens
    c = m.complete("The opposite of believable is", regex=" unbelievab", max_tokens=10, temperature=0)
    assert c.text == " unbelievab" and c.finish_reason == "stop"
    # a character the byte-level vocabulary spells with several tokens
    for kw in SAMPLINGS[:3]:
        c = m.complete("Pick an emoji:", regex="(🦜|🦩|🪿) (yes|no)", max_tokens=16, **kw)
        assert re.fullmatch("(🦜|🦩|🪿) (yes|no)", c.text), c.text
    grammar = 'start: "SELECT " COL (", " COL)* " FROM " TABLE\nCOL: /[a-z]{1,8}/\nTABLE: "users" | "orders"'
    c = m.complete("Write SQL to list user names and emails:\n", grammar=grammar, max_tokens=32, temperature=0)
    assert re.fullmatch(r"SELECT [a-z]{1,8}(, [a-z]{1,8})* FROM (users|orders)", c.text), c.text
    c = m.complete(chat, json_schema=PEOPLE, max_tokens=8, temperature=0)
    assert c.finish_reason == "length" and c.incomplete


def test_regex_digits_and_inner_encoding(tiny):
    # \d is narrowed to ASCII digits (Python's \d also takes other scripts' digits) unless that
    # would widen the pattern (\D, negated classes)
    assert constraint(tiny, regex=r"\d+").accepts("42") and not constraint(tiny, regex=r"\d+").accepts("٤٢")
    for rx, yes, no in [(r"\D", "x", "٤"), (r"[^\d]", "x", "٤"), (r"[^\d]\d", "x4", "٤4")]:
        assert re.fullmatch(rx, yes) and not re.fullmatch(rx, no)  # Python's meaning: "٤" is a digit
        assert constraint(tiny, regex=rx).accepts(yes) and not constraint(tiny, regex=rx).accepts(no)
    tok = tiny.tokenizer
    for text in ["{", "hello world", " two  spaces", "é😀"]:  # pieces of output: no space prefix, no BOS
        assert b"".join(tok.id_to_bytes(i) for i in tok.encode_inner(text)) == text.encode()
