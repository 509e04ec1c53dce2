"""Regenerate the tokenizer and chat-template fixtures under tests/fixtures/ from HF transformers.

Run it with the reference venv's python (it needs transformers; llama-cpp-python is optional and
only used for a cross-check):

    ~/.cache/npllama-refs/venv/bin/python bench/make_tokenizer_fixtures.py \
        --smollm2 PATH/SmolLM2-135M-Instruct.Q4_1.gguf --gemma3 PATH/gemma-3-270m-q4_k_m.gguf

Writes:
* tests/fixtures/tok_<model>.json: for each text of tests/fixtures/tokenizer_corpus.json, the ids
  without special-token parsing (`ids`: HF ``split_special_tokens=True``) and, where they differ,
  with it (`ids_special`: HF's default), both without BOS (``add_special_tokens=False``).
* tests/fixtures/chat_smollm2.json: SmolLM2's template and HF's renderings of a few conversations.
* tests/fixtures/chat_features.json: renderings of npllama's ChatML fallback and of a template that
  exercises HF's Jinja environment (tojson, loop controls, namespace, generation blocks, tools).

The HF tokenizer is loaded with ``AutoTokenizer.from_pretrained(dir, gguf_file=name)``. HF's GGUF
conversion ignores `tokenizer.ggml.pre`, so for SmolLM2 it loses the individual-digit split of the
original tokenizer.json; the script restores that pre-tokenizer (Digits(individual_digits=True) +
ByteLevel) so that the fixtures hold what the original HF tokenizer returns. It then prints where
the unpatched GGUF conversion and llama.cpp (when installed) disagree with the fixtures.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
from pathlib import Path

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"


def _load_chat_module():
    """npllama/chat.py on its own: the package's __init__ needs numba, which this venv lacks."""
    spec = importlib.util.spec_from_file_location("npllama_chat", ROOT / "npllama" / "chat.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHATML_TEMPLATE = _load_chat_module().CHATML_TEMPLATE

CONVERSATIONS = [
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Answer in French."},
     {"role": "user", "content": "Say hi."},
     {"role": "assistant", "content": "Salut !"},
     {"role": "user", "content": "Now count: 1, 2, 3 {braces} \"quotes\" <tags>\n\nand é🎉"}],
    [{"role": "user", "content": "  leading and trailing whitespace  \n"},
     {"role": "assistant", "content": ""},
     {"role": "user", "content": "<|im_start|>literal markers<|im_end|>"}],
]

# Exercises what HF's Jinja environment adds or configures; rendered by HF and by npllama.text.chat.
FEATURE_TEMPLATE = """{%- set ns = namespace(system='', turns=0) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system = message['content'] -%}
        {%- continue -%}
    {%- endif -%}
    {%- if ns.turns >= 3 -%}{%- break -%}{%- endif -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{- raise_exception('unexpected role ' + message['role']) -}}
    {%- endif -%}
    {%- set ns.turns = ns.turns + 1 %}
    <turn role="{{ message['role'] }}" n="{{ loop.index }}">
    {% if message['role'] == 'assistant' %}
        {% generation %}{{ message['content'] | trim }}{% endgeneration %}
    {% else %}
        {{ message['content'] }}
    {% endif %}
    </turn>
{% endfor %}
{{ {'system': ns.system, 'count': messages | length, 'tools': tools} | tojson }}
{{ messages[-1] | tojson(indent=2, sort_keys=true) }}
{% if add_generation_prompt %}{{ bos_token }}<turn role="assistant">{% endif %}"""

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <du> jour",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_json(path: Path, data: dict) -> None:
    """Compact JSON, one list entry per line, so fixtures stay small and diffable."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = json.dumps(head, ensure_ascii=False, indent=1)[:-2]
    cases = ",\n".join(json.dumps(c, ensure_ascii=False) for c in data["cases"])
    path.write_text(f"{lines},\n \"cases\": [\n{cases}\n]}}\n", encoding="utf-8")
    print(f"wrote {path.relative_to(ROOT)} ({path.stat().st_size} bytes)")


def hf_ids(tok, text: str, *, special: bool) -> list[int]:
    return tok(text, add_special_tokens=False, split_special_tokens=not special)["input_ids"]


def llama_cpp_ids(path: Path):
    """A function text -> (plain ids, special ids) from llama.cpp, or None when it is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return None
    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    return lambda text: (llm.tokenize(text.encode(), add_bos=False, special=False),
                         llm.tokenize(text.encode(), add_bos=False, special=True))


def make_token_fixture(name: str, path: Path, texts: list[str], *, restore_digit_split: bool) -> None:
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    as_converted = {t: (hf_ids(tok, t, special=False), hf_ids(tok, t, special=True)) for t in texts}
    reference = f"HF transformers AutoTokenizer.from_pretrained(gguf_file={path.name!r})"
    if restore_digit_split:
        tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
        reference += " with the original tokenizer.json pre-tokenizer (Digits + ByteLevel) restored"
    cases = []
    for text in texts:
        plain, special = hf_ids(tok, text, special=False), hf_ids(tok, text, special=True)
        decoded = tok.decode(plain, clean_up_tokenization_spaces=False)
        if decoded != text:
            print(f"  {name}: HF decode does not round-trip {text!r}: {decoded!r}")
        cases.append({"text": text, "ids": plain} | ({"ids_special": special} if special != plain else {}))
        if as_converted[text] != (plain, special):
            print(f"  {name}: the unpatched GGUF conversion differs on {text!r}")
    llama = llama_cpp_ids(path)
    for case in cases if llama else ():
        if llama(case["text"]) != (case["ids"], case.get("ids_special", case["ids"])):
            print(f"  {name}: llama.cpp differs on {case['text']!r}")
    write_json(FIXTURES / f"tok_{name}.json", {"model": path.name, "sha256": sha256(path), "reference": reference,
                                               "cases": cases})


def make_chat_fixtures(smollm2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(str(smollm2.parent), gguf_file=smollm2.name)
    cases = [{"messages": m, "add_generation_prompt": g,
              "expected": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g)}
             for m in CONVERSATIONS for g in (True, False)]
    write_json(FIXTURES / "chat_smollm2.json", {
        "reference": f"HF transformers apply_chat_template(tokenize=False) of {smollm2.name}",
        "template": tok.chat_template, "bos_token": tok.bos_token, "eos_token": tok.eos_token, "cases": cases})

    cases = []
    for template_name, template in (("chatml", CHATML_TEMPLATE), ("features", FEATURE_TEMPLATE)):
        for m in CONVERSATIONS:
            for tools in (None, TOOLS) if template_name == "features" else (None,):
                cases.append({"template": template_name, "messages": m, "tools": tools,
                              "expected": tok.apply_chat_template(m, chat_template=template, tools=tools,
                                                                  tokenize=False, add_generation_prompt=True)})
    write_json(FIXTURES / "chat_features.json", {
        "reference": "HF transformers apply_chat_template(tokenize=False, add_generation_prompt=True, tools=...)",
        "bos_token": tok.bos_token, "templates": {"chatml": CHATML_TEMPLATE, "features": FEATURE_TEMPLATE},
        "cases": cases})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smollm2", type=Path, required=True, help="SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--gemma3", type=Path, help="gemma-3-270m GGUF (SentencePiece vocabulary)")
    args = parser.parse_args()
    texts = json.loads((FIXTURES / "tokenizer_corpus.json").read_text(encoding="utf-8"))["texts"]
    make_token_fixture("smollm2", args.smollm2, texts, restore_digit_split=True)
    if args.gemma3:
        make_token_fixture("gemma3", args.gemma3, texts, restore_digit_split=False)
    make_chat_fixtures(args.smollm2)


if __name__ == "__main__":
    main()
