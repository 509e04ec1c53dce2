"""Chat template tests: message validation, the sandboxed Jinja environment, and exact matches
against HF transformers' apply_chat_template (tests/fixtures/chat_*.json, made by
bench/make_tokenizer_fixtures.py; they carry their templates, so no model file is needed)."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from npllama.chat import CHATML_TEMPLATE, format_chat, validate_messages
from npllama.tokenizer import Tokenizer
from tinygguf import CHAT_TEMPLATE, tiny_vocab

FIXTURES = Path(__file__).parent / "fixtures"
SMOLLM2 = json.loads((FIXTURES / "chat_smollm2.json").read_text(encoding="utf-8"))
FEATURES = json.loads((FIXTURES / "chat_features.json").read_text(encoding="utf-8"))

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize("messages, message", [
    ({"role": "user", "content": "hi"}, "messages must be a list of dicts, not dict"),
    ("hi", "messages must be a list of dicts, not str"),
    ([("user", "hi")], "message 0 must be a dict"),
    ([{"role": "user", "content": "a"}, {"content": "b"}], "message 1 has no 'role'"),
    ([{"role": "robot", "content": "b"}], "message 0 has role 'robot'; expected one of system, user, assistant, tool"),
    ([{"role": "user"}], "message 0 has no 'content'"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
     "message 1 has content of type NoneType; expected str"),
    ([{"role": "user", "content": ["a"]}], "message 0 has content of type list"),
])
def test_invalid_messages(messages, message):
    with pytest.raises(ValueError, match=message):
        validate_messages(messages)
    with pytest.raises(ValueError, match=message):
        format_chat(CHATML_TEMPLATE, messages)


def test_valid_messages_keep_extra_keys():
    messages = [{"role": "system", "content": ""}, {"role": "tool", "content": "42", "name": "calc"}]
    validate_messages(messages)
    assert format_chat("{{ messages[1]['name'] }}", messages) == "calc"
    assert format_chat(None, []) == "<|im_start|>assistant\n"


def test_chatml_fallback():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert format_chat(None, messages, add_generation_prompt=False) == expected
    assert format_chat(None, messages) == expected + "<|im_start|>assistant\n"


@pytest.mark.parametrize("case", SMOLLM2["cases"], ids=lambda c: f"{len(c['messages'])}msg-gen{c['add_generation_prompt']}")
def test_smollm2_template_matches_hf(case):
    got = format_chat(SMOLLM2["template"], case["messages"], add_generation_prompt=case["add_generation_prompt"],
                      bos_token=SMOLLM2["bos_token"], eos_token=SMOLLM2["eos_token"])
    assert got == case["expected"]


@pytest.mark.parametrize("case", FEATURES["cases"],
                         ids=lambda c: f"{c['template']}-{len(c['messages'])}msg-tools{c['tools'] is not None}")
def test_jinja_environment_matches_hf(case):
    template = FEATURES["templates"][case["template"]]
    if case["template"] == "chatml":
        assert template == CHATML_TEMPLATE
        template = None
    got = format_chat(template, case["messages"], bos_token=FEATURES["bos_token"], tools=case["tools"])
    assert got == case["expected"]


def test_raise_exception_becomes_value_error():
    template = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('System message required') }}{% endif %}"
    with pytest.raises(ValueError, match="chat template error: System message required"):
        format_chat(template, HELLO)


@pytest.mark.parametrize("template", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",  # attribute access the sandbox forbids
    "{% set seen = [] %}{{ seen.append(1) }}",           # mutation the immutable sandbox forbids
    "{% for m in messages %}",                          # syntax error
])
def test_unsafe_or_broken_templates_raise_value_error(template):
    with pytest.raises(ValueError, match="chat template error"):
        format_chat(template, HELLO)


def test_template_helpers():
    assert format_chat("{{ strftime_now('%Y') }}", HELLO) == str(datetime.now().year)
    assert format_chat("{{ messages | tojson }}", [{"role": "user", "content": "é <b>"}]) == \
        '[{"role": "user", "content": "é <b>"}]'  # no ASCII or HTML escaping, as in HF
    assert format_chat("{{ bos_token }}|{{ eos_token }}|{{ extra }}", HELLO, bos_token="<s>", eos_token="</s>",
                       extra=3) == "<s>|</s>|3"
    assert format_chat("{{ tools is none }} {{ documents is none }}", HELLO) == "True True"


def tiny_tokenizer(**extra) -> Tokenizer:
    tokens, types, merges = tiny_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 2}
    return Tokenizer.from_metadata({**meta, **extra})


def test_tokenizer_apply_chat_template():
    tok = tiny_tokenizer(**{"tokenizer.chat_template": CHAT_TEMPLATE})
    assert tok.apply_chat_template(HELLO) == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(tok.apply_chat_template(HELLO), special=True)[0] == 1
    echo = tiny_tokenizer(**{"tokenizer.chat_template": "{{ bos_token }}{{ eos_token }}"})
    assert echo.apply_chat_template(HELLO) == "<|endoftext|><|im_end|>"
    assert tiny_tokenizer().apply_chat_template(HELLO, add_generation_prompt=False) == \
        "<|im_start|>user\nHello<|im_end|>\n"  # no template in the file: ChatML
