"""A model's weights as the executors use them: matrices kept in their GGUF block format
(`QWeight`, zero-copy views of the file) and one `Layer` per transformer block."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..kernels import quants


@dataclass(frozen=True)
class QWeight:
    """A weight matrix kept in its GGUF block format; products run directly on the blocks."""
    name: str
    data: np.ndarray  # (rows, row_bytes) uint8, a zero-copy view of the file
    qtype: int
    rows: int         # output features
    cols: int         # input features

    @classmethod
    def from_tensor(cls, t) -> "QWeight":
        rows, cols = t.shape
        data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
        return cls(t.name, data.reshape(rows, -1), t.qtype, rows, cols)

    @classmethod
    def split(cls, t, sizes: tuple[int, ...]) -> tuple["QWeight", ...]:
        """Row ranges of a fused matrix (Phi-3's attn_qkv, its gate|up ffn_up) as separate
        weights: each a view of consecutive whole rows, so still a contiguous view of the file."""
        whole = cls.from_tensor(t)
        out, r0 = [], 0
        for n in sizes:
            out.append(cls(f"{t.name}[{r0}:{r0 + n}]", whole.data[r0:r0 + n], t.qtype, n, whole.cols))
            r0 += n
        return tuple(out)

    @classmethod
    def experts(cls, t) -> tuple["QWeight", ...]:
        """The experts of a (n_expert, rows, cols) tensor, one weight each."""
        n_expert, rows, cols = t.shape
        data = t.data if t.data.dtype == np.uint8 else t.data.view(np.uint8)
        data = data.reshape(n_expert, rows, -1)
        return tuple(cls(f"{t.name}[{e}]", data[e], t.qtype, rows, cols) for e in range(n_expert))

    def __matmul__(self, x: np.ndarray) -> np.ndarray:
        """W @ x for x of shape (cols,), and x @ W.T for x of shape (S, cols)."""
        return quants.matmul(self.data, self.qtype, x)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows `ids` as float32 (len(ids), cols): an embedding lookup."""
        return quants.dequantize(self.data[ids], self.qtype).reshape(len(ids), self.cols)


@dataclass(frozen=True)
class Layer:
    """One block's weights. Which optional ones are present follows the ModelConfig. A norm
    is its weight (n_embd,), or with config.norm "layer" a (weight, bias) pair; with
    config.post_ln, attn_norm and ffn_norm norm the stream after each sublayer's add."""
    attn_norm: np.ndarray  # (n_embd,)
    wq: QWeight            # (n_head * head_dim, n_embd)
    wk: QWeight            # (n_head_kv * head_dim, n_embd)
    wv: QWeight            # (n_head_kv * head_dim, n_embd)
    wo: QWeight            # (n_embd, n_head * head_dim)
    ffn_norm: np.ndarray   # (n_embd,)
    w_gate: QWeight | None = None   # (n_ff, n_embd); None in a mixture-of-experts layer
    w_up: QWeight | None = None     # (n_ff, n_embd)
    w_down: QWeight | None = None   # (n_embd, n_ff)
    bq: np.ndarray | None = None    # Qwen2's q/k/v biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    bo: np.ndarray | None = None              # (n_embd,): the attention output's bias (BERT)
    b_up: np.ndarray | None = None            # (n_ff,): the ungated FFN's biases (BERT)
    b_down: np.ndarray | None = None          # (n_embd,)
    q_norm: np.ndarray | None = None          # (head_dim,): config.qk_norm
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None  # (n_embd,): config.post_norms
    post_ffn_norm: np.ndarray | None = None
    router: QWeight | None = None             # (n_expert, n_embd): config.n_expert
    experts: tuple[tuple[QWeight, QWeight, QWeight], ...] = ()  # (gate, up, down) per expert


@dataclass(frozen=True)
class EncoderWeights:
    """An encoder's weights outside its layers: what its input adds to the token embeddings,
    and a cross-encoder's classification head (over the first token's hidden state)."""
    position_embd: np.ndarray                 # (n_ctx, n_embd): absolute positions
    token_types: np.ndarray | None            # (n_types, n_embd): segment A / B; None: none
    embd_norm: tuple[np.ndarray, np.ndarray]  # LayerNorm (weight, bias) of the summed embeddings
    cls: QWeight | None = None                # (n_embd, n_embd): dense, then tanh (RoBERTa's head)
    cls_b: np.ndarray | None = None
    cls_out: QWeight | None = None            # (n_labels, n_embd): the scores
    cls_out_b: np.ndarray | None = None


def f32(t) -> np.ndarray:
    """A (small) tensor dequantized to float32 in its logical shape."""
    return quants.dequantize(t.data, t.qtype).reshape(t.shape)


def llama_layer(tensor, opt, i: int, **extra) -> Layer:
    """Layer i of a llama-style block from tensor(name) / opt(name) lookups (opt gives None
    for an absent tensor); `extra` overrides or adds fields."""
    def w(suffix):
        return QWeight.from_tensor(tensor(f"blk.{i}.{suffix}"))

    def vec(suffix):
        t = opt(f"blk.{i}.{suffix}")
        return f32(t) if t is not None else None

    fields = dict(
        attn_norm=f32(tensor(f"blk.{i}.attn_norm.weight")), ffn_norm=f32(tensor(f"blk.{i}.ffn_norm.weight")),
        bq=vec("attn_q.bias"), bk=vec("attn_k.bias"), bv=vec("attn_v.bias"),
    )
    fields.update(extra)
    for name, suffix in (("wq", "attn_q.weight"), ("wk", "attn_k.weight"), ("wv", "attn_v.weight"),
                         ("wo", "attn_output.weight"), ("w_gate", "ffn_gate.weight"), ("w_up", "ffn_up.weight"),
                         ("w_down", "ffn_down.weight")):
        if name not in fields:
            fields[name] = w(suffix)
    return Layer(**fields)
