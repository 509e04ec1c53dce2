"""A Session drives a model over one KV cache. Its position *is* the cache length: there is no
second counter, so a cleared cache with a stale position, or a counter that counts calls
instead of tokens, cannot happen."""
from __future__ import annotations

import numbers
import reprlib

import numpy as np

from ..cache.kvcache import KVCache
from ..errors import ContextOverflowError
from ..kernels.threads import check_threads


def check_ctx(ctx, n_ctx: int) -> int:
    """A context length: `ctx` checked to be an integer from 1 to `n_ctx`, or n_ctx for None."""
    if ctx is None:
        return n_ctx
    if isinstance(ctx, bool) or not isinstance(ctx, numbers.Integral) or not 1 <= ctx <= n_ctx:
        try:
            shown = reprlib.repr(ctx)
        except Exception:  # noqa: BLE001 - e.g. an int too long to print
            shown = f"<{type(ctx).__name__}>"
        raise ValueError(f"ctx must be an integer from 1 to the model's context {n_ctx}, got {shown}")
    return int(ctx)


class Session:
    """One sequence's state: the KV cache and the token ids it holds.

    `ctx` limits the session to fewer positions than the model's training context.
    """

    def __init__(self, model, *, ctx: int | None = None, threads: int | None = None,
                 cache: KVCache | None = None, tokens: list[int] | None = None):
        self.model = model
        self.ctx = check_ctx(ctx, model.config.n_ctx)
        self.threads = check_threads(threads)
        if cache is not None:
            model.check_cache(cache)
        self.cache = cache if cache is not None else model.new_cache()
        self._tokens: list[int] = list(tokens or [])  # the ids whose keys and values the cache holds

    @property
    def pos(self) -> int:
        """The position of the next token: always the cache length."""
        return self.cache.length

    @property
    def tokens(self) -> list[int]:
        """A copy of the token ids fed so far (len(tokens) == pos)."""
        return list(self._tokens)

    def feed(self, ids, all_logits: bool = False, *, threads: int | None = None) -> np.ndarray:
        """Append `ids` to the sequence and return float32 logits: (n_vocab,) for the last token,
        or (len(ids), n_vocab) with `all_logits=True`."""
        ids = self.model.check_ids(ids)
        if self.pos + len(ids) > self.ctx:
            raise ContextOverflowError(
                f"feeding {len(ids)} tokens at position {self.pos} needs {self.pos + len(ids)} "
                f"positions, past this session's context of {self.ctx}; truncate() or reset() the "
                f"session, or shorten the input")
        logits = self.model._run(ids, self.cache, all_logits, "logits",
                                 check_threads(threads) or self.threads or self.model.threads)
        self._tokens.extend(ids.tolist())
        return logits

    def reset(self) -> None:
        """Forget everything: position 0, empty cache (its memory is kept for reuse)."""
        self.cache.reset()
        self._tokens.clear()

    def truncate(self, n: int) -> None:
        """Keep only the first `n` positions."""
        self.cache.truncate(n)
        del self._tokens[n:]

    def fork(self) -> "Session":
        """An independent copy: the two sessions share no cache memory."""
        return Session(self.model, ctx=self.ctx, threads=self.threads, cache=self.cache.fork(),
                       tokens=self._tokens)
