"""Phi-3: the llama block with fused weights, split at load time into views of the file:
`attn_qkv` holds the rows of Q, then K, then V; `ffn_up` holds the gate's rows, then the
up projection's. RoPE rotates NeoX halves of the first `rope.dimension_count` dimensions of
each head (partial rotary). LongRoPE, when the file has `rope_factors_long/short`: a
forward call whose last position reaches past `rope.scaling.original_context_length` uses
the long factors, any other the short ones (as HF chooses by the sequence length), and cos
and sin are multiplied by `rope.scaling.attn_factor`. A sliding window applies when the file
has one."""
from __future__ import annotations

from .base import Meta, Rope, llama_fields, llama_tensors
from .weights import QWeight, llama_layer

NAMES = ("phi3",)


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=True)
    long, short = "rope_factors_long.weight", "rope_factors_short.weight"
    if (long in m.tensors) != (short in m.tensors):
        raise m.error(f"has only one of '{long}' and '{short}'; LongRoPE needs both")
    if long in m.tensors:
        rope = fields["ropes"][0]
        orig = m.positive("rope.scaling.original_context_length", fields["n_ctx"])
        fields.update(rope_scaling_type="longrope",
                      ropes=(Rope(rope.base, factors=short, long_factors=long, orig_ctx=orig,
                                  mscale=m.positive("rope.scaling.attn_factor", 1.0, float)),))
    fields["layer_window"] = (m.window(),) * fields["n_layer"]
    return fields


def tensors(cfg):
    per_layer = {k: v for k, v in llama_tensors(cfg).items()
                 if not k.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate.", "ffn_up."))}
    per_layer["attn_qkv.weight"] = ((cfg.q_dim + 2 * cfg.kv_dim, cfg.n_embd),
                                    f"n_head={cfg.n_head}, n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}")
    per_layer["ffn_up.weight"] = ((2 * cfg.n_ff, cfg.n_embd), f"2 x n_ff={cfg.n_ff}, n_embd={cfg.n_embd}")
    return per_layer


def load_layer(cfg, tensor, opt, i: int):
    wq, wk, wv = QWeight.split(tensor(f"blk.{i}.attn_qkv.weight"), (cfg.q_dim, cfg.kv_dim, cfg.kv_dim))
    gate, up = QWeight.split(tensor(f"blk.{i}.ffn_up.weight"), (cfg.n_ff, cfg.n_ff))
    return llama_layer(tensor, opt, i, wq=wq, wk=wk, wv=wv, w_gate=gate, w_up=up)
