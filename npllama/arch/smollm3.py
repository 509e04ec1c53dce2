"""SmolLM3: the llama block, except that every 4th layer ((i + 1) % 4 == 0) has no RoPE
(NoPE). The period is fixed by the architecture (llama.cpp fixes it too; the file does not
carry it)."""
from __future__ import annotations

from .base import Meta, llama_fields, llama_tensors
from .weights import llama_layer

NAMES = ("smollm3",)
_NO_ROPE_PERIOD = 4


def configure(m: Meta) -> dict:
    fields = llama_fields(m, neox=False)
    n = fields["n_layer"]
    fields.update(layer_rope=tuple(-1 if (i + 1) % _NO_ROPE_PERIOD == 0 else 0 for i in range(n)),
                  layer_window=(m.window(),) * n)
    return fields


tensors = llama_tensors


def load_layer(cfg, tensor, opt, i: int):
    return llama_layer(tensor, opt, i)
