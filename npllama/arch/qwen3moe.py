"""Qwen 3 MoE: the Qwen 3 attention, and a mixture of SwiGLU experts for the FFN. A router
`ffn_gate_inp` scores the experts; each token takes the softmax over all of them, keeps the
top `expert_used_count`, renormalises those weights to sum to 1, and adds up its experts'
outputs so weighted. Expert FFNs are `expert_feed_forward_length` wide."""
from __future__ import annotations

from .base import Meta, llama_fields, llama_tensors, qk_norm_tensors
from .weights import QWeight, f32, llama_layer

NAMES = ("qwen3moe",)


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=True, dense=False)
    n_expert = m.positive("expert_count")
    n_used = m.positive("expert_used_count")
    if n_used > n_expert:
        raise m.error(f"'{m.arch}.expert_used_count' ({n_used}) exceeds '{m.arch}.expert_count' ({n_expert})")
    n_ff_exp = m.positive("expert_feed_forward_length")
    fields.update(qk_norm=True, n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_ff=n_ff_exp,
                  layer_window=(m.window(),) * fields["n_layer"])
    return fields


def tensors(cfg):
    per_layer = {k: v for k, v in llama_tensors(cfg).items() if not k.startswith(("ffn_gate.", "ffn_up.", "ffn_down."))}
    per_layer |= qk_norm_tensors(cfg)
    E, F, n = cfg.n_expert, cfg.n_ff_exp, cfg.n_embd
    why = f"n_expert={E}, n_ff_exp={F}, n_embd={n}"
    per_layer["ffn_gate_inp.weight"] = ((E, n), f"n_expert={E}, n_embd={n}")
    per_layer["ffn_gate_exps.weight"] = ((E, F, n), why)
    per_layer["ffn_up_exps.weight"] = ((E, F, n), why)
    per_layer["ffn_down_exps.weight"] = ((E, n, F), why)
    return per_layer


def load_layer(cfg, tensor, opt, i: int):
    gates, ups, downs = (QWeight.experts(tensor(f"blk.{i}.ffn_{w}_exps.weight")) for w in ("gate", "up", "down"))
    return llama_layer(tensor, opt, i, q_norm=f32(tensor(f"blk.{i}.attn_q_norm.weight")),
                       k_norm=f32(tensor(f"blk.{i}.attn_k_norm.weight")), w_gate=None, w_up=None, w_down=None,
                       router=QWeight.from_tensor(tensor(f"blk.{i}.ffn_gate_inp.weight")),
                       experts=tuple(zip(gates, ups, downs)))
