"""Text generation: a generator of tokens over a Session, with streaming text, stop strings that
may span token boundaries, EOS/end-of-turn stops, and optional top-N logprobs.

`generate_tokens` is the engine; `complete` collects it into a `Completion`, and `stream`
yields only the text pieces.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from ..errors import ContextOverflowError, show
from ..text.tokenizer import StreamDecoder
from .sampling import GREEDY, Sampler, SamplingParams, make_sampler


@dataclass
class Token:
    """One generated token: its id, the text it completed, and (optionally) logprobs."""
    id: int
    text: str
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None  # [(id, logprob)], best first


@dataclass
class Completion:
    """A generated text. `incomplete` is True when the output was constrained (json_schema, regex
    or grammar) and generation ended before the text satisfied the constraint: max_tokens or
    the context cut it short ("length"), or a stop string did. Such a text is the start of a
    conforming output and will not parse. It is False otherwise, and always for unconstrained
    generation."""
    text: str
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (EOS, end of turn, a stop string, a constraint complete) or "length"
    prompt_tokens: int = 0
    incomplete: bool = False


class _StopScanner:
    """Holds back text that may be the start of a stop string, and finds stop strings that span
    several tokens. `push(text)` returns (text safe to emit, stopped?)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in check_stop(stops) if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:n]):
                    hold = n
                    break
        out = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {show(value)}")
    return int(value)


def check_max_tokens(max_tokens) -> int:
    """`max_tokens` as an int, or ValueError unless it is a non-negative integer."""
    return _count("max_tokens", max_tokens)


def check_logprobs(logprobs) -> int:
    """`logprobs` (how many top alternatives to report per token; 0 for none) as an int."""
    return _count("logprobs", logprobs)


SAMPLING_KEYS = frozenset(SamplingParams.__dataclass_fields__)  # the sampling keywords of the text API


def prompt_ids(model, prompt, room: int | None = None) -> list[int]:
    """The token ids of a prompt: text (encoded with its special tokens) or token ids (checked).
    With `room` (the prompt tokens that fit), a text too long to fit whatever its tokens is
    refused before it is tokenized, which for megabytes of text takes seconds."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the prompt is empty: give some text (or token ids) to continue")
        if room is not None and len(prompt) > room:
            n_bytes = len(prompt.encode("utf-8", "surrogatepass"))
            least = -(-n_bytes // model.tokenizer.longest_token_bytes)
            if least > room:
                raise ContextOverflowError(
                    f"the prompt is {n_bytes} bytes of text, at least {least} tokens, but only {max(room, 0)} "
                    f"prompt tokens fit in the context; shorten the prompt, lower max_tokens, raise ctx, "
                    f"or pass truncate=True")
        return model.tokenize(prompt, special=True)
    ids = model.check_ids(prompt)  # raises on empty or out-of-range ids
    return [int(i) for i in ids]


def check_stop(stop) -> list[str]:
    """Stop strings as a list: one str, or a list or tuple of str; ValueError otherwise."""
    if isinstance(stop, str):
        return [stop]
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a string or a list of strings, got {show(stop)}")
    return list(stop)


def fit_prompt(ids: list[int], ctx: int, max_tokens: int, truncate: bool) -> list[int]:
    """`ids` if prompt plus generation fits in `ctx`; else its tail when `truncate`, else an error."""
    room = ctx - max_tokens
    if len(ids) <= room:
        return ids
    if truncate and room > 0:
        return ids[len(ids) - room:]
    raise ContextOverflowError(
        f"the prompt is {len(ids)} tokens and max_tokens is {max_tokens}, but the context holds "
        f"{ctx} tokens; shorten the prompt, lower max_tokens, raise ctx, or pass truncate=True "
        f"to keep only the last {max(room, 0)} prompt tokens")


def generate_tokens(session, prompt_ids: Sequence[int], *, max_tokens: int = 256,
                    sampler: Sampler | None = None, stop: Sequence[str] = (),
                    stop_ids: set[int] | None = None, logprobs: int = 0, matcher=None) -> Iterator[Token]:
    """Feed `prompt_ids` to `session`, then sample up to `max_tokens` tokens, yielding each as a
    Token whose `text` is what became safe to show (possibly ""). Generation ends at a stop id
    (default: EOS and end-of-turn ids), at a stop string (not emitted), or at `max_tokens`.
    The generator returns `(finish_reason, tail)`: "stop" or "length", and the text that was
    held back (a possible start of a stop string that never completed).

    `matcher` (a `structured.Matcher`, from `Constraint.matcher()`) constrains the output: each
    token is sampled from the logits it masks, EOS/end-of-turn only where the output may end,
    and generation stops ("stop") as soon as the output is complete. When generation ends, the
    matcher's `conforms` says whether the returned text satisfies the constraint.

    The arguments are checked when it is called, before any token: ValueError for an empty
    prompt, a `max_tokens` or `logprobs` that is not a non-negative integer, or a `stop` that is
    not a string or a list of strings."""
    max_tokens = check_max_tokens(max_tokens)
    logprobs = check_logprobs(logprobs)
    scanner = _StopScanner(stop)
    if not len(prompt_ids):
        raise ValueError("the prompt is empty: give at least one token to generate from")
    return _generate(session, prompt_ids, max_tokens, sampler or make_sampler(GREEDY), scanner, stop_ids,
                     logprobs, matcher)


class TokenPicker:
    """The part of generation that runs once per token, shared by a session's loop
    (`generate_tokens`) and the continuous batching's requests (`scheduler.Request`): mask the
    logits (under a constraint), sample, stop at an end-of-turn id, a stop string or a complete
    constrained output, and decode the text that became safe to show."""

    def __init__(self, tokenizer, history: list[int], sampler: Sampler, scanner: "_StopScanner",
                 stop_ids, logprobs: int, matcher=None):
        self.decoder = StreamDecoder(tokenizer, skip_special=True)
        self.history, self.sampler, self.scanner = history, sampler, scanner
        self.stop_ids, self.logprobs, self.matcher = stop_ids, logprobs, matcher
        self.shown: list[str] = []  # the text so far, to check a constrained output a stop string cuts

    def pick(self, logits) -> tuple[Token | None, str | None]:
        """(the next Token, how generation ends with it): (None, "stop") at an end-of-turn id;
        "stop string" when a stop string ended the text (nothing is held back: no `finish`);
        "complete" when the constrained output is complete; None to go on."""
        m = self.matcher
        if m is not None:
            logits = m.mask(logits)
        tid = self.sampler(logits, self.history)
        if tid in self.stop_ids:
            return None, "stop"
        if m is not None:
            m.consume(tid)
        self.history.append(tid)
        text, stopped = self.scanner.push(self.decoder.feed(tid))
        token = Token(tid, text, *(_logprobs(logits, tid, self.logprobs) if self.logprobs else ()))
        if stopped:
            if m is not None:
                m.conforms = m.constraint.accepts("".join(self.shown) + text)
            return token, "stop string"
        if m is not None:
            self.shown.append(text)
            if m.done:
                return token, "complete"
        return token, None

    def finish(self) -> str:
        """End generation (other than by a stop string): the text held back (a possible start of
        a stop string that never completed); the matcher says whether the output conforms."""
        if self.matcher is not None:
            self.matcher.conforms = self.matcher.accepting
        tail, _ = self.scanner.push(self.decoder.flush())
        return tail + self.scanner.flush()


def _generate(session, prompt_ids, max_tokens, sampler, scanner, stop_ids, logprobs, matcher=None):
    tok = session.model.tokenizer
    picker = TokenPicker(tok, list(session.tokens) + list(prompt_ids), sampler, scanner,
                         tok.eot_ids if stop_ids is None else stop_ids, logprobs, matcher)
    if max_tokens == 0 or matcher is not None and matcher.done:
        return ("stop" if max_tokens and matcher is not None else "length"), picker.finish()
    logits = session.feed(prompt_ids)
    reason = "length"
    for n in range(max_tokens):
        token, end = picker.pick(logits)
        if token is None:
            reason = "stop"
            break
        yield token
        if end == "stop string":
            return "stop", ""
        if end == "complete":
            reason = "stop"
            break
        if n + 1 == max_tokens or session.pos >= session.ctx:
            break
        logits = session.feed([token.id])
    return reason, picker.finish()


def _logprobs(logits: np.ndarray, tid: int, n: int):
    lp = logits.astype(np.float64)
    lp = lp - (lp.max() + np.log(np.exp(lp - lp.max()).sum()))
    top = np.argsort(-lp)[:n]
    return float(lp[tid]), [(int(i), float(lp[i])) for i in top]


def complete(session, prompt_ids: Sequence[int], **kw) -> Completion:
    """Run `generate_tokens` to the end and collect the text, tokens, finish reason and (for a
    constrained output, with `matcher`) whether it is incomplete."""
    gen = generate_tokens(session, prompt_ids, **kw)
    tokens: list[Token] = []
    try:
        while True:
            tokens.append(next(gen))
    except StopIteration as end:
        reason, tail = end.value
    matcher = kw.get("matcher")
    return Completion("".join(t.text for t in tokens) + tail, tokens, reason, len(prompt_ids),
                      incomplete=matcher is not None and not matcher.conforms)


def stream(session, prompt_ids: Sequence[int], **kw) -> Iterator[str]:
    """The generated text piece by piece, as it becomes safe to show (arguments checked at once)."""
    return _pieces(generate_tokens(session, prompt_ids, **kw))


def _pieces(gen) -> Iterator[str]:
    try:
        while True:
            t = next(gen)
            if t.text:
                yield t.text
    except StopIteration as end:
        if end.value[1]:
            yield end.value[1]
