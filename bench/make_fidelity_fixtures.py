"""Regenerate the fidelity fixtures in tests/fixtures/ from the reference engines.

Run with the references' python (it needs transformers, torch, gguf and llama_cpp):
    npllama pull smollm2
    REF=$(../shared/tools/setup-refs.sh); $(dirname $REF)/pip install accelerate  # HF needs it for GGUF
    $REF bench/make_fidelity_fixtures.py

For the default model (Q4_1) and its Q8_0 and F16 re-quantizations it records, from HF
transformers in float32 loading the same GGUF: the token ids of a varied corpus, the top-10
logits and the log-sum-exp at every position, and the log-probability of each next token.
For a few chat prompts it records HF's greedy continuation and llama.cpp's, so the tests can
ask that npllama follows the float reference for at least as long as llama.cpp does.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from requant import requantize  # noqa: E402

OUT = HERE.parent / "tests" / "fixtures"
TOPK = 10
GREEDY_TOKENS = 48
CORPUS = json.loads((OUT / "fidelity_corpus.json").read_text())


def hf_fixture(path: Path, name: str, tok) -> dict:
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    model.eval()
    out: dict[str, np.ndarray] = {}
    for key, text in CORPUS["texts"].items():
        ids = tok(text, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lse = torch.logsumexp(logits, -1)
        top = torch.topk(logits, TOPK, -1)
        tgt = logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] - lse[:-1]
        out[f"{key}/ids"] = np.array(ids, np.int32)
        out[f"{key}/top_ids"] = top.indices.numpy().astype(np.int32)
        out[f"{key}/top_logits"] = top.values.numpy().astype(np.float32)
        out[f"{key}/lse"] = lse.numpy().astype(np.float32)
        out[f"{key}/target_logprob"] = tgt.numpy().astype(np.float32)
    np.savez_compressed(OUT / f"fidelity_{name}.npz", **out)
    greedy = {}
    for i, messages in enumerate(CORPUS["chats"]):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(prompt, dict) or hasattr(prompt, "input_ids"):
            prompt = prompt["input_ids"]
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
        greedy[str(i)] = {"prompt": list(map(int, prompt)), "hf": gen[0, len(prompt):].tolist()}
    return greedy


def llama_cpp_greedy(path: Path, greedy: dict) -> None:
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=1024, n_threads=2, logits_all=False, verbose=False)
    for g in greedy.values():
        llm.reset()
        out = []
        for t in llm.generate(g["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            out.append(int(t))
            if len(out) == len(g["hf"]):
                break
        g["llama_cpp"] = out


def main():
    # The references' venv has no numba, so npllama is not imported: the model comes from
    # $NPLLAMA_MODEL or the cache that `npllama pull` fills.
    src = Path(os.environ.get("NPLLAMA_MODEL")
               or Path.home() / ".cache/npllama/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    greedy_all = {}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"q4_1": src,
                    "q8_0": requantize(src, Path(tmp) / "smol-q8_0.gguf", QT.Q8_0),
                    "f16": requantize(src, Path(tmp) / "smol-f16.gguf", QT.F16)}
        for name, path in variants.items():
            greedy = hf_fixture(path, name, tok)
            llama_cpp_greedy(path, greedy)
            greedy_all[name] = greedy
            print(name, {k: (len(v["hf"]), len(v["llama_cpp"])) for k, v in greedy.items()})
    (OUT / "fidelity_greedy.json").write_text(json.dumps(greedy_all, indent=1) + "\n")


if __name__ == "__main__":
    main()
