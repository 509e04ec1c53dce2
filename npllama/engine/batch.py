"""Batched inference over a paged KV pool: one forward pass for many sequences.

Packed variable-length batches
------------------------------
`forward_batch(model, pool, seqs, token_lists)` runs B sequences of different lengths, each
feeding any number of new tokens, in ONE forward pass. The new tokens of all sequences are
concatenated into one (T, n_embd) activation, so each weight takes part in one product per
layer (T rows) instead of B products: the weights stream from memory once per step, which
is where batching gains on a CPU. Each token carries its own absolute position (RoPE is
applied per token) and the index of its sequence; its key and value are scattered into its
sequence's pool slots in place, and attention (paged_attention.py) reads every sequence's
keys through its page table. There is no padding, so no mask: a token of sequence b at
position p sees exactly positions 0..p of sequence b. (`batch_mask` shows the padded
alternative, for callers of `attention.attend`.)

Products: the packed activations go through the panel kernels (engine/ops.py: PanelOps, with
int24 or int8 activations; the row kernels for weights without panels), which read every
weight once per pass (q/k/v share one parallel region, gate/up and the GLU another; the
per-token norms and RoPE run serially); where every layer product has panels, the layers run
in one compiled call and one parallel region (engine/packed.py: the same routines on the same
rows, so the same bits; a 16-sequence int8 decode pass 0.85-0.88x the time). Passes run in
chunks of CHUNK_TOKENS packed tokens (a later chunk attends to keys an earlier one wrote),
which keeps the activations in cache. Weights whose sizes are not whole 32-element blocks
take the tiled-dequant + BLAS path, as Model.forward's prefill does. A model on a CUDA device
runs the pass itself (`CudaModel.forward_packed`), over a pool whose pages are in device memory
(`KVPool.for_model` makes it on the model's device).

Continuous batching (generation/scheduler.py) and beam search (generation/beam.py) step
many sequences through `forward_batch`.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..cache.kvpool import KVPool, PoolSeq
from ..kernels.attention import MASKED
from ..kernels.f16 import bits
from ..kernels.paged_attention import _paged_kernel, plan_blocks
from ..kernels.rows import _rmsnorm_rows
from ..kernels.threads import check_threads, using_threads
from . import block, packed
from .ops import PanelOps, fits_rows

__all__ = ["forward_batch", "decode_alone", "batch_mask", "steps_match"]

CHUNK_TOKENS = 256     # packed tokens per pass through the layers (longer batches run in chunks)
USE_ROW_KERNELS = True  # False: every product through the tiled-dequant + BLAS path
COMPILED_LAYERS = True  # False: the layers through block.run_layers even where packed.run_layers serves
_BLAS_CHUNK = 512       # packed tokens per pass on that path (as Model.forward's prefill chunks)


# ---------------------------------------------------------------------------------------
# One packed forward pass
# ---------------------------------------------------------------------------------------

def _check_pool(model, pool: KVPool) -> None:
    cfg = model.config
    if pool.device != model.device:
        raise ValueError(f"the KV pool is on device {pool.device!r} and the model on {model.device!r}: make the "
                         f"pool with KVPool.for_model(model, ...)")
    if (pool.n_layers, pool.n_kv_heads, pool.head_dim) != (cfg.n_layer, cfg.n_head_kv, cfg.head_dim):
        raise ValueError(f"the KV pool is shaped for (layers, kv heads, head dim) = "
                         f"{(pool.n_layers, pool.n_kv_heads, pool.head_dim)}, this model needs "
                         f"{(cfg.n_layer, cfg.n_head_kv, cfg.head_dim)}; make one with KVPool.for_model(model, ...)")


def forward_batch(model, pool: KVPool, seqs: Sequence[PoolSeq], token_lists, *, all_logits: bool = False,
                  threads: int | None = None) -> list[np.ndarray]:
    """Feed `token_lists[i]` to `seqs[i]` for every i in one packed forward pass.

    Each sequence continues at its own position (`seq.length`); its keys and values are
    written into its pool pages and the ids committed to it. Returns, per sequence, float32
    logits of its last new token (n_vocab,), or of all its new tokens (n_i, n_vocab) with
    `all_logits=True`. Raises PoolExhaustedError (pool unchanged) when the pool cannot hold
    the new positions, ContextOverflowError past the model's context; if the pass fails
    midway, no sequence's length changes (pages reserved for it are reused next time).
    """
    _check_pool(model, pool)
    seqs = list(seqs)
    if len(seqs) != len(token_lists):
        raise ValueError(f"forward_batch: {len(seqs)} sequences but {len(token_lists)} token lists")
    if not seqs:
        return []
    ids_list = [model.check_ids(t) for t in token_lists]
    counts = [len(t) for t in ids_list]
    positions = np.concatenate([np.arange(s.length, s.length + n, dtype=np.int64)
                                for s, n in zip(seqs, counts)])
    model.ropes.check(positions)
    slots = np.concatenate(pool.reserve(seqs, counts))
    T, B = len(positions), len(seqs)
    ids = np.concatenate(ids_list)
    seq_of_token = np.repeat(np.arange(B, dtype=np.int64), counts)
    tables = pool.tables(seqs)
    ends = np.cumsum(counts)
    want = np.arange(T) if all_logits else ends - 1  # the tokens whose logits are returned
    if model.device != "cpu":
        logits = model.forward_packed(pool, ids, positions, slots, seq_of_token, tables, want)
    else:
        logits = _forward_cpu(model, pool, ids, positions, slots, seq_of_token, tables, want, threads)
    for s, t in zip(seqs, ids_list):
        pool.commit(s, t)
    if not all_logits:
        return list(logits)
    return np.split(logits, ends[:-1])


def _forward_cpu(model, pool, ids, positions, slots, seq_of_token, tables, want, threads):
    """The packed pass on the CPU: the logits (len(want), n_vocab) of the tokens `want`."""
    cfg = model.config
    T = len(ids)
    threads = check_threads(threads) or model.threads
    rows_kernels = USE_ROW_KERNELS and fits_rows(cfg)
    compiled = COMPILED_LAYERS and rows_kernels and packed.fits(model)
    if not compiled:  # the Python layer loop's attention reads each layer's buffer
        scale = np.float32(cfg.attn_scale)
        kv_bufs = [bits(b) for b in pool.buffers()]
    chunk = CHUNK_TOKENS if rows_kernels else _BLAS_CHUNK
    end = int(positions.max()) + 1
    hidden = np.empty((len(want), cfg.n_embd), np.float32)
    with using_threads(threads):
        # consecutive chunks of the packed tokens: a later chunk's tokens attend to the keys
        # an earlier chunk wrote, so chunking changes nothing but the activations' size
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            blocks = plan_blocks(seq_of_token[c0:c1], positions[c0:c1])
            slots_c = slots[c0:c1]

            x = block.embed(model, ids[c0:c1])
            if compiled:
                packed.run_layers(model, x, positions[c0:c1], pool.slots(), pool.page_size, slots_c, tables, blocks,
                                  end, threads)
            else:
                def paged_attention(li, q, k, v, window, slots_c=slots_c, blocks=blocks):
                    pool.write(li, slots_c, k, v)
                    a = np.empty_like(q)
                    _paged_kernel(q, kv_bufs[li], tables, *blocks, scale, window, a)
                    return a

                block.run_layers(model, x, positions[c0:c1], _ops(model, paged_attention, rows_kernels), end)
            lo, hi = np.searchsorted(want, (c0, c1))
            hidden[lo:hi] = x[want[lo:hi] - c0]
        return _head(model, hidden, _ops(model, None, rows_kernels))


def _ops(model, attention, rows_kernels):
    """The pass's pieces: PanelOps (int24 or int8 activations, as the model's mode); with
    weights whose sizes are not whole blocks, every product through the tiled-dequant + BLAS
    path."""
    if not rows_kernels:
        return block.Ops(model.config, lambda w, h: w @ h, attention)
    return PanelOps(model, attention, int8=model.activations == "int8")


def steps_match(model) -> bool:
    """Whether a packed pass gives each token the results of a session's fused decode step.
    Where every product weight has panels (kernels/panels.py) the two run the same product
    kernels; in int8 mode their attention too, so the bits are the same, and in the exact
    mode its attention groups the keys differently (float rounding, which greedy results
    never showed apart). The exact mode's row dots of other weights also differ from the
    pass's only by rounding; int8 mode's differ in the last bits, which a token's
    quantization can carry into any bit."""
    return model.activations == "f32" or all(model.panels(w) is not None for w in model.product_weights())


def decodes_alone(model) -> bool:
    """Whether `decode_alone` applies to `model`: a packed pass's results equal the fused
    step's (`steps_match`), no mixture of experts (which the fused step does not run), and the
    CPU (the fused step's). Otherwise a lone sequence takes the packed pass as in a batch: its
    results then do not depend on the batch."""
    return model.device == "cpu" and not model.config.n_expert and steps_match(model)


def decode_alone(model, pool: KVPool, seq: PoolSeq, token: int, *, threads: int | None = None) -> np.ndarray:
    """Logits (n_vocab,) after one more token of a pool sequence that is decoding alone: the
    fused decode step of a session (engine/decode.py) over the sequence's pages, in place of
    a packed pass of one token (one compiled call instead of a Python loop over the layers:
    about half the time). The same products, so the same results up to float rounding; for
    models where `decodes_alone` holds."""
    _check_pool(model, pool)
    model.ropes.check_range(seq.length, seq.length + 1)
    return model.decode_plan.step_paged(int(token), pool, seq, check_threads(threads) or model.threads)


def _head(model, x, ops):
    """Logits (rows, n_vocab) of final hidden states x (rows, n_embd), by `ops`' products."""
    h = np.empty_like(x)
    _rmsnorm_rows(x, model.output_norm, np.float32(model.config.rms_eps), h)
    if len(h) <= CHUNK_TOKENS:  # a decode pass's rows: the product's own array, not a copy of it
        out = ops.product(model.output, h)
    else:
        out = np.empty((len(h), model.output.rows), np.float32)
        for c0 in range(0, len(h), CHUNK_TOKENS):
            out[c0:c0 + CHUNK_TOKENS] = ops.product(model.output, h[c0:c0 + CHUNK_TOKENS])
    return block.softcap(out, model.config.softcap)


# ---------------------------------------------------------------------------------------
# Masks for padded batches (the alternative that varlen packing avoids)
# ---------------------------------------------------------------------------------------

def batch_mask(lengths, kv_len: int) -> np.ndarray:
    """Additive key masks for a right-padded batch: (B, 1, 1, kv_len) float32, 0 where key
    t < lengths[b] and MASKED (-1e30, finite) on padding.

    The singleton axes are the head and query axes, so the mask broadcasts against scores
    (B, H, S, K) as intended. A (B, K) mask would align its batch axis with the *query* axis
    and, when S == 1 (decoding), broadcast silently to (B, H, B, K). For `attend` (one
    sequence), pass `mask[b, 0]`, shape (1, kv_len), or `mask[b, 0, 0]` broadcast to (S, kv_len).
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim != 1 or (lengths < 0).any() or (lengths > kv_len).any():
        raise ValueError(f"batch_mask: lengths must be a 1-D array of values in [0, {kv_len}], got {lengths}")
    keep = np.arange(kv_len)[None, :] < lengths[:, None]  # (B, K)
    return np.where(keep, np.float32(0.0), np.float32(MASKED)).astype(np.float32)[:, None, None, :]
