"""The OpenAI request shapes: parse and check JSON bodies, and shape responses and stream chunks.

Every check raises `APIError` (an HTTP status and OpenAI's `{"error": {...}}` body) naming the
field and what is allowed; messages quote at most a few dozen characters of the input, so a
huge or hostile body is never echoed back. Nothing here runs the model.
"""
from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass, field

from ..generation.generate import Token
from ..generation.sampling import SamplingParams

MAX_N = 16              # choices per request
MAX_PROMPTS = 64        # prompts (times n) in one /v1/completions request
MAX_STOP = 16           # stop strings
MAX_STOP_CHARS = 256    # characters per stop string
MAX_TOP_LOGPROBS = 20
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}

_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 40, 40, 4, 4, 2


def show(value) -> str:
    """A short repr of untrusted input (never more than about a hundred characters)."""
    try:
        return _short.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print
        return f"<{type(value).__name__}>"


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 503: "server_error", 500: "server_error"}

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message[:1000], code, param
        self.type = type or self.TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"{param}: {message}", code=code, param=param)


# ---- field checks ----------------------------------------------------------------------------
def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(name, f"must be a number, got {show(v)}", "invalid_type")
    if v < low or v > high or (low_open and v == low):
        raise _bad(name, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {show(v)}")
    return float(v)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise _bad(name, f"must be an integer, got {show(v)}", "invalid_type")
    if v < low or (high is not None and v > high):
        raise _bad(name, f"must be an integer from {low}{f' to {high}' if high is not None else ' up'}, got {show(v)}")
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(name, f"must be true or false, got {show(v)}", "invalid_type")
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", f"must be a string or a list of strings, got {show(v)}", "invalid_type")
    if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise _bad("stop", f"at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
    return stops


def _logit_bias(body: dict, n_vocab: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise _bad("logit_bias", f"must be an object mapping token ids to biases, got {show(v)}", "invalid_type")
    if len(v) > n_vocab:
        raise _bad("logit_bias", f"has {len(v)} entries, more than the vocabulary's {n_vocab} tokens")
    out = {}
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 12 and int(key) < n_vocab):
            raise _bad("logit_bias", f"key {show(key)} is not a token id from 0 to {n_vocab - 1}")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise _bad("logit_bias", f"the bias of token {key} must be a number from -100 to 100, got {show(bias)}")
        out[int(key)] = float(bias)
    return out


def parse_response_format(body: dict) -> dict:
    """`response_format` as the keyword a constrained Request takes: {} for plain text,
    {"json_schema": schema} for JSON (json_object: any JSON object). The one place it is read."""
    v = body.get("response_format")
    if v is None:
        return {}
    if not isinstance(v, dict) or not isinstance(v.get("type"), str):
        raise _bad("response_format", f"must be an object with a 'type', got {show(v)}", "invalid_type")
    kind = v["type"]
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    if kind == "json_schema":
        spec = v.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _bad("response_format", "json_schema must be an object with a 'schema' object")
        return {"json_schema": spec.get("schema", {})}
    raise _bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {show(kind)}")


@dataclass
class Generation:
    """What a completion request asks for, checked: everything but the prompt."""
    max_tokens: int | None
    sampling: list[SamplingParams]      # one per choice (seeds seed, seed + 1, ...)
    stop: list[str]
    n: int
    logprobs: int                       # top alternatives the engine computes (0: none)
    want_logprobs: bool
    top_logprobs: int                   # alternatives reported per token
    stream: bool
    include_usage: bool
    constraint: dict = field(default_factory=dict)  # a Request's structured-output keyword
    tools: dict | None = None  # chat: {"tools", "tool_choice", "parallel_tool_calls"} as given; None without tools


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """A 400 for the OpenAI fields that would change the answer but are not implemented, rather
    than an answer that silently ignores them (other unknown fields are ignored)."""
    given = {k: v for k, v in body.items() if v not in (None, False, [], "")}
    if chat:
        names = [k for k in ("functions", "function_call", "audio", "prediction")
                 if k in given and not (k == "function_call" and given[k] in ("none", "auto"))]
    else:
        names = [k for k in ("echo", "suffix") if k in given]
        if given.get("best_of") not in (None, 1, given.get("n", 1)):
            names.append("best_of")
    if names:
        raise APIError(400, f"{names[0]}: not supported by this server", code="unsupported_parameter",
                       param=names[0])


def parse_generation(body: dict, n_vocab: int, *, chat: bool) -> Generation:
    """Check the generation fields common to /v1/chat/completions and /v1/completions."""
    _refuse_unsupported(body, chat)
    max_tokens = _integer(body, "max_completion_tokens", 1) if chat else None
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1)
    n = _integer(body, "n", 1, MAX_N) or 1
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise _bad("seed", f"must be an integer from 0 to 2**63 - 1, got {show(seed)}")
    opts = dict(temperature=_number(body, "temperature", 0, 2), top_p=_number(body, "top_p", 0, 1, low_open=True),
                top_k=_integer(body, "top_k", 0), min_p=_number(body, "min_p", 0, 1),
                repeat_penalty=_number(body, "repeat_penalty", 0, 10, low_open=True),
                repeat_last_n=_integer(body, "repeat_last_n", -1),
                presence_penalty=_number(body, "presence_penalty", -2, 2),
                frequency_penalty=_number(body, "frequency_penalty", -2, 2),
                logit_bias=_logit_bias(body, n_vocab))
    opts = {k: v for k, v in opts.items() if v is not None}
    sampling = [SamplingParams(**opts, seed=None if seed is None else (seed + i) % 2**63) for i in range(n)]
    if chat:
        want = _flag(body, "logprobs")
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not want:
            raise _bad("top_logprobs", "needs logprobs: true")
        logprobs = max(top, 1) if want else 0
    else:
        top = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        want, logprobs, top = top is not None, 0 if top is None else max(top, 1), top or 0
    stream = _flag(body, "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not stream:
            raise _bad("stream_options", "is only allowed with stream: true")
        if not isinstance(so, dict):
            raise _bad("stream_options", f"must be an object, got {show(so)}", "invalid_type")
        include_usage = _flag(so, "include_usage")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {show(model)}", "invalid_type")
    tools = parse_tools(body) if chat else None
    constraint = parse_response_format(body)
    if tools is not None and constraint:
        raise _bad("response_format", "cannot be combined with tools: the tool-call grammar already constrains "
                                      "the reply")
    return Generation(max_tokens, sampling, _stop(body), n, logprobs, want, top, stream, include_usage,
                      constraint, tools)


def parse_tools(body: dict) -> dict | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` as `tools.plan` takes them (checked there
    against the model), or None without tools; a tool_choice other than "none" or "auto"
    without tools is a 400."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise _bad("tool_choice", f"needs tools, got {show(choice)} without any")
        return None
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", f"must be true or false, got {show(parallel)}", "invalid_type")
    return {"tools": tools, "tool_choice": "auto" if choice is None else choice,
            "parallel_tool_calls": True if parallel is None else parallel}


def _content(i: int, content) -> str:
    """A message's content: a string, or a list of text parts joined; null is empty."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"messages[{i}].content", f"only text parts are supported, got {show(part)}")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad(f"messages[{i}].content", f"must be a string or a list of text parts, got {show(content)}",
               "invalid_type")


def parse_messages(body: dict) -> list[dict]:
    """`messages` as the chat template takes them: [{"role", "content": str}, ...]."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages", f"must be a non-empty list of messages, got {show(msgs)}",
                   "missing_required_parameter" if msgs is None else "invalid_type")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"must be an object with 'role' and 'content', got {show(m)}", "invalid_type")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {show(role)}")
        msg = {"role": ROLES[role], "content": _content(i, m.get("content"))}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = m["tool_calls"]  # checked with the tools (generation/tools.check_messages)
        out.append(msg)
    return out


def _is_ids(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_prompts(body: dict) -> list:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of lists of ids."""
    p = body.get("prompt")
    if isinstance(p, str) or _is_ids(p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        prompts = p
    else:
        raise _bad("prompt", f"must be a string, a list of strings, or token ids, got {show(p)}",
                   "missing_required_parameter" if p is None else "invalid_type")
    if len(prompts) > MAX_PROMPTS:
        raise _bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}")
    if any(x == "" for x in prompts):
        raise _bad("prompt", "a prompt is empty")
    return prompts


# ---- responses -------------------------------------------------------------------------------
def _token_entry(tok, tid: int, lp: float) -> dict:
    b = tok.id_to_bytes(tid)
    return {"token": b.decode("utf-8", "replace"), "logprob": max(lp, -9999.0), "bytes": list(b)}


def chat_logprobs(tok, tokens: list[Token], top: int) -> dict:
    return {"content": [{**_token_entry(tok, t.id, t.logprob),
                         "top_logprobs": [_token_entry(tok, i, lp) for i, lp in (t.top_logprobs or [])[:top]]}
                        for t in tokens]}


def completion_logprobs(tok, tokens: list[Token], top: int, offset: int = 0) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(tok.id_to_bytes(t.id).decode("utf-8", "replace"))
        out["token_logprobs"].append(max(t.logprob, -9999.0))
        tops = {}
        for i, lp in (t.top_logprobs or [])[:top]:
            tops.setdefault(tok.id_to_bytes(i).decode("utf-8", "replace"), max(lp, -9999.0))
        out["top_logprobs"].append(tops)
        out["text_offset"].append(offset)
        offset += len(t.text)
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
