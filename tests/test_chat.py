"""Chat template tests: message validation, the sandboxed Jinja environment, and exact matches
against HF transformers' apply_chat_template (tests/fixtures/chat_*.json, made by
bench/make_tokenizer_fixtures.py; they carry their templates, so no model file is needed)."""
from __future__ import annotations

import json
import types
from datetime import datetime
from pathlib import Path

import pytest

from npllama import cli
from npllama.text import chat
from npllama.text.chat import CHATML_TEMPLATE, MAX_BUILT, MAX_CHARS, format_chat, validate_messages
from npllama.errors import ChatTemplateError
from npllama.text.tokenizer import Tokenizer
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


def test_a_huge_bad_role_gives_a_short_message():
    """A role that is a container of megabyte strings (the chat fuzz target's finding,
    tests/fuzz_corpus/chat/regress-7343b47c22ae) is shown cut short: the message once held its
    whole repr, 144 MB built in 2 s."""
    role = {b"k": {"|" * 2**20: ["x" * 2**20] * 100}}
    with pytest.raises(ValueError) as e:
        validate_messages([{"role": role, "content": "hi"}])
    assert str(e.value).startswith("message 0 has role {b'k': {") and len(str(e.value)) < 400


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
    with pytest.raises(ChatTemplateError, match="chat template error"):
        format_chat(template, HELLO)


DOUBLING = "{% set ns = namespace(s='a') %}{% for i in range(60) %}{% set ns.s = ns.s OP ns.s %}{% endfor %}"
# A list of a list of ... doubled 60 times: 60 small lists in memory, 2**60 items as text.
SELF_SIMILAR = "{% set ns = namespace(l=['a']) %}{% for i in range(60) %}{% set ns.l = [ns.l, ns.l] %}{% endfor %}"


@pytest.mark.parametrize("template, message", [
    (DOUBLING.replace("OP", "~"), f"'~' would have 33554432 characters or items; the limit is {MAX_CHARS}"),
    (DOUBLING.replace("OP", "+"), "'[+]' would have 33554432"),
    ("{{ 'a' * 10**10 }}", "'[*]' would have 10000000000"),
    ("{{ [0] * 10000000000 }}", "'[*]' would have 10000000000"),
    ("{{ 'a'.ljust(10**10) }}", "str.ljust[(][)] was given 10000000000"),
    ("{{ 'a' | center(10**10) }}", "center would have 10000000000"),
    ("{{ '%0999999999d' % 1 }}", "'%' would have 1000000013"),
    ("{{ '%*d' % (999999999, 1) }}", "'%' would have"),
    ("{{ '{:>999999999}'.format(1) }}", "str.format would have"),
    ("{{ '{:>{w}}'.format(1, w=99999999) }}", "str.format would have"),
    ("{{ '%999999999s' | format('a') }}", "format would have"),
    ("{% set s = 'a' * 10000 %}{{ s.replace('', s) }}", "str.replace would have 100020000"),
    ("{% set s = 'a' * 10000 %}{{ s | replace('', s) }}", "replace would have 100020000"),
    ("{% set s = 'a' * 1000000 %}{{ ([s] * 1000) | join }}", "join would have"),
    ("{% set s = 'a' * 1000000 %}{{ ''.join([s] * 1000) }}", "str.join would have"),
    ("{{ ('\t' * 1000000).expandtabs(1000) }}", "str.expandtabs would have"),
    ("{{ ('\n' * 1000000) | indent(1000, true, true) }}", "indent would have"),
    ("{{ ('a ' * 1000000) | wordwrap(1, wrapstring='x' * 1000) }}", "wordwrap would have"),
    ("{{ ('a' * 100000).translate({97: 'b' * 1000}) }}", "str.translate would have"),
    ("{{ range(100000) | list | tojson(indent=10000) }}", "tojson would have"),
    ("{% set big = [0] * 100000 %}{{ ([big] * 100000) | sum(start=[]) }}", "sum would have"),
    ("{{ range(3) | slice(100000000) | list }}", "slice was asked for 100000000 slices; the limit is 100000"),
    ("{{ lipsum(10**7) }}", "lipsum was asked for 10000000 paragraphs"),
    ("{{ (1).to_bytes(10**10, 'big') }}", "int.to_bytes[(][)] was given 10000000000"),
    ("{% set ns = namespace(x=3) %}{% for i in range(100) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "'[*]' would make an integer of more than 65536 bits"),
    ("{{ 2 ** 1000000 }}", "'[*][*]' would make an integer of more than 65536 bits"),
    (SELF_SIMILAR + "{{ ns.l }}", "the text of an expression would have"),
    (SELF_SIMILAR + "{{ ns }}", "the text of an expression would have"),
    (SELF_SIMILAR + "{{ 'x' ~ ns.l }}", "the text of a '~' operand would have"),
    (SELF_SIMILAR + "{{ ns.l | tojson }}", "tojson would have"),
    (SELF_SIMILAR + "{{ ns.l | join }}", "join would have"),
    (SELF_SIMILAR + "{{ [ns.l] | map('string') | list }}", "string would have"),
    (SELF_SIMILAR + "{{ '%s' % [ns.l] }}", "'%' would have"),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", f"its output passed {MAX_CHARS} characters"),
    ("{% for i in range(100000) %}" + "y" * 1000 + "{% endfor %}", "its output passed"),
    # 40 strings of 16 M characters, each under the size limit, all alive at once
    ("".join("{%% set a%d = 'a' * 16000000 %%}" % i for i in range(40)), f"it built more than {MAX_BUILT}"),
    ("x" * (chat.MAX_TEMPLATE_CHARS + 1), "it is 1048577 characters long; the limit is 1048576"),
])
def test_templates_that_would_exhaust_memory_are_refused_before_they_do(template, message):
    with pytest.raises(ChatTemplateError, match="chat template refused: " + message) as e:
        format_chat(template, HELLO)
    assert f"(template sha256:{chat.hashlib.sha256(template.encode()).hexdigest()[:12]}, {len(template)} characters)" \
        in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("template", [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",  # no call in the loop
    "{% macro m() %}{% for i in range(100000) %}{% for j in range(100000) %}z{% endfor %}{% endfor %}{% endmacro %}"
    "{{ m() }}",
    "{% for i in range(100000) %}{{ range(100000) | map('string') | join | length }}{% endfor %}",
])
def test_templates_that_would_run_for_hours_hit_the_time_limit(template, monkeypatch):
    monkeypatch.setattr(chat, "MAX_SECONDS", 0.2)
    with pytest.raises(ChatTemplateError, match="chat template refused: it ran for more than 0.2 s, the time limit"):
        format_chat(template, HELLO)


@pytest.mark.parametrize("template, message", [
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{{ 1 is divisibleby 0 }}", "ZeroDivisionError"),
    ("{{ range(10**9) | list }}", r"OverflowError: Range too big. The sandbox blocks ranges larger than MAX_RANGE \(100000\)"),
    ("{{ 10.0 ** 400 }}", "OverflowError"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "it recursed deeper than Python allows"),
    ("{{ 'a' + 1 }}", "TypeError: can only concatenate str"),
    ("{{ foo() }}", "'foo' is undefined"),
])
def test_every_failure_in_a_template_is_a_chat_template_error(template, message):
    with pytest.raises(ChatTemplateError, match="chat template error: " + message) as e:
        format_chat(template, HELLO)
    assert "template sha256:" in str(e.value) and "\n" not in str(e.value)


def test_out_of_memory_in_a_template_is_a_chat_template_error(monkeypatch):
    def no_memory(*args):
        raise MemoryError
    monkeypatch.setattr(chat._BoundedSandbox, "npllama_concat", staticmethod(no_memory))
    with pytest.raises(ChatTemplateError, match="it ran out of memory"):
        format_chat("{{ messages[0].content ~ '!' }}", HELLO)


def test_bounds_leave_room_for_long_conversations_and_tools():
    """A conversation of 4 MB (a million tokens), and a tool-calling template with 200 tools: far from any bound."""
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} " + "word " * 4000}
                for i in range(200)]
    got = format_chat(SMOLLM2["template"], messages, bos_token=SMOLLM2["bos_token"], eos_token=SMOLLM2["eos_token"])
    assert all(m["content"] in got for m in messages) and len(got) > 4_000_000
    tools = next(c["tools"] for c in FEATURES["cases"] if c["tools"] is not None) * 100
    got = format_chat(FEATURES["templates"]["features"], messages, bos_token=FEATURES["bos_token"], tools=tools)
    assert json.dumps(tools, ensure_ascii=False) in got


def test_cli_prints_one_line_for_a_hostile_template(monkeypatch, capsys):
    hostile = DOUBLING.replace("OP", "~")
    model = types.SimpleNamespace(tokenizer=types.SimpleNamespace(chat_template=hostile),
                                  format_chat=lambda messages: format_chat(hostile, messages))
    monkeypatch.setattr(cli, "_load", lambda args: model)
    assert cli.main(["run", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("npllama: error: chat template refused: '~' would have") and err.count("\n") == 1


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
    with pytest.raises(ChatTemplateError, match="'[*]' would have 10000000000"):
        tiny_tokenizer(**{"tokenizer.chat_template": "{{ 'a' * 10**10 }}"}).apply_chat_template(HELLO)
