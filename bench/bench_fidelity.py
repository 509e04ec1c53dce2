"""Top-1 agreement with HF transformers in float32 on the same GGUF and the same token ids,
teacher-forced over the fidelity corpus (tests/fixtures/fidelity_corpus.json: prose, code,
numbers, several languages), for npllama's modes and for llama.cpp. Never a pass/fail test.

    python bench/bench_fidelity.py [--model PATH] [--quant q4_k_m|q5_k_m|q6_k|...] [--keep DIR]
                                   [--engines npllama,npllama-int8,llama.cpp]

--model, --quant and --keep make or find the file as bench_compare.py does (the K-quant mixes by
llama.cpp's own quantizer). npllama's modes (bench_compare.MODES) give every position's logits
twice: through the prefill (a text's tokens at once) and through the decode step (one token at
a time). llama.cpp's are its teacher-forced logits of each text (llama-cpp-python, logits_all).
HF and llama.cpp run in the references' python (../shared/tools/setup-refs.sh, or
$NPLLAMA_REF_PY; HF's GGUF loading also needs `accelerate` there); without it nothing can be
compared, and the script says so.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench_compare import LLAMA_QUANTS, MODES, model_file, ref_python  # noqa: E402

CORPUS = HERE.parent / "tests" / "fixtures" / "fidelity_corpus.json"

# Runs inside the references' python: argv = engine ("transformers" or "llama.cpp"), gguf path,
# json file of {text name: ids}; prints {text name: [the top-1 id at each position]}.
REF_SCRIPT = r'''
import json, os, sys
import numpy as np
engine, path, texts = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
top1 = {}
if engine == "llama.cpp":
    from llama_cpp import Llama
    n = max(map(len, texts.values()))
    llm = Llama(model_path=path, n_ctx=n + 8, n_batch=n + 8, n_threads=2, logits_all=True, verbose=False)
    for name, ids in texts.items():
        llm.reset()
        llm.eval(ids)
        top1[name] = np.asarray(llm.scores[:len(ids)]).argmax(-1).tolist()
else:
    import torch
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                             dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        for name, ids in texts.items():
            top1[name] = m(torch.tensor([ids])).logits[0].argmax(-1).tolist()
print(json.dumps(top1))
'''


def run_ref(py: str, engine: str, path: Path, texts: dict) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(texts, f)
        f.flush()
        r = subprocess.run([py, "-c", REF_SCRIPT, engine, str(path), f.name], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{engine} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def npllama_top1(path: Path, texts: dict, activations: str, kv_dtype) -> tuple[dict, dict]:
    """Each text's top-1 ids through the prefill and through the decode step."""
    import npllama
    model = npllama.Model(path, activations=activations, kv_dtype=kv_dtype)
    prefill, decode = {}, {}
    for name, ids in texts.items():
        prefill[name] = model.session().feed(ids, all_logits=True).argmax(-1).tolist()
        s = model.session()
        decode[name] = [int(s.feed([t]).argmax()) for t in ids]
    return prefill, decode


def agreement(a: dict, b: dict) -> tuple[int, int]:
    same = sum(int(np.sum(np.asarray(a[k]) == np.asarray(b[k]))) for k in b)
    return same, sum(len(v) for v in b.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="GGUF (default: the default model)")
    ap.add_argument("--quant", choices=["q8_0", "f16", *LLAMA_QUANTS], help="as bench_compare.py's --quant")
    ap.add_argument("--keep", metavar="DIR", help="write the re-quantized model into DIR (reused when there)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's quantizer's threads")
    ap.add_argument("--engines", default="npllama,npllama-int8,llama.cpp",
                    help=f"comma-separated, from {', '.join(MODES)}, llama.cpp")
    args = ap.parse_args()
    engines = args.engines.split(",")
    if unknown := [e for e in engines if e not in (*MODES, "llama.cpp")]:
        ap.error(f"unknown engine(s) {', '.join(unknown)}")
    py = ref_python()
    if py is None:
        ap.error("HF transformers runs in the references' python: run ../shared/tools/setup-refs.sh")
    with tempfile.TemporaryDirectory() as tmp:
        path = model_file(ap, args, py, tmp)
        import npllama
        tok = npllama.Model(path).tokenizer
        texts = {name: tok.encode(text) for name, text in json.loads(CORPUS.read_text())["texts"].items()}
        hf = run_ref(py, "transformers", path, texts)
        rows = []
        for engine in engines:
            if engine == "llama.cpp":
                rows.append(("llama.cpp (teacher-forced)", agreement(run_ref(py, engine, path, texts), hf)))
                continue
            prefill, decode = npllama_top1(path, texts, *MODES[engine])
            rows += [(f"{engine} prefill", agreement(prefill, hf)), (f"{engine} decode step", agreement(decode, hf))]
    print(f"model {Path(path).name}: top-1 against HF transformers float32 over {sum(map(len, texts.values()))} "
          f"positions of {len(texts)} texts")
    for name, (same, n) in rows:
        print(f"  {name:<28}{same:>5}/{n}  {100 * same / n:6.2f}%")


if __name__ == "__main__":
    main()
