"""Sampling: small composable callables that turn logits into the next token.

A *processor* maps `(logits, history) -> logits` (penalties, logit bias). A *sampler* maps
`(logits, history) -> token id`. `make_sampler(...)` chains them in llama.cpp's order:
penalties and bias, then top-k, top-p and min-p on the unscaled distribution, then temperature,
then a seeded draw. Temperature 0 is greedy. The defaults are llama.cpp's.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from ..errors import show

Processor = Callable[[np.ndarray, Sequence[int]], np.ndarray]
Sampler = Callable[[np.ndarray, Sequence[int]], int]

MAX_TOKEN_ID = 2**31 - 1  # far above any vocabulary; a logit_bias key past it is a mistake


def _real(name: str, value, *, allow_neg_inf: bool = False) -> float:
    """`value` as a float: a real number (not a bool), finite (or -inf where allowed)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {show(value)}")
    try:
        out = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large for a float: {show(value)}") from None
    if not (math.isfinite(out) or allow_neg_inf and out == -math.inf):
        raise ValueError(f"{name} must be finite{' or -inf' if allow_neg_inf else ''}, got {out}")
    return out


def _integer(name: str, value) -> int:
    """`value` as an int: an integer (Python or NumPy), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {show(value)}")
    return int(value)


def _check_bias(bias) -> dict[int, float]:
    """A logit_bias mapping as {token id: finite bias or -inf}, or a ValueError naming the bad entry."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
    out = {}
    for key, value in bias.items():
        tid = _integer("a logit_bias key (a token id)", key)
        if not 0 <= tid <= MAX_TOKEN_ID:
            raise ValueError(f"logit_bias names token id {tid}; token ids are non-negative and below 2**31")
        out[tid] = _real(f"logit_bias[{tid}]", value, allow_neg_inf=True)
    return out


@dataclass(frozen=True)
class SamplingParams:
    """Sampling options, checked (and stored as plain ints and floats) on construction.

    Floats must be finite real numbers and integers integers (NumPy scalars are accepted, bools
    are not); `logit_bias` maps token ids to a finite bias or -inf (which bans the token); `seed`
    is None (fresh entropy) or a non-negative integer. Anything else raises ValueError.
    """
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
        fix = object.__setattr__  # frozen: store the normalised values
        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            fix(self, name, _real(name, getattr(self, name)))
        for name in ("top_k", "repeat_last_n"):
            fix(self, name, _integer(name, getattr(self, name)))
        fix(self, "logit_bias", _check_bias(self.logit_bias))
        if self.seed is not None:
            fix(self, "seed", _integer("seed", self.seed))
            if self.seed < 0:
                raise ValueError(f"seed must be None or a non-negative integer, got {self.seed}")
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
    presence and frequency penalties over the last `last_n` tokens of the history.
    The penalised logits are float64, so that large penalties cannot overflow."""
    def apply(logits, history):
        recent = history if last_n == -1 else history[len(history) - last_n:] if last_n else []
        if not len(recent) or (repeat == 1.0 and presence == 0.0 and frequency == 0.0):
            return logits
        ids, counts = np.unique(_token_ids("the history", recent), return_counts=True)
        _check_in_vocab("the history", ids, len(logits))
        out = logits.astype(np.float64)
        v = out[ids]
        with np.errstate(over="ignore", invalid="ignore"):  # absurd penalties: the sampler refuses inf/NaN
            v = np.where(v > 0, v / repeat, v * repeat)
            out[ids] = v - counts * frequency - presence
        return out
    return apply


def logit_bias(bias: Mapping[int, float]) -> Processor:
    """Add a fixed bias to the logits of chosen token ids (-inf bans a token). The biased logits
    are float64; an id past the vocabulary raises ValueError when the logits arrive."""
    bias = _check_bias(bias)
    ids = np.fromiter(bias.keys(), dtype=np.int64, count=len(bias))
    vals = np.fromiter(bias.values(), dtype=np.float64, count=len(bias))

    def apply(logits, history):
        if not len(ids):
            return logits
        _check_in_vocab("logit_bias", ids, len(logits))
        out = logits.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            out[ids] += vals
        return out
    return apply


def _token_ids(what: str, ids) -> np.ndarray:
    try:
        arr = np.asarray(ids, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of token ids (integers)") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a flat sequence of token ids, got shape {arr.shape}")
    return arr


def _check_in_vocab(what: str, ids: np.ndarray, n_vocab: int) -> None:
    bad = ids[(ids < 0) | (ids >= n_vocab)]
    if bad.size:
        raise ValueError(f"{what} names token id {int(bad[0])}, outside the vocabulary of {n_vocab} tokens")


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
    """A sampler for `params`: penalties and bias, then greedy or a seeded filtered draw.

    The sampler takes 1-D logits (left unchanged) and the token history, and raises ValueError
    when no token can be drawn: every token banned by logit_bias, or logits that are NaN or +inf.
    """
    if not isinstance(params, SamplingParams):
        raise ValueError(f"make_sampler needs a SamplingParams, got {type(params).__name__}")
    procs = [penalties(params.repeat_penalty, params.presence_penalty, params.frequency_penalty,
                       params.repeat_last_n)]
    if params.logit_bias:
        procs.append(logit_bias(params.logit_bias))
    rng = np.random.default_rng(params.seed)

    def sample(logits, history=()):
        logits = np.asarray(logits)
        if logits.ndim != 1 or not logits.size or not np.issubdtype(logits.dtype, np.floating):
            raise ValueError(f"logits must be a non-empty 1-D float array, got {logits.dtype} {logits.shape}")
        for proc in procs:
            logits = proc(logits, history)
        best = int(np.argmax(logits))  # the first NaN where there is one
        top = logits[best]
        if top == -np.inf:
            raise ValueError("every token's logit is -inf (banned by logit_bias): there is nothing to sample")
        if not np.isfinite(top):
            raise ValueError(f"the logits (after penalties and logit_bias) contain {top}: nothing can be sampled")
        if params.temperature == 0:
            return best
        ids, vals = filter_candidates(logits, params.top_k, params.top_p, params.min_p)
        # scale the gaps to the best logit, not the logits: a tiny temperature cannot overflow
        with np.errstate(over="ignore"):  # a gap over a tiny temperature is -inf: probability 0
            p = _softmax((vals - vals[0]) / params.temperature)
        return int(ids[rng.choice(len(ids), p=p)])
    return sample
