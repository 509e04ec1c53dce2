"""Continuous batching: a `Scheduler` steps many generation requests over one KV pool.

Each `step()` is one packed forward pass (`batch.forward_batch`) over the decoding requests
(one token each) and chunks of newly admitted prompts (at most `step_tokens` tokens in all);
a request decoding alone takes the fused decode step over its pages (`batch.decode_alone`).
Up to `max_batch` requests run at once; a request joins at the next step after it is
submitted, as soon as the pool has room for its prompt and its `max_tokens`, and leaves when it
finishes or is cancelled, its pages returned to the pool. Full pages of computed prompts stay
in the pool's prefix cache, so prompts that share a page-aligned prefix (a system prompt, a
few-shot header) compute it once; a prompt waits a step for a running one that is about to
compute more of its prefix.

The scheduler belongs to one thread: `submit`, `cancel` and `step` are called from the thread
that drives it (a server's engine thread, or `complete_many` below). Every request samples
with its own sampler, so its tokens are those that `model.complete` gives for its prompt alone
(token for token with greedy sampling, up to float rounding in near ties).
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from ..cache.kvcache import KVCache
from ..cache.kvpool import KVPool, PoolExhaustedError, PoolSeq
from ..engine.batch import _check_pool, decode_alone, decodes_alone, forward_batch
from ..engine.session import check_ctx
from ..progress import Progress
from .generate import (SAMPLING_KEYS, Completion, Token, TokenPicker, _StopScanner, check_logprobs,
                       check_max_tokens, check_stop, fit_prompt, prompt_ids)
from .sampling import Sampler, SamplingParams, make_sampler
from . import tools as tool_calls
from .structured import Constraint, constraint as make_constraint

__all__ = ["Request", "Scheduler", "complete_many", "generate_many"]


class Request:
    """One prompt's generation state, stepped by a Scheduler (its tokens picked by the
    `generate.TokenPicker` that `generate_tokens` uses for a session). `tokens` grows by one
    Token per step; once `done`, `finish_reason` is "stop", "length", "cancelled" or "error",
    `tail` is the text held back at the end (a possible start of a stop string that never
    completed), and `error` is set if the request could not run. `tag` is the caller's (an
    index, a mailbox). `constraint` (a `structured.Constraint`) constrains the output through
    the request's own matcher; `incomplete` is then True when generation ended before the
    output satisfied it."""

    def __init__(self, model, ids: Sequence[int], *, max_tokens: int, sampler: Sampler, stop: Sequence[str] = (),
                 logprobs: int = 0, ctx: int | None = None, tag=None, constraint: Constraint | None = None):
        self.matcher = constraint.matcher() if constraint is not None else None
        self.ids, self.max_tokens, self.sampler, self.tag = list(ids), max_tokens, sampler, tag
        self.ctx = ctx or model.config.n_ctx
        self.picker = TokenPicker(model.tokenizer, list(self.ids), sampler, _StopScanner(stop),
                                  model.tokenizer.eot_ids, logprobs, self.matcher)
        self.tokens: list[Token] = []
        self.seq: PoolSeq | None = None
        self.fed = 0            # prompt tokens in the cache (computed or shared)
        self.pending = None     # the sampled token to feed next
        self.finish_reason, self.tail, self.done = "length", "", False
        self.error: Exception | None = None
        self.cancelled = False

    @property
    def text(self) -> str:
        return "".join(t.text for t in self.tokens) + self.tail

    @property
    def incomplete(self) -> bool:
        m = self.matcher
        return m is not None and not (m.conforms if m.conforms is not None else m.accepting)

    def advance(self, logits) -> None:
        """Take the logits after the last fed token: sample, and either finish or set `pending`."""
        token, end = self.picker.pick(logits)
        if token is None:
            return self._finish("stop")
        self.tokens.append(token)
        if end == "stop string":
            self.finish_reason, self.done = "stop", True
            return
        if end == "complete":
            return self._finish("stop")
        if len(self.tokens) == self.max_tokens or self.seq.length >= self.ctx:
            return self._finish("length")
        self.pending = token.id

    def _finish(self, reason) -> None:
        self.finish_reason, self.tail, self.done = reason, self.picker.finish(), True

    def completion(self) -> Completion:
        return Completion(self.text, self.tokens, self.finish_reason, len(self.ids), incomplete=self.incomplete)


def _common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Scheduler:
    """Continuous batching of Requests over `pool` (see the module's docstring).

    `stats` counts prompt_tokens (submitted), prefill_tokens (computed), cached_tokens (taken
    from the prefix cache), steps and generated_tokens.
    """

    def __init__(self, model, pool: KVPool, *, max_batch: int = 16, step_tokens: int = 512,
                 prefix_cache: bool = True, threads: int | None = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if not isinstance(step_tokens, int) or step_tokens < 1:
            raise ValueError(f"step_tokens must be an integer >= 1, got {step_tokens!r}")
        _check_pool(model, pool)
        if decodes_alone(model):  # a lone request's fused step: loaded now, or compiled by a helper process
            model.decode_plan.load(KVCache(pool.n_layers, pool.n_kv_heads, pool.head_dim, capacity=1, dtype=pool.dtype),
                                   threads or model.threads)  # beside the first prompts (engine/precompile.py)
        self.model, self.pool, self.max_batch, self.step_tokens = model, pool, max_batch, step_tokens
        self.prefix_cache, self.threads = prefix_cache, threads
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = dict(prompt_tokens=0, prefill_tokens=0, cached_tokens=0, steps=0, generated_tokens=0)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def submit(self, req: Request) -> None:
        """Queue `req`; it joins a step once there is room. A request for no tokens is done at once."""
        self.stats["prompt_tokens"] += len(req.ids)
        if req.max_tokens == 0:
            req.done = True
        else:
            self.waiting.append(req)

    def cancel(self, req: Request) -> None:
        """End `req` now ("cancelled"), returning its pages to the pool; a finished one is left as is."""
        if req.done:
            return
        if req.seq is not None:
            self.pool.free(req.seq)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.cancelled, req.done, req.finish_reason = True, True, "cancelled"

    def close(self) -> None:
        """Cancel every request, returning all their pages."""
        for r in list(self.running) + list(self.waiting):
            self.cancel(r)

    def _outstanding(self) -> int:
        """Pages the running requests may still take (up to their prompt plus max_tokens)."""
        return sum(self.pool.pages_for(len(r.ids) + r.max_tokens) - len(r.seq.pages) for r in self.running)

    def _admit(self) -> list[Request]:
        """Move waiting requests into the batch while there is room; returns the requests that
        can never run (more pages than the empty pool holds), each with its `error` set."""
        pool, ps, failed = self.pool, self.pool.page_size, []
        i = 0
        while len(self.running) < self.max_batch and i < len(self.waiting):
            r = self.waiting[i]
            seq = pool.new_seq()
            shared = pool.prefix.attach(seq, r.ids) if self.prefix_cache else 0
            if self.prefix_cache:
                # wait for a running prompt that will compute more of this prompt's pages
                limit = (len(r.ids) - 1) // ps
                later = max((min(_common_prefix(o.ids, r.ids) // ps, len(o.ids) // ps, limit)
                             for o in self.running if o.fed < len(o.ids)), default=0)
                if later > shared // ps:
                    pool.free(seq)
                    i += 1
                    continue
            need = pool.pages_for(len(r.ids) + r.max_tokens) - len(seq.pages)
            if need + self._outstanding() > pool.n_available:
                pool.free(seq)
                if self.running:
                    return failed  # wait for running requests to free pages
                what = "a prompt" if r.tag is None else f"prompt {r.tag}"
                r.error = PoolExhaustedError(need, pool.n_available,
                                             f"{what} ({len(r.ids)} tokens + {r.max_tokens} new)")
                r.done, r.finish_reason = True, "error"
                failed.append(r)
                del self.waiting[i]
                continue
            r.seq, r.fed = seq, shared
            self.stats["cached_tokens"] += shared
            self.running.append(r)
            del self.waiting[i]
        return failed

    def step(self) -> list[Request]:
        """Admit what fits, run one packed forward pass, and advance every request it fed.
        Returns the requests that changed: those that sampled a token, finished, or failed."""
        changed = self._admit()
        seqs, feeds, members = [], [], []
        # decoding requests feed one token each; prompts share the rest of the step
        budget = max(self.step_tokens - sum(1 for r in self.running if r.fed == len(r.ids)), 1)
        for r in self.running:
            if r.fed < len(r.ids):
                n = min(len(r.ids) - r.fed, budget)
                if n == 0:
                    continue
                budget -= n
                feed = r.ids[r.fed:r.fed + n]
            else:
                feed = [r.pending]
            seqs.append(r.seq)
            feeds.append(feed)
            members.append(r)
        if not members:
            return changed
        if len(members) == 1 and members[0].fed == len(members[0].ids) and decodes_alone(self.model):
            logits = [decode_alone(self.model, self.pool, seqs[0], feeds[0][0], threads=self.threads)]
        else:
            logits = forward_batch(self.model, self.pool, seqs, feeds, threads=self.threads)
        st = self.stats
        st["steps"] += 1
        for r, feed, lg in zip(members, feeds, logits):
            if r.fed < len(r.ids):
                r.fed += len(feed)
                st["prefill_tokens"] += len(feed)
                if r.fed < len(r.ids):
                    continue
                if self.prefix_cache:
                    self.pool.prefix.publish(r.seq, len(r.ids))
            else:
                st["generated_tokens"] += 1
            r.advance(lg)
            changed.append(r)
            if r.done:
                self.pool.free(r.seq)
                r.seq = None
                self.running.remove(r)
        return changed


def complete_many(model, prompts: Sequence, *, max_tokens: int = 256, stop: str | Sequence[str] = (),
                  logprobs: int = 0, max_batch: int = 16, ctx: int | None = None, truncate: bool = False,
                  pool: KVPool | None = None, page_size: int = 16, kv_dtype=None,
                  prefix_cache: bool = True, step_tokens: int = 512, threads: int | None = None,
                  stats: dict | None = None, progress: bool | None = None,
                  sampling: SamplingParams | None = None, json_schema=None, regex: str | None = None,
                  grammar: str | None = None, tools: list[dict] | None = None, tool_choice="auto",
                  parallel_tool_calls: bool = True, **sampling_options) -> list:
    """A Completion for each prompt, in input order, generated with continuous batching by a
    Scheduler (see the module's docstring): the results are those of calling `model.complete`
    on each prompt alone. `stats`, if given, is filled with the scheduler's counts.
    `json_schema`, `regex` or `grammar` constrain every output (each request has its own matcher).

    With `tools` (and `tool_choice`, `parallel_tool_calls`, as `model.chat` takes them) each
    prompt is a conversation (a list of messages) and each result the assistant message dict that
    `model.chat(conversation, tools=...)` returns."""
    if tools is not None:
        if any(v is not None for v in (json_schema, regex, grammar)):
            raise ValueError("tools cannot be combined with json_schema, regex or grammar: the tool-call grammar "
                             "already constrains the reply")
        plans = [tool_calls.plan(model, conv, tools, tool_choice, parallel_tool_calls) for conv in prompts]
        done = complete_many(model, [model.tokenize(p.prompt, special=True) for p in plans], max_tokens=max_tokens,
                             stop=stop, logprobs=logprobs, max_batch=max_batch, ctx=ctx, truncate=truncate, pool=pool,
                             page_size=page_size, kv_dtype=kv_dtype, prefix_cache=prefix_cache,
                             step_tokens=step_tokens, threads=threads, stats=stats, progress=progress,
                             sampling=sampling, grammar=plans[0].grammar if plans else None, **sampling_options)
        return [tool_calls.parse_reply(p, model.tokenizer, c.tokens, c.text, c.finish_reason)
                for p, c in zip(plans, done)]
    unknown = set(sampling_options) - SAMPLING_KEYS
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    params = SamplingParams(**{**(sampling or SamplingParams()).__dict__, **sampling_options})
    check_max_tokens(max_tokens)
    rule = make_constraint(model, json_schema=json_schema, regex=regex, grammar=grammar)
    ctx = check_ctx(ctx, model.config.n_ctx)
    stops = check_stop(stop)
    logprobs = check_logprobs(logprobs)
    room = None if truncate else ctx - max_tokens
    reqs = [Request(model, fit_prompt(prompt_ids(model, p, room), ctx, max_tokens, truncate),
                    max_tokens=max_tokens, sampler=make_sampler(params), stop=stops, logprobs=logprobs, ctx=ctx,
                    tag=i, constraint=rule)
            for i, p in enumerate(prompts)]
    if pool is None:
        need = sorted(-(-(len(r.ids) + max_tokens) // page_size) for r in reqs)
        n_pages = max(1, sum(need[-max_batch:]) + (need[-1] if need else 0))
        pool = KVPool.for_model(model, n_pages, page_size=page_size, dtype=kv_dtype)
    sched = Scheduler(model, pool, max_batch=max_batch, step_tokens=step_tokens, prefix_cache=prefix_cache,
                      threads=threads)
    for r in reqs:
        sched.submit(r)
    with Progress(len(reqs), "generate", unit="prompts", enabled=progress) as bar:
        try:
            while not sched.idle:
                for r in sched.step():
                    if r.error is not None:
                        raise r.error
                    if r.done:
                        bar.update(1)
        finally:
            sched.close()
            if stats is not None:
                stats.update(sched.stats)
    return [r.completion() for r in reqs]


def generate_many(model, prompts: Sequence, **options) -> list[str]:
    """The generated text for each prompt, in input order, with continuous batching; the
    options are those of `complete_many` (sampling keywords, max_tokens, stop, max_batch...)."""
    return [c.text for c in complete_many(model, prompts, **options)]
