"""The llama block (SmolLM2, TinyLlama, Llama 2/3, Mistral, Qwen2): pre-norm attention and
SwiGLU FFN, RoPE on every layer (adjacent pairs; NeoX halves for Qwen2), optional q/k/v
biases (Qwen2), Llama 3's rope_freqs. Mistral converts to `llama`; a sliding window applies
only when the file has `llama.attention.sliding_window`."""
from __future__ import annotations

from .base import Meta, llama_fields, llama_tensors
from .weights import llama_layer

NAMES = ("llama", "mistral", "qwen2")


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=m.arch == "qwen2")
    fields["layer_window"] = (m.window(),) * fields["n_layer"]
    return fields


tensors = llama_tensors


def load_layer(cfg, tensor, opt, i: int):
    return llama_layer(tensor, opt, i)
