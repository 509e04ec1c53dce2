"""Batched inference over a paged KV pool: one forward pass for many sequences, and beam search.

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

Products: the packed activations go through the row kernels of npllama.rows, which read
every weight once per pass (q/k/v share one parallel region, gate/up and the GLU another;
the per-token norms and RoPE run serially). Passes run in chunks of CHUNK_TOKENS packed
tokens (a later chunk attends to keys an earlier one wrote), which keeps the activations in
cache. Weights whose sizes are not whole 32-element blocks take the tiled-dequant + BLAS
path, as Model.forward's prefill does.

Continuous batching (npllama.scheduler) steps many requests through `forward_batch`;
`beam_search` forks pool sequences (copy-on-write pages) to branch and frees the losers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .attention import MASKED
from .errors import ContextOverflowError
from .generate import check_max_tokens, prompt_ids
from . import block
from .f16 import bits
from .kvpool import KVPool, PoolExhaustedError, PoolSeq
from .paged_attention import _paged_kernel, plan_blocks
from .rows import RowOps, _rmsnorm_rows, matmul_rows
from .threads import check_threads, using_threads

__all__ = ["forward_batch", "beam_search", "BeamSearch", "Beam",
           "batch_mask", "KVPool", "PoolSeq", "PoolExhaustedError"]

CHUNK_TOKENS = 256     # packed tokens per pass through the layers (longer batches run in chunks)
USE_ROW_KERNELS = True  # False: every product through the tiled-dequant + BLAS path
_BLAS_CHUNK = 512       # packed tokens per pass on that path (as Model.forward's prefill chunks)


# ---------------------------------------------------------------------------------------
# One packed forward pass
# ---------------------------------------------------------------------------------------

def _check_pool(model, pool: KVPool) -> None:
    cfg = model.config
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
    cfg = model.config
    T, B = len(positions), len(seqs)
    ids = np.concatenate(ids_list)
    seq_of_token = np.repeat(np.arange(B, dtype=np.int64), counts)
    tables = pool.tables(seqs)
    scale = np.float32(cfg.attn_scale)
    kv_bufs = [bits(b) for b in pool.buffers()]
    threads = check_threads(threads) or model.threads
    dims = (cfg.n_embd, cfg.q_dim) + ((cfg.n_ff_exp,) if cfg.n_expert else (cfg.n_ff,))
    rows_kernels = USE_ROW_KERNELS and all(n % 32 == 0 for n in dims)
    chunk = CHUNK_TOKENS if rows_kernels else _BLAS_CHUNK
    end = int(positions.max()) + 1
    ends = np.cumsum(counts)
    want = np.arange(T) if all_logits else ends - 1  # the tokens whose logits are returned
    hidden = np.empty((len(want), cfg.n_embd), np.float32)
    with using_threads(threads):
        # consecutive chunks of the packed tokens: a later chunk's tokens attend to the keys
        # an earlier chunk wrote, so chunking changes nothing but the activations' size
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            blocks = plan_blocks(seq_of_token[c0:c1], positions[c0:c1])
            slots_c = slots[c0:c1]

            def paged_attention(li, q, k, v, window, slots_c=slots_c, blocks=blocks):
                pool.write(li, slots_c, k, v)
                a = np.empty_like(q)
                _paged_kernel(q, kv_bufs[li], tables, *blocks, scale, window, a)
                return a

            ops = RowOps(cfg, paged_attention) if rows_kernels else block.Ops(cfg, lambda w, h: w @ h,
                                                                                paged_attention)
            x = block.run_layers(model, block.embed(model, ids[c0:c1]), positions[c0:c1], ops, end)
            lo, hi = np.searchsorted(want, (c0, c1))
            hidden[lo:hi] = x[want[lo:hi] - c0]
        logits = _head(model, hidden, rows_kernels)
    for s, t in zip(seqs, ids_list):
        pool.commit(s, t)
    if not all_logits:
        return list(logits)
    return np.split(logits, ends[:-1])


def _head(model, x, rows_kernels):
    """Logits (rows, n_vocab) of final hidden states x (rows, n_embd)."""
    h = np.empty_like(x)
    _rmsnorm_rows(x, model.output_norm, np.float32(model.config.rms_eps), h)
    if not rows_kernels:
        return block.softcap(model.output @ h, model.config.softcap)
    out = np.empty((len(h), model.output.rows), np.float32)
    for c0 in range(0, len(h), CHUNK_TOKENS):
        out[c0:c0 + CHUNK_TOKENS] = matmul_rows(model.output, h[c0:c0 + CHUNK_TOKENS])
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


# ---------------------------------------------------------------------------------------
# Beam search
# ---------------------------------------------------------------------------------------

@dataclass
class Beam:
    """A hypothesis: the generated token ids, their summed log-probability, and its text.
    Live beams (during a search) also hold their pool sequence and their next-token logits."""
    tokens: list[int]
    score: float
    text: str = ""
    finished: bool = False
    seq: PoolSeq | None = field(default=None, repr=False)
    logits: np.ndarray | None = field(default=None, repr=False)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    lg = logits.astype(np.float64)
    m = lg.max()
    return lg - (m + np.log(np.exp(lg - m).sum()))


class BeamSearch:
    """Beam search over a KV pool: beams are pool sequences; a beam chosen by several
    children is forked (its pages shared, copied on write), a beam chosen by none is freed.

    `step()` extends the live beams by one token; `live` and `finished` hold the beams.
    """

    def __init__(self, model, prompt, *, beams: int = 4, max_tokens: int = 32, pool: KVPool | None = None,
                 page_size: int = 16, kv_dtype=None, threads: int | None = None):
        if not isinstance(beams, int) or beams < 1:
            raise ValueError(f"beams must be an integer >= 1, got {beams!r}")
        check_max_tokens(max_tokens)
        self.model, self.beams, self.max_tokens, self.threads = model, beams, max_tokens, threads
        self.prompt = prompt_ids(model, prompt)
        if len(self.prompt) + max_tokens > model.config.n_ctx:
            raise ContextOverflowError(f"the prompt is {len(self.prompt)} tokens and max_tokens is {max_tokens}, "
                                       f"past the model's context of {model.config.n_ctx}")
        if pool is None:
            per = -(-(len(self.prompt) + max_tokens) // page_size)
            pool = KVPool.for_model(model, beams * (per + 1) + per, page_size=page_size, dtype=kv_dtype)
        _check_pool(model, pool)
        self.pool = pool
        self.stop_ids = model.tokenizer.eot_ids
        seq = pool.new_seq()
        (logits,) = forward_batch(model, pool, [seq], [self.prompt], threads=threads)
        self.live: list[Beam] = [Beam([], 0.0, seq=seq, logits=logits)]
        self.finished: list[Beam] = []
        self.steps = 0

    @property
    def done(self) -> bool:
        if not self.live or self.steps >= self.max_tokens:
            return True
        if len(self.finished) < self.beams:
            return False
        # summed log-probabilities only fall: no live beam can beat the kept finished ones
        kept = sorted(b.score for b in self.finished)[-self.beams]
        return kept >= max(b.score for b in self.live)

    def step(self) -> None:
        """Extend the live beams by one token each (the best `beams` continuations overall)."""
        if self.done:
            return
        cands = []
        for bi, beam in enumerate(self.live):
            lp = _log_softmax(beam.logits)
            top = np.argpartition(-lp, min(2 * self.beams, len(lp) - 1))[:2 * self.beams]
            cands.extend((beam.score + float(lp[t]), bi, int(t)) for t in top)
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen, used = [], set()
        for rank, (score, bi, t) in enumerate(cands):
            if len(chosen) == self.beams:
                break
            parent = self.live[bi]
            if t in self.stop_ids:
                if rank < self.beams:
                    self.finished.append(Beam(parent.tokens, score, self._text(parent.tokens), True))
                continue
            seq = parent.seq if bi not in used else self.pool.fork(parent.seq)
            used.add(bi)
            chosen.append(Beam(parent.tokens + [t], score, seq=seq))
        for bi, beam in enumerate(self.live):
            if bi not in used:
                self.pool.free(beam.seq)
        self.steps += 1
        if chosen:
            logits = forward_batch(self.model, self.pool, [b.seq for b in chosen],
                                   [[b.tokens[-1]] for b in chosen], threads=self.threads)
            for b, lg in zip(chosen, logits):
                b.logits = lg
        self.live = chosen

    def _text(self, tokens) -> str:
        return self.model.tokenizer.decode(tokens, skip_special=True)

    def results(self) -> list[Beam]:
        """The best `beams` hypotheses, finished or not, best first (live beams keep their
        sequences until `close()`)."""
        out = list(self.finished)
        for b in self.live:
            b.text = self._text(b.tokens)
            out.append(b)
        out.sort(key=lambda b: -b.score)
        return out[:self.beams]

    def close(self) -> None:
        """Free the live beams' pages."""
        for b in self.live:
            self.pool.free(b.seq)
            b.seq = None


def beam_search(model, prompt, *, beams: int = 4, max_tokens: int = 32, **options) -> list[Beam]:
    """The `beams` best continuations of `prompt` by summed log-probability, best first; each
    Beam has `text`, `tokens` (generated ids) and `score`."""
    search = BeamSearch(model, prompt, beams=beams, max_tokens=max_tokens, **options)
    try:
        while not search.done:
            search.step()
        return search.results()
    finally:
        search.close()
