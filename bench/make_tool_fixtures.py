"""Regenerate tests/fixtures/chat_tools.json: HF transformers' renderings of tool conversations
with the real tool-calling templates of llama.cpp's collection, for tests/test_tools.py.

Run it with a venv that has transformers (not the project's), pointing at the templates folder
of the llama-cpp-python 0.3.36 sdist (unpacked, not built):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/sdist
    tar xzf /tmp/sdist/llama_cpp_python-0.3.36.tar.gz -C /tmp/sdist
    /tmp/hfref/bin/python bench/make_tool_fixtures.py \\
        /tmp/sdist/llama_cpp_python-0.3.36/vendor/llama.cpp/models/templates

Writes every template of the collection that reads `tools` (and SmolLM3's, which does not),
each once, and for each one and each conversation below HF's ``render_jinja_template(...,
tools=TOOLS, add_generation_prompt=True)``; a rendering HF itself cannot make (the template
raises) is left out and listed under "skipped" with HF's error.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from transformers.utils.chat_template_utils import render_jinja_template

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "chat_tools.json"

ALSO = ["HuggingFaceTB-SmolLM3-3B"]  # reads no `tools` in this collection (the generic format)

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
    templates = {p.stem: p.read_text() for p in sorted(root.glob("*.jinja"))
                 if p.stem in ALSO or re.search(r"\btools\b", p.read_text())}
    cases, skipped = [], {}
    for name, text in templates.items():
        for i, messages in enumerate(CONVERSATIONS):
            try:
                rendered = render_jinja_template([messages], tools=TOOLS, chat_template=text,
                                                 add_generation_prompt=True, **OPTIONS)[0][0]
            except Exception as e:  # noqa: BLE001 (any error of the template: HF cannot render it)
                skipped[f"{name}/{i}"] = f"{type(e).__name__}: {e}"
                continue
            cases.append({"template": name, "conversation": i, "rendered": rendered})
    OUT.write_text(json.dumps({"reference": "transformers render_jinja_template", "tools": TOOLS,
                               "conversations": CONVERSATIONS, "options": OPTIONS, "templates": templates,
                               "cases": cases, "skipped": skipped}, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT} ({len(templates)} templates, {len(cases)} renderings, {len(skipped)} skipped, "
          f"{OUT.stat().st_size} bytes)")
    for key, error in skipped.items():
        print(f"  skipped {key}: {error[:150]}")


if __name__ == "__main__":
    main(sys.argv[1])
