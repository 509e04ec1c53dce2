"""The HTTP layer: a Starlette app with OpenAI's routes, run by uvicorn.

Handlers check the request (protocol.py), turn prompts into token ids on a worker thread
(tokenizing and chat templates are CPU work that must not stall the event loop), post a Job to
the engine thread, and read its mailbox: a non-streamed answer waits for every choice, a
streamed one (Server-Sent Events) forwards each token as it comes. A client that disconnects
cancels its job. Errors are OpenAI-shaped JSON; an unexpected one is a 500 that is also kept
in `app.state.internal_errors`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import time
import uuid

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ..cache.kvpool import PoolExhaustedError
from ..errors import ChatTemplateError, ContextOverflowError
from ..generation import tools as T
from ..generation.generate import prompt_ids
from ..generation.structured import constraint as make_constraint
from . import embeddings as E
from . import protocol as P
from . import webui as _webui
from .engine import Engine, EngineFailure, Job, ShuttingDown
from .protocol import APIError

log = logging.getLogger("npllama.server")

DEFAULT_MAX_BODY = 4 << 20  # bytes; a bigger body is a 413
DEFAULT_MAX_QUEUE = 256     # requests waiting beyond the running ones; more are a 503
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/rerank", "/v1/models",
          "/health", "/metrics", "/tokenize", "/detokenize")


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, ensure_ascii=False, separators=(",", ":")), status,
                    media_type="application/json")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _engine_error(e: BaseException) -> APIError:
    """The HTTP error for an exception the engine reported for a request."""
    if isinstance(e, (PoolExhaustedError, ShuttingDown)):
        return APIError(503, str(e), code="unavailable")
    if isinstance(e, ValueError):  # the request's own sampler refused (e.g. every token banned)
        return APIError(400, str(e), code="invalid_value")
    return APIError(500, str(e) if isinstance(e, EngineFailure) else "internal error", code="internal_error")


# ---- ASGI middleware ---------------------------------------------------------------------------
async def _send_error(send, err: APIError, headers=()) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class _Auth:
    """`Authorization: Bearer KEY` on every route but /health and the `public` paths, else a 401."""

    def __init__(self, app, api_key: str, public):
        self.app, self.expected, self.public = app, b"Bearer " + api_key.encode(), public

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health" and not self.public(scope["path"]):
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                               code="invalid_api_key")
                return await _send_error(send, err, [(b"www-authenticate", b"Bearer")])
        await self.app(scope, receive, send)


class _Count:
    """Counts answered requests by route and status (unknown paths as 'other')."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        route = scope["path"] if scope["path"] in ROUTES else "other"

        async def counted(message):
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(route, str(message["status"])).inc()
            await send(message)
        await self.app(scope, receive, counted)


class _EventStream(StreamingResponse):
    """A Server-Sent Events response that calls `on_close()` when it ends, normally, by an error,
    or because the client went away (possibly before its body was ever iterated)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


# ---- the app -----------------------------------------------------------------------------------
class _Server:
    """The handlers, bound to one engine."""

    def __init__(self, engine: Engine, model_id: str, max_body: int, max_queue: int):
        self.engine, self.model, self.model_id = engine, engine.model, model_id
        self.max_body, self.max_queue = max_body, max_queue
        self.active = 0  # generation requests submitted and not yet answered
        self.created = int(time.time())
        self.metrics = engine.metrics

    async def read_json(self, request: Request) -> dict:
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) > self.max_body:
            raise APIError(413, f"the request body is {size} bytes; the limit is {self.max_body}",
                           code="request_too_large")
        chunks, n = [], 0
        try:
            async for chunk in request.stream():
                n += len(chunk)
                if n > self.max_body:
                    raise APIError(413, f"the request body is over the limit of {self.max_body} bytes",
                                   code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:  # gone before its body arrived: answered to nobody, not a server error
            raise APIError(400, "the client disconnected while sending the request body",
                           code="client_disconnected") from None
        try:
            body = json.loads(b"".join(chunks))
        except (ValueError, RecursionError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    # ---- prompts (on a worker thread) ----
    def _ids(self, prompt, max_tokens: int | None, param: str) -> list[int]:
        """The prompt's token ids, or a 400 if they and max_tokens (at least 1) overflow the context."""
        ctx = self.engine.ctx
        try:
            ids = prompt_ids(self.model, prompt, ctx - (max_tokens or 1))
        except ContextOverflowError as e:
            raise APIError(400, f"{param}: {e}".replace("truncate=True", "a shorter prompt"),
                           code="context_length_exceeded", param=param) from None
        except ValueError as e:  # token ids out of range
            raise APIError(400, f"{param}: {e}", code="invalid_value", param=param) from None
        if len(ids) + (max_tokens or 1) > ctx:
            raise APIError(400, f"the prompt is {len(ids)} tokens and max_tokens is {max_tokens or 'unset'}, "
                                f"but the context holds {ctx} tokens; shorten the prompt or lower max_tokens",
                           code="context_length_exceeded", param=param)
        return ids

    def chat_ids(self, messages: list[dict], max_tokens: int | None) -> list[int]:
        try:
            text = self.model.format_chat(T.check_messages(messages))
        except (ChatTemplateError, ValueError) as e:
            raise APIError(400, f"the chat template could not render these messages: {e}",
                           code="invalid_value", param="messages") from None
        return self._ids(text, max_tokens, "messages")

    def tool_plan(self, messages: list[dict], tools: dict, max_tokens: int | None):
        """(the prompt's ids, the tool plan, its compiled grammar) for a request with tools, or a 400
        naming the field at fault (tools, tool_choice, parallel_tool_calls, messages)."""
        try:
            plan = T.plan(self.model, messages, **tools)
        except T.ToolError as e:
            message = str(e) if str(e).startswith(e.param) else f"{e.param}: {e}"
            raise APIError(400, message, code="invalid_value", param=e.param) from None
        except (ChatTemplateError, ValueError) as e:
            raise APIError(400, f"the chat template could not render these messages with the tools: {e}",
                           code="invalid_value", param="messages") from None
        rule = make_constraint(self.model, grammar=plan.grammar) if plan.grammar is not None else None
        return self._ids(plan.prompt, max_tokens, "messages"), plan, rule

    def constraint(self, keywords: dict):
        """response_format's schema compiled for the model's vocabulary (cached), or a 400."""
        try:
            return make_constraint(self.model, **keywords)
        except ValueError as e:
            raise APIError(400, f"response_format: {e}", code="invalid_value", param="response_format") from None

    def prompt_ids(self, prompts: list, max_tokens: int | None) -> list[list[int]]:
        return [self._ids(p, max_tokens, "prompt") for p in prompts]

    # ---- generation ----
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _generate(self, request: Request, chat: bool) -> Response:
        if not self.engine.generates:
            raise APIError(400, f"{self.model_id} is an embedding model: it cannot generate text; it answers "
                                f"/v1/embeddings (or /v1/rerank, for a reranker)", code="model_not_supported",
                           param="model")
        start = time.monotonic()
        body = await self.read_json(request)
        gen = P.parse_generation(body, self.model.config.n_vocab, chat=chat)
        rule = await run_in_threadpool(self.constraint, gen.constraint) if gen.constraint else None
        plan = None
        if chat and gen.tools is not None:
            ids, plan, rule = await run_in_threadpool(self.tool_plan, P.parse_messages(body), gen.tools, gen.max_tokens)
            prompts = [ids]
        elif chat:
            messages = P.parse_messages(body)
            prompts = [await run_in_threadpool(self.chat_ids, messages, gen.max_tokens)]
        else:
            raw = P.parse_prompts(body)
            if len(raw) * gen.n > P.MAX_PROMPTS:
                raise APIError(400, f"{len(raw)} prompts x n={gen.n} is more than {P.MAX_PROMPTS} completions "
                                    f"in one request", code="invalid_value", param="n")
            prompts = await run_in_threadpool(self.prompt_ids, raw, gen.max_tokens)
        if self.active >= self.engine.parallel + self.max_queue:
            raise APIError(503, f"the server is busy ({self.active} requests in progress); retry later",
                           code="server_busy")
        job = Job(asyncio.get_running_loop(), prompts=prompts, params=gen, constraint=rule, tool_plan=plan)
        self.active += 1
        self.engine.submit(job)
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if gen.stream:
            state = {"finished": False}

            def close():  # once the response ends, however it ends (even before its first chunk)
                self.active -= 1
                self.metrics.latency.observe(time.monotonic() - start)
                if not state["finished"]:
                    self.engine.cancel(job)
            events = self._stream_tools(job, ident, state) if plan is not None else self._stream(job, chat, ident, state)
            return _EventStream(events, close)
        try:
            result = await self._collect(request, job)
        finally:
            self.active -= 1
            self.metrics.latency.observe(time.monotonic() - start)
        if result is None:  # the client went away
            return Response(status_code=499)
        return _json(self._response(job, chat, ident, *result))

    async def _events(self, job: Job):
        """The job's events until every choice is done; an error event raises APIError."""
        left = job.n_choices
        while left:
            ev = await job.mailbox.get()
            if ev[0] == "error":
                raise _engine_error(ev[2])
            if ev[0] == "done":
                left -= 1
            yield ev

    async def _collect(self, request: Request, job: Job):
        """(tokens, tails, reasons) per choice, or None if the client disconnected first."""
        n = job.n_choices
        tokens, tails, reasons = [[] for _ in range(n)], [""] * n, [None] * n

        async def gather():
            async for ev in self._events(job):
                if ev[0] == "tokens":
                    tokens[ev[1]].extend(ev[2])
                else:
                    reasons[ev[1]], tails[ev[1]] = ev[2], ev[3]

        async def disconnected():
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work, watch = asyncio.ensure_future(gather()), asyncio.ensure_future(disconnected())
        finished = False
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                return None
            finished = True
            work.result()  # raises the job's APIError
            return tokens, tails, reasons
        finally:
            for t in (work, watch):
                t.cancel()
            if not finished:
                self.engine.cancel(job)

    def _response(self, job: Job, chat: bool, ident: str, tokens, tails, reasons) -> dict:
        gen, tok = job.params, self.model.tokenizer
        choices = []
        for k in range(job.n_choices):
            text = "".join(t.text for t in tokens[k]) + tails[k]
            lp = None
            if gen.want_logprobs:
                lp = (P.chat_logprobs(tok, tokens[k], gen.top_logprobs) if chat
                      else P.completion_logprobs(tok, tokens[k], gen.top_logprobs))
            if job.tool_plan is not None:
                message = T.parse_reply(job.tool_plan, tok, tokens[k], text, reasons[k])
                reason = message.pop("finish_reason")
                choices.append({"index": k, "message": message, "logprobs": lp, "finish_reason": reason})
            elif chat:
                choices.append({"index": k, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                                "finish_reason": reasons[k]})
            else:
                choices.append({"index": k, "text": text, "logprobs": lp, "finish_reason": reasons[k]})
        prompt_tokens = sum(len(ids) for ids in job.prompts)
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": choices,
                "usage": P.usage(prompt_tokens, sum(len(t) for t in tokens))}

    async def _stream(self, job: Job, chat: bool, ident: str, state: dict):
        """The SSE lines of a streamed answer; sets state["finished"] once the job is over."""
        gen, tok = job.params, self.model.tokenizer
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        extra = {"usage": None} if gen.include_usage else {}
        offsets = [0] * job.n_choices
        n_tokens = 0

        def chunk(k, text=None, tokens=(), finish=None, role=False):
            lp = None
            if gen.want_logprobs and tokens:
                lp = (P.chat_logprobs(tok, tokens, gen.top_logprobs) if chat
                      else P.completion_logprobs(tok, tokens, gen.top_logprobs, offsets[k]))
            if chat:
                delta = {"role": "assistant", "content": ""} if role else {} if text is None else {"content": text}
                choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": k, "text": text or "", "logprobs": lp, "finish_reason": finish}
            return _sse({"id": ident, "object": obj, "created": created, "model": self.model_id,
                         "choices": [choice], **extra})

        if chat:
            for k in range(job.n_choices):
                yield chunk(k, role=True)
        try:
            async for ev in self._events(job):
                k = ev[1]
                if ev[0] == "tokens":
                    text = "".join(t.text for t in ev[2])
                    if text or gen.want_logprobs:
                        yield chunk(k, text, ev[2])
                    offsets[k] += len(text)
                else:
                    reason, tail, n_tokens = ev[2], ev[3], n_tokens + ev[4]
                    if tail:
                        yield chunk(k, tail)
                    yield chunk(k, finish=reason)
        except APIError as e:
            state["finished"] = True  # the engine ended the job
            yield _sse(e.body())
            return
        state["finished"] = True
        for line in self._closing(job, ident, obj, created, n_tokens):
            yield line

    def _closing(self, job: Job, ident: str, obj: str, created: int, n_tokens: int) -> list[str]:
        """A stream's last SSE lines: the usage chunk where the request asked for it
        (`stream_options.include_usage`), then [DONE]."""
        lines = []
        if job.params.include_usage:
            lines.append(_sse({"id": ident, "object": obj, "created": created, "model": self.model_id, "choices": [],
                               "usage": P.usage(sum(len(ids) for ids in job.prompts), n_tokens)}))
        return lines + ["data: [DONE]\n\n"]

    async def _stream_tools(self, job: Job, ident: str, state: dict):
        """The SSE lines of a streamed answer with tools: each choice's text goes through its own
        CallParser, so content and `tool_calls` deltas (index, id and name first, then arguments in
        pieces) go out as they become certain; sets state["finished"] once the job is over."""
        gen, tok, plan = job.params, self.model.tokenizer, job.tool_plan
        created = int(time.time())
        extra = {"usage": None} if gen.include_usage else {}
        parsers = [plan.parser() for _ in range(job.n_choices)]
        n_tokens = 0

        def chunk(k, delta, finish=None, lp=None):
            choice = {"index": k, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.model_id,
                         "choices": [choice], **extra})

        for k in range(job.n_choices):
            yield chunk(k, {"role": "assistant", "content": ""})
        try:
            async for ev in self._events(job):
                k, parser = ev[1], parsers[ev[1]]
                if ev[0] == "tokens":
                    lp = P.chat_logprobs(tok, ev[2], gen.top_logprobs) if gen.want_logprobs else None
                    deltas = [T.delta_dict(d) for d in parser.feed(T.raw_text(tok, ev[2]))]
                    if lp is not None and not deltas:
                        deltas = [{}]
                    for i, d in enumerate(deltas):
                        yield chunk(k, d, lp=lp if i == 0 else None)
                else:
                    n_tokens += ev[4]
                    for d in parser.feed(ev[3]) + parser.finish():
                        yield chunk(k, T.delta_dict(d))
                    yield chunk(k, {}, finish=T.finish_reason(ev[2], parser.calls))
        except APIError as e:
            state["finished"] = True  # the engine ended the job
            yield _sse(e.body())
            return
        state["finished"] = True
        for line in self._closing(job, ident, "chat.completion.chunk", created, n_tokens):
            yield line

    # ---- other routes ----
    async def call(self, fn):
        """fn(model) run on the engine thread between two steps; its result, or its error as an APIError."""
        job = Job(asyncio.get_running_loop(), call=fn)
        self.engine.submit(job)
        ev = await job.mailbox.get()
        if ev[0] == "error":
            raise _engine_error(ev[2])
        return ev[1]

    async def embeddings(self, request: Request) -> Response:
        return _json(await E.embeddings(self, await self.read_json(request)))

    async def rerank(self, request: Request) -> Response:
        return _json(await E.rerank(self, await self.read_json(request)))

    async def models(self, request: Request) -> Response:
        return _json({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.created,
                                                  "owned_by": "npllama", "max_model_len": self.engine.ctx}]})

    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            return _json({"status": "error", "message": "the engine thread has stopped"}, 503)
        return _json({"status": "ok"})

    async def metrics_route(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        content = body.get("content")
        if not isinstance(content, str):
            raise APIError(400, f"content: must be a string, got {P.show(content)}", code="invalid_type",
                           param="content")
        add_special, parse_special = body.get("add_special", False), body.get("parse_special", True)
        with_pieces = body.get("with_pieces", False)
        for name, v in (("add_special", add_special), ("parse_special", parse_special), ("with_pieces", with_pieces)):
            if not isinstance(v, bool):
                raise APIError(400, f"{name}: must be true or false", code="invalid_type", param=name)
        ids = await run_in_threadpool(self.model.tokenize, content, add_bos=add_special, special=parse_special)
        if with_pieces:
            tok = self.model.tokenizer
            return _json({"tokens": [{"id": i, "piece": tok.id_to_bytes(i).decode("utf-8", "replace")} for i in ids]})
        return _json({"tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        ids = body.get("tokens")
        n_vocab = self.model.config.n_vocab
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise APIError(400, f"tokens: must be a list of token ids, got {P.show(ids)}", code="invalid_type",
                           param="tokens")
        if any(not 0 <= i < n_vocab for i in ids):
            raise APIError(400, f"tokens: token ids are 0 to {n_vocab - 1}", code="invalid_value", param="tokens")
        text = await run_in_threadpool(self.model.detokenize, ids) if ids else ""
        return _json({"content": text})


def create_app(engine: Engine, *, model_id: str | None = None, api_key: str | None = None,
               cors_origins=(), max_body: int = DEFAULT_MAX_BODY, max_queue: int = DEFAULT_MAX_QUEUE,
               webui: bool = True, matryoshka=False) -> Starlette:
    """The server's ASGI app (with the browser chat page at `/` unless `webui` is false or the
    model only embeds). Its lifespan starts the engine thread and stops it at shutdown.
    `matryoshka`: True, or the sizes, if the model is Matryoshka-trained (embeddings.py)."""
    for name, value, low in (("max_body", max_body, 1), ("max_queue", max_queue, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    model_id = model_id or os.path.splitext(os.path.basename(engine.model.path))[0]
    s = _Server(engine, model_id, max_body, max_queue)
    s.matryoshka = E.matryoshka_sizes(matryoshka, engine.model.config.n_embd)
    internal_errors: list[BaseException] = []

    async def api_error(request, exc: APIError):
        return _json(exc.body(), exc.status)

    async def http_error(request, exc: HTTPException):
        return _json(APIError(exc.status_code, str(exc.detail), code=str(exc.status_code)).body(), exc.status_code)

    async def internal_error(request, exc: Exception):
        internal_errors.append(exc)
        return _json(APIError(500, "internal error", code="internal_error").body(), 500)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.stop)

    routes = [Route("/v1/chat/completions", s.chat, methods=["POST"]),
              Route("/v1/completions", s.completions, methods=["POST"]),
              Route("/v1/embeddings", s.embeddings, methods=["POST"]),
              Route("/v1/rerank", s.rerank, methods=["POST"]),
              Route("/rerank", s.rerank, methods=["POST"]),
              Route("/v1/models", s.models, methods=["GET"]),
              Route("/health", s.health, methods=["GET"]),
              Route("/metrics", s.metrics_route, methods=["GET"]),
              Route("/tokenize", s.tokenize, methods=["POST"]),
              Route("/detokenize", s.detokenize, methods=["POST"])]
    if webui and engine.generates:
        routes += _webui.routes(api_key=bool(api_key))
    middleware = [Middleware(_Count, metrics=engine.metrics)]
    if cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(cors_origins),
                                     allow_methods=["GET", "POST", "OPTIONS"],
                                     allow_headers=["Authorization", "Content-Type"]))
    if api_key:
        public = _webui.is_public if webui else (lambda path: False)
        middleware.append(Middleware(_Auth, api_key=api_key, public=public))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error})
    app.state.engine, app.state.internal_errors, app.state.model_id = engine, internal_errors, model_id
    app.state.handlers = s
    return app
