"""The transformer block as its `ModelConfig` describes it, for many tokens at once: the
prefill path (Model.forward) and the batched path (batch.forward_batch) both run
`run_layers`, and differ only in the `Ops` they pass (how products, norms, RoPE and
attention are computed). The fused single-token step (decode.py) and the compiled layers
that both paths take for models whose products all have panels (packed.py) read the same
description in compiled code.

Per layer, with the flags of the description:
    h = norm(x)                               attn_norm
    q, k, v = products of h (+ biases)        split views of a fused qkv are separate weights
    q, k = norm per head                      qk_norm (Gemma 3, Qwen 3)
    q, k = RoPE with table layer_rope[i]      none when layer_rope[i] == -1 (NoPE)
    a = attention(q, k, v)                    window layer_window[i], scale attn_scale
    x += post_norm(wo a)                      post_norms (Gemma 3), else wo a
    h = norm(x)                               ffn_norm
    x += post_norm(ffn(h))                    down(act(gate h) * up h), or a mixture of experts
An encoder (BERT: post_ln, norm "layer", gated_ffn False) norms after each add instead:
    x = norm(x + wo a + bo)                   attn_norm, attention bidirectional (causal False)
    x = norm(x + down(gelu(up x + b_up)) + b_down)    ffn_norm
"""
from __future__ import annotations

import weakref

import numpy as np

from ..kernels.nn import _rope, gelu, glu, layernorm, rmsnorm
from ..kernels.qtypes import TypeMask, kernel_types

_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def kernel_mask(model) -> TypeMask:
    """The type mask (kernels/qtypes.py) of the compiled kernels that read `model`'s weights
    (the decode step, the packed pass, PanelOps' products): the groups of the types of its
    product weights and its token embedding. Made once a model (a batched pass makes its
    PanelOps anew)."""
    mask = _MASKS.get(model)
    if mask is None:
        mask = _MASKS[model] = kernel_types([w.qtype for w in model.product_weights()] + [model.token_embd.qtype])
    return mask


class Ops:
    """The prefill path's pieces: `product(W, h)` is the caller's (h @ W.T), `attention(li,
    q, k, v, window)` stores layer li's new keys and values and returns the output (S, H, D).
    A subclass may define either as a method instead (pass None): an Ops that held its own
    bound method would live in a cycle, and hold its cache, until the collector ran."""

    def __init__(self, cfg, product=None, attention=None):
        self.cfg = cfg
        if product is not None:
            self.product = product
        if attention is not None:
            self.attention = attention

    def norm(self, x, w):
        """RMSNorm by w, or with config.norm "layer" LayerNorm by w = (weight, bias)."""
        if self.cfg.norm == "layer":
            return layernorm(x, w[0], w[1], self.cfg.rms_eps)
        return rmsnorm(x, w, self.cfg.rms_eps)

    def mlp(self, L, h):
        """The ungated FFN: down(gelu(up h + b_up)) + b_down."""
        u = self.product(L.w_up, h)
        self.add(u, L.b_up)
        y = self.product(L.w_down, gelu(u, out=u))
        self.add(y, L.b_down)
        return y

    def qkv(self, L, h):
        return self.product(L.wq, h), self.product(L.wk, h), self.product(L.wv, h)

    def glu(self, gate, up, h):
        """act(h @ gate.T) * (h @ up.T), the FFN's hidden activations."""
        g = self.product(gate, h)
        return glu(g, self.product(up, h), self.cfg.act, out=g)

    def qk_norm(self, q, k, wq, wk):
        """q (S, H, D) and k (S, KVH, D), each head normed by wq and wk (the QK norms)."""
        return self.norm(q, wq), self.norm(k, wk)

    def rope(self, q, k, positions, cos, sin):
        """q (S, H, D) and k (S, KVH, D) rotated in place by the tables' rows at `positions`."""
        for x in (q, k):
            _rope(x, positions, cos, sin, self.cfg.rope_neox)

    def rope_attention(self, li, q, k, v, rope, window):
        """`attention` of layer li after RoPE of q and k by rope = (positions, cos, sin), or
        none where rope is None (a layer without RoPE)."""
        if rope is not None:
            self.rope(q, k, *rope)
        return self.attention(li, q, k, v, window)

    def residual(self, x, y, w):
        """x += y normed by w (a post-norm), or x += y where w is None; in place."""
        x += y if w is None else self.norm(y, w)

    def add_product(self, x, W, h, w):
        """`residual` of the product h @ W.T."""
        self.residual(x, self.product(W, h), w)

    def add(self, x, b):
        """x += b in place (a bias, broadcast over rows)."""
        x += b


def embed(model, ids: np.ndarray, positions: np.ndarray | None = None, types: np.ndarray | None = None) -> np.ndarray:
    """The residual stream's start: token embeddings (S, n_embd), scaled as the architecture says;
    an encoder's (model.encoder) plus those of `positions` and token `types`, LayerNormed."""
    x = model.token_embd.rows_of(ids)
    if model.config.embd_scale != 1.0:
        x *= np.float32(model.config.embd_scale)
    enc = model.encoder
    if enc is not None:
        x += enc.position_embd[positions]
        if enc.token_types is not None:
            x += enc.token_types[types]
        x = layernorm(x, *enc.embd_norm, model.config.rms_eps, out=x)
    return x


def run_layers(model, x: np.ndarray, positions: np.ndarray, ops: Ops, end: int) -> np.ndarray:
    """The residual stream x (S, n_embd) of tokens at `positions` through every layer (in
    place); `end`: one past the call's last position (LongRoPE chooses its factors by it)."""
    cfg = model.config
    S, H, KVH, D = x.shape[0], cfg.n_head, cfg.n_head_kv, cfg.head_dim
    cos, sin = model.ropes.tables(end)
    for li, L in enumerate(model.layers):
        h = x if cfg.post_ln else ops.norm(x, L.attn_norm)
        q, k, v = ops.qkv(L, h)  # (S, H*D), (S, KVH*D) x 2
        if L.bq is not None:
            ops.add(q, L.bq)
            ops.add(k, L.bk)
            ops.add(v, L.bv)
        q, k, v = q.reshape(S, H, D), k.reshape(S, KVH, D), v.reshape(S, KVH, D)
        if cfg.qk_norm:
            q, k = ops.qk_norm(q, k, L.q_norm, L.k_norm)
        table = cfg.layer_rope[li]
        rope = (positions, cos[table], sin[table]) if table >= 0 else None
        a = ops.rope_attention(li, q, k, v, rope, cfg.layer_window[li])
        if cfg.post_ln:
            _add_norm(ops, x, ops.product(L.wo, a.reshape(S, H * D)), L.bo, L.attn_norm)
            del q, k, v, a
            _add_norm(ops, x, ops.mlp(L, x), None, L.ffn_norm)
            continue
        ops.add_product(x, L.wo, a.reshape(S, H * D), L.post_attn_norm if cfg.post_norms else None)
        del q, k, v, a  # a long prompt's chunk: the FFN's activations are the peak
        h = ops.norm(x, L.ffn_norm)
        post = L.post_ffn_norm if cfg.post_norms else None
        if cfg.n_expert:
            ops.residual(x, moe(cfg, L, h, ops), post)
        else:
            ops.add_product(x, L.w_down, ops.glu(L.w_gate, L.w_up, h), post)
    return x


def _add_norm(ops: Ops, x: np.ndarray, y: np.ndarray, b, w) -> None:
    """x = norm(x + y (+ b)) in place: a post-LN sublayer's end."""
    x += y
    if b is not None:
        ops.add(x, b)
    x[...] = ops.norm(x, w)


def moe(cfg, L, h: np.ndarray, ops: Ops) -> np.ndarray:
    """A mixture of experts for tokens h (S, n_embd): softmax over the router's scores, the
    top n_expert_used experts, their weights renormalised to sum to 1, and the sum of their
    GLU FFNs so weighted. Each expert runs once on the tokens routed to it."""
    scores = ops.product(L.router, h)  # (S, n_expert)
    p = np.exp(scores - scores.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :cfg.n_expert_used]  # (S, k), best first
    w = np.take_along_axis(p, top, axis=1)
    w /= w.sum(axis=1, keepdims=True)
    out = np.zeros_like(h)
    for e in np.unique(top):
        rows, slot = np.nonzero(top == e)
        gate, up, down = L.experts[e]
        y = ops.product(down, ops.glu(gate, up, np.ascontiguousarray(h[rows])))
        out[rows] += w[rows, slot, None] * y
    return out


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    """cap * tanh(logits / cap) in place (the final logit soft-cap; nothing when cap is 0)."""
    if cap:
        c = np.float32(cap)
        np.divide(logits, c, out=logits)
        np.tanh(logits, out=logits)
        logits *= c
    return logits
