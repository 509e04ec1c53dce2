"""BERT, and RoBERTa / XLM-RoBERTa as llama.cpp's converter writes them (`bert`): an encoder.

- Input: token + absolute position + token-type embeddings, then a LayerNorm (token_embd_norm).
  RoBERTa counts positions from pad + 1; the converter drops the rows before, so every file's
  positions start at row 0. A file without `token_types` (some converters') adds none.
- Each layer is post-LN: x = LN(x + attn(x)), then x = LN(x + ffn(x)); every LayerNorm has a
  bias, epsilon `attention.layer_norm_epsilon`.
- Attention is bidirectional (`attention.causal` is false), with biases on q, k, v and the
  output, and no RoPE.
- The FFN is ungated: down(gelu(up x + b_up)) + b_down, GELU with erf.
- No output norm and no LM head: the model embeds (`pooling_type`), or, as a cross-encoder
  (`*ForSequenceClassification`), scores the first token's hidden state with `cls` (dense, then
  tanh; RoBERTa's head) and `cls.output`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from .base import Meta, pooling
from .weights import EncoderWeights, Layer, QWeight, f32

NAMES = ("bert",)


def configure(m: Meta) -> dict:
    n_layer = m.positive("block_count")
    if n_layer > len(m.tensors):
        raise m.error(f"'{m.arch}.block_count' is {n_layer} but the file has only {len(m.tensors)} tensors")
    n_embd, n_head = m.positive("embedding_length"), m.positive("attention.head_count")
    if n_embd % n_head:
        raise m.error(f"n_embd ({n_embd}) is not divisible by n_head ({n_head})")
    if m.get("attention.causal", bool, False):
        raise m.error(f"'{m.arch}.attention.causal' is true; npllama reads 'bert' files as encoders "
                      f"(bidirectional attention) only")
    if "token_embd.weight" not in m.tensors:
        raise m.error("missing required tensor 'token_embd.weight'")
    tokens = m.metadata.get("tokenizer.ggml.tokens")
    default_vocab = len(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str) \
        else m.tensors["token_embd.weight"].shape[0]
    head_dim = n_embd // n_head
    return dict(
        arch=m.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head, head_dim=head_dim,
        n_ff=m.positive("feed_forward_length"), n_vocab=m.positive("vocab_size", default_vocab),
        n_ctx=m.positive("context_length"), rope_base=10000.0, rope_dim=head_dim, rope_scaling_type=None,
        rope_scaling_factor=1.0, rope_neox=False, rms_eps=m.positive("attention.layer_norm_epsilon", kind=float),
        tied_output=False, attn_bias=True, has_rope_freqs=False, act="gelu", attn_scale=1.0 / math.sqrt(head_dim),
        ropes=(), layer_rope=(-1,) * n_layer, layer_window=(0,) * n_layer,
        causal=False, norm="layer", post_ln=True, gated_ffn=False, pooling=pooling(m),
    )


def tensors(cfg):
    e, f = cfg.n_embd, cfg.n_ff
    embd, ffn = f"n_embd={e}", f"n_ff={f}, n_embd={e}"
    per_layer = {}
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        per_layer[f"{name}.weight"] = ((e, e), embd)
        per_layer[f"{name}.bias"] = ((e,), embd)
    for name in ("attn_output_norm", "layer_output_norm"):
        per_layer[f"{name}.weight"] = ((e,), embd)
        per_layer[f"{name}.bias"] = ((e,), embd)
    per_layer.update({"ffn_up.weight": ((f, e), ffn), "ffn_up.bias": ((f,), ffn),
                      "ffn_down.weight": ((e, f), ffn), "ffn_down.bias": ((e,), embd)})
    return per_layer


def model_tensors(cfg):
    """The required tensors outside the layers (besides token_embd)."""
    embd = f"n_embd={cfg.n_embd}"
    return {"position_embd.weight": ((cfg.n_ctx, cfg.n_embd), f"n_ctx={cfg.n_ctx}, {embd}"),
            "token_embd_norm.weight": ((cfg.n_embd,), embd), "token_embd_norm.bias": ((cfg.n_embd,), embd)}


def load_layer(cfg, tensor, opt, i: int):
    def w(suffix):
        return QWeight.from_tensor(tensor(f"blk.{i}.{suffix}"))

    def vec(suffix):
        return f32(tensor(f"blk.{i}.{suffix}"))

    return Layer(
        attn_norm=(vec("attn_output_norm.weight"), vec("attn_output_norm.bias")),
        wq=w("attn_q.weight"), wk=w("attn_k.weight"), wv=w("attn_v.weight"), wo=w("attn_output.weight"),
        bq=vec("attn_q.bias"), bk=vec("attn_k.bias"), bv=vec("attn_v.bias"), bo=vec("attn_output.bias"),
        ffn_norm=(vec("layer_output_norm.weight"), vec("layer_output_norm.bias")),
        w_up=w("ffn_up.weight"), b_up=vec("ffn_up.bias"), w_down=w("ffn_down.weight"), b_down=vec("ffn_down.bias"))


def load_model(cfg, tensor, opt, path: str) -> EncoderWeights:
    """The weights outside the layers, the classification head checked against the model."""
    from ..errors import GGUFError
    types = opt("token_types.weight")
    if types is not None and (len(types.shape) != 2 or types.shape[1] != cfg.n_embd):
        raise GGUFError(f"{path}: tensor 'token_types.weight' has shape {types.shape}; it needs (n_types, "
                        f"n_embd={cfg.n_embd})")
    head = {}
    for name, key in (("cls", "cls"), ("cls_out", "cls.output")):
        t = opt(f"{key}.weight")
        if t is None:
            continue
        rows = cfg.n_embd if name == "cls" else t.shape[0]
        if len(t.shape) != 2 or t.shape != (rows, cfg.n_embd):
            raise GGUFError(f"{path}: tensor '{key}.weight' has shape {t.shape}; it needs "
                            f"({'n_embd' if name == 'cls' else 'n_labels'}, n_embd={cfg.n_embd})")
        b = opt(f"{key}.bias")
        if b is None or b.shape != (rows,):
            raise GGUFError(f"{path}: tensor '{key}.bias' is missing or not ({rows},)")
        head[name], head[f"{name}_b"] = QWeight.from_tensor(t), f32(b)
    if "cls" in head and "cls_out" not in head:
        raise GGUFError(f"{path}: has the classification head's 'cls.weight' but not 'cls.output.weight'")
    return EncoderWeights(position_embd=f32(tensor("position_embd.weight")),
                          token_types=f32(types) if types is not None else None,
                          embd_norm=(f32(tensor("token_embd_norm.weight")), f32(tensor("token_embd_norm.bias"))),
                          **head)
