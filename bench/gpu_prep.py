"""Prepares, on a machine with the real models and a warm CPU engine, what bench/gpu_check.sh
needs on a GPU machine that has no network and takes at most 64 MiB along:

- .gpu-carry/NAME.pkl: the shape of SmolLM2-135M Q4_1 and of Gemma 3 270M Q4_K_M
  (bench/shaped_model.py), from which the GPU machine writes random models of those shapes;
- .gpu-carry/NAME.npz: the CPU engine's logits on those random models (a prompt, then greedy
  decode steps) and the files' sha256, for tests/test_cuda_gpu.py; and its throughput and
  tokens on bench_gpu.py's batch of 64 prompts, measured here;
- .gpu-wheels/: the wheel of `gguf`, which the GPU machines lack.

    python bench/gpu_prep.py      # then carry .gpu-carry and .gpu-wheels with the tree
"""
from __future__ import annotations

import hashlib
import pickle
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import shaped_model  # noqa: E402

PROMPT, STEPS = 6, 6
BATCH, BATCH_PROMPT, BATCH_GEN = 64, 32, 32  # bench_gpu.py's batch: prompts, their tokens, tokens generated


def batch_prompts(n_vocab: int) -> list[list[int]]:
    """The batch bench_gpu.py runs on both engines: BATCH random prompts of BATCH_PROMPT ids."""
    return np.random.default_rng(2).integers(3, n_vocab, (BATCH, BATCH_PROMPT)).tolist()


def batch_reference(model) -> dict:
    """The CPU engine's `complete_many` of the batch (greedy, BATCH at once) on this machine: its
    generated tokens/s (the better of two runs) and each prompt's tokens."""
    import time
    from npllama.generation.scheduler import complete_many
    prompts, best = batch_prompts(model.config.n_vocab), 0.0
    for _ in range(2):
        t0 = time.perf_counter()
        done = complete_many(model, prompts, max_tokens=BATCH_GEN, temperature=0, max_batch=BATCH)
        best = max(best, sum(len(c.tokens) for c in done) / (time.perf_counter() - t0))
    tokens = np.full((BATCH, BATCH_GEN), -1, np.int64)
    for i, c in enumerate(done):
        tokens[i, :len(c.tokens)] = [t.id for t in c.tokens]
    return {"cpu_batch_tok_s": best, "cpu_batch_tokens": tokens}


def reference(path: Path) -> dict:
    """The CPU engine's logits on `path`: a prompt's, then STEPS greedy steps'."""
    import npllama
    model = npllama.load(path)
    prompt = np.random.default_rng(1).integers(3, model.config.n_vocab, PROMPT)
    s = model.session()
    prompt_logits = s.feed(prompt, all_logits=True)
    steps, logits = [], []
    tok = int(np.argmax(prompt_logits[-1]))
    for _ in range(STEPS):
        steps.append(tok)
        logits.append(s.feed([tok]))
        tok = int(np.argmax(logits[-1]))
    return {"sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "prompt": prompt,
            "prompt_logits": prompt_logits, "steps": np.array(steps), "step_logits": np.array(logits),
            **batch_reference(model)}


def main():
    from npllama.gguf.hub import known_model_path
    out = ROOT / ".gpu-carry"
    out.mkdir(exist_ok=True)
    for name, known in (("smollm2", "smollm2"), ("gemma3", "gemma3-270m")):
        spec = shaped_model.spec(known_model_path(known))
        (out / f"{name}.pkl").write_bytes(pickle.dumps(spec))
        with tempfile.TemporaryDirectory() as tmp:
            path = shaped_model.write(spec, Path(tmp) / f"{name}.gguf")
            np.savez(out / f"{name}.npz", **reference(path))
        print(f"{name}: {out / name}.pkl and .npz")
    wheels = ROOT / ".gpu-wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                    str(wheels), f"gguf=={version('gguf')}"], check=True)
    print(f"wheels: {sorted(p.name for p in wheels.iterdir())}")


if __name__ == "__main__":
    main()
