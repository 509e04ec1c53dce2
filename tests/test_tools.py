"""Tool calling (npllama.generation.tools): parsing each format, streamed at every cut; the
checks of tools, tool_choice and messages; every tool template of llama.cpp's collection rendered
with tools against HF (tests/fixtures/chat_tools.json, made by bench/make_tool_fixtures.py), its
format recognised, and the call it writes accepted by that format's grammar and parsed back; the
control-token markers on a real vocabulary; and, on the default model, calls decoded under the
grammar with its own template and with other formats' templates spliced into a copy of its GGUF."""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from npllama.generation import tools as T
from npllama.generation.structured import constraint
from npllama.gguf.reader import read_metadata
from npllama.text.chat import format_chat
from npllama.text.tokenizer import Tokenizer

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_tools.json").read_text())
TOOLS = FIXTURE["tools"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _ids():
    return map("id{}".format, itertools.count()).__next__


KINDS = {"get_weather": {"city": "string", "unit": "string"}, "add": {"a": "json", "b": "json"},
         "flags": {"on": "json", "tags": "json", "note": "string"}}


def parse(fmt, pieces) -> dict:
    p = T.ToolPlan("", None, fmt, "auto", KINDS).parser(make_id=_ids())
    deltas = [d for piece in pieces for d in p.feed(piece)] + p.finish()
    return T.assemble(deltas)


# (format, reply as the family's documentation shows it, content, [(name, arguments)])
DOC_REPLIES = [
    (T.HERMES, '<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "get_temperature_date", "arguments": {"location": "San Francisco, '
               'CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
     None, [("get_current_temperature", {"location": "San Francisco, CA, USA"}),
            ("get_temperature_date", {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"})]),
    (T.HERMES, 'Let me look that up.\n<tool_call>\n{"arguments": {"q": "a \\"quoted\\" }{ brace"}, "name": "search"}\n'
               '</tool_call>', "Let me look that up.\n", [("search", {"q": 'a "quoted" }{ brace'})]),
    (T.HERMES, "No tools needed: 2 < 3 and <tool is not a call.", "No tools needed: 2 < 3 and <tool is not a call.", []),
    (T.MISTRAL, '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
                '"format": "celsius"}}, {"name": "add", "arguments": {"a": -1.5e3, "b": null, "c": [true, false]}}]',
     None, [("get_current_weather", {"location": "Paris, France", "format": "celsius"}),
            ("add", {"a": -1.5e3, "b": None, "c": [True, False]})]),
    (T.LLAMA3, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "San Francisco"}}', None,
     [("get_weather", {"city": "San Francisco"})]),
    (T.LLAMA3, '{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}', None,
     [("get_weather", {"city": "Tokyo", "days": 3})]),
    (T.LLAMA3, 'The weather is {"sunny"}.', 'The weather is {"sunny"}.', []),
    (T.MISTRAL_ARGS, 'Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris {\\"x\\"}", "unit": "celsius"}'
                     '[TOOL_CALLS]add[ARGS]{"a": 1, "b": [2, {"c": "]"}]}', "Checking.",
     [("get_weather", {"city": 'Paris {"x"}', "unit": "celsius"}), ("add", {"a": 1, "b": [2, {"c": "]"}]})]),
    (T.MISTRAL_ARGS, "No [TOOL_CALL here.", "No [TOOL_CALL here.", []),
    (T.QWEN3_CODER, 'I will look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew "York"\n</par\nline\n'
                    '</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n'
                    '<function=flags>\n<parameter=on>\nTrue\n</parameter>\n<parameter=tags>\n["a", "b"]\n</parameter>\n'
                    '<parameter=note>\n\n</parameter>\n</function>\n</tool_call>', "I will look.\n",
     [("get_weather", {"city": 'New "York"\n</par\nline', "unit": "celsius"}),
      ("flags", {"on": True, "tags": ["a", "b"], "note": ""})]),
    (T.QWEN3_CODER, "<tool_call>\n<function=now>\n</function>\n</tool_call>", None, [("now", {})]),
    (T.QWEN3_CODER, "<tool_call>\n<function=add>\n<parameter=a>\n-1</parameter>\n<parameter=b>\n2\n</parameter>\n"
                    "</function>\n</tool_call>", None, [("add", {"a": -1, "b": 2})]),  # no line break before a closer
    (T.PYTHONIC, '<|tool_call_start|>[get_candidate_status(candidate_id="12345")]<|tool_call_end|>', None,
     [("get_candidate_status", {"candidate_id": "12345"})]),  # LFM2's documented call
    (T.PYTHONIC, "Checking.<|tool_call_start|>[get_weather(city='Par\\'is\\u00e9\\n\\x41', unit=\"c)]\"), "
                 "add(a=-1.5e3, b=None, c=[True, false, (1, 2)], d={\"k\": null, 'x': 'y'}), now()]<|tool_call_end|>",
     "Checking.", [("get_weather", {"city": "Par'isé\nA", "unit": "c)]"}),
                   ("add", {"a": -1500, "b": None, "c": [True, False, [1, 2]], "d": {"k": None, "x": "y"}}), ("now", {})]),
    (T.PYTHONIC, "No <|tool_call here.", "No <|tool_call here.", []),
    (T.GENERIC, '{"tool_calls": [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", '
                '"arguments": {"city": "Nice"}}]}', None, [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Nice"})]),
    (T.GENERIC, '{"response": "Caf\\u00e9 \\ud83c\\udf89 \\"ok\\"\\n\\\\ done"}', 'Café 🎉 "ok"\n\\ done', []),
]


@pytest.mark.parametrize("fmt,text,content,calls", DOC_REPLIES, ids=lambda v: getattr(v, "name", None))
def test_parse_documented_replies(fmt, text, content, calls):
    message = parse(fmt, [text])
    assert message["content"] == content
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert got == calls
    assert [c["id"] for c in message.get("tool_calls", [])] == [f"id{i}" for i in range(len(calls))]
    if fmt.trigger is not None and calls:
        assert fmt.trigger not in (message["content"] or "")


@pytest.mark.parametrize("fmt,text,content,calls", DOC_REPLIES, ids=lambda v: getattr(v, "name", None))
def test_stream_cut_anywhere_equals_whole(fmt, text, content, calls):
    whole = parse(fmt, [text])
    for i in range(len(text) + 1):
        assert parse(fmt, [text[:i], text[i:]]) == whole, i
    assert parse(fmt, list(text)) == whole


def test_stream_sends_name_first_then_arguments_in_pieces():
    p = T.CallParser(T.HERMES, make_id=_ids())
    deltas = [d for ch in '<tool_call>\n{"name": "f", "arguments": {"x": "abc"}}\n</tool_call>' for d in p.feed(ch)]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.id, first.name, first.arguments) == (0, "id0", "f", "")
    assert len(rest) > 3 and all(d.id is None and d.index == 0 for d in rest)
    assert "".join(d.arguments for d in rest) == '{"x": "abc"}'
    assert [T.delta_dict(first)] == [{"tool_calls": [{"index": 0, "id": "id0", "type": "function",
                                                      "function": {"name": "f", "arguments": ""}}]}]


def test_held_back_trigger_prefix_is_content_at_the_end():
    p = T.CallParser(T.HERMES)
    assert [d.content for d in p.feed("see <tool_c")] == ["see "]
    assert [d.content for d in p.finish()] == ["<tool_c"]


# ---- checks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tools,match", [
    ([], "non-empty list"),
    ([{"type": "function"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "JSON Schema object"),
    ([{"type": "function", "function": {"name": "f", "parameters": ["x"]}}], "JSON Schema object"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "unique"),
])
def test_bad_tools(tools, match):
    with pytest.raises(T.ToolError, match=match) as e:
        T.check_tools(tools)
    assert e.value.param == "tools"


def test_tool_choice():
    tools = T.check_tools(TOOLS)
    assert T.check_tool_choice("auto", tools) == ("auto", ["get_weather", "add"])
    assert T.check_tool_choice({"type": "function", "function": {"name": "add"}}, tools) == ("required", ["add"])
    with pytest.raises(T.ToolError, match="'nope', which is not among the tools"):
        T.check_tool_choice({"type": "function", "function": {"name": "nope"}}, tools)
    with pytest.raises(T.ToolError, match="tool_choice must be"):
        T.check_tool_choice("always", tools)


def test_messages_checked_and_arguments_decoded():
    call = {"id": "abc123XYZ", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    msgs = T.check_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "abc123XYZ", "content": "2"}])
    assert msgs[1]["content"] == "" and msgs[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    with pytest.raises(T.ToolError, match="tool_call_id 'zzz', which answers no call") as e:
        T.check_messages([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "zzz", "content": "2"}])
    assert e.value.param == "messages"


# ---- templates -------------------------------------------------------------------------------

# The format of every template in the fixture, from reading what each one writes for a call;
# the others (GLM's <arg_key>, Kimi's, MiniMax's <invoke>, Command R's, ...) are
# refused with a ValueError.
KNOWN = {
    "hermes": ["Bielik-11B-v3.0-Instruct", "MiMo-VL", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
               "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "Qwen-QwQ-32B", "Qwen-Qwen2.5-7B-Instruct",
               "Qwen-Qwen3-0.6B", "Reka-Edge", "ibm-granite-granite-4.0", "ibm-granite-granite-4.1"],
    "qwen3_coder": ["NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "Qwen3-Coder", "Qwen3.5-4B", "StepFun3.5-Flash"],
    "mistral_args": ["Mistral-Small-3.2-24B-Instruct-2506", "mistralai-Ministral-3-14B-Reasoning-2512",
                     "unsloth-mistral-Devstral-Small-2507"],
    "mistral": ["mistralai-Mistral-Nemo-Instruct-2407"],
    "llama3": ["meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
               "meta-llama-Llama-3.3-70B-Instruct"],
    "pythonic": ["LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"],
    "generic": ["HuggingFaceTB-SmolLM3-3B"],  # this collection's SmolLM3 template reads no tools (nor xml_tools)
}
FORMAT_OF = {name: fmt for fmt, names in KNOWN.items() for name in names}


def test_formats_detected_from_real_templates():
    for name, text in FIXTURE["templates"].items():
        if name in FORMAT_OF:
            assert T.detect_format(text).name == FORMAT_OF[name], name
        else:
            with pytest.raises(ValueError, match="format npllama does not know|cannot render a tool call"):
                T.detect_format(text)
    assert T.detect_format(None) is T.GENERIC
    assert len(FIXTURE["templates"]) - len(FORMAT_OF) == 38


# The call of conversation 1 (get_weather, Paris, celsius) as each format's grammar must take it,
# and the part of it that the templates write into the history (Nemo adds an "id" after the
# arguments; Mistral Small 3.2 a [CALL_ID] before them, which the grammar does not ask for).
WRITTEN = {
    "hermes": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
               None),
    "qwen3_coder": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\n"
                    "celsius\n</parameter>\n</function>\n</tool_call>", None),
    "mistral_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}'),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None),
    "pythonic": ("<|tool_call_start|>[get_weather(city='Paris', unit='celsius')]<|tool_call_end|>", None),
}
# LFM2-8B-A1B's and LFM2.5-Instruct's templates write an assistant turn's content only: no call.
WRITE_NO_CALL = {"LFM2-8B-A1B", "LFM2.5-Instruct"}


@pytest.fixture(scope="module")
def smol_vocab(default_model_path):
    """The default model's tokenizer, as a stand-in model for compiling grammars."""
    return _vocab_model(Tokenizer.from_metadata(read_metadata(default_model_path)))


def _vocab_model(tok):
    return SimpleNamespace(tokenizer=tok, config=SimpleNamespace(n_vocab=tok.n_vocab))


@pytest.mark.parametrize("name", sorted(n for n in FORMAT_OF if FORMAT_OF[n] != "generic" and n not in WRITE_NO_CALL))
def test_grammar_takes_the_call_the_template_writes(smol_vocab, name):
    fmt, (text, written) = T.FORMATS[FORMAT_OF[name]], WRITTEN[FORMAT_OF[name]]
    case = next(c for c in FIXTURE["cases"] if c["template"] == name and c["conversation"] == 1)
    assert (written or text) in case["rendered"].replace("[CALL_ID]abc123XYZ", "")
    tools = T.check_tools(TOOLS)
    for choice, parallel in [("required", False), ("required", True), ("auto", True)]:
        rule = constraint(smol_vocab, grammar=T.grammar(fmt, smol_vocab.tokenizer, tools, choice, ["get_weather", "add"],
                                                        parallel))
        assert rule.accepts(text) and not rule.accepts(text.replace("celsius", "kelvin"))
        assert rule.accepts(text + text) == (parallel and fmt.shape not in ("leading", "array", "pythonic"))
    none = constraint(smol_vocab, grammar=T.grammar(fmt, smol_vocab.tokenizer, tools, "none", ["add"], True))
    assert not none.accepts(text) and none.accepts("It is sunny.")
    kinds = {t["function"]["name"]: {p[0]: p[3] for p in T.xml_params(t)} for t in tools}
    message = T.assemble(T.ToolPlan("", None, fmt, "auto", kinds).parser().feed(text))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]


@pytest.mark.parametrize("params,match", [
    ({"type": "object", "properties": {"q": {"type": "string", "pattern": "^a"}}}, r"keywords \['pattern'\]"),
    ({"type": "object", "properties": {"q": {"type": ["string", "null"]}}}, "no single type"),
    ({"type": "object", "properties": {"q": {}}}, "no single type"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "listed properties only"),
    ({"type": "object", "properties": {}, "required": ["q"]}, "not among its properties"),
])
def test_xml_refuses_schemas_it_cannot_hold(params, match):
    tool = T.check_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])[0]
    with pytest.raises(T.ToolError, match=match) as e:
        T.xml_params(tool)
    assert e.value.param == "tools"


def test_xml_values_held_to_each_parameters_schema(smol_vocab):
    tools = T.check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}, "s": {"type": "string", "maxLength": 3},
                                         "on": {"type": "boolean"}, "xs": {"type": "array", "items": {"type": "number"}}},
        "required": ["n"]}}}])
    rule = constraint(smol_vocab, grammar=T.grammar(T.QWEN3_CODER, smol_vocab.tokenizer, tools, "required", ["f"], False))

    def call(*params):
        body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
        return f"<tool_call>\n<function=f>\n{body}</function>\n</tool_call>"
    assert rule.accepts(call(("n", "3"), ("s", "a\nb"), ("on", "True"), ("xs", "[1.5, -2]")))
    assert rule.accepts(call(("n", "0"), ("on", "false")))
    assert rule.accepts(call(("n", "0"), ("s", "abc")).replace("abc\n</", "abc</"))
    for bad in [call(("n", "-1")), call(("n", "1.5")), call(("n", "1"), ("s", "abcd")), call(("s", "a")),
                call(("n", "1"), ("on", "yes")), call(("n", "1"), ("xs", "[1,2]")), call(("n", "1"), ("z", "1")),
                call(("s", "a"), ("n", "1"))]:
        assert not rule.accepts(bad), bad


def test_pythonic_values_held_to_each_parameters_schema(smol_vocab):
    tools = T.check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {
            "n": {"type": "integer", "minimum": 0}, "s": {"type": "string"}, "e": {"enum": ["a'b", 2, None]},
            "on": {"type": "boolean"}, "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
            "d": {"type": "object", "properties": {"k": {"type": ["string", "null"]}}, "required": ["k"]},
            "any": {}},
        "required": ["n"]}}}, TOOLS[1]])
    rule = constraint(smol_vocab, grammar=T.grammar(T.PYTHONIC, smol_vocab.tokenizer, tools, "required", ["f", "add"],
                                                    True))

    def call(*calls):
        return "<|tool_call_start|>[" + ", ".join(calls) + "]<|tool_call_end|>"
    good = ["f(n=3, s='a\\'b\\n', e='a\\'b', on=True, xs=[1.5, -2], d={'k': None}, any={'x': [1, \"y\"]})",
            "f(n=0, e=\"a'b\", on=false, d={\"k\": \"v\"})", "f(n=0, e=2)", "f(n=0, e=None, xs=[])", "add(a=1, b=2)"]
    for one in good:
        assert rule.accepts(call(one)), one
    assert rule.accepts(call(*good))
    for bad in ["f(n=-1)", "f(n=1.5)", "f(s='a')", "f(n=1, e='b')", "f(n=1, on=yes)", "f(n=1, xs=[1, 2, 3])",
                "f(n=1, d={})", "f(n=1, z=1)", "f(s='a', n=1)", "f(n=1, s='a\nb')", "f(n=1, s='a\")",
                "f(1)", "g(n=1)", "add(a='1', b=2)"]:
        assert not rule.accepts(call(bad)), bad
    one = constraint(smol_vocab, grammar=T.grammar(T.PYTHONIC, smol_vocab.tokenizer, tools, "required", ["add"], False))
    assert one.accepts(call(good[-1])) and not one.accepts(call(good[-1], good[-1]))
    assert not one.accepts(call(good[0]))


@pytest.mark.parametrize("params,match", [
    ({"type": "object", "properties": {"q": {"type": "string", "pattern": "^a"}}}, r"parameter 'q': keywords \['pattern'\]"),
    ({"type": "object", "properties": {"q": {"type": "string", "maxLength": 3}}}, r"parameter 'q': keywords"),
    ({"type": "object", "properties": {"q": {"enum": [["x"]]}}}, "parameter 'q': an enum"),
    ({"type": "object", "properties": {"q": {"oneOf": [{"type": "string"}]}}}, r"parameter 'q': keywords \['oneOf'\]"),
    ({"type": "object", "properties": {"class": {"type": "string"}}}, "'class' is not a Python identifier"),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, "listed properties only"),
    ({"type": "object", "properties": {}, "required": ["q"]}, "not among its properties"),
])
def test_pythonic_refuses_schemas_it_cannot_hold(smol_vocab, params, match):
    tools = T.check_tools([{"type": "function", "function": {"name": "f", "parameters": params}}])
    with pytest.raises(T.ToolError, match=match) as e:
        T.grammar(T.PYTHONIC, smol_vocab.tokenizer, tools, "auto", ["f"], True)
    assert e.value.param == "tools"


# ---- control-token markers on a real vocabulary ----------------------------------------------

@pytest.fixture(scope="module")
def llama3_vocab():
    """Llama 3's vocabulary (llama.cpp's ggml-vocab-llama-bpe.gguf) with three of its reserved
    control tokens named as the tool formats' markers: 128010 is <|python_tag|> in Llama 3.1 (the
    same vocabulary otherwise); 128011 and 128012 stand in for the [TOOL_CALLS] and [ARGS] control
    tokens of Mistral's vocabularies, none of which llama.cpp ships."""
    from llama_vocabs import VocabFetchError, vocab_dir
    try:
        path = vocab_dir() / "ggml-vocab-llama-bpe.gguf"
    except VocabFetchError as e:
        pytest.skip(f"llama.cpp's vocabularies are not available: {e}")
    meta = dict(read_metadata(path))
    tokens = list(meta["tokenizer.ggml.tokens"])
    assert tokens[128010:128013] == [f"<|reserved_special_token_{i}|>" for i in (5, 6, 7)]
    tokens[128010:128013] = ["<|python_tag|>", "[TOOL_CALLS]", "[ARGS]"]
    return _vocab_model(Tokenizer.from_metadata({**meta, "tokenizer.ggml.tokens": tokens}))


def _tokens(tok, ids):
    return [SimpleNamespace(id=i, text="" if tok.is_special(i) else tok.decode([i])) for i in ids]


@pytest.mark.parametrize("fmt,marker", [(T.LLAMA3, 128010), (T.MISTRAL_ARGS, 128011)])
def test_control_token_markers(llama3_vocab, fmt, marker):
    tok, tools = llama3_vocab.tokenizer, T.check_tools(TOOLS)
    assert T._marker(tok, fmt.trigger) == (f"<[{marker}]>", True)
    args = '{"city": "Paris"}'
    if fmt is T.MISTRAL_ARGS:
        body = [marker] + tok.encode("get_weather", add_bos=False) + [128012] + tok.encode(args, add_bos=False)
    else:
        body = [marker] + tok.encode('{"name": "get_weather", "parameters": ' + args + "}", add_bos=False)
    required = constraint(llama3_vocab, grammar=T.grammar(fmt, tok, tools, "required", ["get_weather"], False)).matcher()
    allowed = required.allowed()
    if fmt is T.MISTRAL_ARGS:  # the marker is forced, as its control token: not as text ("[" ...)
        assert allowed.nonzero()[0].tolist() == [marker]
    else:  # Llama 3.1: the call follows the tag, or opens the reply bare
        assert allowed[marker] and allowed[tok.encode("{", add_bos=False)[0]]
    for i in body:
        assert required.allowed()[i], tok.decode([i])
        if fmt is T.MISTRAL_ARGS and i == 128012:
            assert required.allowed().nonzero()[0].tolist() == [128012]  # [ARGS] forced after the name
        required.consume(i)
    assert required.accepting
    auto = constraint(llama3_vocab, grammar=T.grammar(fmt, tok, tools, "auto", ["get_weather"], True)).matcher()
    assert auto.allowed()[marker] and auto.allowed()[tok.encode("Hi", add_bos=False)[0]]
    none = constraint(llama3_vocab, grammar=T.grammar(fmt, tok, tools, "none", ["get_weather"], True)).matcher()
    assert not none.allowed()[marker]
    text = T.raw_text(tok, _tokens(tok, body))  # the marker's text written back, as generation drops it
    assert text.startswith(fmt.trigger)
    message = T.assemble(T.ToolPlan("", None, fmt, "auto").parser().feed(text))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})] and message["content"] is None


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['template']}-{c['conversation']}")
def test_renderings_with_tools_equal_hf(case):
    template, messages = FIXTURE["templates"][case["template"]], FIXTURE["conversations"][case["conversation"]]
    assert format_chat(template, messages, tools=TOOLS, **FIXTURE["options"]) == case["rendered"]
    # arguments as OpenAI sends them (a JSON string) render as HF's dict does, once checked
    as_sent = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                    for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    assert format_chat(template, T.check_messages(as_sent), tools=TOOLS, **FIXTURE["options"]) == case["rendered"]


# ---- on the default model --------------------------------------------------------------------

WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = dict(temperature=0, max_tokens=256)  # room for MAX_CALLS parallel calls: replies end on their own
NONE = dict(temperature=0, max_tokens=24)  # "none": text, of which a few tokens show that no call starts


@pytest.fixture(scope="module")
def model(default_model_path):
    import npllama
    return npllama.load(default_model_path)


def splice(src, dst, template: str):
    """A copy of the GGUF `src` at `dst` with `template` as its chat template."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE]
    writer = gguf.GGUFWriter(dst, arch=str(bytes(arch.parts[arch.data[0]]), "utf-8"), endianess=reader.endianess)
    copy_with_new_metadata(reader, writer, {gguf.Keys.Tokenizer.CHAT_TEMPLATE: MetadataDetails(
        gguf.GGUFValueType.STRING, template)}, [])
    return dst


@pytest.fixture(scope="module")
def spliced(default_model_path, tmp_path_factory):
    """The default model with each format's real template, by format name."""
    import npllama
    folder = tmp_path_factory.mktemp("spliced")
    picks = {"hermes": "Qwen-Qwen2.5-7B-Instruct", "llama3": "meta-llama-Llama-3.1-8B-Instruct",
             "mistral": "mistralai-Mistral-Nemo-Instruct-2407", "qwen3_coder": "Qwen3-Coder",
             "mistral_args": "Mistral-Small-3.2-24B-Instruct-2506", "pythonic": "LFM2.5-8B-A1B"}
    return {fmt: npllama.load(splice(default_model_path, folder / f"{fmt}.gguf", FIXTURE["templates"][name]))
            for fmt, name in picks.items()}


def assert_valid_calls(message, allowed=None, most=None):
    calls = message.get("tool_calls", [])
    if most is not None:
        assert len(calls) <= most
    for c in calls:
        name = c["function"]["name"]
        assert name in (allowed or SCHEMAS)
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])
    if calls:
        assert message["finish_reason"] in ("tool_calls", "length")
    return calls


def _without_ids(message):
    return {**message, "tool_calls": [{**c, "id": None} for c in message.get("tool_calls", [])]}


@pytest.mark.model
@pytest.mark.slow
def test_required_named_none_auto(model):
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
    assert len(assert_valid_calls(m, most=1)) == 1 and m["finish_reason"] == "tool_calls"
    m = model.chat(WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                   parallel_tool_calls=False, **GREEDY)  # (with parallel calls the 135M model repeats the call 8 times)
    assert assert_valid_calls(m, allowed={"add"})
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="none", **NONE)
    assert "tool_calls" not in m and m["content"] and m["finish_reason"] in ("stop", "length")
    m = model.chat(WEATHER, tools=TOOLS, **GREEDY)
    assert_valid_calls(m)
    assert m.get("tool_calls") or m["content"] is not None
    assert model.chat(WEATHER, temperature=0, max_tokens=4) == model.generate(
        model.format_chat(WEATHER), temperature=0, max_tokens=4)  # no tools: text, as before


@pytest.mark.model
@pytest.mark.slow
def test_stream_equals_whole_and_complete_many(model):
    from npllama.generation.scheduler import complete_many
    opts = dict(tools=TOOLS, tool_choice="required", **GREEDY)
    whole = model.chat(WEATHER, **opts)
    deltas = list(model.chat(WEATHER, stream=True, **opts))
    joined = T.assemble(T.Delta(**_fields(d)) for d in deltas[:-1])
    assert _without_ids({**joined, **deltas[-1]}) == _without_ids(whole)
    other = [{"role": "user", "content": "Add 2 and 3."}]
    many = complete_many(model, [WEATHER, other], **opts)
    assert _without_ids(many[0]) == _without_ids(whole)
    assert _without_ids(many[1]) == _without_ids(model.chat(other, **opts))


def _fields(d):
    if "content" in d:
        return {"content": d["content"]}
    c = d["tool_calls"][0]
    return {"index": c["index"], "id": c.get("id"), "name": c["function"].get("name"), "arguments": c["function"]["arguments"]}


@pytest.mark.model
@pytest.mark.slow
def test_session_agent_loop(model):
    conv = model.chat_session(tools=TOOLS, parallel_tool_calls=False, **GREEDY)
    first = conv.send("What is the weather in Paris?")
    for _ in range(3):
        calls = assert_valid_calls(first, most=1)
        if not calls:
            break
        first = conv.send({"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 21}'})
        assert conv.messages[-1]["role"] == "assistant"
    roles = [m["role"] for m in conv.messages]
    assert roles[:2] == ["user", "assistant"] and "tool" in roles


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "qwen3_coder", "mistral_args", "pythonic"])
def test_each_format_end_to_end(spliced, fmt):
    model = spliced[fmt]
    assert T.detect_format(model.tokenizer.chat_template).name == fmt
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
    assert len(assert_valid_calls(m, most=1)) == 1
    m = model.chat(WEATHER, tools=TOOLS, **GREEDY)
    assert_valid_calls(m)
    marker = T.FORMATS[fmt].trigger
    assert marker not in (m["content"] or "")
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="none", **NONE)
    assert "tool_calls" not in m and marker not in m["content"]


@pytest.mark.model
def test_bad_requests_are_value_errors(model):
    unique = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]
    with pytest.raises(ValueError, match="tool 'f': parameters: unsupported json_schema"):
        model.chat(WEATHER, tools=unique)
    with pytest.raises(ValueError, match="'nope', which is not among"):
        model.chat(WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(ValueError, match="answers no call"):
        model.chat(WEATHER + [{"role": "tool", "tool_call_id": "x", "content": "1"}], tools=TOOLS)
    with pytest.raises(ValueError, match="need tools"):
        model.chat(WEATHER, tool_choice="required")
    with pytest.raises(ValueError, match="cannot be combined with json_schema"):
        model.chat(WEATHER, tools=TOOLS, json_schema={"type": "object"})


@pytest.mark.model
@pytest.mark.slow
def test_template_that_cannot_express_tools(default_model_path, tmp_path):
    import npllama
    refuses_system = ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('System role not "
                      "supported') }}{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    model = npllama.load(splice(default_model_path, tmp_path / "nosys.gguf", refuses_system))
    with pytest.raises(T.ToolError, match="tools cannot be expressed") as e:
        model.chat(WEATHER, tools=TOOLS)
    assert e.value.param == "tools"
