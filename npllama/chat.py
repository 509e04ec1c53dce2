"""Chat prompts: render a model's Jinja2 chat template (GGUF `tokenizer.chat_template`) exactly as
HF transformers' ``tokenizer.apply_chat_template(messages, tokenize=False)`` does.

The template runs in Jinja2's immutable sandbox with HF's settings: ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension, the ``{% generation %}`` block (rendered as its
body), the globals ``raise_exception`` and ``strftime_now``, and a ``tojson`` filter that does not
escape HTML characters. A model without a template gets `CHATML_TEMPLATE`.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["CHATML_TEMPLATE", "ROLES", "format_chat", "validate_messages"]

ROLES = ("system", "user", "assistant", "tool")

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


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


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
            raise ValueError(f"message {i} has role {message['role']!r}; expected one of {', '.join(ROLES)}")
        if "content" not in message:
            raise ValueError(f"message {i} has no 'content'")
        if not isinstance(message["content"], str):
            raise ValueError(f"message {i} has content of type {type(message['content']).__name__}; expected str")


def format_chat(template: str | None, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **kwargs: Any) -> str:
    """Render `messages` with the Jinja2 chat `template` (None: `CHATML_TEMPLATE`).

    Returns the same string as HF's ``apply_chat_template(messages, tokenize=False,
    add_generation_prompt=...)``. `bos_token`/`eos_token` are the vocabulary's texts (templates
    often start with ``{{ bos_token }}``); other keyword arguments reach the template as variables
    (``tools`` and ``documents`` default to None, as in HF). The rendered text still has to be
    encoded with ``special=True`` so that its control tokens become single ids.

    Raises ValueError for malformed messages (see `validate_messages`) and for template errors,
    including the template's own ``raise_exception(...)``.
    """
    validate_messages(messages)
    kwargs.setdefault("tools", None)
    kwargs.setdefault("documents", None)
    try:
        return _compile(CHATML_TEMPLATE if template is None else template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=bos_token, eos_token=eos_token, **kwargs)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"chat template error: {e}") from e
