"""Architectures: what a transformer block computes, described once and read by every executor.

Each supported architecture is a small module here (llama.py, gemma3.py, qwen3.py, ...) with
    NAME       the GGUF `general.architecture` it reads
    configure  metadata -> the architecture's fields of the `ModelConfig` (base.py)
    tensors    the per-layer tensors it needs, with their shapes
    load_layer the weights of one layer, fused tensors split into views of the file
An encoder's module (bert.py) also has `model_tensors` (its required tensors outside the
layers) and `load_model` (their weights: npllama.arch.weights.EncoderWeights).
The prefill path (Model.forward), the batched path (batch.forward_batch) and the fused decode
step (decode.DecodePlan) all read the same `ModelConfig`: its flags (norm placement, QK-norm,
activation, RoPE tables and which layer uses which, sliding windows, attention and embedding
scales, logit soft-cap, experts) are the whole difference between architectures.
"""
from __future__ import annotations

from . import bert, gemma3, llama, phi3, qwen3, qwen3moe, smollm3
from .base import ModelConfig, Rope

_MODULES = (llama, gemma3, qwen3, qwen3moe, smollm3, phi3, bert)
ARCHS = {name: m for m in _MODULES for name in m.NAMES}
SUPPORTED_ARCHS = tuple(ARCHS)

__all__ = ["ARCHS", "SUPPORTED_ARCHS", "ModelConfig", "Rope"]
