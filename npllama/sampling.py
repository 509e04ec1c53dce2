"""Sampling: small composable callables that turn logits into the next token.

A *processor* maps `(logits, history) -> logits` (penalties, logit bias). A *sampler* maps
`(logits, history) -> token id`. `make_sampler(...)` chains them in llama.cpp's order:
penalties and bias, then top-k, top-p and min-p on the unscaled distribution, then temperature,
then a seeded draw. Temperature 0 is greedy. The defaults are llama.cpp's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

Processor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
Sampler = Callable[[np.ndarray, Sequence[int]], int]


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40            # 0 disables
    top_p: float = 0.95        # 1.0 disables
    min_p: float = 0.05        # 0.0 disables
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64    # penalties look at this many most recent tokens (0: none, -1: all)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not self.repeat_penalty > 0:
            raise ValueError(f"repeat_penalty must be > 0 (1.0 disables it), got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1, got {self.repeat_last_n}")


GREEDY = SamplingParams(temperature=0.0)


def penalties(repeat: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
              last_n: int = 64) -> Processor:
    """Repetition (llama.cpp/CTRL style: divide positive logits, multiply negative ones),
    presence and frequency penalties over the last `last_n` tokens of the history."""
    def apply(logits, history):
        recent = history if last_n == -1 else history[len(history) - last_n:] if last_n else []
        if not len(recent) or (repeat == 1.0 and presence == 0.0 and frequency == 0.0):
            return logits
        ids, counts = np.unique(np.asarray(recent, dtype=np.int64), return_counts=True)
        out = logits.copy()
        v = out[ids]
        v = np.where(v > 0, v / repeat, v * repeat)
        out[ids] = v - counts * frequency - presence
        return out
    return apply


def logit_bias(bias: Mapping[int, float]) -> Processor:
    """Add a fixed bias to the logits of chosen token ids (-inf bans a token)."""
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))

    def apply(logits, history):
        if not len(ids):
            return logits
        out = logits.copy()
        out[ids] += vals
        return out
    return apply


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def filter_candidates(logits: np.ndarray, top_k: int, top_p: float, min_p: float):
    """The surviving (ids, logits) after top-k, top-p and min-p, sorted by logit, descending."""
    k = len(logits) if top_k <= 0 else min(top_k, len(logits))
    ids = np.argpartition(-logits, k - 1)[:k] if k < len(logits) else np.arange(len(logits))
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    vals = logits[ids].astype(np.float64)
    if top_p < 1.0:
        cum = np.cumsum(_softmax(vals))
        keep = int(np.searchsorted(cum, top_p)) + 1  # smallest prefix with mass >= top_p
        ids, vals = ids[:keep], vals[:keep]
    if min_p > 0.0:
        p = _softmax(vals)
        keep = p >= min_p * p[0]
        ids, vals = ids[keep], vals[keep]
    return ids, vals


def make_sampler(params: SamplingParams = SamplingParams()) -> Sampler:
    """A sampler for `params`: penalties and bias, then greedy or a seeded filtered draw."""
    procs = [penalties(params.repeat_penalty, params.presence_penalty, params.frequency_penalty,
                       params.repeat_last_n)]
    if params.logit_bias:
        procs.append(logit_bias(params.logit_bias))
    rng = np.random.default_rng(params.seed)

    def sample(logits, history=()):
        for proc in procs:
            logits = proc(logits, history)
        if params.temperature == 0:
            return int(np.argmax(logits))
        ids, vals = filter_candidates(logits, params.top_k, params.top_p, params.min_p)
        p = _softmax(vals / params.temperature)
        return int(ids[rng.choice(len(ids), p=p)])
    return sample
