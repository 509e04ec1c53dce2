"""/v1/embeddings and /v1/rerank on embedding and reranking models (tests/fixtures/embed: a tiny
BERT with mean pooling, a RoBERTa cross-encoder), through real servers, the official `openai`
client and raw httpx. The answers equal `Model.embed` / `Model.rerank` on the same texts."""
from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import openai
import pytest

import npllama
from npllama.server.run import build
from test_server import Running

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning"),
              pytest.mark.timeout(120)]

FIXTURES = Path(__file__).parent / "fixtures" / "embed"
TEXTS = ["the quick brown fox", "Héllo, wörld!", "a"]
QUERY = "what does the fox do"
DOCS = ["the fox jumps over the dog", "stock prices fell today", "a quick brown fox", "rain in spain"]


@pytest.fixture(scope="module")
def bert():
    s = Running(npllama.load(FIXTURES / "bert.gguf"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def bert_matryoshka():
    s = Running(npllama.load(FIXTURES / "bert.gguf"), matryoshka=[16, 32])
    yield s
    s.close()


@pytest.fixture(scope="module")
def reranker():
    s = Running(npllama.load(FIXTURES / "roberta-rerank.gguf"))
    yield s
    s.close()


def error(r, param, code=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    assert code is None or err["code"] == code, err
    return err["message"]


def test_embeddings_equal_the_model(bert):
    want = bert.model.embed(TEXTS)
    c = bert.client()
    got = c.embeddings.create(model="x", input=TEXTS)  # the client asks for base64 and decodes it
    np.testing.assert_array_equal(np.array([d.embedding for d in got.data], np.float32), want)
    assert [d.index for d in got.data] == [0, 1, 2]
    tok = bert.model.tokenizer
    n = sum(len(tok.encode_input(t)[0]) for t in TEXTS)  # [CLS] ... [SEP] each
    assert got.usage.prompt_tokens == got.usage.total_tokens == n
    floats = c.embeddings.create(model="x", input=TEXTS[0], encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, want[0], rtol=1e-7)
    raw = bert.post("/v1/embeddings", {"input": TEXTS, "encoding_format": "base64"}).json()
    for d, v in zip(raw["data"], want):  # little-endian float32 bytes, as OpenAI sends them
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(d["embedding"]), "<f4"), v)
    same = c.embeddings.create(model="x", input=TEXTS, dimensions=64)  # the model's own size: no change
    np.testing.assert_array_equal(np.array([d.embedding for d in same.data], np.float32), want)


def test_dimensions_only_for_a_declared_matryoshka_model(bert, bert_matryoshka):
    msg = error(bert.post("/v1/embeddings", {"input": "a", "dimensions": 16}), "dimensions", "unsupported_value")
    assert "not declared Matryoshka-trained" in msg and "--matryoshka" in msg
    full = bert_matryoshka.model.embed(TEXTS).astype(np.float64)
    for d in (16, 32):
        got = bert_matryoshka.client().embeddings.create(model="x", input=TEXTS, dimensions=d)
        v = np.array([e.embedding for e in got.data], np.float64)
        want = full[:, :d] / np.linalg.norm(full[:, :d], axis=1, keepdims=True)
        assert v.shape == (3, d)
        np.testing.assert_allclose(v, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1, rtol=1e-6)
    assert "at sizes 16, 32 and 64" in error(bert_matryoshka.post("/v1/embeddings", {"input": "a", "dimensions": 20}),
                                             "dimensions")
    error(bert_matryoshka.post("/v1/embeddings", {"input": "a", "dimensions": 65}), "dimensions")
    error(bert_matryoshka.post("/v1/embeddings", {"input": "a", "dimensions": "16"}), "dimensions", "invalid_type")
    with pytest.raises(ValueError, match="matryoshka sizes must be integers from 1 to 64"):
        build(bert.model, port=0, matryoshka=[0, 16])


def test_embedding_model_refuses_generation_and_rerank(bert):
    c = bert.client()
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        c.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        c.completions.create(model="x", prompt="hi")
    assert "not a reranker" in error(bert.post("/v1/rerank", {"query": "q", "documents": ["d"]}), "model")
    assert bert.post("/v1/models").status_code == 405 and bert.client().models.list().data[0].id == "bert"
    msg = error(bert.post("/v1/embeddings", {"input": [101, 2003]}), "input", "invalid_type")
    assert "token ids are not accepted" in msg
    error(bert.post("/v1/embeddings", {"input": ["ok", ""]}), "input")
    error(bert.post("/v1/embeddings", {"input": ["a"] * 2049}), "input")
    msg = error(bert.post("/v1/embeddings", {"input": ["ok", "fox " * 300]}), "input", "context_length_exceeded")
    assert "input 1 is 302 tokens" in msg
    assert bert.post("/", None).status_code in (404, 405)  # no chat page for a model that cannot chat
    assert bert.client().embeddings.create(model="x", input="still serving").data[0].index == 0


def test_rerank_equals_the_model(reranker):
    want = reranker.model.rerank(QUERY, DOCS)
    tok = reranker.model.tokenizer
    n = sum(len(tok.encode_input(QUERY, d)[0]) for d in DOCS)
    for path in ("/v1/rerank", "/rerank"):
        r = reranker.post(path, {"model": "x", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
        assert body["results"] == [{"index": w["index"], "relevance_score": w["relevance_score"],
                                    "document": {"text": w["document"]}} for w in want]
    top = reranker.post("/v1/rerank", {"query": QUERY, "documents": [{"text": d} for d in DOCS], "top_n": 2,
                                       "return_documents": False}).json()["results"]
    assert top == [{"index": w["index"], "relevance_score": w["relevance_score"]}
                   for w in want[:2]]
    assert len(reranker.post("/v1/rerank", {"query": QUERY, "documents": DOCS, "top_n": 99}).json()["results"]) == 4


@pytest.mark.parametrize("body, param", [
    ({"documents": ["d"]}, "query"),
    ({"query": "", "documents": ["d"]}, "query"),
    ({"query": "q", "documents": []}, "documents"),
    ({"query": "q", "documents": "d"}, "documents"),
    ({"query": "q", "documents": ["d", ""]}, "documents"),
    ({"query": "q", "documents": [{"title": "d"}]}, "documents"),
    ({"query": "q", "documents": ["d"] * 1001}, "documents"),
    ({"query": "q", "documents": ["d"], "top_n": 0}, "top_n"),
    ({"query": "q", "documents": ["d"], "top_n": True}, "top_n"),
    ({"query": "q", "documents": ["d"], "return_documents": "yes"}, "return_documents"),
    ({"query": "q", "documents": ["d"], "model": 3}, "model"),
    ({"query": "q", "documents": ["d", "fox " * 300]}, "documents"),
])
def test_bad_rerank_requests(reranker, body, param):
    msg = error(reranker.post("/v1/rerank", body), param)
    if "fox " * 300 in body.get("documents", []):
        assert "document 1 is" in msg and "context" in msg


def test_reranker_refuses_embeddings(reranker):
    assert "is a reranker" in error(reranker.post("/v1/embeddings", {"input": "a"}), "model")
