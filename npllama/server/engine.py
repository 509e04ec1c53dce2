"""The engine thread: the one thread that runs model code.

It owns the model, the KV pool and the continuous-batching `Scheduler` (an embedding model,
which cannot generate, has neither). HTTP handlers (on the event loop) never touch them: they
post a `Job` (one HTTP request's choices, or a call such as an embedding batch) to the engine's
inbox, a thread-safe queue, and read events from the job's own mailbox, an asyncio queue that
the engine feeds through `loop.call_soon_threadsafe`. A cancellation (the client went away) is
posted the same way and takes effect at the engine's next step, which frees the request's pages.

Each loop of the thread takes everything in the inbox (new jobs join the batch at this step),
runs one scheduler step, and posts each changed request's new tokens to its job's mailbox.
A sampler that fails (e.g. logit_bias banned every token) ends only its own request; a step
that fails fails the requests it ran, is recorded in `failures`, and the engine keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import traceback

from ..cache.kvpool import KVPool
from ..engine.session import check_ctx
from ..errors import MemoryLimitError
from ..generation.sampling import make_sampler
from ..generation.scheduler import Request, Scheduler
from .metrics import Metrics

log = logging.getLogger("npllama.server")


class ShuttingDown(RuntimeError):
    """The server stopped before the request could finish."""


class EngineFailure(RuntimeError):
    """The engine failed while running the request (a bug, logged with its traceback)."""


class Job:
    """One HTTP request's work, and the mailbox its events arrive in.

    For generation, `prompts` holds the token ids of each prompt and `params` the checked
    protocol.Generation; choice k (of n per prompt) is prompt k // n. Events posted to the
    mailbox: ("tokens", k, [Token...]) as tokens are sampled, ("done", k, finish_reason, tail,
    n_tokens) when choice k ends, ("error", k, exception) if it failed. A `call` job (a function
    of the model, e.g. an embedding batch, run whole between two scheduler steps) gets
    ("result", its return value) or ("error", 0, exception).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, *, prompts=(), params=None, call=None, constraint=None,
                 tool_plan=None):
        self.loop, self.prompts, self.params, self.call = loop, list(prompts), params, call
        self.constraint = constraint  # a compiled structured.Constraint: each choice gets its own matcher
        self.tool_plan = tool_plan    # a chat with tools: its generation.tools.ToolPlan (the reply is parsed)
        self.mailbox: asyncio.Queue = asyncio.Queue()
        self.reqs: list[Request] = []
        self.sent: list[int] = []   # tokens of each choice already posted
        self.submitted = time.monotonic()
        self.first_token: float | None = None

    @property
    def n_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def post(self, event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.mailbox.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class _GuardedSampler:
    """A request's sampler that turns its own failure into an end of that request only: the
    error is kept and an end-of-turn id returned, so the scheduler finishes the request."""

    def __init__(self, sampler, stop_id: int):
        self.sampler, self.stop_id, self.error = sampler, stop_id, None

    def __call__(self, logits, history):
        try:
            return self.sampler(logits, history)
        except Exception as e:  # noqa: BLE001 - reported to this request's client
            self.error = e
            return self.stop_id


class Engine:
    """Continuous batching for a server: up to `parallel` sequences of up to `ctx` tokens each.

    The KV pool holds `parallel` full contexts, so every request that fits `ctx` runs once
    enough others have finished; requests beyond `parallel` wait in the scheduler's queue.
    A pool that cannot fit in memory is refused here, before the server starts. An embedding
    model (an encoder: `generates` is False) gets no pool and no scheduler: it only runs calls.
    """

    def __init__(self, model, *, ctx: int | None = None, parallel: int = 4, threads: int | None = None,
                 page_size: int = 16, kv_dtype=None):
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1, got {parallel!r}")
        self.model = model
        self.ctx = check_ctx(ctx if ctx is not None else min(model.config.n_ctx, 4096), model.config.n_ctx)
        self.parallel = parallel
        self.generates = model.config.causal
        self.pool = self.sched = None
        if self.generates:
            pages = parallel * -(-self.ctx // page_size)
            try:
                self.pool = KVPool.for_model(model, pages, page_size=page_size, dtype=kv_dtype)
            except MemoryLimitError as e:
                raise MemoryLimitError(f"the server's KV pool ({parallel} sequences of {self.ctx} tokens): {e}; "
                                       f"lower -c/--ctx or --parallel") from None
            self.sched = Scheduler(model, self.pool, max_batch=parallel, threads=threads)
        self.metrics = Metrics(self.pool.n_pages if self.pool is not None else 0)
        tok = model.tokenizer  # built now, not on the first request
        self.stop_id = min(tok.eot_ids) if tok.eot_ids else None
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: set[Job] = set()
        self.failures: list[BaseException] = []  # unexpected engine errors (each already answered)
        self._thread = threading.Thread(target=self._run, name="npllama-engine", daemon=True)
        self._stopping = False
        self._cached = 0  # the scheduler's cached_tokens count already in the metrics

    # ---- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort every running request and end the thread (returns within about `timeout`)."""
        self.inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ---- the engine thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                msgs = [self.inbox.get()] if self._idle else []
                while True:
                    try:
                        msgs.append(self.inbox.get_nowait())
                    except queue.Empty:
                        break
                for kind, job in msgs:
                    if kind == "stop":
                        self._stopping = True
                    elif kind == "cancel":
                        self._cancel(job)
                    elif self._stopping:
                        job.post(("error", 0, ShuttingDown("the server is shutting down")))
                    elif job.call is not None:
                        self._call(job)
                    else:
                        self._submit(job)
                if self._stopping:
                    break
                if not self._idle:
                    self._step()
                self._gauges()
        except BaseException as e:  # a bug in the engine itself: record it, answer every job, end
            self._fail_all(e)
            raise
        finally:
            if self.sched is not None:
                self.sched.close()
            for job in list(self.jobs):
                job.post(("error", 0, ShuttingDown("the server is shutting down")))
            self.jobs.clear()
            self._gauges()

    def _submit(self, job: Job) -> None:
        p = job.params
        for k in range(job.n_choices):
            sampler = make_sampler(p.sampling[k % p.n])
            if self.stop_id is not None:
                sampler = _GuardedSampler(sampler, self.stop_id)
            ids = job.prompts[k // p.n]
            r = Request(self.model, ids, max_tokens=p.max_tokens or self.ctx - len(ids), sampler=sampler,
                        stop=p.stop, logprobs=p.logprobs, ctx=self.ctx, tag=(job, k), constraint=job.constraint)
            job.reqs.append(r)
            job.sent.append(0)
            self.sched.submit(r)
        self.jobs.add(job)
        self.metrics.prompt_tokens.inc(sum(len(ids) for ids in job.prompts))

    def _cancel(self, job: Job) -> None:
        if any(not r.done for r in job.reqs):
            self.metrics.cancelled.inc()
        for r in job.reqs:
            self.sched.cancel(r)
        self.jobs.discard(job)

    @property
    def _idle(self) -> bool:
        return self.sched is None or self.sched.idle

    def _call(self, job: Job) -> None:
        try:
            job.post(("result", job.call(self.model)))
        except Exception as e:  # noqa: BLE001 - answered to this request
            job.post(("error", 0, e))

    def _step(self) -> None:
        try:
            changed = self.sched.step()
        except Exception as e:  # noqa: BLE001 - fail the requests this step ran, keep serving
            log.error("engine step failed:\n%s", traceback.format_exc())
            self.failures.append(e)
            failed = {r.tag[0]: r.tag[1] for r in self.sched.running}  # the jobs it ran or admitted
            for job, k in failed.items():
                for r in job.reqs:
                    self.sched.cancel(r)
                self.jobs.discard(job)
                job.post(("error", k, EngineFailure(f"the engine failed: {type(e).__name__}")))
            return
        now = time.monotonic()
        for r in changed:
            job, k = r.tag
            new = r.tokens[job.sent[k]:]
            job.sent[k] = len(r.tokens)
            if new:
                job.post(("tokens", k, new))
                if job.first_token is None:
                    job.first_token = now
                    self.metrics.ttft.observe(now - job.submitted)
                self.metrics.generation_tokens.inc(len(new))
            if not r.done:
                continue
            error = r.error or getattr(r.sampler, "error", None)
            if error is not None:
                for other in job.reqs:
                    self.sched.cancel(other)
                job.post(("error", k, error))
            else:
                job.post(("done", k, r.finish_reason, r.tail, len(r.tokens)))
            if all(o.done for o in job.reqs):
                self.jobs.discard(job)
                if job.first_token is not None and error is None:
                    n = sum(len(o.tokens) for o in job.reqs)
                    if n > 1 and now > job.first_token:
                        self.metrics.tokens_per_second.observe((n - len(job.reqs)) / (now - job.first_token))

    def _fail_all(self, e: BaseException) -> None:
        log.error("the engine thread failed:\n%s", traceback.format_exc())
        self.failures.append(e)
        for job in list(self.jobs):
            job.post(("error", 0, EngineFailure(f"the engine failed: {type(e).__name__}")))

    def _gauges(self) -> None:
        if self.sched is None:  # an embedding model: no sequences, no pages
            return
        m, pool = self.metrics, self.pool
        cached = self.sched.stats["cached_tokens"]
        m.cached_tokens.inc(cached - self._cached)
        self._cached = cached
        m.waiting.set(len(self.sched.waiting))
        m.running.set(len(self.sched.running))
        m.kv_used.set(pool.n_pages - pool.n_available)
        m.kv_cached.set(pool.prefix.n_evictable)
