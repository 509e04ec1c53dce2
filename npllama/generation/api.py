"""The text-level API that `Model` exposes: generation, chat, scoring, perplexity (embeddings and
reranking: embedding.py).

Each function takes the model as its first argument; `Model` binds them as methods. Prompts
may be text (tokenized with the model's tokenizer, BOS as its metadata says) or token ids.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from ..progress import Progress
from . import tools as tool_calls
from .generate import (SAMPLING_KEYS, Completion, check_max_tokens, complete, fit_prompt, generate_tokens,
                       prompt_ids, stream as stream_text)
from .sampling import SamplingParams, make_sampler
from .structured import CONSTRAINT_KEYS, constraint as make_constraint

def complete_text(model, prompt, *, max_tokens: int = 256, stop: str | Sequence[str] = (), logprobs: int = 0,
                  truncate: bool = False, ctx: int | None = None, session=None,
                  sampling: SamplingParams | None = None, json_schema=None, regex: str | None = None,
                  grammar: str | None = None, **sampling_options) -> Completion:
    """Generate a continuation of `prompt` and return a Completion (text, tokens, finish reason).

    Sampling keywords (temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n,
    presence_penalty, frequency_penalty, logit_bias, seed) override `sampling`, whose defaults
    are llama.cpp's. `truncate=True` keeps the tail of a prompt that would not fit the context.
    `session` continues an existing session instead of starting a new one.

    Structured output (at most one; see `npllama.structured`): `json_schema` (a dict or a JSON
    string), `regex` (Python syntax, matching the whole output) or `grammar` (llguidance's Lark
    format). The output then conforms whatever the sampling settings, generation stops when it
    is complete, and `Completion.incomplete` says when max_tokens (or a stop string) cut it short.
    """
    return _run(model, prompt, complete, max_tokens, stop, logprobs, truncate, ctx, session, sampling,
                sampling_options, dict(json_schema=json_schema, regex=regex, grammar=grammar))


def generate(model, prompt, *, max_tokens: int = 256, stream: bool = False, stop: str | Sequence[str] = (),
             logprobs: int = 0, truncate: bool = False, ctx: int | None = None, session=None,
             sampling: SamplingParams | None = None, json_schema=None, regex: str | None = None,
             grammar: str | None = None, **sampling_options) -> str | Iterator[str]:
    """The text generated after `prompt`; with `stream=True`, an iterator of text pieces.
    The options are those of `complete`."""
    constrain = dict(json_schema=json_schema, regex=regex, grammar=grammar)
    if stream:
        return _run(model, prompt, stream_text, max_tokens, stop, logprobs, truncate, ctx, session, sampling,
                    sampling_options, constrain)
    return _run(model, prompt, complete, max_tokens, stop, logprobs, truncate, ctx, session, sampling,
                sampling_options, constrain).text


def _run(model, prompt, runner, max_tokens, stop, logprobs, truncate, ctx, session, sampling, options, constrain):
    unknown = set(options) - SAMPLING_KEYS
    if unknown:
        raise TypeError(f"unexpected keyword arguments: {', '.join(sorted(unknown))}")
    params = SamplingParams(**{**(sampling or SamplingParams()).__dict__, **options})
    check_max_tokens(max_tokens)
    rule = make_constraint(model, **constrain)
    session = session if session is not None else model.session(ctx=ctx)
    room = session.ctx - session.pos
    ids = fit_prompt(prompt_ids(model, prompt, None if truncate else room - max_tokens), room, max_tokens, truncate)
    return runner(session, ids, max_tokens=max_tokens, sampler=make_sampler(params),
                  stop=[stop] if isinstance(stop, str) else stop, logprobs=logprobs,
                  matcher=rule.matcher() if rule is not None else None)


def chat(model, messages: list[dict], *, tools: list[dict] | None = None, tool_choice="auto",
         parallel_tool_calls: bool = True, **options):
    """The assistant's reply to `messages` (a list of {'role', 'content'} dicts): its text, or
    with `stream=True` an iterator of text pieces.

    With `tools` (OpenAI's ``[{"type": "function", "function": {"name", "description",
    "parameters"}}]``) the reply is an assistant message dict, ``{"role": "assistant",
    "content": str | None, "tool_calls": [{"id", "type": "function", "function": {"name",
    "arguments": a JSON string}}], "finish_reason"}`` ("tool_calls" when it ended in calls;
    no `tool_calls` key without calls); with `stream=True` an iterator of OpenAI-shaped deltas
    (``{"content": ...}`` or ``{"tool_calls": [...]}``), the last ``{"finish_reason": ...}``.
    `tool_choice` is "auto", "none", "required" or ``{"type": "function", "function": {"name":
    ...}}``; `parallel_tool_calls=False` allows one call. Calls are decoded under a grammar, so
    each one parses and its arguments are valid under its tool's schema (`npllama.generation.tools`).
    Messages may hold assistant turns with `tool_calls` and ``{"role": "tool", "tool_call_id",
    "content"}`` results. ValueError (before any token) for malformed tools, tool_choice or
    messages, a schema llguidance cannot enforce, or a template that cannot express tools."""
    if tools is None:
        _no_tools(tool_choice, parallel_tool_calls)
        prompt = model.format_chat(tool_calls.check_messages(messages), add_generation_prompt=True)
        return generate(model, model.tokenize(prompt, special=True), **options)
    plan = tool_calls.plan(model, messages, tools, tool_choice, parallel_tool_calls)
    return tool_reply(model, model.tokenize(plan.prompt, special=True), plan, **options)


def _no_tools(tool_choice, parallel_tool_calls) -> None:
    if tool_choice not in ("auto", "none") or parallel_tool_calls is not True:
        raise ValueError("tool_choice and parallel_tool_calls need tools: pass tools=[...] as well")


def tool_reply(model, ids, plan: "tool_calls.ToolPlan", *, stream: bool = False, max_tokens: int = 256,
               stop=(), logprobs: int = 0, truncate: bool = False, ctx: int | None = None, session=None,
               sampling: SamplingParams | None = None, **sampling_options):
    """The reply to the prompt `ids` of a tool `plan`: an assistant message dict, or with
    `stream=True` an iterator of delta dicts ending with ``{"finish_reason": ...}``."""
    given = [k for k in CONSTRAINT_KEYS if sampling_options.get(k) is not None]
    if given:
        raise ValueError(f"tools cannot be combined with {given[0]}: the tool-call grammar already constrains "
                         f"the reply")
    sampling_options = {k: v for k, v in sampling_options.items() if k not in CONSTRAINT_KEYS}
    tokens = _run(model, ids, generate_tokens, max_tokens, stop, logprobs, truncate, ctx, session, sampling,
                  sampling_options, dict(grammar=plan.grammar))
    deltas = _tool_deltas(model.tokenizer, tokens, plan.parser())
    if stream:
        return deltas
    parts = list(deltas)
    message = tool_calls.assemble(tool_calls.Delta(**_delta_fields(d)) for d in parts[:-1])
    return {**message, **parts[-1]}


def _delta_fields(d: dict) -> dict:
    """A Delta's fields back from its dict (for `assemble`)."""
    if "content" in d:
        return {"content": d["content"]}
    call = d["tool_calls"][0]
    return {"index": call["index"], "id": call.get("id"), "name": call["function"].get("name"),
            "arguments": call["function"]["arguments"]}


def _tool_deltas(tokenizer, tokens, parser: "tool_calls.CallParser"):
    """Delta dicts parsed from generated Tokens as they come, then ``{"finish_reason": ...}``."""
    try:
        while True:
            t = next(tokens)
            for d in parser.feed(tool_calls.raw_text(tokenizer, [t])):
                yield tool_calls.delta_dict(d)
    except StopIteration as end:
        reason, tail = end.value
    for d in parser.feed(tail) + parser.finish():
        yield tool_calls.delta_dict(d)
    yield {"finish_reason": tool_calls.finish_reason(reason, parser.calls)}


class ChatSession:
    """A conversation that keeps its KV cache across turns and feeds only each turn's new tokens.

    `send(text)` adds a user message and returns the reply (or streams it with `stream=True`);
    `send` also takes a message dict or a list of them (a tool's results, say). The whole
    conversation is re-rendered with the chat template each turn and only the tokens after the
    longest prefix already in the cache are fed, so templates that re-render earlier turns
    differently still give exact results. `reset()` (or a new ChatSession) starts over.

    With `tools` (and `tool_choice`, `parallel_tool_calls`; see `chat`) every reply is an
    assistant message dict (or a stream of deltas), kept in `messages` with its tool calls, so
    that the next `send` can give their results as ``{"role": "tool", ...}`` messages.
    """

    def __init__(self, model, *, system: str | None = None, ctx: int | None = None, tools: list[dict] | None = None,
                 tool_choice="auto", parallel_tool_calls: bool = True, **options):
        self.model = model
        self.session = model.session(ctx=ctx)
        self.system = system
        if tools is None:
            _no_tools(tool_choice, parallel_tool_calls)
        self.tools, self.tool_choice, self.parallel_tool_calls = tools, tool_choice, parallel_tool_calls
        self.options = options
        self.messages: list[dict] = []
        self.reset()

    def reset(self) -> None:
        """Start a new conversation (the cache memory is kept)."""
        self.session.reset()
        self.messages = [{"role": "system", "content": self.system}] if self.system else []

    def send(self, message, *, stream: bool = False, **options):
        if isinstance(message, str):
            if not message:
                raise ValueError("a chat message must be a non-empty string")
            added = [{"role": "user", "content": message}]
        elif isinstance(message, dict):
            added = [message]
        elif isinstance(message, list) and message:
            added = list(message)
        else:
            raise ValueError(f"send() takes a non-empty string, a message dict or a list of them, "
                             f"got {type(message).__name__}")
        messages = self.messages + added
        if self.tools is None:
            prompt = self.model.format_chat(tool_calls.check_messages(messages))
            plan = None
        else:
            plan = tool_calls.plan(self.model, messages, self.tools, self.tool_choice, self.parallel_tool_calls)
            prompt = plan.prompt
        self.messages = messages
        ids = self._feedable(self.model.tokenize(prompt, special=True))
        opts = {**self.options, **options}
        if plan is not None:
            deltas = tool_reply(self.model, ids, plan, session=self.session, stream=True, **opts)
            recorded = self._record_message(deltas)
            if stream:
                return recorded
            for _ in recorded:
                pass
            return self.reply
        pieces = generate(self.model, ids, session=self.session, stream=True, **opts)
        return self._record(pieces) if stream else "".join(self._record(pieces))

    def _feedable(self, prompt: list[int]) -> list[int]:
        """The prompt's tokens after the longest prefix already in the cache (at least one)."""
        held = self.session.tokens
        common = 0
        while common < min(len(held), len(prompt) - 1) and held[common] == prompt[common]:
            common += 1
        self.session.truncate(common)
        return prompt[common:]

    def _record(self, pieces):
        reply = []
        for piece in pieces:
            reply.append(piece)
            yield piece
        self.messages.append({"role": "assistant", "content": "".join(reply)})

    def _record_message(self, deltas):
        parts = []
        for d in deltas:
            parts.append(d)
            yield d
        message = tool_calls.assemble(tool_calls.Delta(**_delta_fields(d)) for d in parts[:-1])
        self.messages.append(message)
        self.reply = {**message, **parts[-1]}  # the last reply, with its finish_reason


def score(model, text: str) -> tuple[list[int], np.ndarray]:
    """(ids, logprobs): the tokens of `text` and the log-probability of each given the ones before.

    The first token is conditioned on BOS (or, for vocabularies without one, EOS), so every
    token of `text` gets a score; `logprobs` has one float32 per id.
    """
    ids = model.tokenize(text, add_bos=False)
    if not ids:
        raise ValueError("score() needs non-empty text")
    start = model.tokenizer.bos_id if model.tokenizer.bos_id is not None else model.tokenizer.eos_id
    logits = model.session().feed([start] + ids[:-1], all_logits=True)
    return ids, _target_logprobs(logits, ids)


def _target_logprobs(logits: np.ndarray, targets) -> np.ndarray:
    """log softmax(logits[i])[targets[i]] for each row i, in float64 then stored as float32."""
    lg = logits.astype(np.float64)
    m = lg.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(lg - m).sum(-1, keepdims=True)))[:, 0]
    return (lg[np.arange(len(targets)), targets] - lse).astype(np.float32)


def perplexity(model, text: str, ctx: int = 512, *, progress: bool | None = None) -> float:
    """Perplexity as llama-perplexity defines it: the tokens are cut into windows of `ctx`, each
    window starts with BOS when the model adds one, and only the tokens after the middle of
    each window are scored (positions ctx//2 + 1 .. ctx - 1, so every scored token has more
    than ctx/2 tokens of context)."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 3 or ctx > model.config.n_ctx:
        raise ValueError(f"ctx must be an integer from 3 to {model.config.n_ctx}, got {ctx!r}")
    ids = model.tokenize(text)
    n_chunks = len(ids) // ctx
    if n_chunks == 0:
        raise ValueError(f"the text is {len(ids)} tokens, shorter than one window of ctx={ctx}; "
                         f"lower ctx or give more text")
    first = ctx // 2
    nll, count = 0.0, 0
    session = model.session()
    with Progress(n_chunks, "perplexity", unit="windows", enabled=progress) as bar:
        for c in range(n_chunks):
            window = ids[c * ctx:(c + 1) * ctx]
            if model.tokenizer.add_bos:
                window[0] = model.tokenizer.bos_id
            session.reset()
            logits = session.feed(window, all_logits=True)
            lp = _target_logprobs(logits[first:ctx - 1], window[first + 1:])
            nll -= float(lp.astype(np.float64).sum())
            count += len(lp)
            bar.update(1)
    return float(np.exp(nll / count))


def generate_batch(model, prompts: Sequence, *, progress: bool | None = None, **options) -> list[str]:
    """The generated text for each prompt, in input order (a progress bar shows for long lists).

    Prompts run together with continuous batching (`npllama.scheduler.generate_many`: new prompts
    join as others finish, shared prefixes are computed once); with greedy sampling each result
    equals running that prompt alone (on a CUDA device too: its batched pass computes each token
    as a session does). Where that equality could not hold, the prompts run one by one: in int8
    mode for a model with a product weight of a type without panels (kernels/panels.py), which
    the decode step and the batched pass would compute with different kernels.
    """
    from ..engine.batch import steps_match
    if steps_match(model):
        from .scheduler import generate_many
        return generate_many(model, prompts, progress=progress, **options)
    results = []
    with Progress(len(prompts), "generate", unit="prompts", enabled=progress) as bar:
        for p in prompts:
            results.append(generate(model, p, **options))
            bar.update(1)
    return results
