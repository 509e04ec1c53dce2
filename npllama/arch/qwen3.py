"""Qwen 3: the llama block with per-head RMSNorm of q and k before RoPE (NeoX halves), no
biases; `attention.key_length` may differ from n_embd / n_head."""
from __future__ import annotations

from .base import Meta, llama_fields, llama_tensors, qk_norm_tensors
from .weights import f32, llama_layer

NAMES = ("qwen3",)


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=True)
    fields.update(qk_norm=True, layer_window=(m.window(),) * fields["n_layer"])
    return fields


def tensors(cfg):
    return llama_tensors(cfg) | qk_norm_tensors(cfg)


def load_layer(cfg, tensor, opt, i: int):
    return llama_layer(tensor, opt, i, q_norm=f32(tensor(f"blk.{i}.attn_q_norm.weight")),
                       k_norm=f32(tensor(f"blk.{i}.attn_k_norm.weight")))
