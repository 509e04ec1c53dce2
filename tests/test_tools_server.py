"""Tool calling through `npllama serve` with the official `openai` client, on the default model
(its own template: the generic JSON format): required, named, none, auto, streaming equal to
the whole answer (logprobs included), a three-turn agent loop, parallel_tool_calls, and the 400s."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from test_server import Running
from test_tools import SCHEMAS, TOOLS, WEATHER

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
              pytest.mark.timeout(600), pytest.mark.model, pytest.mark.slow]

GREEDY = dict(model="m", temperature=0, max_tokens=256)  # room for MAX_CALLS parallel calls


@pytest.fixture(scope="module")
def server(default_model_path):
    import npllama
    s = Running(npllama.load(default_model_path), ctx=1024, parallel=2)
    yield s
    s.close()


def valid_calls(message, allowed=None):
    calls = message.tool_calls or []
    for c in calls:
        assert c.type == "function" and c.id and c.function.name in (allowed or SCHEMAS)
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def test_required_named_none_auto(server):
    c = server.client()
    r = c.chat.completions.create(messages=WEATHER, tools=TOOLS, tool_choice="required", **GREEDY)
    assert valid_calls(r.choices[0].message) and r.choices[0].finish_reason in ("tool_calls", "length")
    r = c.chat.completions.create(messages=WEATHER, tools=TOOLS, tool_choice={"type": "function",
                                  "function": {"name": "add"}}, **GREEDY)
    assert valid_calls(r.choices[0].message, {"add"})
    r = c.chat.completions.create(messages=WEATHER, tools=TOOLS, tool_choice="none", **{**GREEDY, "max_tokens": 24})
    assert not r.choices[0].message.tool_calls and r.choices[0].message.content
    r = c.chat.completions.create(messages=WEATHER, tools=TOOLS, **GREEDY)
    m = r.choices[0].message
    assert valid_calls(m) or m.content is not None


def test_parallel_false_makes_one_call(server):
    r = server.client().chat.completions.create(messages=WEATHER, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False, **GREEDY)
    assert len(valid_calls(r.choices[0].message)) == 1 and r.choices[0].finish_reason == "tool_calls"


def test_stream_equals_whole(server):
    c = server.client()
    opts = dict(messages=WEATHER, tools=TOOLS, tool_choice="required", **GREEDY)
    whole = c.chat.completions.create(**opts).choices[0]
    calls: dict[int, dict] = {}
    content, finish, first = "", None, {}
    for chunk in c.chat.completions.create(stream=True, **opts):
        ch = chunk.choices[0]
        content += ch.delta.content or ""
        finish = ch.finish_reason or finish
        for d in ch.delta.tool_calls or []:
            if d.index not in calls:
                first[d.index] = d  # the first piece of a call carries its id and name
                calls[d.index] = {"name": d.function.name, "arguments": ""}
            calls[d.index]["arguments"] += d.function.arguments or ""
    assert all(d.id and d.function.name for d in first.values())
    assert finish == whole.finish_reason and content == (whole.message.content or "")
    assert [calls[i] for i in sorted(calls)] == [{"name": t.function.name, "arguments": t.function.arguments}
                                                 for t in whole.message.tool_calls]


def test_streamed_logprobs_with_tools_equal_whole(server):
    c = server.client()
    opts = dict(messages=WEATHER, tools=TOOLS, tool_choice="required", logprobs=True, top_logprobs=2, **GREEDY)
    whole = c.chat.completions.create(**opts)
    streamed = [lp for chunk in c.chat.completions.create(stream=True, **opts) if chunk.choices
                for lp in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else None) or []]
    expected = whole.choices[0].logprobs.content
    assert len(expected) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in expected)
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in expected]
    text = "".join(t.token for t in expected)
    assert whole.choices[0].message.tool_calls[0].function.name in text  # the call's own tokens, markup and all


def test_three_turn_agent_loop(server):
    c = server.client()
    messages = list(WEATHER)
    for turn in range(3):
        r = c.chat.completions.create(messages=messages, tools=TOOLS, parallel_tool_calls=False,
                                      tool_choice="required" if turn == 0 else "auto", **GREEDY)
        m = r.choices[0].message
        messages.append(m.model_dump(exclude_none=True))
        for call in valid_calls(m):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})})
    assert [m["role"] for m in messages][:3] == ["user", "assistant", "tool"]


@pytest.mark.parametrize("kwargs,param,words", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools", "JSON Schema object"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}]), "tools", "unsupported"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "not among"),
    (dict(tools=TOOLS, messages=WEATHER + [{"role": "tool", "tool_call_id": "x", "content": "1"}]), "messages",
     "answers no call"),
    (dict(tools=TOOLS, response_format={"type": "json_object"}), "response_format", "cannot be combined"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
])
def test_bad_requests_are_400s(server, kwargs, param, words):
    opts = {"messages": WEATHER, **GREEDY, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(**opts)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
