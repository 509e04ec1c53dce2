"""Beam search over a KV pool: beams are pool sequences that share their pages (copy on write)
with the beams they branched from; `batch.forward_batch` extends every live beam in one pass."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..cache.kvpool import KVPool, PoolSeq
from ..engine.batch import _check_pool, forward_batch
from ..errors import ContextOverflowError
from .generate import check_max_tokens, prompt_ids

__all__ = ["Beam", "BeamSearch", "beam_search"]


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
