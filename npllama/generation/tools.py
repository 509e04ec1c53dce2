"""Tool calling: OpenAI's `tools` / `tool_choice` / `tool_calls` over any chat template.

`plan(model, messages, tools, tool_choice, parallel_tool_calls)` checks the request (ValueError
naming what is wrong, before any token), recognises the model's tool-call format from its chat
template and vocabulary, renders the prompt, and returns a `ToolPlan`: the prompt text, the Lark
grammar (llguidance) that the output is decoded under, and a `CallParser` factory that turns the
generated text back into content and calls, piece by piece as it streams.

The formats (one `Format` each; the first whose template markers match wins):

* ``hermes``: Hermes 2/3, Qwen 2.5, Qwen 3, SmolLM3. ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call.
* ``mistral``: Mistral Nemo and the other ``[TOOL_CALLS]`` templates. ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]``.
* ``llama3``: Llama 3.1 / 3.2 / 3.3 JSON calls: ``{"name": ..., "parameters": {...}}`` at the start
  of the reply, after ``<|python_tag|>`` or bare (one call per turn, as Meta documents).
* ``generic``: templates that know no tools (SmolLM2, Gemma 3): the tools are described in a
  system message, and the whole reply is one JSON object, ``{"tool_calls": [{"name": ...,
  "arguments": {...}}, ...]}`` or ``{"response": "..."}``.

What the grammar guarantees: with ``tool_choice="required"`` or a named function the reply is
only calls (at least one) to the allowed tools, with arguments valid under each tool's
`parameters` schema. With ``"auto"`` the model may write text; once it emits the call's opening
marker (``<tool_call>``, ``[TOOL_CALLS]``, a leading ``{``) the rest is constrained the same way,
so a call is never malformed (llguidance's lazy lexemes: the text before the marker is free).
With ``"none"`` no call can start. ``parallel_tool_calls=False`` allows one call, True up to
`MAX_CALLS`. A reply cut short by `max_tokens` ends with its last call's arguments cut short.
"""
from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .structured import constraint as make_constraint, _bound_numbers

__all__ = ["FORMATS", "MAX_CALLS", "CallParser", "Delta", "ToolError", "ToolPlan", "assemble", "check_messages",
           "check_tool_choice", "check_tools", "delta_dict", "detect_format", "finish_reason", "new_call_id",
           "parse_reply", "plan", "raw_text"]

MAX_CALLS = 8  # calls in one reply with parallel_tool_calls (bounds what a small model can loop on)
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# compact JSON inside calls: the separators the templates render (", " and ": "), no free whitespace
_COMPACT = {"whitespace_flexible": False}


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

    `trigger` opens the calls (None: the reply *is* JSON, as in `generic`); `shape` says where
    the call objects are once it has: "blocks" (one object per ``open ... close`` block),
    "array" (the objects of one JSON array), "leading" (one object at the start of the reply),
    "generic" (the objects of the "tool_calls" array of the reply's object). `args_key` is the
    key that holds the arguments."""
    name: str
    trigger: str | None
    shape: str
    args_key: str = "arguments"
    close: str = ""          # "blocks": the text that ends a block
    before: str = ""         # "blocks": the text between the trigger and the object
    after: str = ""          # "blocks": the text between the object and `close`


HERMES = Format("hermes", "<tool_call>", "blocks", before="\n", after="\n", close="</tool_call>")
MISTRAL = Format("mistral", "[TOOL_CALLS]", "array")
LLAMA3 = Format("llama3", "<|python_tag|>", "leading", args_key="parameters")
GENERIC = Format("generic", None, "generic")
FORMATS = {f.name: f for f in (HERMES, MISTRAL, LLAMA3, GENERIC)}


def detect_format(template: str | None) -> Format:
    """The tool-call format of a chat template: from the markers its tool branch writes; a
    template that never reads `tools` gets `generic`. ValueError for a template that reads
    `tools` in a way npllama does not know (its calls could be neither constrained nor parsed)."""
    if template is None or not re.search(r"\btools\b", template):
        return GENERIC
    if "<function=" in template and "<parameter=" in template:
        raise ValueError("this chat template writes tool calls as <function=...><parameter=...> XML "
                         "(Qwen3-Coder), which npllama cannot constrain yet; pass tools to a model whose "
                         "template uses <tool_call> JSON, [TOOL_CALLS] or Llama 3 JSON, or leave tools out")
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        if "[ARGS]" in template:
            raise ValueError("this chat template writes tool calls as [TOOL_CALLS]name[ARGS]{...} (Mistral "
                             "Small 3.2, Devstral), which npllama cannot constrain yet; leave tools out")
        return MISTRAL
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3
    raise ValueError("this chat template reads `tools` but writes calls in a format npllama does not know "
                     "(it knows <tool_call> JSON, [TOOL_CALLS], Llama 3 JSON, and templates without tools); "
                     "leave tools out, or use a model with one of those templates")


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
    call = _json(_one_of(tools, names, fmt.args_key))

    def more(item: str) -> str:  # the calls after the first, with parallel_tool_calls
        return f" ({item}){{0,{MAX_CALLS - 1}}}" if parallel else ""
    if fmt.shape == "blocks":
        block = f"{_lit(fmt.before)} call {_lit(fmt.after)} {_lit(fmt.close)}"
        gap = r"/[ \t]*\n?/"
        body = "calls: " + block + more(f"{gap} {mark} {block}") + "\n"
    elif fmt.shape == "array":
        body = 'calls: "[" call' + more('", " call') + ' "]"\n'
    else:  # leading: one call
        body = "calls: call\n"
    rules = body + f"call: {call}\n"
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
    (Lark; None: unconstrained) and the `format` its reply is parsed in (`parser()`)."""
    prompt: str
    grammar: str | None
    format: Format
    choice: str

    def parser(self) -> "CallParser":
        return CallParser(None if self.choice == "none" else self.format)


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
    return ToolPlan(prompt, text, fmt, choice)


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
            return self._json_char(ch, out)
        if self.fmt is None or self.mode == "text" and self.fmt.shape == "leading":
            out.append(Delta(content=ch))
            return
        self.pending += ch
        trig = self.fmt.trigger
        if self.mode == "start":  # leading: a call opens the reply, after the tag or with "{"
            if self.pending in (trig, "{"):
                rest, self.pending, self.mode = self.pending.removeprefix(trig), "", "calls"
                for c in rest:
                    self._json_char(c, out)
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
    def _json_char(self, ch: str, out: list[Delta]) -> None:
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
            call["name"], call["index"] = _unescape(raw), self.calls
            self.calls += 1
            out.append(Delta(index=call["index"], id=self.make_id(), name=call["name"], arguments="".join(call["args"])))
            call["args"] = None  # from now on the arguments go straight out
        return self._value_done()

    def _content(self, ch: str, out: list[Delta]) -> None:
        text, self.content_raw = _decode_partial(self.content_raw + ch)
        if text:
            out.append(Delta(content=text))


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
