"""Gemma 3: a llama-shaped block with
- token embeddings scaled by sqrt(n_embd); the output head is the tied, unscaled embedding;
- RMSNorm of the attention and of the FFN output before each residual add (post-norms);
- per-head RMSNorm of q and k before RoPE, which rotates NeoX halves;
- a GeGLU FFN: down(gelu_tanh(gate x) * up x);
- sliding-window layers: layer i slides unless i % 6 == 5 (or as
  `gemma3.attention.sliding_window_pattern` says: a period, or one bool per layer); they use
  RoPE base `rope.freq_base_swa` (default 10000) without scaling, the global layers
  `rope.freq_base` with the file's linear scaling;
- logits soft-capped only when `gemma3.final_logit_softcapping` is present.
llama.cpp's converter stores every norm weight as 1 + w (HF's Gemma RMSNorm), so they are
used as they are. Scores are scaled by query_pre_attn_scalar ** -0.5, which the file does not
carry: 1/sqrt(head_dim) for every Gemma 3 but the 27B (62 layers), 1/sqrt(n_embd / n_head)
for it, as llama.cpp and the HF configs have it.
"""
from __future__ import annotations

import math

import numpy as np

from .base import Meta, Rope, llama_fields, llama_tensors, qk_norm_tensors
from .weights import f32, llama_layer

NAMES = ("gemma3",)
_PERIOD = 6  # the default pattern: five sliding layers, then a global one


def _sliding(m: Meta, n_layer: int) -> tuple[bool, ...]:
    """Which layers slide: `sliding_window_pattern` as a period or per-layer bools, else i % 6 != 5."""
    pattern = m.metadata.get("gemma3.attention.sliding_window_pattern")
    if pattern is None:
        pattern = _PERIOD
    if isinstance(pattern, np.ndarray):
        if pattern.shape != (n_layer,):
            raise m.error(f"'gemma3.attention.sliding_window_pattern' has {pattern.size} entries; "
                          f"it needs one per layer ({n_layer})")
        return tuple(bool(p) for p in pattern)
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
        raise m.error(f"'gemma3.attention.sliding_window_pattern' is {pattern!r}; it must be a positive "
                      f"period or one bool per layer")
    return tuple(i % pattern != pattern - 1 for i in range(n_layer))


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=True)
    n_layer, head_dim = fields["n_layer"], fields["head_dim"]
    # scores scale by query_pre_attn_scalar ** -0.5, which the file does not carry: it is
    # head_dim in every Gemma 3 but the 27B (62 layers), where it is n_embd / n_head
    scalar = fields["n_embd"] / fields["n_head"] if n_layer == 62 else head_dim
    window = m.window()
    if not window:
        raise m.error("missing required metadata key 'gemma3.attention.sliding_window'")
    sliding = _sliding(m, n_layer)
    rope_global = fields["ropes"][0]
    rope_local = Rope(m.positive("rope.freq_base_swa", 10000.0, float))
    softcap = m.positive("final_logit_softcapping", 0.0, float)
    fields.update(
        act="gelu_tanh", qk_norm=True, post_norms=True, embd_scale=math.sqrt(fields["n_embd"]),
        attn_scale=1.0 / math.sqrt(scalar), softcap=softcap, ropes=(rope_global, rope_local),
        layer_rope=tuple(1 if s else 0 for s in sliding),
        layer_window=tuple(window if s else 0 for s in sliding),
    )
    return fields


def tensors(cfg):
    per_layer = llama_tensors(cfg) | qk_norm_tensors(cfg)
    embd = ((cfg.n_embd,), f"n_embd={cfg.n_embd}")
    per_layer["post_attention_norm.weight"] = embd
    per_layer["post_ffw_norm.weight"] = embd
    return per_layer


def load_layer(cfg, tensor, opt, i: int):
    def vec(suffix):
        return f32(tensor(f"blk.{i}.{suffix}"))

    return llama_layer(tensor, opt, i, q_norm=vec("attn_q_norm.weight"), k_norm=vec("attn_k_norm.weight"),
                       post_attn_norm=vec("post_attention_norm.weight"), post_ffn_norm=vec("post_ffw_norm.weight"))
