"""Tool calling: OpenAI's `tools` / `tool_choice` / `tool_calls` over any chat template.

`plan(model, messages, tools, tool_choice, parallel_tool_calls)` checks the request (ValueError
naming what is wrong, before any token), recognises the model's tool-call format from its chat
template and vocabulary, renders the prompt, and returns a `ToolPlan`: the prompt text, the Lark
grammar (llguidance) that the output is decoded under, and a `CallParser` factory that turns the
generated text back into content and calls, piece by piece as it streams.

The formats (one `Format` each), recognised by how the template writes a probe call into the
history (`detect_format`):

* ``hermes``: Hermes 2/3, Qwen 2.5, Qwen 3, Granite 4. ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call.
* ``qwen3_coder``: Qwen3-Coder, Qwen 3.5, Nemotron 3 Nano. ``<tool_call>\\n<function=NAME>\\n``, then
  per argument ``<parameter=P>\\nVALUE\\n</parameter>\\n`` (strings raw, other values JSON), then
  ``</function>\\n</tool_call>``; the grammar follows each parameter's schema (`xml_params`).
* ``mistral``: Mistral Nemo. ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.
* ``mistral_args``: Mistral Small 3.2, Devstral, Ministral 3. ``[TOOL_CALLS]NAME[ARGS]{...}`` per call.
* ``llama3``: Llama 3.1 / 3.2 / 3.3 JSON calls: ``{"name": ..., "parameters": {...}}`` at the start
  of the reply, after ``<|python_tag|>`` or bare (one call per turn, as Meta documents).
* ``pythonic``: LFM2, LFM2.5. ``<|tool_call_start|>[get_weather(city='Paris'), add(a=1, b=2)]<|tool_call_end|>``:
  one Python list of calls, keyword arguments only, values as Python literals; the grammar follows
  each parameter's schema (`pythonic_params`), and the parser sends the arguments as JSON.
* ``generic``: templates that know no tools (SmolLM2, Gemma 3): the tools are described in a
  system message, and the whole reply is one JSON object, ``{"tool_calls": [{"name": ...,
  "arguments": {...}}, ...]}`` or ``{"response": "..."}``.

A marker that the vocabulary holds as a control token (``<|python_tag|>``, ``[TOOL_CALLS]``,
``[ARGS]``, ``<|tool_call_start|>``, ``<|tool_call_end|>``) is asked for as that token.

What the grammar guarantees: with ``tool_choice="required"`` or a named function the reply is
only calls (at least one) to the allowed tools, with arguments valid under each tool's
`parameters` schema. With ``"auto"`` the model may write text; once it emits the call's opening
marker (``<tool_call>``, ``[TOOL_CALLS]``, a leading ``{``) the rest is constrained the same way,
so a call is never malformed (llguidance's lazy lexemes: the text before the marker is free).
With ``"none"`` no call can start. ``parallel_tool_calls=False`` allows one call, True up to
`MAX_CALLS`. A reply cut short by `max_tokens` ends with its last call's arguments cut short.
"""
from __future__ import annotations

import ast
import json
import keyword
import random
import re
import string
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Callable, Iterable

from ..text.chat import format_chat
from .structured import constraint as make_constraint, _bound_numbers

__all__ = ["FORMATS", "MAX_CALLS", "CallParser", "Delta", "NamedCallParser", "PythonicCallParser", "ToolError",
           "ToolPlan", "XmlCallParser", "assemble", "check_messages", "check_tool_choice", "check_tools", "delta_dict",
           "detect_format", "finish_reason", "new_call_id", "parse_reply", "plan", "pythonic_params", "raw_text",
           "xml_params"]

MAX_CALLS = 8  # calls in one reply with parallel_tool_calls (bounds what a small model can loop on)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# JSON inside calls as the templates render it (tojson): ", " and ": " between items, no other whitespace
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# ---- checking the request ---------------------------------------------------------------------

class ToolError(ValueError):
    """A tool request that cannot be served; `param` is the request field at fault ("tools",
    "tool_choice", "parallel_tool_calls" or "messages"), for the server's 400."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> list[dict]:
    """`tools` in OpenAI's shape, checked: ``[{"type": "function", "function": {"name",
    "description"?, "parameters"?}}]``. Returns them as given, with `parameters` defaulting to an
    empty object schema. ValueError names the tool and the problem."""
    if not isinstance(tools, list) or not tools:
        raise ToolError("tools", f"tools must be a non-empty list of {{'type': 'function', 'function': {{...}}}} "
                         f"objects, got {_brief(tools)}")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError("tools", f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             f"'parameters': ...}}}}, got {_brief(tool)}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ToolError("tools", f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', "
                             f"got {_brief(name)}")
        if name in seen:
            raise ToolError("tools", f"tools[{i}]: two tools are named {name!r}; tool names must be unique")
        seen.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise ToolError("tools", f"tool {name!r}: description must be a string, got {_brief(fn['description'])}")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise ToolError("tools", f"tool {name!r}: parameters must be a JSON Schema object (a dict with "
                             f"\"type\": \"object\"), got {_brief(params)}")
        out.append({**tool, "function": {**fn, "parameters": params}})
    return out


def check_tool_choice(choice: Any, tools: list[dict]) -> tuple[str, list[str]]:
    """("auto" | "none" | "required", the names of the tools a call may use). A named function
    ``{"type": "function", "function": {"name": ...}}`` is "required" with that one name."""
    names = [t["function"]["name"] for t in tools]
    if choice in ("auto", "none", "required"):
        return choice, names
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ToolError("tool_choice", f"tool_choice names the function {_brief(name)}, which is not among the tools "
                             f"({', '.join(names)})")
        return "required", [name]
    raise ToolError("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': "
                     f"{{'name': ...}}}}, got {_brief(choice)}")


def check_messages(messages: Any) -> list[dict]:
    """The messages as templates take them: an assistant turn's `tool_calls` checked (arguments
    given as a JSON string become the object they encode, as HF's templates expect), a null
    content made "", and every ``tool`` message checked to answer a call made before it
    (its `tool_call_id`). ValueError names the message and the problem."""
    if not isinstance(messages, list):
        raise ToolError("messages", f"messages must be a list of dicts, not {type(messages).__name__}")
    ids: set[str] = set()
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ToolError("messages", f"message {i} must be a dict with 'role' and 'content', not {type(m).__name__}")
        m = dict(m)
        if m.get("content") is None and (m.get("tool_calls") or m.get("role") == "assistant"):
            m["content"] = ""
        if m.get("tool_calls") is not None:
            m["tool_calls"] = [_check_call(i, k, c, ids) for k, c in enumerate(_list(i, m["tool_calls"]))]
        if m.get("role") == "tool":
            tid = m.get("tool_call_id")
            if tid not in ids:
                raise ToolError("messages", f"message {i} (role 'tool') has tool_call_id {_brief(tid)}, which answers no "
                                 f"call of an earlier assistant message; give the id of the call it answers")
        out.append(m)
    return out


def _list(i: int, calls: Any) -> list:
    if not isinstance(calls, list):
        raise ToolError("messages", f"message {i}: tool_calls must be a list, got {_brief(calls)}")
    return calls


def _check_call(i: int, k: int, call: Any, ids: set) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("messages", f"message {i}: tool_calls[{k}] must be {{'id', 'type': 'function', 'function': "
                         f"{{'name', 'arguments'}}}}, got {_brief(call)}")
    if isinstance(call.get("id"), str):
        ids.add(call["id"])
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        args = parsed if isinstance(parsed, dict) else args  # a string that is no object stays as given
    return {**call, "function": {**fn, "arguments": args}}


def _brief(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---- formats -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Format:
    """One tool-call format: how calls are written, and so grammar-constrained and parsed.

    `trigger` opens the calls (None: the reply *is* JSON, as in `generic`); `shape` says how the
    calls are written once it has: "blocks" (one JSON object per ``open ... close`` block),
    "array" (the objects of one JSON array), "leading" (one object at the start of the reply),
    "generic" (the objects of the "tool_calls" array of the reply's object), "named" (``trigger
    name sep {arguments}`` per call), "xml" (one ``<function=name>`` block of ``<parameter=p>``
    lines per ``trigger ... close`` block), "pythonic" (one Python list of ``name(p=value, ...)``
    calls per ``trigger ... close`` block). `args_key` is the key that holds the arguments."""
    name: str
    trigger: str | None
    shape: str
    args_key: str = "arguments"
    close: str = ""          # "blocks", "xml", "pythonic": the text that ends a block
    before: str = ""         # "blocks": the text between the trigger and the object
    after: str = ""          # "blocks": the text between the object and `close`
    sep: str = ""            # "named": the text between the name and the arguments


HERMES = Format("hermes", "<tool_call>", "blocks", before="\n", after="\n", close="</tool_call>")
MISTRAL = Format("mistral", "[TOOL_CALLS]", "array")
MISTRAL_ARGS = Format("mistral_args", "[TOOL_CALLS]", "named", sep="[ARGS]")
QWEN3_CODER = Format("qwen3_coder", "<tool_call>", "xml", close="</tool_call>")
LLAMA3 = Format("llama3", "<|python_tag|>", "leading", args_key="parameters")
PYTHONIC = Format("pythonic", "<|tool_call_start|>", "pythonic", close="<|tool_call_end|>")
GENERIC = Format("generic", None, "generic")
FORMATS = {f.name: f for f in (HERMES, MISTRAL, MISTRAL_ARGS, QWEN3_CODER, LLAMA3, PYTHONIC, GENERIC)}


# A probe conversation: the format is recognised from what the template writes for its call.
_PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn", "description": "A probe.", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}, "required": ["probe_arg"]}}}
_PROBE = [{"role": "user", "content": "Call the probe."},
          {"role": "assistant", "content": "", "tool_calls": [{"id": "abc123XYZ", "type": "function", "function": {
              "name": "probe_fn", "arguments": {"probe_arg": "probe_value"}}}]},
          {"role": "tool", "tool_call_id": "abc123XYZ", "name": "probe_fn", "content": "ok"}]
_WRITTEN = [  # (format, the pattern of its probe call in the rendering)
    (QWEN3_CODER, r"<tool_call>\n<function=probe_fn>\n<parameter=probe_arg>\nprobe_value\n</parameter>\n"),
    (HERMES, r'<tool_call>\n\{"name": "probe_fn", "arguments": \{"probe_arg": "probe_value"\}\}\n</tool_call>'),
    (MISTRAL_ARGS, r'\[TOOL_CALLS\]probe_fn(\[CALL_ID\]abc123XYZ)?\[ARGS\]\{"probe_arg": "probe_value"\}'),
    (MISTRAL, r'\[TOOL_CALLS\] ?\[\{"name": "probe_fn", "arguments": \{"probe_arg": "probe_value"\}'),
    (LLAMA3, r'(^|\n|>)\{"name": "probe_fn", "parameters": \{"probe_arg": "probe_value"\}\}'),
    (PYTHONIC, r"<\|tool_call_start\|>\[probe_fn\(probe_arg=(['\"])probe_value\1\)\]<\|tool_call_end\|>"),
    # LFM2-8B-A1B's and LFM2.5-Instruct's templates write an assistant turn's content only, so no
    # call; they are known by the tool list they write, as LFM2 documents it (its models then
    # answer in pythonic calls). Last: a template that writes a call is known by that call.
    (PYTHONIC, r'List of tools: (<\|tool_list_start\|>)?\[\{"type": "function", "function": \{"name": "probe_fn"'),
]


@lru_cache(maxsize=32)
def detect_format(template: str | None) -> Format:
    """The tool-call format of a chat template, from how it writes a probe call into the history
    (a template that never reads `tools` gets `generic`). ValueError for a template that reads
    `tools` but writes calls in a format npllama does not know, or that cannot render one: its
    calls could be neither constrained nor parsed."""
    if template is None or not re.search(r"\btools\b", template):
        return GENERIC
    try:
        rendered = format_chat(template, _PROBE, tools=[_PROBE_TOOL], bos_token="<s>", eos_token="</s>")
    except ValueError as e:
        raise ValueError(f"this chat template reads `tools` but cannot render a tool call ({e}); leave tools "
                         f"out") from None
    for fmt, pattern in _WRITTEN:
        if re.search(pattern, rendered):
            return fmt
    raise ValueError("this chat template reads `tools` but writes calls in a format npllama does not know "
                     "(it knows <tool_call> JSON, Qwen3-Coder's <tool_call><function=...> XML, [TOOL_CALLS] "
                     "JSON or name[ARGS], Llama 3 JSON, LFM2's <|tool_call_start|>[name(p=...)], and templates "
                     "without tools); leave tools out, or use a model with one of those templates")


# ---- grammars ----------------------------------------------------------------------------------

def _arguments_schema(params: dict) -> dict:
    """A tool's `parameters` as the grammar enforces them: numbers bounded as for json_schema=,
    and no properties beyond those listed where the schema lists some and says nothing of others
    (small models otherwise pad calls with invented ones). Both only narrow what is valid."""
    params = _bound_numbers(params)
    if "properties" in params and "additionalProperties" not in params and "patternProperties" not in params:
        params = {**params, "additionalProperties": False}
    return params


def _call_schema(tool: dict, args_key: str) -> dict:
    fn = tool["function"]
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: _arguments_schema(fn["parameters"])},
            "required": ["name", args_key], "additionalProperties": False}


def _one_of(tools: list[dict], names: list[str], args_key: str) -> dict:
    schemas = [_call_schema(t, args_key) for t in tools if t["function"]["name"] in names]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


_GAP = r"/[ \t]*\n?/"  # between one call's block and the next one's trigger


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT})


def _lit(text: str) -> str:
    return json.dumps(text)


def _marker(tokenizer, text: str) -> tuple[str, bool]:
    """(grammar item, is a control token) for a format's marker: the vocabulary's control
    token when it has one for exactly this text (`<[id]>`), else the literal text."""
    ids = tokenizer.encode(text, add_bos=False, special=True)
    if len(ids) == 1 and tokenizer.is_special(ids[0]):
        return f"<[{ids[0]}]>", True
    return _lit(text), False


# Qwen3-Coder's XML calls write each argument as its own ``<parameter=p>`` block, a string raw and
# any other value as JSON (the template writes a True/False/None scalar as Python does). So the
# arguments' schema is enforced per parameter: its listed properties in their order, the required
# ones present; a string by its enum, const or length (raw text holds no escapes to check
# anything else against), any other type by its JSON Schema.
_XML_OBJECT_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title", "$schema"}
_XML_STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength", "description", "title", "default", "examples"}
_XML_PYTHON = {"True": "true", "False": "false", "None": "null"}
_XML_END = "</parameter>"  # ends a value; the line break the template writes before it is optional
_NL = "\n"


def _listed_params(tool: dict, writes: str) -> tuple[str, dict, list]:
    """("tool NAME", its properties, its required names) for formats whose calls name each
    parameter (`writes`: how the template writes a call); ToolError for a schema that is not a
    list of properties only, or that requires one it does not list."""
    fn = tool["function"]
    params, where = _arguments_schema(fn["parameters"]), f"tool {fn['name']!r}"
    extra = sorted(set(params) - _XML_OBJECT_KEYS)
    if extra or params.get("additionalProperties", False) is not False:
        raise ToolError("tools", f"{where}: this model's template writes calls as {writes}, which npllama "
                         f"holds to a schema of listed properties only; {extra or ['additionalProperties']} cannot "
                         f"be enforced there: drop them, or list every parameter under properties")
    props, required = params.get("properties", {}), params.get("required", [])
    missing = [r for r in required if r not in props]
    if missing:
        raise ToolError("tools", f"{where}: required parameters {missing} are not among its properties; list them "
                         f"under properties")
    return where, props, required


def xml_params(tool: dict) -> list[tuple[str, dict, bool, str]]:
    """(name, schema, required, "string" or "json") of each parameter of `tool` in XML calls;
    ToolError for a `parameters` schema these calls cannot be held to."""
    where, props, required = _listed_params(tool, "<parameter=...> XML")
    out = []
    for name, prop in props.items():
        kind = _xml_kind(prop)
        bad = sorted(set(prop) - _XML_STRING_KEYS) if kind == "string" else []
        if kind is None or bad or not _NAME.fullmatch(name):
            why = (f"keywords {bad}, which raw text cannot be checked against" if bad else
                   "a name other than letters, digits, '_', '-', '.' or ':'" if kind else
                   "no single type: raw text and JSON cannot be told apart (give it a type, string or not)")
            raise ToolError("tools", f"{where}: parameter {name!r} has {why}, and this model's template writes "
                             f"calls as <parameter=...> XML, strings raw")
        out.append((name, prop, name in required, kind))
    return out


def _xml_kind(prop: Any) -> str | None:
    """"string" for a parameter written raw, "json" for one written as JSON, None if unclear."""
    if not isinstance(prop, dict):
        return None
    types = prop.get("type")
    if types is None and ("enum" in prop or "const" in prop):
        values = prop.get("enum", [prop.get("const")])
        types = ["string" if isinstance(v, str) else "other" for v in values]
    types = {types} if isinstance(types, str) else set(types or [])
    return "string" if types == {"string"} else "json" if types and "string" not in types else None


def _xml_rules(tools: list[dict]) -> str:
    """The Lark rules of one XML call (`call`) to one of `tools`: ``<function=name>\n``, then
    each parameter's ``<parameter=p>\nvalue\n</parameter>\n``, then ``</function>``."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        params = []
        for j, (name, prop, required, kind) in enumerate(xml_params(tool)):
            rule = f"t{i}p{j}"
            rules.append(f"{rule}: {_lit(f'<parameter={name}>' + _NL)} {_xml_value(rule, prop, kind, rules)} {_lit(_NL)}")
            params.append(rule if required else f"{rule}?")
        calls.append(f"t{i}")
        head = _lit(f"<function={tool['function']['name']}>" + _NL)
        rules.append(f"t{i}: {head} {' '.join(params)} {_lit('</function>')}")
    return f"call: {' | '.join(calls)}\n" + "".join(r + "\n" for r in rules)


def _xml_value(rule: str, prop: dict, kind: str, rules: list[str]) -> str:
    """The grammar item of one parameter's value and its ``\n</parameter>`` (adding any rule it
    needs to `rules`): a string as raw text (the first ``</parameter>`` ends it, and a line break
    just before it is not part of it, as the template writes one), else JSON."""
    if kind == "json":
        if prop.get("type") == "boolean" and "enum" not in prop and "const" not in prop:
            value = '("true" | "false" | "True" | "False")'
        elif prop.get("type") == "null":
            value = '("null" | "None")'
        else:
            value = _json(_bound_numbers(prop))
        return f"{value} {_lit(_NL)}? {_lit(_XML_END)}"
    if "enum" in prop or "const" in prop:
        values = [prop["const"]] if "const" in prop else prop["enum"]
        return "(" + " | ".join(_lit(v) for v in values) + f") {_lit(_NL)}? {_lit(_XML_END)}"
    low, high = prop.get("minLength", 0), prop.get("maxLength")
    text = "/(?s:.*)/" if (low, high) == (0, None) else f"/(?s:.){{{low},{'' if high is None else high}}}\\n?/"
    rules.append(f"{rule}v[lazy]: {text} {_lit(_XML_END)}")
    return f"{rule}v"


# LFM2's pythonic calls are one Python list, ``[name(p=value, ...), ...]``, keyword arguments
# only. The grammar asks for a tool's listed parameters in the schema's order, the required ones
# present, and writes each value as a Python literal held to its parameter's schema: a string
# quoted either way (escapes \\ \' \" \n \r \t \b \f \xHH \uXXXX), by its enum or const; a number
# by its JSON Schema (the same digits in Python); True/False, None; a list by its items,
# minItems and maxItems; a dict by its properties (listed ones in order, keys quoted either way)
# or, without them, any keys; anyOf and lists of types as alternatives. JSON's true/false/null
# are taken too, since the LFM2.5 template writes a dict argument as JSON (the parser reads both).
_PY_NOTES = {"description", "title", "default", "examples", "$comment"}
_PY_NUMBER_KEYS = {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_PY_KEYS = {"string": {"type"}, "integer": _PY_NUMBER_KEYS, "number": _PY_NUMBER_KEYS, "boolean": {"type"},
            "null": {"type"}, "array": {"type", "items", "minItems", "maxItems"},
            "object": {"type", "properties", "required", "additionalProperties"}}
_PY_ESCAPES = {"\\": "\\", "'": "'", '"': '"', "n": "\n", "r": "\r", "t": "\t", "b": "\b", "f": "\f"}
_PY_ESC = r"""\\(["'\\nrtbf]|x[0-9a-fA-F]{2}|u([0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))"""
_PY_COMMON = (f"""PYSTR: /'([^'\\\\\\n\\r]|{_PY_ESC})*'|"([^"\\\\\\n\\r]|{_PY_ESC})*"/\n"""
              "PYNUM: /-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,10})?([eE][+-]?[0-9]{1,3})?/\n"
              'pybool: "True" | "False" | "true" | "false"\n'
              'pynone: "None" | "null"\n'
              'pyany: PYSTR | PYNUM | pybool | pynone | "[" (pyany (", " pyany)*)? "]" '
              '| "{" (PYSTR ": " pyany (", " PYSTR ": " pyany)*)? "}"\n')


class _PyGrammar:
    """The Lark rules of pythonic calls, gathered while each tool's parameters are walked."""

    def __init__(self):
        self.rules: list[str] = []

    def rule(self, body: str) -> str:
        name = f"py{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: Any, where: str) -> str:
        """The grammar item of a value under `schema`; ToolError (naming `where`) if it cannot hold it."""
        if not isinstance(schema, dict):
            _py_refuse(where, f"schema {_brief(schema)}, which is not an object")
        s = {k: v for k, v in schema.items() if k not in _PY_NOTES}
        if "enum" in s or "const" in s:
            values = [s["const"]] if "const" in s else s["enum"]
            items = [_py_literals(v) for v in values] if isinstance(values, list) else [None]
            if set(s) - {"type", "enum", "const"} or None in items or not items:
                _py_refuse(where, "an enum or const of other than strings, numbers, booleans and null, or with other "
                                  "keywords beside it")
            return "(" + " | ".join(x for lits in items for x in lits) + ")"
        if "anyOf" in s:
            if set(s) != {"anyOf"} or not isinstance(s["anyOf"], list) or not s["anyOf"]:
                _py_refuse(where, "anyOf with keywords beside it")
            return "(" + " | ".join(self.value(x, where) for x in s["anyOf"]) + ")"
        types = s.get("type")
        if types is None:
            if s:
                _py_refuse(where, f"keywords {sorted(s)} without a type")
            return "pyany"
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in _PY_KEYS for t in types):
            _py_refuse(where, f"type {_brief(types)}")
        extra = sorted(set(s) - set().union(*(_PY_KEYS[t] for t in types)))
        if extra:
            _py_refuse(where, f"keywords {extra}, which pythonic calls cannot be held to")
        alts = [self.typed(t, {k: v for k, v in s.items() if k in _PY_KEYS[t]}, where) for t in types]
        return alts[0] if len(alts) == 1 else "(" + " | ".join(alts) + ")"

    def typed(self, t: str, s: dict, where: str) -> str:
        if t == "string":
            return "PYSTR"
        if t in ("integer", "number"):
            return _json(_bound_numbers({**s, "type": t}))
        if t in ("boolean", "null"):
            return "pybool" if t == "boolean" else "pynone"
        if t == "array":
            item = self.value(s.get("items", {}), where)
            low, high = s.get("minItems", 0), s.get("maxItems")
            if high == 0:
                return '"[]"'
            rest = f'(", " {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
            return self.rule(f'"[" {item} {rest} "]"' + ("" if low else ' | "[]"'))
        props, required = s.get("properties"), s.get("required", [])
        extra = s.get("additionalProperties", props is None)
        if props is None and not required:
            value = "pyany" if extra is True else self.value(extra, where) if extra is not False else None
            return '"{}"' if value is None else self.rule(f'"{{" (PYSTR ": " {value} (", " PYSTR ": " {value})*)? "}}"')
        if not isinstance(props, dict) or extra is not False or any(r not in props for r in required):
            _py_refuse(where, "an object with required keys it does not list, or with listed and unlisted keys both")
        items = [(f'({" | ".join(_py_literals(k))}) ": " {self.value(v, where)}', k in required)
                 for k, v in props.items()]
        return self.rule(f'"{{" {_py_sequence(items)} "}}"')

    def calls(self, tools: list[dict]) -> str:
        """The rules of one call (`call`) to one of `tools`: ``name(p=value, ...)``."""
        names = []
        for tool in tools:
            fn, items = tool["function"], []
            for name, prop, required in pythonic_params(tool):
                value = self.value(prop, f"tool {fn['name']!r}: parameter {name!r}")
                items.append((f"{_lit(name + '=')} {value}", required))
            names.append(self.rule(f"{_lit(fn['name'] + '(')} {_py_sequence(items)} {_lit(')')}"))
        return f"call: {' | '.join(names)}\n" + "".join(r + "\n" for r in self.rules) + _PY_COMMON


def pythonic_params(tool: dict) -> list[tuple[str, dict, bool]]:
    """(name, schema, required) of each parameter of `tool` in pythonic calls; ToolError for a
    `parameters` schema these calls cannot be held to (keyword arguments: listed properties only,
    each named as a Python identifier)."""
    where, props, required = _listed_params(tool, "name(p=value, ...)")
    for name in props:
        if not name.isidentifier() or keyword.iskeyword(name):
            raise ToolError("tools", f"{where}: parameter {name!r} is not a Python identifier, and this model's template "
                             f"writes calls as name(p=value, ...)")
    return [(name, prop, name in required) for name, prop in props.items()]


def _py_refuse(where: str, why: str) -> None:
    raise ToolError("tools", f"{where}: {why}; this model's template writes calls as name(p=value, ...) with Python "
                     f"values, and npllama cannot hold them to that schema: simplify it")


def _py_literals(value: Any) -> list[str] | None:
    """The grammar literals of a JSON scalar written in Python (strings quoted either way); None for others."""
    if isinstance(value, str):
        return [_lit(_py_quote(value, q)) for q in "'\""]
    if isinstance(value, bool) or value is None:
        return [_lit(w) for w in {True: ("True", "true"), False: ("False", "false"), None: ("None", "null")}[value]]
    if isinstance(value, (int, float)):
        return [_lit(json.dumps(value))]
    return None


def _py_quote(text: str, quote: str) -> str:
    """`text` as a Python string literal in `quote`, with only the escapes the grammar allows."""
    names = {"\\": "\\\\", quote: "\\" + quote, "\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}
    return quote + "".join(names.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x20 else c) for c in text) + quote


def _py_sequence(items: list[tuple[str, bool]]) -> str:
    """`items` (grammar item, required) in their order, each optional one maybe left out, with
    ", " between those present."""
    alts = []
    for k, (first, required) in enumerate(items):
        tail = [f'", " {item}' if req else f'(", " {item})?' for item, req in items[k + 1:]]
        alts.append(" ".join([first] + tail))
        if required:  # no alternative may leave a required item out
            return "(" + " | ".join(alts) + ")"
    return f"({' | '.join(alts)})?" if alts else ""


def grammar(fmt: Format, tokenizer, tools: list[dict], choice: str, names: list[str], parallel: bool) -> str | None:
    """The Lark grammar (llguidance) of a reply in `fmt` under `choice`; None for no constraint."""
    if fmt is GENERIC:
        if choice == "none":
            return None
        calls = {"type": "object", "properties": {"tool_calls": {
            "type": "array", "items": _one_of(tools, names, "arguments"), "minItems": 1,
            "maxItems": MAX_CALLS if parallel else 1}}, "required": ["tool_calls"], "additionalProperties": False}
        answer = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"],
                  "additionalProperties": False}
        return f"start: {_json(calls if choice == 'required' else {'anyOf': [calls, answer]})}\n"
    mark, special = _marker(tokenizer, fmt.trigger)
    chosen = [t for t in tools if t["function"]["name"] in names]

    def more(item: str) -> str:  # the calls after the first, with parallel_tool_calls
        return f" ({item}){{0,{MAX_CALLS - 1}}}" if parallel else ""
    if fmt.shape == "blocks":
        block = f"{_lit(fmt.before)} call {_lit(fmt.after)} {_lit(fmt.close)}"
        body = "calls: " + block + more(f"{_GAP} {mark} {block}") + "\n"
    elif fmt.shape == "array":
        body = 'calls: "[" call' + more('", " call') + ' "]"\n'
    elif fmt.shape == "named":
        body = "calls: call" + more(f"{mark} call") + "\n"
    elif fmt.shape == "pythonic":
        body = 'calls: "[" call' + more('", " call') + f' "]" {_marker(tokenizer, fmt.close)[0]}\n'
    elif fmt.shape == "xml":
        block = f'"\\n" call "\\n" {_lit(fmt.close)}'
        body = "calls: " + block + more(f"{_GAP} {mark} {block}") + "\n"
    else:  # leading: one call
        body = "calls: call\n"
    if fmt.shape == "named":
        sep = _marker(tokenizer, fmt.sep)[0]
        rules = body + "call: " + " | ".join(
            f"{_lit(t['function']['name'])} {sep} {_json(_arguments_schema(t['function']['parameters']))}"
            for t in chosen) + "\n"
    elif fmt.shape == "xml":
        rules = body + _xml_rules(chosen)
    elif fmt.shape == "pythonic":
        rules = body + _PyGrammar().calls(chosen)
    else:
        rules = body + f"call: {_json(_one_of(tools, names, fmt.args_key))}\n"
    if fmt is LLAMA3:  # the call opens the reply, after the tag or bare
        tag = mark if special else f"{mark}"
        text = ("TEXT: /(?s:[^{].*)?/" if special else
                f"TEXT: /(?s:[^{{].*)?/ & ~/{re.escape(fmt.trigger)}(?s:.*)/".replace("|", "\\|"))
        if choice == "none":
            return f"start: TEXT\n{text}\n"
        start = "start: calls | " + tag + " calls" + ("" if choice == "required" else " | TEXT")
        return f"{start}\n{text}\n{rules}"
    free = "/(?s:.*)/"
    if choice == "none":
        return f"start: TEXT\nTEXT: {free}\n" if special else \
            f"start: TEXT\nTEXT: {free} & ~/(?s:.*){re.escape(fmt.trigger)}(?s:.*)/\n"
    if choice == "required":
        return f"start: {mark} calls\n{rules}"
    if special:
        return f"start: TEXT | TEXT {mark} calls\nTEXT: {free}\n{rules}"
    return f"start: TEXT | pre calls\nTEXT: {free}\npre[lazy]: {free} {mark}\n{rules}"


# ---- rendering the prompt ----------------------------------------------------------------------

GENERIC_SYSTEM = (
    "You can call these tools (JSON Schema of each one's arguments):\n{tools}\n\n"
    "Reply with one JSON object: {{\"tool_calls\": [{{\"name\": <a tool's name>, \"arguments\": <its "
    "arguments>}}]}} to call tools, or {{\"response\": <your answer>}} to answer directly.")


def _generic_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` for a template without tools: the tools described in the system message, each
    assistant call turn written as the JSON the model is to answer in, and tool results as a
    user turn (consecutive results joined), so that roles still alternate."""
    described = json.dumps([{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                             "parameters": t["function"]["parameters"]} for t in tools], ensure_ascii=False)
    note = GENERIC_SYSTEM.format(tools=described)
    out: list[dict] = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m["role"] == "tool":
            result = json.dumps({"tool_response": {"tool_call_id": m["tool_call_id"], "content": m["content"]}},
                                ensure_ascii=False)
            if out and out[-1].get("npllama_results"):
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result, "npllama_results": True})
        elif m["role"] == "assistant":
            out.append({**m, "content": json.dumps({"response": m["content"]}, ensure_ascii=False)})
        else:
            out.append(m)
    out = [{k: v for k, v in m.items() if k != "npllama_results"} for m in out]
    if out and out[0]["role"] == "system":
        return [{**out[0], "content": out[0]["content"] + "\n\n" + note}] + out[1:]
    return [{"role": "system", "content": note}] + out


@dataclass
class ToolPlan:
    """A checked tool request for one model: the `prompt` to generate from, the `grammar`
    (Lark; None: unconstrained) and the `format` its reply is parsed in (`parser()`); `kinds`
    says, for XML calls, which parameters are written raw (``{tool: {parameter: "string" or
    "json"}}``)."""
    prompt: str
    grammar: str | None
    format: Format
    choice: str
    kinds: dict = field(default_factory=dict)

    def parser(self, make_id: Callable[[], str] | None = None) -> "CallParser":
        """A parser of one reply (`make_id` gives the calls' ids: `new_call_id` by default)."""
        fmt, make_id = None if self.choice == "none" else self.format, make_id or new_call_id
        if fmt is not None and fmt.shape == "named":
            return NamedCallParser(fmt, make_id)
        if fmt is not None and fmt.shape == "xml":
            return XmlCallParser(fmt, self.kinds, make_id)
        if fmt is not None and fmt.shape == "pythonic":
            return PythonicCallParser(fmt, make_id)
        return CallParser(fmt, make_id)


def plan(model, messages: list[dict], tools: Any, tool_choice: Any = "auto", parallel_tool_calls: bool = True,
         **template_options) -> ToolPlan:
    """Check a tool request against `model` and prepare it (see the module's docstring).

    ValueError, before any token, for: malformed tools or tool_choice, a `parameters` that is not
    a JSON Schema object or that llguidance cannot enforce (naming the tool), a `tool` message
    that answers no earlier call, and a template whose tool format npllama does not know."""
    tools = check_tools(tools)
    choice, names = check_tool_choice(tool_choice, tools)
    if not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", f"parallel_tool_calls must be True or False, got {_brief(parallel_tool_calls)}")
    messages = check_messages(messages)
    for t in tools:
        try:
            make_constraint(model, json_schema=_arguments_schema(t["function"]["parameters"]))
        except ValueError as e:
            raise ToolError("tools", f"tool {t['function']['name']!r}: parameters: {e}") from None
    try:
        fmt = detect_format(model.tokenizer.chat_template)
    except ValueError as e:
        raise ToolError("tools", str(e)) from None
    if fmt is GENERIC:
        shown = messages if choice == "none" else _generic_messages(messages, tools)
        try:
            prompt = model.format_chat(shown, **template_options)
        except ValueError as e:
            raise ToolError("tools", f"tools cannot be expressed with this model's chat template, which knows no tools "
                             f"(npllama describes them in a system message, and the template refused it: {e})") \
                from None
    else:
        prompt = model.format_chat(messages, tools=tools, **template_options)
    text = grammar(fmt, model.tokenizer, tools, choice, names, parallel_tool_calls)
    if text is not None:
        make_constraint(model, grammar=text)  # compiled (and cached) now: any error before generation
    kinds = {t["function"]["name"]: {p[0]: p[3] for p in xml_params(t)} for t in tools} if fmt is QWEN3_CODER else {}
    return ToolPlan(prompt, text, fmt, choice, kinds)


# ---- parsing the reply -------------------------------------------------------------------------

@dataclass
class Delta:
    """One piece of a parsed reply: `content` text, or a piece of call `index` (its `id` and
    `name` come in the call's first piece, then `arguments` text in pieces)."""
    content: str = ""
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str = ""


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    """A call id: 9 letters and digits, the form every template accepts (Mistral's demands it)."""
    return "".join(random.choices(_ID_CHARS, k=9))


class CallParser:
    """Turns a reply into `Delta`s as its text arrives: `feed(text)` returns the pieces that became
    certain, `finish()` the rest. Text before the format's trigger is content (a possible start of
    the trigger is held back until it is decided); after it, the JSON is followed one character
    at a time (the stack of open containers, each object's current key, strings and scalars), so
    a call's id and name go out as soon as its name is read, then its arguments text as it comes.
    Nothing of the markup reaches `content`. The pieces join the same whatever the cuts, so a
    streamed reply equals the whole one. `fmt=None` reads everything as content."""

    def __init__(self, fmt: Format | None, make_id: Callable[[], str] = new_call_id):
        self.fmt, self.make_id = fmt, make_id
        self.mode = "text" if fmt is None else "calls" if fmt.shape == "generic" else \
            "start" if fmt.shape == "leading" else "text"
        self.pending = ""         # text held back: a possible start of the trigger
        self.stack: list[dict] = []   # open containers: {"kind": "{" or "[", "key", "expect"}
        self.in_string = self.escape = self.is_key = self.scalar = False
        self.string: list[str] = []
        self.calls = 0
        self.call: dict | None = None  # the call object being read
        self.content_raw: str | None = None  # generic: the raw text of the "response" string so far

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        for ch in text:
            self._char(ch, out)
        return _merge(out)

    def finish(self) -> list[Delta]:
        out = [Delta(content=self.pending)] if self.mode != "calls" and self.pending else []
        self.pending = ""
        return _merge(out)

    # -- text before the calls --
    def _char(self, ch: str, out: list[Delta]) -> None:
        if self.mode == "calls":
            return self._in_calls(ch, out)
        if self.fmt is None or self.mode == "text" and self.fmt.shape == "leading":
            out.append(Delta(content=ch))
            return
        self.pending += ch
        trig = self.fmt.trigger
        if self.mode == "start":  # leading: a call opens the reply, after the tag or with "{"
            if self.pending in (trig, "{"):
                rest, self.pending, self.mode = self.pending.removeprefix(trig), "", "calls"
                for c in rest:
                    self._in_calls(c, out)
            elif not trig.startswith(self.pending):
                out.append(Delta(content=self.pending))
                self.pending, self.mode = "", "text"
            return
        if self.pending.endswith(trig):
            out.append(Delta(content=self.pending[:-len(trig)]))
            self.pending, self.mode = "", "calls"
            return
        keep = next((n for n in range(min(len(trig) - 1, len(self.pending)), 0, -1)
                     if self.pending.endswith(trig[:n])), 0)
        out.append(Delta(content=self.pending[:len(self.pending) - keep]))
        self.pending = self.pending[len(self.pending) - keep:]

    # -- the calls --
    def _new_call(self, name: str, out: list[Delta], arguments: str = "") -> int:
        """Sends call `name`'s first piece (its index, a new id, the name); returns its index."""
        index = self.calls
        self.calls += 1
        out.append(Delta(index=index, id=self.make_id(), name=name, arguments=arguments))
        return index

    def _in_calls(self, ch: str, out: list[Delta]) -> None:
        """One character after the trigger: the JSON of the calls, followed as the class says."""
        call = self.call
        end = self._scan(ch, out)
        if call is not None and (call["capture"] == "on" or end == "inclusive"):
            if call["args"] is None:
                out.append(Delta(index=call["index"], arguments=ch))
            else:
                call["args"].append(ch)

    def _scan(self, ch: str, out: list[Delta]) -> str | None:
        """Follow one character; "inclusive" or "exclusive" when it ends the arguments value
        (the character being part of it or not)."""
        if self.in_string:
            if self.content_raw is not None and (self.escape or ch != '"'):
                self._content(ch, out)
            if self.escape:
                self.escape = False
            elif ch == "\\":
                self.escape = True
            elif ch == '"':
                self.in_string = False
                return "inclusive" if self._string_done("".join(self.string), out) else None
            self.string.append(ch)
            return None
        if self.scalar:
            if ch not in ",}] \t\r\n":
                return None
            self.scalar = False
            if self._value_done():
                self._structural(ch, out)
                return "exclusive"
        return "inclusive" if self._structural(ch, out) else None

    def _structural(self, ch: str, out: list[Delta]) -> bool:
        """A character outside strings and scalars; True when it ends the arguments value."""
        top = self.stack[-1] if self.stack else None
        if ch.isspace() or top is None and ch not in "{[":
            return False  # whitespace, or markup between the calls
        value = top is None or top["expect"] == "value"
        if ch in "{[":
            if value:
                self._value_begins()
            self.stack.append({"kind": ch, "key": None, "expect": "key" if ch == "{" else "value"})
            if ch == "{" and self.call is None and self._call_opens():
                self.call = {"depth": len(self.stack), "name": None, "index": None, "args": [], "capture": None}
            return False
        if ch in "}]":
            self.stack.pop()
            if self.call is not None and len(self.stack) < self.call["depth"]:
                self.call = None  # the call object closed (one without a name is dropped)
            return self._value_done()
        if ch == '"':
            self.in_string, self.string = True, []
            self.is_key = top["kind"] == "{" and top["expect"] == "key"
            if not self.is_key:
                self._value_begins()
                if self.fmt.shape == "generic" and len(self.stack) == 1 and top["key"] == "response":
                    self.content_raw = ""
            return False
        if ch == ":":
            top["expect"] = "value"
        elif ch == ",":
            top["expect"], top["key"] = ("key", None) if top["kind"] == "{" else ("value", top["key"])
        elif value:
            self._value_begins()
            self.scalar = True
        return False

    def _call_opens(self) -> bool:
        """Whether the object just opened (on top of the stack) is a call, by the format's shape."""
        st, shape = self.stack, self.fmt.shape
        if shape in ("blocks", "leading"):
            return len(st) == 1
        if shape == "array":
            return len(st) == 2 and st[0]["kind"] == "["
        return len(st) == 3 and st[0]["key"] == "tool_calls" and st[1]["kind"] == "["

    def _value_begins(self) -> None:
        """A value begins inside the container on top of the stack (or at the top level)."""
        if not self.stack:
            return
        top, call = self.stack[-1], self.call
        top["expect"] = "comma"
        if call is not None and len(self.stack) == call["depth"] and top["key"] == self.fmt.args_key \
                and call["capture"] is None:
            call["capture"] = "on"

    def _value_done(self) -> bool:
        """A value ended inside the container on top of the stack; True if it was the arguments."""
        call = self.call
        if call is not None and call["capture"] == "on" and len(self.stack) == call["depth"]:
            call["capture"] = "done"
            return True
        return False

    def _string_done(self, raw: str, out: list[Delta]) -> bool:
        top, call = self.stack[-1] if self.stack else None, self.call
        self.content_raw = None
        if top is None:
            return False
        if self.is_key:
            top["key"], top["expect"] = _unescape(raw), "colon"
            return False
        if call is not None and len(self.stack) == call["depth"] and top["key"] == "name" and call["name"] is None:
            call["name"] = _unescape(raw)
            call["index"] = self._new_call(call["name"], out, "".join(call["args"]))
            call["args"] = None  # from now on the arguments go straight out
        return self._value_done()

    def _content(self, ch: str, out: list[Delta]) -> None:
        text, self.content_raw = _decode_partial(self.content_raw + ch)
        if text:
            out.append(Delta(content=text))


class NamedCallParser(CallParser):
    """`CallParser` for "named" calls, ``trigger name sep {arguments}`` each (Mistral's
    ``[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}``): the name runs up to `sep`, the
    arguments object (sent as it comes) up to the brace that closes it, outside strings."""

    def __init__(self, fmt: Format, make_id: Callable[[], str] = new_call_id):
        super().__init__(fmt, make_id)
        self.state, self.buf, self.depth = "name", "", 0

    def _in_calls(self, ch: str, out: list[Delta]) -> None:
        if self.state == "args":
            out.append(Delta(index=self.calls - 1, arguments=ch))
            if self.escape:
                self.escape = False
            elif self.in_string:
                self.escape, self.in_string = ch == "\\", ch != '"'
            elif ch == '"':
                self.in_string = True
            elif ch in "{[]}":
                self.depth += 1 if ch in "{[" else -1
                self.state = "between" if self.depth == 0 else "args"
            return
        self.buf += ch
        if self.state == "name" and self.buf.endswith(self.fmt.sep):
            self._new_call(self.buf[:-len(self.fmt.sep)].strip(), out)
            self.state, self.buf = "args", ""
        elif self.state == "between" and self.buf.endswith(self.fmt.trigger):
            self.state, self.buf = "name", ""


class XmlCallParser(CallParser):
    """`CallParser` for "xml" calls (Qwen3-Coder's): per ``trigger`` block, the name of its
    ``<function=name>``, then each ``<parameter=p>\nvalue\n</parameter>`` as one key of the
    arguments object. A string value (by `kinds`) is sent as it comes, JSON-escaped, holding back
    what may be the start of ``\n</parameter>`` (the line break before it is markup); any other
    value at its end (True/False/None read as JSON's true/false/null)."""

    def __init__(self, fmt: Format, kinds: dict, make_id: Callable[[], str] = new_call_id):
        super().__init__(fmt, make_id)
        self.kinds = kinds
        self.state, self.buf = "open", ""
        self.name = self.kind = None
        self.index = self.params = 0  # the call being read, and its parameters so far
        self.value: list[str] = []  # a JSON value's text so far

    def _in_calls(self, ch: str, out: list[Delta]) -> None:
        if self.state == "newline":  # the line break after <parameter=p>
            self.state = "value"
            if ch == "\n":
                return
        self.buf += ch
        head = self.buf.lstrip()
        if self.state == "open" and head.startswith("<function=") and head.endswith(">"):
            self.name = head[len("<function="):-1]
            self.index, self.params = self._new_call(self.name, out), 0
            self.state, self.buf = "params", ""
        elif self.state == "params" and head.startswith("<parameter=") and head.endswith(">"):
            param = head[len("<parameter="):-1]
            self.kind = self.kinds.get(self.name, {}).get(param, "string")
            opening = ('{' if self.params == 0 else ', ') + json.dumps(param, ensure_ascii=False) + ": "
            self._args(opening + ('"' if self.kind == "string" else ""), out)
            self.params += 1
            self.state, self.buf, self.value = "newline", "", []
        elif self.state == "params" and head == "</function>":
            self._args("}" if self.params else "{}", out)
            self.state, self.buf = "after", ""
        elif self.state == "value":
            self._value(out)
        elif self.state == "after" and self.buf.endswith(self.fmt.close):
            self.state, self.buf = "between", ""
        elif self.state == "between" and self.buf.endswith(self.fmt.trigger):
            self.state, self.buf = "open", ""

    def _value(self, out: list[Delta]) -> None:
        done = self.buf.endswith(_XML_END)
        if done:
            keep = len(_XML_END) + self.buf[:-len(_XML_END)].endswith(_NL)
        else:
            closer = _NL + _XML_END
            keep = next((n for n in range(min(len(closer) - 1, len(self.buf)), 0, -1)
                         if self.buf.endswith(closer[:n]) or self.buf.endswith(_XML_END[:n])), 0)
        text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        if self.kind == "string":
            self._args(json.dumps(text, ensure_ascii=False)[1:-1] + ('"' if done else ""), out)
        else:
            self.value.append(text)
            if done:
                value = "".join(self.value).strip()
                self._args(_XML_PYTHON.get(value, value), out)
        if done:
            self.state, self.buf = "params", ""

    def _args(self, text: str, out: list[Delta]) -> None:
        if text:
            out.append(Delta(index=self.index, arguments=text))


class PythonicCallParser(CallParser):
    """`CallParser` for "pythonic" calls (LFM2's ``[get_weather(city='Paris'), add(a=1, b=2)]``
    per ``trigger ... close`` block): each call's name up to its ``(``, then its keyword
    arguments as one JSON object, converted as they come: strings (quoted either way) re-quoted
    and re-escaped character by character, True/False/None as true/false/null (JSON's own taken
    as they are), numbers as JSON writes them, tuples as lists, ", " and ": " between items."""

    def __init__(self, fmt: Format, make_id: Callable[[], str] = new_call_id):
        super().__init__(fmt, make_id)
        self.state, self.buf = "open", ""
        self.key: str | None = None  # the keyword being read (None: in a value)
        self.depth = self.params = 0  # containers open in the value; the call's arguments so far
        self.quote: str | None = None  # the quote of the string being read
        self.raw = ""  # an escape being read in a string, or the scalar being read outside one

    def _in_calls(self, ch: str, out: list[Delta]) -> None:
        if self.state == "args":
            return self._string(ch, out) if self.quote is not None else self._arg(ch, out)
        self.buf += ch
        if self.state == "open" and ch == "[":
            self.state, self.buf = "name", ""
        elif self.state == "name" and ch == "(":
            self._new_call(self.buf[:-1].strip(" ,\n"), out)
            self.state, self.key, self.params = "args", "", 0
        elif self.state == "name" and ch == "]":
            self.state, self.buf = "after", ""
        elif self.state == "after" and self.buf.endswith(self.fmt.close):
            self.state, self.buf = "between", ""
        elif self.state == "between" and self.buf.endswith(self.fmt.trigger):
            self.state, self.buf = "open", ""

    def _arg(self, ch: str, out: list[Delta]) -> None:
        """One character of the arguments, outside strings."""
        if self.key is not None:  # a keyword, up to its "=", or the call's ")"
            if ch == "=":
                name = json.dumps(self.key.strip(" ,\n"), ensure_ascii=False)
                self._args(("{" if self.params == 0 else ", ") + name + ": ", out)
                self.key, self.params = None, self.params + 1
            elif ch == ")":
                self._end_call(out)
            else:
                self.key += ch
            return
        if ch.isalnum() or ch in "._+-":
            self.raw += ch
            return
        if self.raw:
            self._args(_py_scalar(self.raw), out)
            self.raw = ""
        if ch in "'\"":
            self.quote = ch
            self._args('"', out)
        elif ch in "[{(":
            self.depth += 1
            self._args("{" if ch == "{" else "[", out)
        elif ch in ")]}" and self.depth == 0:
            self._end_call(out)
        elif ch in ")]}":
            self.depth -= 1
            self._args("}" if ch == "}" else "]", out)
        elif ch == ",":
            if self.depth == 0:
                self.key = ""
            else:
                self._args(", ", out)
        elif ch == ":":
            self._args(": ", out)

    def _string(self, ch: str, out: list[Delta]) -> None:
        """One character inside a string: sent JSON-escaped, an escape once it is whole."""
        if self.raw:
            self.raw += ch
            text = _py_escape(self.raw)
            if text is not None:
                self._args(text, out)
                self.raw = ""
        elif ch == "\\":
            self.raw = ch
        elif ch == self.quote:
            self.quote = None
            self._args('"', out)
        else:
            self._args(json.dumps(ch, ensure_ascii=False)[1:-1], out)

    def _end_call(self, out: list[Delta]) -> None:
        self._args("}" if self.params else "{}", out)
        self.state, self.buf = "name", ""

    def _args(self, text: str, out: list[Delta]) -> None:
        out.append(Delta(index=self.calls - 1, arguments=text))


_PY_NAMES = {"True": "true", "False": "false", "None": "null"}


def _py_scalar(token: str) -> str:
    """A Python scalar's token as JSON: True/False/None named as JSON does, a number written by
    `json` (``1_000``, ``0x1f``, ``.5`` are Python's); anything else as it is."""
    if token in _PY_NAMES:
        return _PY_NAMES[token]
    try:
        value = ast.literal_eval(token)
    except (ValueError, SyntaxError):
        return token
    return json.dumps(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else token


def _py_escape(raw: str) -> str | None:
    """A whole Python string escape (``\\n``, ``\\xHH``, ``\\uXXXX``) as the text of a JSON string,
    None while `raw` is only its start; an escape Python does not know keeps its backslash."""
    size = {"x": 4, "u": 6, "U": 10}.get(raw[1], 2)
    if len(raw) < size:
        return None
    if size == 2:
        text = _PY_ESCAPES.get(raw[1], raw)
    else:
        try:
            code = int(raw[2:], 16)
        except ValueError:
            code = None
        if code is not None and 0xD800 <= code < 0xE000:
            return f"\\u{code:04x}"  # half a surrogate pair: JSON joins the two
        text = raw if code is None or code > 0x10FFFF else chr(code)
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _unescape(raw: str) -> str:
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw


def _decode_partial(raw: str) -> tuple[str, str]:
    """(the text of the complete escapes and characters of a JSON string's raw start, the rest)."""
    out, i = [], 0
    while i < len(raw):
        if raw[i] != "\\":
            out.append(raw[i])
            i += 1
            continue
        if i + 1 >= len(raw):
            break
        if raw[i + 1] != "u":
            out.append(_unescape(raw[i:i + 2]))
            i += 2
            continue
        if i + 6 > len(raw):
            break
        code = int(raw[i + 2:i + 6], 16)
        if 0xD800 <= code < 0xDC00:  # a surrogate pair: wait for its second half
            if i + 12 > len(raw):
                break
            out.append(_unescape(raw[i:i + 12]))
            i += 12
        else:
            out.append(chr(code))
            i += 6
    return "".join(out), raw[i:]


def _merge(deltas: list[Delta]) -> list[Delta]:
    """Adjacent content pieces, and adjacent argument pieces of one call, joined."""
    out: list[Delta] = []
    for d in deltas:
        prev = out[-1] if out else None
        if prev is not None and d.index is None and prev.index is None:
            prev.content += d.content
        elif prev is not None and d.index is not None and d.index == prev.index and d.id is None:
            prev.arguments += d.arguments
        else:
            out.append(d)
    return [d for d in out if d.index is not None or d.content]


def assemble(deltas: Iterable[Delta]) -> dict:
    """The assistant message that `deltas` make: ``{"role": "assistant", "content": str | None,
    "tool_calls": [{"id", "type": "function", "function": {"name", "arguments"}}]}`` (no
    `tool_calls` key when there are none; content None when there is none beside calls)."""
    content, calls = [], []
    for d in deltas:
        if d.index is None:
            content.append(d.content)
        elif d.id is not None:
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": d.arguments}})
        else:
            calls[d.index]["function"]["arguments"] += d.arguments
    message = {"role": "assistant", "content": "".join(content) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def raw_text(tokenizer, tokens: Iterable, tail: str = "") -> str:
    """The generated text with its control tokens written out (generation's text drops them, but
    a format's marker may be one, as Llama's ``<|python_tag|>``)."""
    parts = [tokenizer.id_to_bytes(t.id).decode("utf-8", "replace") if tokenizer.is_special(t.id) else t.text
             for t in tokens]
    return "".join(parts) + tail


def delta_dict(d: Delta) -> dict:
    """A Delta in OpenAI's streamed shape: ``{"content": ...}`` or ``{"tool_calls": [{"index",
    "id", "type", "function": {"name", "arguments"}}]}`` (id, type and name in a call's first)."""
    if d.index is None:
        return {"content": d.content}
    fn = {"arguments": d.arguments} if d.id is None else {"name": d.name, "arguments": d.arguments}
    call = {"index": d.index, **({} if d.id is None else {"id": d.id, "type": "function"}), "function": fn}
    return {"tool_calls": [call]}


def finish_reason(reason: str, calls: int) -> str:
    """The reply's finish reason: "tool_calls" when it ended in calls, else generation's own."""
    return "tool_calls" if calls and reason == "stop" else reason


def parse_reply(plan: ToolPlan, tokenizer, tokens: list, text: str, reason: str) -> dict:
    """The assistant message of a finished reply (`tokens` and the whole `text` of a Completion),
    with its `finish_reason`."""
    shown = "".join(t.text for t in tokens)
    parser = plan.parser()
    deltas = parser.feed(raw_text(tokenizer, tokens, text[len(shown):])) + parser.finish()
    message = assemble(deltas)
    return {**message, "finish_reason": finish_reason(reason, parser.calls)}
