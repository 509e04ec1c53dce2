"""`npllama.Model`: a loaded model with the text API as methods, and `load()`.

The engine (npllama.engine.Transformer) computes logits from token ids; the generation layer
(npllama.generation) turns them into text. This class joins the two for users, and nothing
inside npllama depends on it, so data flows one way: file -> weights -> session -> kernels ->
logits -> sampler -> text.
"""
from __future__ import annotations

import os

from .engine.transformer import Transformer
from .generation import api, beam, embedding

__all__ = ["Model", "load"]


class Model(Transformer):
    __doc__ = Transformer.__doc__

    generate = api.generate
    complete = api.complete_text
    chat = api.chat
    score = api.score
    perplexity = api.perplexity
    embed = embedding.embed
    rerank = embedding.rerank
    generate_batch = api.generate_batch
    beam_search = beam.beam_search

    def chat_session(self, **options) -> api.ChatSession:
        """A multi-turn conversation that keeps its KV cache between turns."""
        return api.ChatSession(self, **options)


def load(path: str | os.PathLike | None = None, *, threads: int | None = None, activations: str = "f32",
         kv_dtype=None, device: str = "cpu") -> Model:
    """Load a GGUF model: `path`, else $NPLLAMA_MODEL, else the default model (fetched once).

    `activations="int8"` quantizes the products' activations to int8 blocks (llama.cpp's
    arithmetic: faster, and no longer exact). The default, "f32", is the exact mode: the
    weights are dequantized exactly and the activations keep float32's precision (integers of
    24 bits per block of 32, kernels/panels.py), so the products agree with a float64 dot as
    a float32 dot does. `kv_dtype` is the KV cache's storage, float32 or float16 (half the memory and
    half the bytes attention reads, keys and values rounded to float16); by default float16
    with int8 activations, as llama.cpp, and float32 otherwise.

    `device="cuda"` computes on the GPU (npllama.backends.cuda; `pip install 'npllama[cuda]'`)
    with the same API, logits coming back as NumPy arrays; DeviceError (a RuntimeError) where
    there is no usable CUDA device. With NUMBA_ENABLE_CUDASIM=1 it runs in Numba's simulator.
    """
    from .gguf.hub import resolve_model
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if device == "cuda":
        from .backends import cuda
        return cuda.load(resolve_model(path), threads=threads, activations=activations, kv_dtype=kv_dtype)
    return Model(resolve_model(path), threads=threads, activations=activations, kv_dtype=kv_dtype)
