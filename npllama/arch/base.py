"""The model description every executor reads (`ModelConfig`), and what the architecture
modules share: checked metadata access (`Meta`), the llama block's keys and tensors."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import GGUFError

_REQUIRED = object()


@dataclass(frozen=True)
class Rope:
    """One RoPE table: frequency i of a rotary dimension `dim` is base ** (-2i / dim), divided
    by the tensor `factors` when named (Llama 3's rope_freqs, LongRoPE's short factors);
    positions are divided by `linear`; cos and sin are multiplied by `mscale` (LongRoPE's
    attention factor). With `long_factors`, a forward call whose last position reaches past
    `orig_ctx` uses those factors instead, as HF's LongRoPE does."""
    base: float
    linear: float = 1.0
    factors: str | None = None
    long_factors: str | None = None
    orig_ctx: int = 0
    mscale: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The hyperparameters of a model and what its blocks compute, read from GGUF metadata
    by its architecture module and checked. Every executor reads this and nothing else."""

    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    n_ctx: int                       # training context length
    rope_base: float                 # the (first) RoPE table's base, as the file gives it
    rope_dim: int                    # rotary dimensions of each head (partial rotary: < head_dim)
    rope_scaling_type: str | None    # None, 'linear', 'longrope', ... as the file names it
    rope_scaling_factor: float
    rope_neox: bool                  # True: rotate halves (NeoX); False: adjacent pairs (llama)
    rms_eps: float                   # the norms' epsilon (RMSNorm's, or LayerNorm's with norm="layer")
    tied_output: bool                # no output.weight: the output projection is token_embd
    attn_bias: bool                  # q/k/v biases present (qwen2)
    has_rope_freqs: bool             # rope_freqs.weight present (llama 3 rope scaling)
    # --- what the block computes (the llama block unless an architecture says otherwise) ---
    act: str = "silu"                # FFN activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False            # per-head RMSNorm of q and k before RoPE
    post_norms: bool = False         # RMSNorm of the attention and FFN outputs before each residual add
    embd_scale: float = 1.0          # token embeddings multiplied by this
    attn_scale: float = 0.0          # scores scaled by this (set by every architecture; 1/sqrt(head_dim) usually)
    softcap: float = 0.0             # > 0: final logits become softcap * tanh(logits / softcap)
    ropes: tuple[Rope, ...] = ()     # the RoPE tables
    layer_rope: tuple[int, ...] = ()    # per layer: index into ropes, or -1 for a layer without RoPE
    layer_window: tuple[int, ...] = ()  # per layer: query p sees keys t with p - t < window; 0: all t <= p
    n_expert: int = 0                # mixture of experts: experts per layer (0: a dense FFN)
    n_expert_used: int = 0           # experts each token is routed to
    n_ff_exp: int = 0                # the FFN width of one expert
    # --- encoders (BERT) and embedding models ---
    causal: bool = True              # False: bidirectional attention (an encoder: it embeds, never generates)
    norm: str = "rms"                # "layer": LayerNorm with a bias (its weights a (weight, bias) pair)
    post_ln: bool = False            # each sublayer's output added to x, then x normed (BERT): no pre-norms
    gated_ffn: bool = True           # False: down(act(up h + b_up)) + b_down, act "gelu" (erf)
    pooling: str | None = None       # '{arch}.pooling_type': "none", "mean", "cls", "last" or "rank"; None if absent

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim


def read_key(path: str, metadata: dict, key: str, kind: type, default=_REQUIRED):
    """metadata[key] checked to be `kind` (int, float, str or bool); `default` if absent, else GGUFError."""
    value = metadata.get(key, _REQUIRED)
    if value is _REQUIRED:
        if default is _REQUIRED:
            raise GGUFError(f"{path}: missing required metadata key '{key}'")
        return default
    accepted = (int, float) if kind is float else kind
    if not isinstance(value, accepted) or (isinstance(value, bool) and kind is not bool):
        raise GGUFError(f"{path}: metadata key '{key}' should be {kind.__name__} but is {type(value).__name__}")
    if kind is float:
        value = float(value)
        if not math.isfinite(value):
            raise GGUFError(f"{path}: metadata key '{key}' is {value}; it must be finite")
    return value


class Meta:
    """Checked access to one file's metadata and tensor table, for an architecture module."""

    def __init__(self, path: str, metadata: dict, tensors: dict, arch: str):
        self.path, self.metadata, self.tensors, self.arch = path, metadata, tensors, arch

    def error(self, message: str) -> GGUFError:
        return GGUFError(f"{self.path}: {message}")

    def has(self, suffix: str) -> bool:
        return f"{self.arch}.{suffix}" in self.metadata

    def get(self, suffix: str, kind: type, default=_REQUIRED):
        """The value of '{arch}.{suffix}', checked to be `kind`; `default` if absent."""
        return read_key(self.path, self.metadata, f"{self.arch}.{suffix}", kind, default)

    def positive(self, suffix: str, default=_REQUIRED, kind: type = int):
        """A positive '{arch}.{suffix}'; `default` (unchecked) if absent and one is given."""
        if default is not _REQUIRED and not self.has(suffix):
            return default
        value = self.get(suffix, kind)
        if value <= 0:
            raise self.error(f"metadata key '{self.arch}.{suffix}' is {value}; it must be positive")
        return value

    def window(self) -> int:
        """'{arch}.attention.sliding_window': how many keys a query of a sliding layer sees
        (itself included), 0 when absent."""
        window = self.get("attention.sliding_window", int, 0)
        if window < 0:
            raise self.error(f"metadata key '{self.arch}.attention.sliding_window' is {window}; it must be >= 0")
        return window


POOLING = ("none", "mean", "cls", "last", "rank")  # llama.cpp's pooling types, by their number


def pooling(m: Meta) -> str | None:
    """'{arch}.pooling_type' by name (POOLING), None when the file has none."""
    kind = m.get("pooling_type", int, None)
    if kind is None:
        return None
    if not 0 <= kind < len(POOLING):
        raise m.error(f"metadata key '{m.arch}.pooling_type' is {kind}; known pooling types are "
                      f"{', '.join(f'{i} ({p})' for i, p in enumerate(POOLING))}")
    return POOLING[kind]


def llama_fields(m: Meta, *, neox: bool, dense: bool = True) -> dict:
    """The ModelConfig fields every architecture here shares with the llama block: sizes,
    heads, RMSNorm epsilon, one RoPE table (with linear scaling and Llama 3's rope_freqs),
    and full causal attention in every layer. `dense=False`: the FFN width may be absent
    (a mixture of experts gives its own)."""
    n_layer = m.positive("block_count")
    if n_layer > len(m.tensors):  # every layer has tensors; checked before anything is made per layer
        raise m.error(f"'{m.arch}.block_count' is {n_layer} but the file has only {len(m.tensors)} tensors")
    n_embd = m.positive("embedding_length")
    n_head = m.positive("attention.head_count")
    n_head_kv = m.positive("attention.head_count_kv", n_head)
    if n_head % n_head_kv:
        raise m.error(f"n_head ({n_head}) is not divisible by n_head_kv ({n_head_kv})")
    if not m.has("attention.key_length") and n_embd % n_head:
        raise m.error(f"n_embd ({n_embd}) is not divisible by n_head ({n_head}) "
                      f"and there is no '{m.arch}.attention.key_length'")
    head_dim = m.positive("attention.key_length", n_embd // n_head)
    value_dim = m.positive("attention.value_length", head_dim)
    if value_dim != head_dim:
        raise m.error(f"'{m.arch}.attention.value_length' ({value_dim}) differs from the key length "
                      f"({head_dim}); npllama needs them equal")
    rope_dim = m.positive("rope.dimension_count", head_dim)
    if rope_dim > head_dim or rope_dim % 2:
        raise m.error(f"rope dimension count {rope_dim} must be even and at most head_dim ({head_dim})")
    if "token_embd.weight" not in m.tensors:
        raise m.error("missing required tensor 'token_embd.weight'")
    tokens = m.metadata.get("tokenizer.ggml.tokens")
    default_vocab = len(tokens) if isinstance(tokens, Sequence) and not isinstance(tokens, str) \
        else m.tensors["token_embd.weight"].shape[0]
    rope_base = m.positive("rope.freq_base", 10000.0, float)
    rms_eps = m.positive("attention.layer_norm_rms_epsilon", kind=float)
    scaling_type = m.get("rope.scaling.type", str, None)
    scaling_factor = m.get("rope.scaling.factor", float, 0.0)
    linear_scale = m.get("rope.scale_linear", float, 0.0)  # older files
    if linear_scale and scaling_type is None:
        scaling_type, scaling_factor = "linear", linear_scale
    if scaling_factor < 0:
        raise m.error(f"rope scaling factor {scaling_factor} is negative")
    scaling_type = None if scaling_type == "none" else scaling_type
    scaling_factor = scaling_factor or 1.0  # llama.cpp reads 0 as "no scaling"
    if scaling_type not in (None, "linear"):
        raise m.error(f"RoPE scaling '{scaling_type}' is not supported for architecture '{m.arch}' "
                      f"(npllama applies none, 'linear', Llama 3's rope_freqs and Phi-3's LongRoPE)")
    has_freqs = "rope_freqs.weight" in m.tensors
    rope = Rope(rope_base, scaling_factor if scaling_type == "linear" else 1.0,
                factors="rope_freqs.weight" if has_freqs else None)
    return dict(
        arch=m.arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        n_ff=m.positive("feed_forward_length") if dense else m.positive("feed_forward_length", 0), n_vocab=m.positive("vocab_size", default_vocab),
        n_ctx=m.positive("context_length"), rope_base=rope_base, rope_dim=rope_dim,
        rope_scaling_type=scaling_type, rope_scaling_factor=scaling_factor, rope_neox=neox, rms_eps=rms_eps,
        tied_output="output.weight" not in m.tensors, attn_bias="blk.0.attn_q.bias" in m.tensors,
        has_rope_freqs=has_freqs, attn_scale=1.0 / math.sqrt(head_dim), ropes=(rope,),
        layer_rope=(0,) * n_layer, layer_window=(0,) * n_layer, pooling=pooling(m),
    )


def llama_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The llama block's per-layer tensors: suffix -> (shape, the config values it follows)."""
    heads = f"n_head={cfg.n_head}, head_dim={cfg.head_dim}, n_embd={cfg.n_embd}"
    kv_heads = f"n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}, n_embd={cfg.n_embd}"
    ffn = f"n_ff={cfg.n_ff}, n_embd={cfg.n_embd}"
    per_layer = {
        "attn_norm.weight": ((cfg.n_embd,), f"n_embd={cfg.n_embd}"),
        "attn_q.weight": ((cfg.q_dim, cfg.n_embd), heads),
        "attn_k.weight": ((cfg.kv_dim, cfg.n_embd), kv_heads),
        "attn_v.weight": ((cfg.kv_dim, cfg.n_embd), kv_heads),
        "attn_output.weight": ((cfg.n_embd, cfg.q_dim), heads),
        "ffn_norm.weight": ((cfg.n_embd,), f"n_embd={cfg.n_embd}"),
        "ffn_gate.weight": ((cfg.n_ff, cfg.n_embd), ffn),
        "ffn_up.weight": ((cfg.n_ff, cfg.n_embd), ffn),
        "ffn_down.weight": ((cfg.n_embd, cfg.n_ff), ffn),
    }
    if cfg.attn_bias:
        per_layer["attn_q.bias"] = ((cfg.q_dim,), f"n_head={cfg.n_head}, head_dim={cfg.head_dim}")
        per_layer["attn_k.bias"] = ((cfg.kv_dim,), f"n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}")
        per_layer["attn_v.bias"] = ((cfg.kv_dim,), f"n_head_kv={cfg.n_head_kv}, head_dim={cfg.head_dim}")
    return per_layer


def qk_norm_tensors(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """The per-head q and k RMSNorm weights (Gemma 3, Qwen 3)."""
    why = f"head_dim={cfg.head_dim}"
    return {"attn_q_norm.weight": ((cfg.head_dim,), why), "attn_k_norm.weight": ((cfg.head_dim,), why)}
