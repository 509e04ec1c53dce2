"""Chat prompts: render a model's Jinja2 chat template (GGUF `tokenizer.chat_template`) exactly as
HF transformers' ``tokenizer.apply_chat_template(messages, tokenize=False)`` does.

The template runs in Jinja2's immutable sandbox with HF's settings: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, the ``{% generation %}`` block (rendered as its
body), the globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does not
escape HTML characters. A model without a template gets `CHATML_TEMPLATE`.

A template comes with the model file, from whoever made it, and is code that we run; the sandbox
stops it reaching outside, and this module also bounds what it may consume. Every string or list
it builds (with ``+``, ``*``, ``~``, ``%``, ``join``, ``format``, string methods, filters) is
checked against `MAX_CHARS` *before* it is built, and all of them together against `MAX_BUILT`;
its output against `MAX_CHARS`; every loop step and call against a deadline of `MAX_SECONDS`;
integers against `MAX_INT_BITS`. Anything that goes wrong in a template (a bound, a Jinja error,
a ``ZeroDivisionError``, the sandbox's ``OverflowError`` for big ranges, recursion, memory) is a
`ChatTemplateError` that names the template. The bounds are far above what real templates need
(a 12 KB tool-calling template renders a long conversation in milliseconds and builds a few times
its output); what they cannot stop is a comparison or sort of huge self-similar lists, which
costs time but no memory.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import re
import string
import time
import types
from collections import abc
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, update_wrapper
from typing import Any, Callable

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from ..errors import ChatTemplateError, show

__all__ = ["CHATML_TEMPLATE", "MAX_BUILT", "MAX_CHARS", "MAX_INT_BITS", "MAX_SECONDS", "MAX_TEMPLATE_CHARS",
           "ROLES", "format_chat", "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")

#: The longest string or list a template may build, and the longest output it may render
#: (characters or items): 16 Mi, some 4 million tokens, past any model's context.
MAX_CHARS = 1 << 24
#: All the characters and items one rendering may build, together: 256 Mi. It bounds memory
#: (at most 1 GiB even in 4-byte characters) where a template keeps many large strings alive.
MAX_BUILT = 1 << 28
#: The time one rendering may take, in seconds; real templates take milliseconds.
MAX_SECONDS = 5.0
#: The largest integer a template may compute, in bits (Python prints at most 4300 digits anyway).
MAX_INT_BITS = 1 << 16
#: The longest template accepted; the largest real ones are a few tens of KB.
MAX_TEMPLATE_CHARS = 1 << 20

# The fallback for models whose file has no chat template: plain ChatML, one block per message,
#   <|im_start|>{role}\n{content}<|im_end|>\n
# followed by "<|im_start|>assistant\n" when a generation prompt is asked for.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (HF's assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# ---- bounds ---------------------------------------------------------------------------------------

class _Exceeded(Exception):
    """A bound was exceeded (internal: `format_chat` turns it into a ChatTemplateError). Not a
    ValueError, so that no filter's own ``except ValueError`` can swallow it."""


@dataclass
class _Budget:
    deadline: float
    built: int = 0


# The rendering in progress in this thread (None while a template compiles).
_RENDER: ContextVar[_Budget | None] = ContextVar("npllama_chat_render", default=None)


def _tick() -> None:
    r = _RENDER.get()
    if r is not None and time.monotonic() > r.deadline:
        raise _Exceeded(f"it ran for more than {MAX_SECONDS:g} s, the time limit")


def _check(size: int, what: str) -> None:
    if size > MAX_CHARS:
        raise _Exceeded(f"{what} would have {size} characters or items; the limit is {MAX_CHARS}")


def _build(size: int, what: str) -> None:
    """Check `size` against MAX_CHARS and count it against MAX_BUILT."""
    _check(size, what)
    r = _RENDER.get()
    if r is not None:
        r.built += size
        if r.built > MAX_BUILT:
            raise _Exceeded(f"it built more than {MAX_BUILT} characters and items in all; that is the limit")
        _tick()


_CONTAINERS = (Namespace, abc.Mapping, list, tuple, set, frozenset, abc.MappingView)


def _children(v: Any) -> list | None:
    """The items whose text is part of ``str(v)`` for a container (a mapping's keys and values), else None."""
    if not isinstance(v, _CONTAINERS):
        return None
    if isinstance(v, Namespace):
        v = v._Namespace__attrs  # a namespace prints its attributes
    if isinstance(v, abc.Mapping):
        return [x for kv in v.items() for x in kv]
    if isinstance(v, abc.ItemsView):
        return [x for kv in v for x in kv]
    if isinstance(v, (list, tuple, set, frozenset, abc.MappingView)):
        return list(v)
    return None


def _leaf_size(v: Any) -> int:
    if isinstance(v, str):
        return len(v) + 2
    if isinstance(v, (bytes, bytearray)):
        return 4 * len(v) + 3
    if isinstance(v, int) and not isinstance(v, bool):
        return v.bit_length() // 3 + 2
    return 64  # None, bool, float, range, and objects that print briefly


def _text_size(value: Any, per_item: int = 0, per_level: int = 0) -> int:
    """An upper bound (up to escapes) on the length of ``str(value)``, counting a container's items
    each time they appear: a list of a list of ... doubled 60 times is as big as its text, 2**60.
    `per_item` and `per_level` add separators and indentation (``tojson``, ``pprint``). Each
    distinct container is visited once, so this costs what the value occupies in memory."""
    memo: dict[int, tuple[int, int, int] | None] = {}  # id -> (characters, items, height); None: open
    kids_of: dict[int, list] = {}
    stack = [value]
    steps = 0
    while stack:
        v = stack[-1]
        i = id(v)
        if i not in memo:
            kids = _children(v)
            if kids is None:
                memo[i] = (_leaf_size(v), 1, 0)
                stack.pop()
                continue
            memo[i] = None
            kids_of[i] = kids
            stack.extend(k for k in kids if isinstance(k, _CONTAINERS) and id(k) not in memo)
            steps += len(kids)
            continue
        stack.pop()
        if memo[i] is not None:  # pushed twice; done already
            continue
        kids = kids_of.pop(i)
        chars, items, height = 2 + 4 * len(kids), 1, 0
        for k in kids:
            c, n, h = memo.get(id(k)) or (8, 1, 0) if isinstance(k, _CONTAINERS) else (_leaf_size(k), 1, -1)
            chars, items, height = chars + c, items + n, max(height, h + 1)  # an open one is a cycle: "[...]"
        memo[i] = (chars, items, height)
        if steps > 1 << 16:
            steps = 0
            _tick()
    chars, items, height = memo[id(value)]
    return chars + items * (per_item + per_level * (height + 1))


def _as_text(value: Any, what: str) -> str:
    """``str(value)``, refused before it is built when it would be too long."""
    if isinstance(value, str):
        return value
    _check(_text_size(value), what)
    text = str(value)
    _build(len(text), what)
    return text


def _finalize(value: Any) -> str:
    """Every ``{{ expression }}`` goes through here (Jinja's `finalize` hook)."""
    return _as_text(value, "the text of an expression")


def _concat(values: tuple) -> str:
    """``a ~ b ~ c``."""
    texts = [_as_text(v, "the text of a '~' operand") for v in values]
    _build(sum(map(len, texts)), "'~'")
    return "".join(texts)


def _join_output(parts: Any) -> str:
    """Jinja's `concat`: joins the output of a macro, a ``{% set %}`` block, a filter block."""
    parts = list(parts)
    _build(sum(map(len, parts)), "the output of a block or macro")
    return "".join(parts)


def _loop(iterable: Any) -> Any:
    """What every ``{% for %}`` iterates over: its iterable, with a deadline check per step."""
    for item in iterable:
        _tick()
        yield item


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_printf(fmt: str, values: Any, what: str) -> None:
    """``fmt % values``: the format, every width and precision, and the text of the values."""
    size = len(fmt) + _text_size(values)
    star = False
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            if n == "*":
                star = True
            elif n:
                size += int(n)
    if star:  # widths taken from the values
        vals = values if isinstance(values, tuple) else (values,)
        size += sum(abs(v) for v in vals if isinstance(v, int))
    _check(size, what)


def _check_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """``fmt.format(*args, **kwargs)`` (and ``format_map``): widths and precisions in the format."""
    size = len(fmt) + _text_size(args) + _text_size(kwargs)
    nested = False
    for _, field, spec, _ in string.Formatter().parse(fmt):
        if field is not None and spec:
            size += sum(int(n) for n in re.findall(r"\d+", spec))
            nested = nested or "{" in spec
    if nested:  # widths taken from the arguments
        size += sum(abs(v) for v in (*args, *kwargs.values()) if isinstance(v, int))
    _check(size, "str.format")


def _check_ints(values: Any, what: str) -> None:
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > MAX_CHARS:
            raise _Exceeded(f"{what} was given {v}; the limit is {MAX_CHARS}")


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Size checks for the str/bytes methods that can build more than their input; returns the
    arguments to call with (``join`` gets its iterable as a list, measured)."""
    s, name = method.__self__, method.__name__
    what = f"str.{name}"
    if name in ("format", "format_map"):
        _check_format(s, args, kwargs if name == "format" else (args[0] if args else {}))
    elif name == "join" and args:
        items = list(args[0])
        _check(sum(_text_size(x) for x in items) + len(s) * len(items), what)
        args = (items, *args[1:])
    elif name == "replace" and len(args) >= 2 and all(isinstance(a, type(s)) for a in args[:2]):
        old, new = args[0], args[1]
        n = len(s) + 1 if not old else s.count(old)
        count = args[2] if len(args) > 2 else kwargs.get("count", -1)
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _check(len(s) + n * max(0, len(new) - len(old)), what)
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            _check(len(s) + s.count("\t" if isinstance(s, str) else b"\t") * tab, what)
    elif name == "translate" and args and isinstance(args[0], abc.Mapping):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        _check(len(s) * max(longest, 1), what)
    return args


# Filters that do not turn their value into text (their results are still counted).
_STRUCTURAL_FILTERS = frozenset({
    "abs", "attr", "batch", "bool", "count", "d", "default", "dictsort", "filesizeformat", "first", "float",
    "groupby", "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
    "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"})


def _filter_check(name: str, a: dict) -> None:
    """Pre-checks for the filters whose output can outgrow their input; `a` holds the bound
    arguments by parameter name (without Jinja's context argument) and may be updated."""
    value = next(iter(a.values()))
    if name == "join":
        items = list(value)
        a[next(iter(a))] = items
        _check(sum(_text_size(x) for x in items) + len(str(a.get("d", ""))) * len(items), "join")
    elif name == "indent":
        s = _as_text(value, "indent")
        width = a.get("width", 4)
        width = width if isinstance(width, int) else len(_as_text(width, "indent"))
        _check(len(s) + (s.count("\n") + 1) * width, "indent")
    elif name == "wordwrap":
        s = _as_text(value, "wordwrap")
        width, wrap = a.get("width", 79), a.get("wrapstring") or "\n"
        lines = len(s) // max(width, 1) + s.count("\n") + 1 if isinstance(width, int) else len(s)
        _check(len(s) + lines * len(_as_text(wrap, "wordwrap")), "wordwrap")
    elif name == "center":
        _check(max(len(_as_text(value, "center")), a.get("width", 80)), "center")
    elif name == "replace":
        s, old, new = (_as_text(x, "replace") for x in (value, a["old"], a["new"]))
        n = len(s) + 1 if not old else s.count(old)
        count = a.get("count")
        if isinstance(count, int) and count >= 0:
            n = min(n, count)
        _check(len(s) + n * max(0, len(new) - len(old)), "replace")
    elif name == "format":
        _check_printf(_as_text(value, "format"), a.get("args") or a.get("kwargs"), "format")
    elif name == "tojson":
        indent = a.get("indent")
        indent = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
        seps = a.get("separators") or ("", "")
        per_item = 2 + sum(len(_as_text(x, "tojson")) for x in seps)
        _check(_text_size(value, per_item=per_item, per_level=max(indent, 0)), "tojson")
    elif name == "pprint":
        _check(_text_size(value, per_level=1), "pprint")
    elif name == "batch":
        _check(a["linecount"], "batch")
    elif name == "slice":
        if isinstance(a["slices"], int) and a["slices"] > jinja2.sandbox.MAX_RANGE:
            raise _Exceeded(f"slice was asked for {a['slices']} slices; the limit is {jinja2.sandbox.MAX_RANGE}")
    elif name == "sum" and not isinstance(a.get("start", 0), (int, float)):
        items = list(value)
        a[next(iter(a))] = items
        _check(sum(len(x) for x in items if isinstance(x, abc.Sized)) + _text_size(a["start"]), "sum")
    elif name not in _STRUCTURAL_FILTERS:
        _check(_text_size(value), name)


def _count_result(result: Any, what: str) -> None:
    if isinstance(result, (str, bytes, bytearray, list, tuple, dict)):
        _build(len(result), what)


def _bounded_filter(name: str, func: Callable) -> Callable:
    """`func` (a Jinja filter) with the deadline, its pre-checks and its result counted."""
    lead = 1 if hasattr(func, "jinja_pass_arg") else 0  # Jinja passes a context/environment first
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if hasattr(inspect.unwrap(func), "jinja_pass_arg"):
        params = params[1:]
    sig = sig.replace(parameters=params)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _tick()
        bound = sig.bind(*args[lead:], **kwargs)
        a = bound.arguments
        _filter_check(name, a)
        result = func(*args[:lead], *bound.args, **bound.kwargs)
        _count_result(result, name)
        return result

    return update_wrapper(wrapper, func)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 (Jinja's names)
    if n * max > 1_000_000:
        raise _Exceeded(f"lipsum was asked for {n} paragraphs of up to {max} words; the limit is 1000000 words")
    return jinja2.utils.generate_lorem_ipsum(n=n, html=html, min=min, max=max)


class _BoundedCodeGenerator(CodeGenerator):
    """Jinja's code generator, with ``~`` and ``{% for %}`` routed through the environment."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.npllama_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        node.iter = nodes.Call(nodes.EnvironmentAttribute("npllama_loop"), [node.iter], [], None, None,
                               lineno=node.lineno)
        super().visit_For(node, frame)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox, with every operation that can build a large value checked
    against the bounds above before it runs, and a deadline checked at every call and loop step."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"+", "*", "%", "**"})
    concat = staticmethod(_join_output)
    npllama_concat = staticmethod(_concat)
    npllama_loop = staticmethod(_loop)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(finalize=_finalize, **kwargs)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.globals["lipsum"] = _lipsum

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        seqs = (str, bytes, list, tuple)
        if operator == "+" and isinstance(left, seqs) and isinstance(right, seqs):
            _build(len(left) + len(right), "'+'")
        elif operator == "*":
            seq, n = (left, right) if isinstance(left, seqs) else (right, left)
            if isinstance(seq, seqs) and isinstance(n, int):
                _build(len(seq) * max(n, 0), "'*'")
            elif isinstance(left, int) and isinstance(right, int) \
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise _Exceeded(f"'*' would make an integer of more than {MAX_INT_BITS} bits, the limit")
        elif operator == "%" and isinstance(left, str):
            _check_printf(left, right, "'%'")
            result = left % right
            _build(len(result), "'%'")
            return result
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 \
                and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS:
            raise _Exceeded(f"'**' would make an integer of more than {MAX_INT_BITS} bits, the limit")
        return self.binop_table[operator](left, right)

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        _tick()
        target = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped by the sandbox
        builtin = isinstance(target, types.BuiltinMethodType)
        if builtin:
            if isinstance(getattr(target, "__self__", None), (str, bytes)):
                args = _check_str_method(target, args, kwargs)
            if target.__name__ not in ("format", "format_map"):  # widths: an argument that says how much to build
                _check_ints((*args, *kwargs.values()), f"{getattr(target, '__qualname__', 'a method')}()")
        result = super().call(context, obj, *args, **kwargs)
        if not isinstance(obj, (Macro, LoopContext)):  # those built their output through `concat`
            _count_result(result, "a call")
        return result


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def _describe(template: str | None) -> str:
    if template is None:
        return "the ChatML fallback template"
    digest = hashlib.sha256(template.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"template sha256:{digest}, {len(template)} characters"


def validate_messages(messages: Any) -> None:
    """Check that `messages` is a list of dicts, each with a 'role' among `ROLES` and a str 'content'.

    Raises ValueError naming the first bad message's index and what is wrong with it.
    Other keys (``name``, ``tool_calls``...) are allowed and passed to the template.
    """
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of dicts, not {type(messages).__name__}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', not {type(message).__name__}")
        if "role" not in message:
            raise ValueError(f"message {i} has no 'role'")
        if message["role"] not in ROLES:
            raise ValueError(f"message {i} has role {show(message['role'])}; expected one of {', '.join(ROLES)}")
        if "content" not in message:
            raise ValueError(f"message {i} has no 'content'")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {i} has content of type {type(message['content']).__name__}; expected str")


def _render(template: str, variables: dict) -> str:
    if len(template) > MAX_TEMPLATE_CHARS:
        raise _Exceeded(f"it is {len(template)} characters long; the limit is {MAX_TEMPLATE_CHARS}")
    compiled = _compile(template)
    token = _RENDER.set(_Budget(deadline=time.monotonic() + MAX_SECONDS))
    try:
        out: list[str] = []
        size = 0
        for chunk in compiled.generate(**variables):
            size += len(chunk)
            if size > MAX_CHARS:
                raise _Exceeded(f"its output passed {MAX_CHARS} characters, the limit")
            out.append(chunk)
        return "".join(out)
    finally:
        _RENDER.reset(token)


def format_chat(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render `messages` with the Jinja2 chat `template` (None: `CHATML_TEMPLATE`).

    Returns the same string as HF's ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``. `bos_token`/`eos_token` are the vocabulary's texts (templates
    often start with ``{{ bos_token }}``); other keyword arguments reach the template as variables
    (``tools`` and ``documents`` default to None, as in HF). The rendered text still has to be
    encoded with ``special=True`` so that its control tokens become single ids.

    Raises ValueError for malformed messages (see `validate_messages`), and `ChatTemplateError`
    (a ValueError) for anything that goes wrong in the template, including its own
    ``raise_exception(...)`` and the bounds in this module's docstring.
    """
    validate_messages(messages)
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", None)
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt,
                     bos_token=bos_token, eos_token=eos_token, **kwargs)
    try:
        return _render(CHATML_TEMPLATE if template is None else template, variables)
    except _Exceeded as e:
        raise ChatTemplateError(f"chat template refused: {e} ({_describe(template)}); the template is broken "
                                f"or hostile: use another one") from None
    except jinja2.exceptions.TemplateError as e:
        detail = " ".join(str(e).split())
        raise ChatTemplateError(f"chat template error: {detail} ({_describe(template)})") from e
    except RecursionError:
        raise ChatTemplateError(f"chat template error: it recursed deeper than Python allows "
                                f"({_describe(template)})") from None
    except MemoryError:
        raise ChatTemplateError(f"chat template error: it ran out of memory ({_describe(template)})") from None
    except Exception as e:  # the template is code from the model file: any failure in it is its own
        detail = " ".join(str(e).split())
        raise ChatTemplateError(f"chat template error: {type(e).__name__}: {detail} ({_describe(template)})") from e
