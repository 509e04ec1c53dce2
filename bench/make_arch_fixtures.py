"""Make the per-architecture oracle fixtures in tests/fixtures/arch/.

Run with the references' python (torch, transformers, tokenizers; it installs sentencepiece
into that venv if missing):
    REF=$(../shared/tools/setup-refs.sh); $REF bench/make_arch_fixtures.py [--only gemma3 ...]

For every architecture it builds a tiny random Hugging Face model locally (no hub) in float32
with a fixed torch seed, trains a tiny tokenizer of the family's kind (SentencePiece for
gemma3 / phi3 / llama, byte-level BPE for qwen3 / qwen3moe / smollm3), saves the HF directory,
converts it with llama.cpp's own `convert_hf_to_gguf.py --outtype f32` (taken from the
llama-cpp-python==0.3.36 sdist, with that sdist's gguf-py first on sys.path; the converter is
imported and run in this process, unmodified) into tests/fixtures/arch/<name>.gguf, and stores
HF's answers in tests/fixtures/arch/<name>.npz:
    ids     int64 (N,)         a fixed token sequence, N = 32 (longer than gemma3's sliding
                               window 6 and than phi3-longrope's original context 16)
    logits  float32 (N, V)     HF logits of every position, teacher-forced, one forward pass
    greedy  int64 (16,)        HF's greedy continuation of ids[:8] (`generate`, KV cache)
and, for phi3-longrope only,
    logits_short float32 (16, V)  HF logits of ids[:16] alone (a pass that never passes the
                               original context, so HF uses the short factors throughout)
    logits_decode float32 (N, V)  HF logits when ids are fed one token per forward call with
                               its KV cache (model(..., cache=...), no recomputation)
It then dumps every GGUF's metadata and tensors with gguf's reader into
tests/fixtures/arch/README.md.

Random weights are drawn wider than HF's init (matrices N(0, 1/fan_in), embeddings N(0, 1),
norm weights around their identity) so logits spread over tens of units and the top-1 token
is decided by a clear margin; the script checks that margin (top-1 minus top-2 at least
2e-3 of the logit range at every teacher-forced and greedy position) and draws another id
sequence if it is not met, so the fixtures do not depend on float rounding.

Tokenizers: the tests use token ids only. BPE pre-tokenizer: the converter hashes the
tokenizer's output on a fixed text to recognise the family's pre-tokenizer; a freshly trained
tokenizer has an unknown hash, so `get_vocab_base_pre` is wrapped to fall back to the name the
real family has ("qwen2" for qwen3/qwen3moe, "llama-bpe" for smollm3, which uses Llama 3's
tokenizer); the trained tokenizers use those families' split regexes.

How HF (transformers 5.24) applies LongRoPE to Phi-3 (phi3-longrope)
--------------------------------------------------------------------
`Phi3RotaryEmbedding.forward` is wrapped by `dynamic_rope_update`; for rope_type "longrope"
it calls `longrope_frequency_update`, which looks at the positions of the CURRENT forward call:
seq_len = max(position_ids) + 1; if seq_len > original_max_position_embeddings it uses the
inverse frequencies built from long_factor, otherwise those from short_factor. The choice is
per call and holds for every position of that call: a 32-token teacher-forced pass uses the
long factors at positions 0..31 (so `logits` is long-factor logits throughout), a 16-token
pass the short ones throughout (`logits_short`). Called one token at a time with its KV
cache, the model itself does not recompute: the keys of positions 0..15 stay as computed
with the short factors, and positions 16.. use the long ones for their queries and keys
(`logits_decode`; rows 0..15 equal logits_short). In `generate`, Phi3ForCausalLM's
`prepare_inputs_for_generation` drops the KV cache at the first step whose input is longer
than original_max_position_embeddings (while the cache holds <= that many positions) and
recomputes the whole sequence, so that from then on every cached key has the long factors:
HF's next-token logits after a sequence of length L use the long factors at all positions
iff L > original_max_position_embeddings. In terms of the fixture: the logits HF generates
from are logits_short[i] for i < 16 and logits[i] for i >= 16. (llama.cpp instead picks one
set per context: long when the context size n_ctx exceeds rope.scaling.original_context_length,
else short, and never recomputes.)
The attention factor multiplies cos and sin for both sets; HF computes it as
sqrt(1 + ln(factor) / ln(original_max_position_embeddings)) with
factor = max_position_embeddings / original_max_position_embeddings (here 64/16 = 4 ->
sqrt(1 + ln 4 / ln 16) = sqrt(1.5) = 1.2247), the same formula the converter stores as
phi3.rope.scaling.attn_factor. The inverse frequency of pair i (of rotary_dim / 2) is
1 / (factor_i * base^(2i / rotary_dim)), rotary_dim = head_dim * partial_rotary_factor, and
HF rotates the first rotary_dim dims of each head NeoX-style (halves), passing the rest.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import math
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "tests" / "fixtures" / "arch"
REF_VERSION = "0.3.36"
REFS = Path(os.environ.get("NPLLAMA_REFS", Path.home() / ".cache" / "npllama-refs"))
SDIST_DIR = REFS / "sdist"
SEQ_LEN = 32
PROMPT = 8
GREEDY = 16
DUMP_MARK = "<!-- generated by bench/make_arch_fixtures.py below this line -->"
MIN_GAP = 2e-3  # of the logit range, between the top-1 and top-2 logits at every checked position

# split regexes of the real families' tokenizers (qwen2's digits one by one, llama 3's up to three)
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|")

TEXT = """\
The quick brown fox jumps over the lazy dog. A small model can still learn a few words.
Numbers like 12, 345 and 6789 appear in text; so do dates such as 2024-05-17 and times 10:30.
def add(a, b):
    return a + b
print(add(2, 3))  # prints 5
Weather today: sunny with a chance of rain in the afternoon, winds from the north-west.
She said, "It's fine, we'll go tomorrow." He didn't agree, but they'd already decided.
Les enfants jouent dans le jardin. Die Katze schläft auf dem Sofa. El perro corre rápido.
Attention is computed from queries, keys and values; rotary embeddings rotate pairs of dims.
Sliding windows limit how far back a layer can look, while global layers see everything.
Mixture of experts routes every token to a few feed-forward networks chosen by a router.
"""

# ---- the architectures ----------------------------------------------------------------------

SPECS = {
    "llama": dict(cls="LlamaForCausalLM", tok="sp-llama", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)),
    "gemma3": dict(cls="Gemma3ForCausalLM", tok="sp-gemma", cfg=dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24, sliding_window=6,
        max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True)),
    "gemma3-linear": dict(cls="Gemma3ForCausalLM", tok="sp-gemma", cfg=dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=7, num_attention_heads=4,
        num_key_value_heads=1, head_dim=24, query_pre_attn_scalar=24, sliding_window=6,
        max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
        final_logit_softcapping=5.0, attn_logit_softcapping=None, tie_word_embeddings=True)),
    "qwen3": dict(cls="Qwen3ForCausalLM", tok="bpe-qwen2", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True)),
    "qwen3moe": dict(cls="Qwen3MoeForCausalLM", tok="bpe-qwen2", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-6,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)),
    "smollm3": dict(cls="SmolLM3ForCausalLM", tok="bpe-llama3", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=128, rms_norm_eps=1e-6,
        no_rope_layer_interval=4, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 2e6}, tie_word_embeddings=True)),
    "phi3": dict(cls="Phi3ForCausalLM", tok="sp-llama", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=64,
        rms_norm_eps=1e-5, sliding_window=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False)),
    "phi3-longrope": dict(cls="Phi3ForCausalLM", tok="sp-llama", cfg=dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, original_max_position_embeddings=16,
        rms_norm_eps=1e-5, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "original_max_position_embeddings": 16,
                         # rotary_dim = 0.5 * head_dim 16 = 8 dims: 4 pairs
                         "long_factor": [1.0, 2.5, 6.0, 12.0], "short_factor": [1.0, 1.05, 1.2, 1.5]},
        tie_word_embeddings=False)),
}
BPE_PRE = {"bpe-qwen2": "qwen2", "bpe-llama3": "llama-bpe"}


# ---- llama.cpp's converter --------------------------------------------------------------------

def llama_cpp_dir() -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist, downloaded and extracted once."""
    root = SDIST_DIR / f"llama_cpp_python-{REF_VERSION}"
    vendor = root / "vendor" / "llama.cpp"
    if (vendor / "convert_hf_to_gguf.py").is_file():
        return vendor
    SDIST_DIR.mkdir(parents=True, exist_ok=True)
    archive = SDIST_DIR / f"llama_cpp_python-{REF_VERSION}.tar.gz"
    if not archive.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={REF_VERSION}", "-d", str(SDIST_DIR)], check=True)
    with tarfile.open(archive) as tf:
        tf.extractall(SDIST_DIR, filter="data")
    if not (vendor / "convert_hf_to_gguf.py").is_file():
        raise SystemExit(f"{archive} has no vendor/llama.cpp/convert_hf_to_gguf.py")
    return vendor


def import_converter(vendor: Path):
    """Import the converter with its own gguf-py first on sys.path; wrap the BPE pre-tokenizer
    lookup so that a tiny trained tokenizer gets its family's pre-tokenizer name."""
    sys.path[:0] = [str(vendor / "gguf-py"), str(vendor)]
    import gguf
    if not Path(gguf.__file__).resolve().is_relative_to(vendor.resolve()):
        raise SystemExit(f"gguf was imported from {gguf.__file__}, not from {vendor}/gguf-py; "
                         "run this script in a fresh interpreter")
    import convert_hf_to_gguf
    from conversion import base

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            pre = os.environ["NPLLAMA_FIXTURE_PRE"]
            print(f"  (unknown BPE pre-tokenizer hash of the tiny tokenizer: writing {pre!r})")
            return pre
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    return convert_hf_to_gguf


def convert(converter, hf_dir: Path, out: Path, pre: str | None) -> None:
    argv = sys.argv
    sys.argv = ["convert_hf_to_gguf.py", str(hf_dir), "--outtype", "f32", "--outfile", str(out)]
    if pre:
        os.environ["NPLLAMA_FIXTURE_PRE"] = pre
    try:
        converter.main()
    finally:
        sys.argv = argv
        os.environ.pop("NPLLAMA_FIXTURE_PRE", None)


# ---- tokenizers ---------------------------------------------------------------------------------

def ensure_sentencepiece():
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "sentencepiece"], check=True)


def write_sentencepiece(hf_dir: Path, kind: str) -> dict:
    """Train a tiny byte-fallback SentencePiece BPE model into hf_dir/tokenizer.model; returns
    the special ids for the config."""
    import sentencepiece as spm
    if kind == "sp-gemma":  # gemma: <pad>=0 <eos>=1 <bos>=2 <unk>=3
        ids = dict(pad_id=0, eos_id=1, bos_id=2, unk_id=3)
    else:                   # llama / phi3: <unk>=0 <s>=1 </s>=2, no pad
        ids = dict(unk_id=0, bos_id=1, eos_id=2, pad_id=-1)
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXT.splitlines()), model_writer=buf, vocab_size=360, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, hard_vocab_limit=False, num_threads=1,
        add_dummy_prefix=kind != "sp-gemma", minloglevel=2, **ids)
    (hf_dir / "tokenizer.model").write_bytes(buf.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    out = dict(vocab_size=sp.vocab_size(), bos_token_id=sp.bos_id(), eos_token_id=sp.eos_id())
    out["pad_token_id"] = sp.pad_id() if sp.pad_id() >= 0 else None
    return out


def write_bpe(hf_dir: Path, kind: str) -> dict:
    """Train a tiny byte-level BPE with the family's split regex; save it as a HF fast tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    split = QWEN2_SPLIT if kind == "bpe-qwen2" else LLAMA3_SPLIT
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=360, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT.splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token=None)
    fast.save_pretrained(hf_dir)
    return dict(vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"),
                pad_token_id=tok.token_to_id("<|endoftext|>"))


# ---- models -------------------------------------------------------------------------------------

def randomize(model, gemma: bool) -> None:
    """Wider random weights than HF's init, so that logits spread and top-1 is clear-cut.

    With tied embeddings the output matrix is the input one, and a residual stream dominated
    by the input token's embedding makes every position predict its own token; so tied
    embeddings are drawn small (N(0, 0.1); gemma scales them up by sqrt(hidden) = 8 on input,
    and its sandwich norms keep each layer's output at unit scale) so that the layers'
    outputs dominate the stream."""
    import torch
    cfg = model.config
    embed_std = 0.1 if cfg.tie_word_embeddings else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm weights (no model here has biases)
                if not name.endswith("norm.weight"):
                    raise SystemExit(f"unexpected 1-D parameter {name}")
                p.normal_(0.0, 0.1)
                if not gemma:  # gemma's RMSNorm multiplies by (1 + w)
                    p.add_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, embed_std)
            else:  # nn.Linear (out, in) and fused experts (E, out, in): fan-in is the last dim
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))


def build_hf(name: str, spec: dict, hf_dir: Path):
    import torch
    import transformers
    hf_dir.mkdir(parents=True)
    tok = spec["tok"]
    special = write_sentencepiece(hf_dir, tok) if tok.startswith("sp") else write_bpe(hf_dir, tok)
    cls = getattr(transformers, spec["cls"])
    config = cls.config_class(**spec["cfg"], **special)
    config.architectures = [spec["cls"]]
    torch.manual_seed(1234)
    model = cls(config).float().eval()
    randomize(model, gemma=spec["cls"].startswith("Gemma"))
    model.save_pretrained(hf_dir)
    # reload what was saved (as the converter reads it), eager attention as the plainest reference
    model = cls.from_pretrained(hf_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return model


def top_gap(logits: np.ndarray) -> float:
    """Smallest (top-1 minus top-2) over rows, relative to the logit range."""
    s = np.sort(logits, axis=-1)
    return float(np.min(s[:, -1] - s[:, -2]) / (logits.max() - logits.min()))


def hf_generate(model, prompt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """HF's greedy continuation of `prompt` (GREEDY tokens, never stopping at EOS) with its KV
    cache, through `generate` (which is where Phi-3 handles LongRoPE's switch), and the logits
    each token was chosen from."""
    import torch
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        gen = model.generate(torch.tensor(prompt[None]), max_new_tokens=GREEDY, min_new_tokens=GREEDY,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    tokens = gen.sequences[0, len(prompt):].numpy().astype(np.int64)
    step_logits = torch.stack(gen.logits)[:, 0].float().numpy()
    if len(tokens) != GREEDY or not np.array_equal(step_logits.argmax(-1), tokens):
        raise SystemExit(f"generate did not give {GREEDY} greedy tokens: {tokens}")
    return tokens, step_logits


def hf_answers(model, vocab: int, name: str) -> dict:
    import torch
    for attempt in range(50):
        rng = np.random.default_rng(1000 + attempt)
        ids = rng.integers(0, vocab, SEQ_LEN).astype(np.int64)
        with torch.no_grad():
            logits = model(torch.tensor(ids[None])).logits[0].float().numpy()
        greedy, step_logits = hf_generate(model, ids[:PROMPT])
        gaps = (top_gap(logits), top_gap(step_logits))
        echo = int(np.sum(logits.argmax(-1) == ids))
        if echo > SEQ_LEN // 4:
            raise SystemExit(f"{name}: the top-1 is the input token itself at {echo} of {SEQ_LEN} positions")
        if min(gaps) >= MIN_GAP:
            break
        print(f"  ids seed {1000 + attempt}: top-1 margin {min(gaps):.2e} of the range, drawing again")
    else:
        raise SystemExit(f"{name}: no id sequence with a clear top-1 at every position")
    res = dict(ids=ids, logits=logits.astype(np.float32), greedy=greedy)
    if name == "phi3-longrope":
        n = model.config.rope_parameters["original_max_position_embeddings"]
        with torch.no_grad():
            res["logits_short"] = model(torch.tensor(ids[None, :n])).logits[0].float().numpy()
        diff = np.abs(res["logits_short"] - logits[:n]).max()
        print(f"  long vs short factors over the first {n} positions: max |diff| {diff:.3f}")
        if diff < 1e-2:
            raise SystemExit("phi3-longrope: long and short factors give the same logits; widen them")
        # one token per forward call with HF's KV cache and no recomputation: positions
        # 0..15 short (keys cached so), 16.. long queries and keys over the cached short keys
        with torch.no_grad():
            out = model(torch.tensor(ids[None, :1]), use_cache=True)
            rows = [out.logits[0, -1]]
            for t in ids[1:]:
                out = model(torch.tensor([[int(t)]]), cache=out.cache, use_cache=True)
                rows.append(out.logits[0, -1])
        res["logits_decode"] = torch.stack(rows).float().numpy()
        if not np.allclose(res["logits_decode"][:n], res["logits_short"], atol=1e-4):
            raise SystemExit("phi3-longrope: HF's cached decode disagrees with its short-factor pass")
        print(f"  one-token decode vs one pass from position {n}: max |diff| "
              f"{np.abs(res['logits_decode'][n:] - logits[n:]).max():.3f}")
        # generate's tokens are those of a fresh full pass over each prefix (short factors up
        # to length n, long beyond: the cache is recomputed at the switch), as the docstring says
        seq = np.concatenate([ids[:PROMPT], greedy])
        with torch.no_grad():
            fresh = [int(model(torch.tensor(seq[None, :L])).logits[0, -1].argmax()) for L in range(PROMPT, len(seq))]
        if fresh != greedy.tolist():
            raise SystemExit(f"phi3-longrope: generate {greedy.tolist()} != fresh passes {fresh}")
    else:
        # the cached decode agrees with one teacher-forced pass over prompt + continuation
        seq = np.concatenate([ids[:PROMPT], greedy])
        with torch.no_grad():
            full = model(torch.tensor(seq[None])).logits[0].float().numpy()
        if not np.array_equal(full[PROMPT - 1:-1].argmax(-1), greedy):
            raise SystemExit(f"{name}: HF's cached greedy decode disagrees with its own teacher-forced pass")
    print(f"  logits range {logits.min():.2f}..{logits.max():.2f}, smallest top-1 margin {min(gaps):.2e} "
          f"of the range, greedy {greedy.tolist()}")
    return res


# ---- the metadata dump --------------------------------------------------------------------------

def _pairs_interleaved(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's q/k rows (each head: first half, second half of the rotated dims) reordered so that
    each rotated pair is adjacent: row 2i of a head is HF's row i, row 2i+1 is HF's row i + d/2."""
    out, d_in = w.shape
    return w.reshape(n_head, 2, out // n_head // 2, d_in).swapaxes(1, 2).reshape(out, d_in)


def relations(name: str, hf_dir: Path, path: Path) -> list[str]:
    """Check, tensor by tensor, how the converter's tensors relate to HF's, and say so."""
    from gguf import GGUFReader
    from safetensors.numpy import load_file
    hf = load_file(hf_dir / "model.safetensors")
    g = {t.name: np.array(t.data) for t in GGUFReader(path).tensors}  # numpy order: (out, in)
    cfg = json.loads((hf_dir / "config.json").read_text())
    said, checked = [], set()

    def check(gname, value, text):
        if gname not in g or g[gname].shape != value.shape or not np.array_equal(g[gname], value):
            raise SystemExit(f"{name}: {gname} is not {text}")
        checked.add(gname)
        if text not in said:
            said.append(text)

    check("token_embd.weight", hf["model.embed_tokens.weight"], "token_embd = embed_tokens (n_vocab, n_embd)")
    if "lm_head.weight" in hf and not cfg.get("tie_word_embeddings"):
        check("output.weight", hf["lm_head.weight"], "output = lm_head")
    elif "output.weight" in g:
        raise SystemExit(f"{name}: tied embeddings but an output.weight")
    else:
        said.append("no output.weight: the output matrix is token_embd (tied)")
    gemma = name.startswith("gemma")
    norms = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm" if gemma else "ffn_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    simple = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.down_proj": "ffn_down",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate": "ffn_gate_inp",
              "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
    permuted = name in ("llama", "smollm3")
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        for hname, gname in norms.items():
            if pre + hname + ".weight" in hf:
                w = hf[pre + hname + ".weight"]
                check(f"blk.{i}.{gname}.weight", w + np.float32(1) if gemma else w,
                      f"{gname} = {hname}" + (" + 1 (stored as 1 + w: HF's Gemma3RMSNorm scales by 1 + w)" if gemma else ""))
        for hname, gname in simple.items():
            if pre + hname + ".weight" in hf:
                check(f"blk.{i}.{gname}.weight", hf[pre + hname + ".weight"], f"{gname} = {hname} as HF has it")
        for hname, gname, heads in (("q_proj", "attn_q", "num_attention_heads"), ("k_proj", "attn_k", "num_key_value_heads")):
            if pre + f"self_attn.{hname}.weight" in hf:
                w = hf[pre + f"self_attn.{hname}.weight"]
                if permuted:
                    check(f"blk.{i}.{gname}.weight", _pairs_interleaved(w, cfg[heads]),
                          f"{gname} = {hname} with each head's rows permuted so that rotated pairs are adjacent "
                          "(GGUF row 2j = HF row j, row 2j+1 = HF row j + head_dim/2): rotate ADJACENT pairs (0,1), (2,3)...")
                else:
                    check(f"blk.{i}.{gname}.weight", w, f"{gname} = {hname} unpermuted: rotate HALVES "
                          "(dim j with j + rotary_dim/2, NeoX style) as HF does")
        if f"{pre}mlp.experts.0.gate_proj.weight" in hf:
            for hname, gname in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
                stack = np.stack([hf[f"{pre}mlp.experts.{e}.{hname}.weight"] for e in range(cfg["num_local_experts"])])
                check(f"blk.{i}.{gname}.weight", stack, f"{gname}[e] = experts.e.{hname} (numpy (n_expert, out, in))")
    if name.startswith("phi3"):
        said.append("attn_qkv rows: q (n_head*head_dim) | k (n_kv*head_dim) | v (n_kv*head_dim); "
                    "ffn_up rows: gate (n_ff) | up (n_ff): out = down(up * silu(gate))")
    if "rope_factors_long.weight" in g:
        rp = cfg["rope_parameters"]
        check("rope_factors_long.weight", np.array(rp["long_factor"], np.float32), "rope_factors_long = long_factor")
        check("rope_factors_short.weight", np.array(rp["short_factor"], np.float32), "rope_factors_short = short_factor")
    checked |= {"output_norm.weight"}
    check("output_norm.weight", hf["model.norm.weight"] + (np.float32(1) if gemma else np.float32(0)),
          "output_norm = model.norm" + (" + 1" if gemma else ""))
    left = sorted(set(g) - checked)
    if left:
        raise SystemExit(f"{name}: tensors not accounted for: {left}")
    return said


def describe(path: Path, said: list[str]) -> str:
    from gguf import GGUFReader
    r = GGUFReader(path)
    lines = [f"### {path.stem} ({path.stat().st_size / 1024:.0f} KiB)", "", "Tensors against HF's (checked value for value):", ""]
    lines += [f"- {s}" for s in said]
    lines += ["", "Metadata:", "```"]
    for f in r.fields.values():
        if f.name.startswith("GGUF."):
            continue
        v = f.contents()
        if isinstance(v, list) and len(v) > 8:
            v = f"[{len(v)} items] {v[:4]!r}..."
        lines.append(f"{f.name} = {v!r}")
    lines += ["```", "", "Tensors (shape in GGUF order, fastest-varying first; numpy's is reversed):", "```"]
    for t in r.tensors:
        lines.append(f"{t.name:28s} {t.tensor_type.name:5s} {list(map(int, t.shape))}")
    lines += ["```", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(SPECS), help="make only these fixtures")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--keep-hf", type=Path, help="keep the HF model directories here")
    args = ap.parse_args()
    vendor = llama_cpp_dir()
    converter = import_converter(vendor)
    ensure_sentencepiece()
    import torch
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    names = args.only or list(SPECS)
    said = {}
    with contextlib.ExitStack() as stack:
        work = args.keep_hf or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for name in names:
            print(f"== {name}")
            hf_dir = work / name
            model = build_hf(name, SPECS[name], hf_dir)
            gguf_path = args.out / f"{name}.gguf"
            convert(converter, hf_dir, gguf_path, BPE_PRE.get(SPECS[name]["tok"]))
            said[name] = relations(name, hf_dir, gguf_path)
            res = hf_answers(model, model.config.vocab_size, name)
            np.savez_compressed(args.out / f"{name}.npz", **res)
    if args.only:
        print("not rewriting README.md (it describes all the fixtures; run without --only)")
        return
    readme = args.out / "README.md"
    head = readme.read_text().split(DUMP_MARK)[0] if readme.exists() else "# Architecture fixtures\n\n"
    dump = "\n".join(describe(args.out / f"{n}.gguf", said[n]) for n in SPECS)
    readme.write_text(head + DUMP_MARK + "\n## What the converter wrote (dumped with gguf's reader)\n\n" + dump)
    print(f"wrote {readme}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
