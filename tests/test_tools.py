"""Tool calling (npllama.generation.tools): parsing each format, streamed at every cut; the
checks of tools, tool_choice and messages; the templates' renderings with tools against HF's
(tests/fixtures/chat_tools.json, made by bench/make_tool_fixtures.py); and, on the default model,
calls decoded under the grammar with its own template and with other formats' templates spliced
into a copy of its GGUF."""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import jsonschema
import pytest

from npllama.generation import tools as T
from npllama.text.chat import format_chat

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_tools.json").read_text())
TOOLS = FIXTURE["tools"]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def _ids():
    return map("id{}".format, itertools.count()).__next__


def parse(fmt, pieces) -> dict:
    p = T.CallParser(fmt, make_id=_ids())
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

FORMAT_OF = {"Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes", "HuggingFaceTB-SmolLM3-3B": "generic",  # it reads xml_tools, not tools
             "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes", "meta-llama-Llama-3.1-8B-Instruct": "llama3",
             "meta-llama-Llama-3.2-3B-Instruct": "llama3", "mistralai-Mistral-Nemo-Instruct-2407": "mistral"}


def test_formats_detected_from_real_templates():
    assert {name: T.detect_format(text).name for name, text in FIXTURE["templates"].items()} == FORMAT_OF
    assert T.detect_format(None) is T.GENERIC
    with pytest.raises(ValueError, match="Qwen3-Coder"):
        T.detect_format("{% for t in tools %}<function={{ t.name }}><parameter=x>{% endfor %}")


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
GREEDY = dict(temperature=0, max_tokens=96)


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
             "mistral": "mistralai-Mistral-Nemo-Instruct-2407"}
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
    m = model.chat(WEATHER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}, **GREEDY)
    assert assert_valid_calls(m, allowed={"add"})
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="none", **GREEDY)
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
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral"])
def test_each_format_end_to_end(spliced, fmt):
    model = spliced[fmt]
    assert T.detect_format(model.tokenizer.chat_template).name == fmt
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **GREEDY)
    assert len(assert_valid_calls(m, most=1)) == 1
    m = model.chat(WEATHER, tools=TOOLS, **GREEDY)
    assert_valid_calls(m)
    marker = T.FORMATS[fmt].trigger
    assert marker not in (m["content"] or "")
    m = model.chat(WEATHER, tools=TOOLS, tool_choice="none", **GREEDY)
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
