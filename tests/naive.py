"""A naive NumPy llama forward pass, written from the architecture's definition: the reference
that npllama's model is tested against on tiny random GGUF files. Float64 throughout, weights
dequantized with gguf.quants, full attention matrix with a causal mask."""
import numpy as np
import gguf


def _w(f, name):
    t = f.tensors[name]
    return gguf.quants.dequantize(np.asarray(t.data), t.qtype).reshape(t.shape).astype(np.float64)


def _rope(x, pos, base, neox, factors):
    d = x.shape[-1]
    inv = base ** (-np.arange(0, d, 2) / d)
    if factors is not None:
        inv = inv / factors
    rot = np.exp(1j * pos[:, None] * inv)[:, None, :]
    x = x.copy()
    if neox:
        z = (x[..., : d // 2] + 1j * x[..., d // 2:]) * rot
        x[..., : d // 2], x[..., d // 2:] = z.real, z.imag
    else:
        z = (x[..., 0::2] + 1j * x[..., 1::2]) * rot
        x[..., 0::2], x[..., 1::2] = z.real, z.imag
    return x


def forward(f, ids):
    """All logits (len(ids), n_vocab) of `ids` from position 0, for a GGUFFile `f`."""
    c = f.config
    S, H, KVH, D = len(ids), c.n_head, c.n_head_kv, c.head_dim
    pos = np.arange(S, dtype=np.float64)
    factors = _w(f, "rope_freqs.weight") if "rope_freqs.weight" in f.tensors else None

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + c.rms_eps) * w

    x = _w(f, "token_embd.weight")[ids]
    causal = np.triu(np.full((S, S), -np.inf), 1)
    for i in range(c.n_layer):
        p = f"blk.{i}."
        h = norm(x, _w(f, p + "attn_norm.weight"))
        q, k, v = (h @ _w(f, p + n + ".weight").T for n in ("attn_q", "attn_k", "attn_v"))
        if c.attn_bias:
            q, k, v = (a + _w(f, p + n + ".bias") for a, n in ((q, "attn_q"), (k, "attn_k"), (v, "attn_v")))
        q = _rope(q.reshape(S, H, D), pos, c.rope_base, c.rope_neox, factors)
        k = _rope(k.reshape(S, KVH, D), pos, c.rope_base, c.rope_neox, factors)
        v = v.reshape(S, KVH, D)
        k, v = np.repeat(k, H // KVH, axis=1), np.repeat(v, H // KVH, axis=1)  # fine in a reference
        scores = np.einsum("shd,thd->hst", q, k) / np.sqrt(D) + causal
        p_ = np.exp(scores - scores.max(-1, keepdims=True))
        p_ /= p_.sum(-1, keepdims=True)
        a = np.einsum("hst,thd->shd", p_, v).reshape(S, H * D)
        x = x + a @ _w(f, p + "attn_output.weight").T
        h = norm(x, _w(f, p + "ffn_norm.weight"))
        g, u = h @ _w(f, p + "ffn_gate.weight").T, h @ _w(f, p + "ffn_up.weight").T
        x = x + (g / (1 + np.exp(-g)) * u) @ _w(f, p + "ffn_down.weight").T
    out = _w(f, "token_embd.weight") if c.tied_output else _w(f, "output.weight")
    return norm(x, _w(f, "output_norm.weight")) @ out.T
