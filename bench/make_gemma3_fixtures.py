"""Regenerate the Gemma 3 270M fidelity fixtures in tests/fixtures/ from the reference engines.

Run with the references' python (it needs transformers, torch, gguf and llama_cpp):
    npllama pull gemma3-270m
    REF=$(../shared/tools/setup-refs.sh); $(dirname $REF)/pip install accelerate  # HF needs it for GGUF
    $REF bench/make_gemma3_fixtures.py

The texts and the short greedy prompts live in tests/fixtures/fidelity_gemma3.json (public-domain
prose, and a mixed text: the default model's fidelity corpus followed by the top of an npllama
module). Each text is over 1,000 tokens, so the 512-token sliding window of the model's local
layers matters. From HF transformers in float32, loading the same Q4_K_M GGUF, this records into
fidelity_gemma3.npz the token ids (BOS first, as the model's metadata asks), the top-10 logits and
the log-sum-exp at every position and the log-probability of each next token, and llama.cpp's
teacher-forced top-1 for comparison. Into the json it writes HF's perplexity of each text, and
for each greedy prompt (the short ones, and the first LONG_PROMPT tokens of two texts) the ids and
HF's and llama.cpp's greedy continuations, so the tests can ask that npllama follows the float
reference for at least as long as llama.cpp does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "fixtures"
DOC = OUT / "fidelity_gemma3.json"
TOPK = 10
GREEDY_TOKENS = 96
LONG_PROMPT = 640            # past the 512-token window
LONG_PROMPT_TEXTS = ("declaration", "lincoln")
N_CTX = 2048


def hf_teacher_forced(model, texts: dict[str, list[int]]) -> tuple[dict, dict]:
    out: dict[str, np.ndarray] = {}
    ppl = {}
    for key, ids in texts.items():
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        lse = torch.logsumexp(logits, -1)
        top = torch.topk(logits, TOPK, -1)
        tgt = logits[torch.arange(len(ids) - 1), torch.tensor(ids[1:])] - lse[:-1]
        del logits
        out[f"{key}/ids"] = np.array(ids, np.int32)
        out[f"{key}/top_ids"] = top.indices.numpy().astype(np.int32)
        out[f"{key}/top_logits"] = top.values.numpy().astype(np.float32)
        out[f"{key}/lse"] = lse.numpy().astype(np.float32)
        out[f"{key}/target_logprob"] = tgt.numpy().astype(np.float32)
        ppl[key] = float(np.exp(-tgt.double().mean().item()))
        print(f"HF {key}: {len(ids)} tokens, perplexity {ppl[key]:.4f}", flush=True)
    return out, ppl


def hf_greedy(model, prompts: dict[str, list[int]]) -> dict:
    greedy = {}
    for key, prompt in prompts.items():
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompt]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
        greedy[key] = {"prompt": list(map(int, prompt)), "hf": gen[0, len(prompt):].tolist()}
    return greedy


def llama_cpp_runs(path: Path, out: dict, texts: dict[str, list[int]], greedy: dict) -> None:
    """llama.cpp's teacher-forced top-1 on the texts (into `out`) and its greedy continuations."""
    from llama_cpp import Llama
    llm = Llama(model_path=str(path), n_ctx=N_CTX, n_threads=2, logits_all=True, verbose=False)
    for key, ids in texts.items():
        llm.reset()
        llm.eval(ids)
        top1 = np.asarray(llm.scores[:len(ids)]).argmax(-1).astype(np.int32)
        out[f"{key}/llama_cpp_top1"] = top1
        agree = (top1 == out[f"{key}/top_ids"][:, 0]).mean()
        print(f"llama.cpp {key}: top-1 agreement with HF {agree:.2%}", flush=True)
    for g in greedy.values():
        llm.reset()
        ours = []
        for t in llm.generate(g["prompt"], top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            ours.append(int(t))
            if len(ours) == len(g["hf"]):
                break
        g["llama_cpp"] = ours


def main():
    # The references' venv has no numba, so npllama is not imported: the model comes from
    # $NPLLAMA_GEMMA3 or the cache that `npllama pull gemma3-270m` fills.
    src = Path(os.environ.get("NPLLAMA_GEMMA3")
               or Path.home() / ".cache/npllama/gemma-3-270m-q4_k_m.gguf")
    doc = json.loads(DOC.read_text())
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    texts = {k: tok(t)["input_ids"] for k, t in doc["texts"].items()}  # BOS first
    assert all(ids[0] == tok.bos_token_id and len(ids) > 1000 for ids in texts.values())
    prompts = {f"short{i}": tok(p)["input_ids"] for i, p in enumerate(doc["prompts"])}
    prompts.update({f"long_{k}": texts[k][:LONG_PROMPT] for k in LONG_PROMPT_TEXTS})

    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    model.eval()
    assert model.config.model_type == "gemma3_text" and model.config.sliding_window == 512
    out, ppl = hf_teacher_forced(model, texts)
    greedy = hf_greedy(model, prompts)
    del model
    llama_cpp_runs(src, out, texts, greedy)
    np.savez_compressed(OUT / "fidelity_gemma3.npz", **out)
    doc["hf_perplexity"] = ppl
    doc["greedy"] = greedy
    DOC.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print({k: (len(v["prompt"]), len(v["hf"]), len(v["llama_cpp"])) for k, v in greedy.items()})


if __name__ == "__main__":
    main()
