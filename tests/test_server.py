"""`npllama serve`: real uvicorn servers on free loopback ports, driven by the official `openai`
client and by raw httpx (to read the SSE lines).

Most tests use two tiny random models: tinygguf's llama (a ChatML chat template; its greedy
text is a repeated token) for chat, and the llama fixture of tests/fixtures/arch (varied text,
no chat template) for /v1/completions where the text must vary. A few use the default model.
A server's teardown fails the test if the engine thread or a handler hit an unexpected error,
and an exception in any thread fails the test (filterwarnings below).
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import jsonschema
import numpy as np
import openai
import pytest

import npllama
from npllama.server.run import build

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
              pytest.mark.timeout(120)]

ARCH_LLAMA = Path(__file__).parent / "fixtures" / "arch" / "llama.gguf"
KEY = "sekrit-key"


class Running:
    """A server in a background thread; `close()` stops it and checks it met no internal error."""

    def __init__(self, model, **options):
        urls = queue.Queue()
        self.server = build(model, host="127.0.0.1", port=0, log_level="error", on_ready=urls.put, **options)
        self.app, self.engine = self.server.app, self.server.app.state.engine
        self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self.thread.start()
        self.url = urls.get(timeout=60)
        self.model = model
        self.auth: dict = {}  # headers for /metrics

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=60, **kw)

    def post(self, path, body=None, **kw) -> httpx.Response:
        return httpx.post(self.url + path, json=body, **{"timeout": 60, **kw})

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", headers=self.auth, timeout=10).text
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))

    def close(self) -> None:
        deadline = time.monotonic() + 10
        while self.app.state.handlers.active:  # every answered or abandoned request was let go
            assert time.monotonic() < deadline, f"{self.app.state.handlers.active} requests still counted"
            time.sleep(0.05)
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the server did not stop"
        assert not self.engine.alive, "the engine thread did not stop"
        assert self.app.state.internal_errors == [], self.app.state.internal_errors
        assert self.engine.failures == [], self.engine.failures


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    s = Running(npllama.Model(tiny_model_path), ctx=128, parallel=4)
    yield s
    s.close()


@pytest.fixture(scope="module")
def varied():
    s = Running(npllama.Model(ARCH_LLAMA), ctx=128, parallel=8)
    yield s
    s.close()


@pytest.fixture(scope="module")
def locked(tiny_model_path):
    s = Running(npllama.Model(tiny_model_path), ctx=64, parallel=2, api_key=KEY,
                cors_origins=["http://ok.example"], max_body=4096, max_queue=1)
    s.auth = {"Authorization": f"Bearer {KEY}"}
    yield s
    s.close()


SLOW = 777  # the seed that slow_sampler slows down


@pytest.fixture
def slow_sampler(monkeypatch):
    """Requests with seed SLOW sample one token per 50 ms (so that they are still running)."""
    import npllama.server.engine as eng
    real = eng.make_sampler

    def make(params):
        sample = real(params)
        if params.seed != SLOW:
            return sample

        def slow(logits, history):
            time.sleep(0.05)
            return sample(logits, history)
        return slow
    monkeypatch.setattr(eng, "make_sampler", make)


def sse(url: str, body: dict, headers=None) -> list:
    """The parsed `data:` events of a streamed request ("[DONE]" kept as is)."""
    out = []
    with httpx.stream("POST", url, json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
            else:
                assert line == "", line
    return out


def streamed_text(events, k=0, chat=False) -> str:
    return "".join((c["delta"].get("content") or "") if chat else c["text"]
                   for e in events if isinstance(e, dict) for c in e.get("choices", []) if c["index"] == k)


# ---- chat: the streaming x include_usage x n matrix ---------------------------------------------
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say something."}]


@pytest.mark.parametrize("n", [1, 3])
def test_chat_matrix(tiny, n):
    m = tiny.model
    prompt_tokens = len(m.tokenize(m.format_chat(CHAT), special=True))
    c = tiny.client()
    opts = dict(model="any", messages=CHAT, max_tokens=6, temperature=1.0, seed=7, n=n, logprobs=True)
    cached = tiny.metric("npllama_prompt_tokens_cached_total")
    full = c.chat.completions.create(**opts)
    if n > 1:  # the choices share the prompt's full pages
        assert tiny.metric("npllama_prompt_tokens_cached_total") - cached >= (n - 1) * (prompt_tokens // 16) * 16 > 0
    assert [ch.index for ch in full.choices] == list(range(n))
    texts = [ch.message.content for ch in full.choices]
    assert all(ch.finish_reason in ("stop", "length") and ch.message.role == "assistant" for ch in full.choices)
    n_tokens = sum(len(ch.logprobs.content) for ch in full.choices)
    assert full.usage.prompt_tokens == prompt_tokens
    assert full.usage.completion_tokens == n_tokens and full.usage.total_tokens == prompt_tokens + n_tokens
    for include_usage in (False, True):
        chunks = list(c.chat.completions.create(**opts, stream=True,
                                                stream_options={"include_usage": include_usage}))
        finishes = [(ch.index, ch.finish_reason) for x in chunks for ch in x.choices if ch.finish_reason]
        assert sorted(finishes) == sorted((ch.index, ch.finish_reason) for ch in full.choices)  # one each
        for k in range(n):
            assert "".join(ch.delta.content or "" for x in chunks for ch in x.choices if ch.index == k) == texts[k]
        usage = [x for x in chunks if x.usage is not None]
        if include_usage:
            assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1].choices == []
            assert usage[0].usage.model_dump() == full.usage.model_dump()
        else:
            assert usage == []
    # without stream_options at all: no usage chunk either, and the raw stream ends with [DONE]
    events = sse(tiny.url + "/v1/chat/completions", {**opts, "stream": True})
    assert events[-1] == "[DONE]" and all("usage" not in e for e in events[:-1])
    assert [streamed_text(events, k, chat=True) for k in range(n)] == texts


def test_completions_stream_equals_full(varied):
    c = varied.client()
    opts = dict(model="x", prompt=["Once upon", "The sea"], max_tokens=10, temperature=1.0, top_p=1.0,
                seed=11, n=2, logprobs=3)
    full = c.completions.create(**opts, extra_body={"top_k": 0})
    assert len(full.choices) == 4
    assert len({ch.text for ch in full.choices}) > 1  # the seeds of the choices differ
    events = sse(varied.url + "/v1/completions", {**opts, "top_k": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    assert [streamed_text(events, k) for k in range(4)] == [ch.text for ch in full.choices]
    assert events[-2]["usage"] == full.usage.model_dump(exclude_none=True)
    m = varied.model
    assert full.usage.prompt_tokens == len(m.tokenize("Once upon", special=True)) + len(m.tokenize("The sea", special=True))
    assert full.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in full.choices)
    for ch in full.choices:
        assert all(len(top) <= 3 for top in ch.logprobs.top_logprobs)
    # the library gives the same text for the same seed
    assert full.choices[0].text == m.complete("Once upon", max_tokens=10, temperature=1.0, top_k=0, top_p=1.0,
                                              seed=11).text


def test_stop_strings_split_across_tokens(varied):
    body = dict(prompt="The weather", max_tokens=24, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=3)
    url = varied.url + "/v1/completions"
    pieces = [c["text"] for e in sse(url, {**body, "stream": True}) if isinstance(e, dict)
              for c in e["choices"] if c["text"]]
    text = "".join(pieces)
    # a stop string made of the end of one token and the start of the next (and of three tokens)
    bounds = np.cumsum([len(p) for p in pieces])[:-1]
    stops = [(text[b - 1:b + 1], b - 1) for b in bounds if text.find(text[b - 1:b + 1]) == b - 1]
    assert stops, f"no usable token boundary in {pieces!r}"
    spans = [(text[b - 1:e + 1], b - 1) for b, e in zip(bounds, bounds[1:]) if text.find(text[b - 1:e + 1]) == b - 1]
    for stop, at in stops[:2] + spans[:1]:
        events = sse(url, {**body, "stream": True, "stop": [stop, "\x00never"]})
        assert streamed_text(events) == text[:at], (stop, pieces)
        assert [c["finish_reason"] for e in events[:-1] for c in e["choices"] if c["finish_reason"]] == ["stop"]
        full = varied.post("/v1/completions", {**body, "stop": stop}).json()
        assert full["choices"][0]["text"] == text[:at] and full["choices"][0]["finish_reason"] == "stop"
    # a stop string whose start ends the text is held back, then sent at the end
    events = sse(url, {**body, "stream": True, "stop": text[-1] + "\x00"})
    assert streamed_text(events) == text


def test_greedy_concurrent_equals_sequential(varied):
    c = varied.client()
    prompts = ["Once", "A long time ago", "The quick brown", "1 2 3", "Hello there", "It was", "We", "Zebra"]

    def run(p):
        return c.completions.create(model="x", prompt=p, max_tokens=12, temperature=0).choices[0].text
    one_by_one = [run(p) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        together = list(ex.map(run, prompts))
    assert together == one_by_one
    assert len(set(one_by_one)) > 4


# ---- cancellation and load ---------------------------------------------------------------------
def test_abandoned_streams_are_cancelled(varied):
    import asyncio
    before = {k: varied.metric(k) for k in ("npllama_generation_tokens_total", "npllama_cancelled_requests_total")}

    async def abandon(client):
        async with client.stream("POST", varied.url + "/v1/completions",
                                 json=dict(prompt="Tell me", max_tokens=100, temperature=0, stream=True)) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return json.loads(line[6:])["choices"][0]["text"] is not None

    async def burst():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(abandon(client) for _ in range(16)))
    assert asyncio.run(burst()) == [True] * 16
    t = time.monotonic()
    r = varied.client().completions.create(model="x", prompt="After", max_tokens=4, temperature=0)
    print(f"\nrequest after 16 abandoned streams: {time.monotonic() - t:.3f} s")
    assert r.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 20
    while varied.metric("npllama_running_sequences") or varied.metric("npllama_kv_pages_used"):
        assert time.monotonic() < deadline, "abandoned streams kept running or kept their pages"
        time.sleep(0.05)
    generated = varied.metric("npllama_generation_tokens_total") - before["npllama_generation_tokens_total"]
    assert generated < 16 * 100 / 2  # run to the end, they would have made 16 x 100 tokens
    assert varied.metric("npllama_cancelled_requests_total") > before["npllama_cancelled_requests_total"]
    time.sleep(0.3)
    assert varied.metric("npllama_generation_tokens_total") - before["npllama_generation_tokens_total"] == generated


def test_abandoned_request_is_cancelled(tiny, slow_sampler):
    """A non-streamed request whose client goes away is cancelled too."""
    before = tiny.metric("npllama_cancelled_requests_total")
    with pytest.raises(httpx.ReadTimeout):
        tiny.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "seed": SLOW,
                                           "max_tokens": 100}, timeout=0.5)
    deadline = time.monotonic() + 20
    while tiny.metric("npllama_cancelled_requests_total") == before or tiny.metric("npllama_running_sequences"):
        assert time.monotonic() < deadline, "the abandoned request was not cancelled"
        time.sleep(0.05)


def test_busy_server_answers_503(locked, slow_sampler):
    """parallel 2 + max_queue 1: a fourth request while three run or wait is a 503."""
    body = {"messages": [{"role": "user", "content": "hi"}], "seed": SLOW, "max_tokens": 40, "stream": True}
    url = locked.url + "/v1/chat/completions"
    with httpx.Client(timeout=60, headers=locked.auth) as c:
        streams = [c.stream("POST", url, json=body) for _ in range(3)]
        lines = []  # kept: a dropped line iterator closes its response
        try:
            for s in streams:
                r = s.__enter__()
                assert r.status_code == 200
                lines.append(r.iter_lines())
                assert next(lines[-1]).startswith("data: ")  # the role chunk: it is in
            r = c.post(url, json={**body, "stream": False})
            assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    deadline = time.monotonic() + 20
    while locked.metric("npllama_running_sequences") or locked.metric("npllama_queue_depth"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert locked.client(api_key=KEY).completions.create(model="x", prompt="the", max_tokens=2).choices


def test_load_64_requests_32_threads(varied, tiny):
    vc, tc = varied.client(), tiny.client()

    def one(i):
        t = time.monotonic()
        stream = i % 2 == 0
        if i % 4 < 2:
            kw = dict(model="x", prompt=f"Request {i}:", max_tokens=8, temperature=0.8, seed=i)
            if stream:
                chunks = list(vc.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                text = "".join(ch.text for x in chunks for ch in x.choices)
                reasons = [ch.finish_reason for x in chunks for ch in x.choices if ch.finish_reason]
                usage = chunks[-1].usage
            else:
                r = vc.completions.create(**kw)
                text, reasons, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
        else:
            kw = dict(model="x", messages=[{"role": "user", "content": f"Question {i}"}], max_tokens=8, seed=i)
            if stream:
                chunks = list(tc.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
                text = "".join(ch.delta.content or "" for x in chunks for ch in x.choices)
                reasons = [ch.finish_reason for x in chunks for ch in x.choices if ch.finish_reason]
                usage = chunks[-1].usage
            else:
                r = tc.chat.completions.create(**kw)
                text, reasons, usage = r.choices[0].message.content, [r.choices[0].finish_reason], r.usage
        assert len(reasons) == 1 and reasons[0] in ("stop", "length")
        assert usage.completion_tokens <= 8 and (reasons[0] == "stop" or usage.completion_tokens == 8)
        assert isinstance(text, str) and usage.prompt_tokens > 0
        return time.monotonic() - t

    with cf.ThreadPoolExecutor(32) as ex:
        lat = sorted(ex.map(one, range(64)))
    print(f"\n64 requests / 32 threads: p50 {lat[31] * 1000:.0f} ms, p99 {lat[63] * 1000:.0f} ms")
    assert len(lat) == 64


# ---- the other routes ---------------------------------------------------------------------------
def test_models_health_metrics_tokenize(tiny):
    assert httpx.get(tiny.url + "/health").json() == {"status": "ok"}
    models = tiny.client().models.list()
    assert [m.id for m in models.data] == [tiny.app.state.model_id]
    text = httpx.get(tiny.url + "/metrics").text
    for name in ("npllama_requests_total", "npllama_prompt_tokens_total", "npllama_generation_tokens_total",
                 "npllama_queue_depth", "npllama_running_sequences", "npllama_kv_pages_used",
                 "npllama_kv_pages_total", "npllama_time_to_first_token_seconds_bucket",
                 "npllama_generation_tokens_per_second_bucket"):
        assert name in text, name
    ids = tiny.post("/tokenize", {"content": "the hello<|im_end|>"}).json()["tokens"]
    assert ids == tiny.model.tokenize("the hello<|im_end|>", special=True)
    pieces = tiny.post("/tokenize", {"content": "the", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "the"
    assert tiny.post("/detokenize", {"tokens": ids}).json() == {"content": tiny.model.detokenize(ids)}


def test_embeddings(tiny):
    c = tiny.client()
    one = c.embeddings.create(model="x", input="the cat")  # the client asks for base64
    many = c.embeddings.create(model="x", input=["the cat", "a dog sat"], encoding_format="float")
    want = tiny.model.embed(["the cat", "a dog sat"])
    np.testing.assert_allclose(one.data[0].embedding, want[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose([d.embedding for d in many.data], want, rtol=1e-6, atol=1e-7)
    assert many.usage.prompt_tokens == len(tiny.model.tokenize("the cat")) + len(tiny.model.tokenize("a dog sat"))


# ---- bad input and security ---------------------------------------------------------------------
HUGE = "x" * 100_000
BAD = [
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 1000}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "seed": -3}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"uniqueItems": True}}}},
     400, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": HUGE, "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages[0].content"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hi"}, 400, "messages"),
    ({}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": 5}, 400, "model"),
    ({"messages": [{"role": "user", "content": "hi " * 200}]}, 400, "messages"),          # longer than ctx
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}, 400, "messages"),
    ({"messages": [{"role": "user", "content": HUGE}], "stream": True}, 400, "messages"),
]


@pytest.mark.parametrize("body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_chat_requests(tiny, body, status, param):
    r = tiny.post("/v1/chat/completions", body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert len(r.content) < 1500  # never echoes a huge input back
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    overflow = len(json.dumps(body)) > 500 and param == "messages" or body.get("max_tokens") == 200
    assert (err["code"] == "context_length_exceeded") == overflow


def test_bad_requests_other_routes(tiny):
    url = tiny.url
    cases = [
        (httpx.post(url + "/v1/chat/completions", content=b"{not json"), 400),
        (httpx.post(url + "/v1/chat/completions", content=b"[1, 2]"), 400),
        (httpx.post(url + "/v1/chat/completions", content=b"[" * 100_000), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 10**9]}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": ""}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": "a", "echo": True}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": ["a"] * 8, "n": 16}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": [[]]}), 400),
        (httpx.post(url + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 8}), 400),
        (httpx.post(url + "/v1/embeddings", json={"input": ""}), 400),
        (httpx.post(url + "/v1/embeddings", json={"input": ["a"], "encoding_format": "hex"}), 400),
        (httpx.post(url + "/v1/embeddings", json={"input": "the " * 300}), 400),
        (httpx.post(url + "/tokenize", json={"text": "a"}), 400),
        (httpx.post(url + "/detokenize", json={"tokens": [-1]}), 400),
        (httpx.post(url + "/detokenize", json={"tokens": "abc"}), 400),
        (httpx.get(url + "/v1/chat/completions"), 405),
        (httpx.post(url + "/v1/nothing", json={}), 404),
        (httpx.post(url + "/v1/completions", content=b"x" * (5 << 20)), 413),
        (httpx.post(url + "/v1/completions", content=iter([b"x" * (1 << 20)] * 5)), 413),  # chunked, no length
    ]
    for r, status in cases:
        assert r.status_code == status, (r.request.url, r.text)
        assert len(r.content) < 1500 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert tiny.post("/v1/completions", {"prompt": "x" * 5000, "max_tokens": 8}).json()["error"]["code"] == \
        "context_length_exceeded"
    # and it keeps serving
    r = tiny.client().completions.create(model="x", prompt="the", max_tokens=3)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_openai_client_raises_on_bad_input(tiny):
    with pytest.raises(openai.BadRequestError) as e:
        tiny.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi " * 200}],
                                              stream=True)
    assert e.value.code == "context_length_exceeded"


def test_auth_and_cors(locked, tiny):
    url = locked.url
    for path in ("/v1/models", "/metrics"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.get(url + path, headers=locked.auth).status_code == 200
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        locked.client(api_key="wrong").models.list()
    assert locked.client(api_key=KEY).completions.create(model="x", prompt="the", max_tokens=2).choices
    # its body limit is 4096 bytes
    assert httpx.post(url + "/tokenize", content=b"{" + b" " * 5000 + b"}", headers=locked.auth).status_code == 413
    # CORS: only the named origin, preflight answered without a key
    pre = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(url + "/v1/chat/completions", headers=pre)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    r = httpx.get(url + "/v1/models", headers={**locked.auth, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(tiny.url + "/v1/models", headers={"Origin": "http://ok.example"})
    assert "access-control-allow-origin" not in r.headers  # off unless --cors-origin names it


def test_a_failing_sampler_fails_only_its_request(tiny, monkeypatch):
    """A request whose sampler raises gets a 400 (it is its own input), the others finish."""
    import npllama.server.engine as eng
    real = eng.make_sampler

    def maybe_failing(params):
        sample = real(params)
        if params.seed == 666:
            def fail(logits, history):
                raise ValueError("every token's logit is -inf")
            return fail
        return sample
    monkeypatch.setattr(eng, "make_sampler", maybe_failing)
    c = tiny.client()
    msgs = [{"role": "user", "content": "hi"}]
    with cf.ThreadPoolExecutor(3) as ex:
        ok = [ex.submit(c.chat.completions.create, model="x", messages=msgs, max_tokens=20, seed=s) for s in (1, 2)]
        bad = tiny.post("/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "seed": 666})
        events = sse(tiny.url + "/v1/chat/completions", {"messages": msgs, "seed": 666, "stream": True})
        assert all(f.result().choices[0].finish_reason in ("stop", "length") for f in ok)
    assert bad.status_code == 400 and "-inf" in bad.json()["error"]["message"]
    assert "error" in events[-1]


# ---- the command line ---------------------------------------------------------------------------
def _cli(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-m", "npllama", "serve", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def test_cli_serve_prints_url_and_stops_on_sigterm(tiny_model_path):
    p = _cli("-m", str(tiny_model_path), "--port", "0", "-c", "64", "--parallel", "2", "--log-level", "warning")
    try:
        line = p.stdout.readline()
        url = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line).group(1)
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        with httpx.stream("POST", url + "/v1/completions",
                          json={"prompt": "the", "max_tokens": 40, "stream": True}, timeout=30) as r:
            p.send_signal(signal.SIGTERM)
            lines = [x for x in r.iter_lines() if x]
        assert lines[-1] == "data: [DONE]"  # the running request finished
        p.wait(timeout=20)
        assert p.returncode in (0, -signal.SIGTERM), p.stderr.read()  # uvicorn re-raises the signal
    finally:
        p.kill()
        p.wait()


def test_cli_serve_refuses_a_pool_too_big_for_memory(tiny_model_path):
    p = _cli("-m", str(tiny_model_path), "--port", "0", "-c", "256", "--parallel", "100000000")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1 and "npllama: error:" in err and "--parallel" in err, err
    assert "Traceback" not in err


# ---- the default model --------------------------------------------------------------------------
@pytest.mark.model
def test_default_model_int8_concurrent_equals_sequential(default_model_path):
    """With int8 activations a token's products round its quantized input, so they would
    magnify any difference in the last bit: the server computes a lone request as it computes
    a batch, and concurrent greedy requests equal the same requests one at a time."""
    s = Running(npllama.Model(default_model_path, activations="int8"), ctx=256, parallel=6)
    try:
        c = s.client()
        questions = ["What is the capital of France?", "Name a color.", "Count to five.", "Say hello.",
                     "Write a haiku about rain.", "Why is the sky blue?"]

        def run(q):
            return c.chat.completions.create(model="x", messages=[{"role": "user", "content": q}], max_tokens=24,
                                             temperature=0).choices[0].message.content
        one_by_one = [run(q) for q in questions]
        with cf.ThreadPoolExecutor(len(questions)) as ex:
            assert list(ex.map(run, questions)) == one_by_one
        assert len(set(one_by_one)) == len(questions)
    finally:
        s.close()


@pytest.mark.model
def test_default_model_end_to_end(default_model):
    s = Running(default_model, ctx=512, parallel=4)
    try:
        c = s.client()
        questions = ["What is the capital of France?", "Name a color.", "Count to five.", "Say hello."]
        msgs = [[{"role": "user", "content": q}] for q in questions]
        with cf.ThreadPoolExecutor(4) as ex:
            full = list(ex.map(lambda m: c.chat.completions.create(model="x", messages=m, max_tokens=24,
                                                                   temperature=0), msgs))
        for m, r in zip(msgs, full):
            assert r.choices[0].message.content == default_model.chat(m, max_tokens=24, temperature=0)
            chunks = list(c.chat.completions.create(model="x", messages=m, max_tokens=24, temperature=0,
                                                    stream=True))
            assert "".join(ch.delta.content or "" for x in chunks for ch in x.choices) == r.choices[0].message.content
        assert "Paris" in full[0].choices[0].message.content
        # a stop string on real text, split across tokens
        text = full[0].choices[0].message.content
        at = text.index("Paris")
        stop = text[at + 3:at + 7]  # "is" and what follows: the end of one token and the next
        r = c.chat.completions.create(model="x", messages=msgs[0], max_tokens=24, temperature=0, stop=stop,
                                      stream=True)
        assert "".join(ch.delta.content or "" for x in r for ch in x.choices) == text[:text.index(stop)]
        # structured output on real text: the reply parses and validates
        city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "country": {"type": "string", "maxLength": 20}},
                "required": ["city", "country"], "additionalProperties": False}
        r = c.chat.completions.create(model="x", messages=[{"role": "user", "content": "Where is the Eiffel Tower? "
                                                            "Answer in JSON with city and country."}],
                                      max_tokens=48, temperature=0,
                                      response_format={"type": "json_schema",
                                                       "json_schema": {"name": "place", "schema": city}})
        jsonschema.validate(json.loads(r.choices[0].message.content), city)
        assert r.choices[0].finish_reason == "stop"
    finally:
        s.close()


PICK = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
        "required": ["ok", "n"], "additionalProperties": False,
        "x-guidance": {"whitespace_flexible": False}}  # compact: a random tiny model would indent forever


def test_response_format_constrains_every_choice_streamed_or_not(varied):
    """On /v1/completions (this tiny model has no chat template), as on chat: every choice
    parses and validates, and the streamed choices equal the non-streamed ones."""
    c = varied.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": PICK, "strict": True}}
    opts = dict(model="x", prompt="pick", max_tokens=40, temperature=1.0, seed=3, n=3,
                extra_body={"response_format": fmt})
    r = c.completions.create(**opts)
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.text), PICK)
        assert ch.finish_reason == "stop"
    chunks = list(c.completions.create(**opts, stream=True))
    streamed = ["".join(ch.text for x in chunks for ch in x.choices if ch.index == i) for i in range(3)]
    assert streamed == [ch.text for ch in r.choices]
    short = c.completions.create(model="x", prompt="pick", max_tokens=2, temperature=0,
                                 extra_body={"response_format": fmt})
    assert short.choices[0].finish_reason == "length"  # cut short: the start of a conforming object
    assert short.choices[0].text.startswith("{")


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(tiny, monkeypatch):
    import npllama.generation.scheduler
    real, calls = npllama.generation.scheduler.forward_batch, []

    def forward_failing_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return real(*args, **kw)
    monkeypatch.setattr(npllama.generation.scheduler, "forward_batch", forward_failing_once)
    r = tiny.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 500 and r.json()["error"]["message"] == "the engine failed: RuntimeError"
    assert [str(e) for e in tiny.engine.failures] == ["boom"]
    tiny.engine.failures.clear()  # expected here; any other fails the server's teardown
    assert tiny.client().chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4).choices[0].finish_reason == "length"
    assert tiny.metric("npllama_kv_pages_used") == 0


def test_a_client_that_leaves_mid_body_is_no_server_error(tiny):
    import socket
    host, port = tiny.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"messages\": [")
        time.sleep(0.2)
    time.sleep(0.2)
    assert httpx.get(tiny.url + "/health").status_code == 200  # and teardown finds no internal error
