"""Regenerate tests/fixtures/chat_tools.json: HF transformers' renderings of tool conversations
with the real tool-calling templates of llama.cpp's collection, for tests/test_tools.py.

Run it with a venv that has transformers (not the project's), pointing at the templates folder
of the llama-cpp-python 0.3.36 sdist (unpacked, not built):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    /tmp/hfref/bin/python bench/make_tool_fixtures.py \\
        /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates

Writes the templates of the formats npllama constrains (a few KB each) and, for each one and
each conversation below, HF's ``render_jinja_template(..., tools=TOOLS, add_generation_prompt=True)``.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat_tools.json"

TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "HuggingFaceTB-SmolLM3-3B",
             "NousResearch-Hermes-3-Llama-3.1-8B-tool_use", "meta-llama-Llama-3.1-8B-Instruct",
             "meta-llama-Llama-3.2-3B-Instruct", "mistralai-Mistral-Nemo-Instruct-2407"]

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]

CALL = {"id": "abc123XYZ", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is the weather in Paris?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is the weather in Paris?"},
     {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "abc123XYZ", "name": "get_weather", "content": "{\"temperature\": 21}"}],
]
OPTIONS = {"bos_token": "<s>", "eos_token": "</s>", "date_string": "26 Jul 2024"}


def main(folder: str) -> None:
    root = Path(folder)
    templates = {name: (root / f"{name}.jinja").read_text() for name in TEMPLATES}
    cases = []
    for name, text in templates.items():
        for i, messages in enumerate(CONVERSATIONS):
            rendered = render_jinja_template([messages], tools=TOOLS, chat_template=text, add_generation_prompt=True,
                                             **OPTIONS)[0][0]
            cases.append({"template": name, "conversation": i, "rendered": rendered})
    OUT.write_text(json.dumps({"reference": "transformers render_jinja_template", "tools": TOOLS,
                               "conversations": CONVERSATIONS, "options": OPTIONS, "templates": templates,
                               "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(cases)} renderings, {OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1])
