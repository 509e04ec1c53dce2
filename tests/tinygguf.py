"""Writes tiny random GGUF models with gguf.GGUFWriter, so that most tests need no download.

`write_tiny_llama(path, ...)` produces a complete llama-architecture file: metadata, a small
byte-level BPE tokenizer, and random weights in the requested quant type.
"""
from __future__ import annotations

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# bytes a block, and where its float16 scales lie (gguf's block layouts)
SCALES = {QT.Q4_0: (18, slice(0, 2)), QT.Q4_1: (20, slice(0, 4)), QT.Q5_0: (22, slice(0, 2)),
          QT.Q5_1: (24, slice(0, 4)), QT.Q8_0: (34, slice(0, 2)), QT.Q4_K: (144, slice(0, 4)),
          QT.Q5_K: (176, slice(0, 4)), QT.Q6_K: (210, slice(208, 210)), QT.Q3_K: (110, slice(108, 110)),
          QT.Q2_K: (84, slice(80, 84))}


def random_blocks(qtype: QT, n_blocks: int, rng, high: float = 0.01) -> np.ndarray:
    """`n_blocks` random blocks of `qtype` (uint8, (n_blocks, bytes a block)) whose float16
    scales lie in [0.001, high]: the K-quants, which gguf cannot quantize to, or any type."""
    size, at = SCALES[qtype]
    raw = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    raw[:, at] = rng.uniform(0.001, high, (n_blocks, (at.stop - at.start) // 2)).astype(np.float16).view(np.uint8)
    return raw


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte value, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a small gpt2-style vocabulary: specials, 256 bytes, merges."""
    tokens = list(SPECIALS) + _byte_to_unicode() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))  # 3 = control, 1 = normal
    return tokens, types, list(MERGES)


def _add_tensor(w: gguf.GGUFWriter, name: str, arr: np.ndarray, qtype: QT) -> None:
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if qtype == QT.F32 or arr.ndim == 1:
        w.add_tensor(name, arr)
    elif qtype == QT.F16:
        w.add_tensor(name, arr.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)


def write_tiny_llama(
    path,
    *,
    n_layer: int = 2,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 96,
    n_ctx: int = 256,
    qtype: QT = QT.F32,
    tied: bool = True,
    seed: int = 0,
    arch: str = "llama",
    rope_base: float = 10000.0,
    extra_kv: dict | None = None,
    skip_tensors: tuple[str, ...] = (),
    tensor_overrides: dict[str, np.ndarray] | None = None,
    merges: list[str] | None = None,
):
    """Write a random llama-family model to `path` and return `path`.

    Weights are N(0, 0.02) except norms (around 1). `qtype` applies to the 2-D matrices;
    `skip_tensors` drops tensors by name and `tensor_overrides` replaces them, for tests of
    validation errors; `merges` replaces the vocabulary's merge list.
    """
    rng = np.random.default_rng(seed)
    tokens, types, vocab_merges = tiny_vocab()
    merges = vocab_merges if merges is None else merges
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-random")
    w.add_context_length(n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for k, v in (extra_kv or {}).items():
        if isinstance(v, str):
            w.add_string(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        else:
            w.add_uint32(k, int(v))

    def rnd(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    kv_dim = n_head_kv * head_dim
    tensors: dict[str, np.ndarray] = {"token_embd.weight": rnd(n_vocab, n_embd) * 20}
    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = norm(n_embd)
        tensors[p + "attn_q.weight"] = rnd(n_embd, n_embd) * 5
        tensors[p + "attn_k.weight"] = rnd(kv_dim, n_embd) * 5
        tensors[p + "attn_v.weight"] = rnd(kv_dim, n_embd)
        tensors[p + "attn_output.weight"] = rnd(n_embd, n_embd)
        tensors[p + "ffn_norm.weight"] = norm(n_embd)
        tensors[p + "ffn_gate.weight"] = rnd(n_ff, n_embd)
        tensors[p + "ffn_up.weight"] = rnd(n_ff, n_embd)
        tensors[p + "ffn_down.weight"] = rnd(n_embd, n_ff)
    tensors["output_norm.weight"] = norm(n_embd)
    if not tied:
        tensors["output.weight"] = rnd(n_vocab, n_embd) * 20
    tensors.update(tensor_overrides or {})
    for name, arr in tensors.items():
        if name not in skip_tensors:
            _add_tensor(w, name, arr, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
