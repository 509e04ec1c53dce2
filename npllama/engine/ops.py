"""How the block's pieces are computed for many tokens at once: `PanelOps`, the prefill's
and the batched pass's (a model whose products all take whole blocks of 32).

The products of weights with panel kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K:
kernels/panels.py) run on the weight's panels, which the model packs at first use
(`Transformer.panels`), their input rows quantized to int24 blocks (the exact mode) or
(int8=True) int8 ones, once for q/k/v and once for gate/up. The other weights' products run on
their GGUF blocks by the row kernels of kernels/rows.py. Either way q/k/v share one parallel
region and gate/up another with the activation, whose output is the FFN's only (T, n_ff)
array; norms and RoPE run per token, serially. Each token's products depend only on its own
row, so a token gives the same results in a batch as alone, and as in the decode step, which
reads the same kernels.
"""
from __future__ import annotations

import numpy as np

from ..kernels import aligned
from ..kernels.nn import ACTS
from ..kernels.panels import _gate_up_panels, _matmul_panels, _qkv_panels, activation_rows
from ..kernels.rows import _gate_up_rows, _matmul_rows, _qkv_rows, _rmsnorm_rows, _rope_rows
from . import block

__all__ = ["PanelOps", "fits_rows"]


def fits_rows(cfg) -> bool:
    """Whether the row kernels can compute `cfg`'s products: every product's input is whole
    blocks of 32 (else they take the tiled-dequant + BLAS path)."""
    dims = (cfg.n_embd, cfg.q_dim) + ((cfg.n_ff_exp,) if cfg.n_expert else (cfg.n_ff,))
    return all(n % 32 == 0 for n in dims)


def _product_rows(mask, w, h):
    """h @ w.T by the row kernels (h: T contiguous float32 rows; mask: the model's type mask)."""
    out = np.empty((h.shape[0], w.rows), np.float32)
    _matmul_rows(mask, int(w.qtype), w.data, np.ascontiguousarray(h), out)
    return out


class PanelOps(block.Ops):
    """The block's pieces (the module's docstring); `model.panels(w)` gives a weight's panels,
    or None for a weight without them. The kernels hold the code of the types of the model's
    weights (`block.kernel_mask`)."""

    def __init__(self, model, attention, *, int8: bool):
        super().__init__(model.config, attention=attention)
        self.eps = np.float32(model.config.rms_eps)
        self.act = ACTS[model.config.act]
        self.panels, self.int8 = model.panels, int8
        self.mask = block.kernel_mask(model)

    def product(self, w, h):
        pw = self.panels(w)
        if pw is None:
            return _product_rows(self.mask, w, h)
        xr = activation_rows(h, self.int8)
        out = aligned.empty((h.shape[0], w.rows), np.float32)  # a panel's rows on cache lines
        _matmul_panels(self.mask, int(w.qtype), pw, w.rows, xr, out)
        return out

    def norm(self, x, w):
        x2 = x.reshape(-1, x.shape[-1])
        out = np.empty_like(x2)
        _rmsnorm_rows(x2, w, self.eps, out)
        return out.reshape(x.shape)

    def qkv(self, L, h):
        pq, pk, pv = ps = [self.panels(w) for w in (L.wq, L.wk, L.wv)]
        rows = all(p is None for p in ps)
        if not rows and any(p is None for p in ps):  # some with panels, some without: one product each
            return block.Ops.qkv(self, L, h)
        T = h.shape[0]
        q = aligned.empty((T, L.wq.rows), np.float32)
        k = aligned.empty((T, L.wk.rows), np.float32)
        v = aligned.empty((T, L.wv.rows), np.float32)
        if rows:
            _qkv_rows(self.mask, int(L.wq.qtype), L.wq.data, int(L.wk.qtype), L.wk.data, int(L.wv.qtype), L.wv.data,
                      h, q, k, v)
        else:
            _qkv_panels(self.mask, int(L.wq.qtype), pq, int(L.wk.qtype), pk, int(L.wv.qtype), pv,
                        activation_rows(h, self.int8), q, k, v)
        return q, k, v

    def glu(self, gate, up, h):
        pg, pu = self.panels(gate), self.panels(up)
        if (pg is None) != (pu is None):  # one with panels, one without: one product each
            return block.Ops.glu(self, gate, up, h)
        out = aligned.empty((h.shape[0], gate.rows), np.float32)
        if pg is None:
            _gate_up_rows(self.mask, int(gate.qtype), gate.data, int(up.qtype), up.data, h, out, self.act)
        else:
            _gate_up_panels(self.mask, int(gate.qtype), pg, int(up.qtype), pu, activation_rows(h, self.int8), out,
                            self.act)
        return out

    def rope(self, q, k, positions, cos, sin):
        for x in (q, k):
            _rope_rows(x, positions, cos, sin, self.cfg.rope_neox)
