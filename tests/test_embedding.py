"""Embedding and reranking models against HF transformers (tests/fixtures/embed/, made by
bench/make_embed_fixtures.py: tiny random BertModel with mean and CLS pooling, a RoBERTa
cross-encoder, converted by llama.cpp's own converter)."""
from pathlib import Path

import numpy as np
import pytest

import npllama
from npllama.generation import embedding

FIXTURES = Path(__file__).parent / "fixtures" / "embed"


def _load(name):
    return npllama.load(FIXTURES / f"{name}.gguf"), np.load(FIXTURES / f"{name}.npz")


def _split(f):
    return [ids.tolist() for ids in np.split(f["ids"], np.cumsum(f["lengths"])[:-1])]


@pytest.fixture(scope="module")
def bert():
    return _load("bert")


@pytest.fixture(scope="module")
def reranker():
    return _load("roberta-rerank")


@pytest.mark.parametrize("name, pooling", [("bert", "mean"), ("bert-cls", "cls")])
def test_embeddings_match_hf(name, pooling):
    """Texts of 3 to 137 tokens (accents, unknown words and characters, punctuation, spacing):
    HF's token ids, and HF's pooled, normalised vectors within cosine 0.9999."""
    model, f = _load(name)
    texts = [str(t) for t in f["texts"]]
    assert model.config.pooling == pooling and not model.config.causal
    assert [model.tokenizer.encode_input(t)[0] for t in texts] == _split(f)
    e = model.embed(texts)
    assert e.shape == (len(texts), 64) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-6)
    cos = np.sum(e.astype(np.float64) * f["embeddings"], axis=1)
    assert cos.min() >= 0.9999, cos
    # the other pooling is another vector: the file's choice is what was followed
    other = model.embed(texts, pooling="cls" if pooling == "mean" else "mean")
    assert np.sum(other.astype(np.float64) * f["embeddings"], axis=1).min() < 0.999


def test_normalize_false_and_pooling_override(bert):
    model, f = bert
    texts = [str(t) for t in f["texts"][:3]]
    raw = model.embed(texts, normalize=False)
    norms = np.linalg.norm(raw.astype(np.float64), axis=1)
    assert np.abs(norms - 1).min() > 1e-2
    np.testing.assert_allclose(raw / norms[:, None], model.embed(texts), rtol=1e-6, atol=1e-7)
    first = model.embed(texts, pooling="cls", normalize=False)
    last = model.embed(texts, pooling="last", normalize=False)
    assert not np.allclose(first, last) and not np.allclose(first, raw)


def test_batched_equals_one_at_a_time(bert, monkeypatch):
    """Texts packed into one pass, into several (a small token budget), and alone: the same bits."""
    model, f = bert
    texts = [str(t) for t in f["texts"]]
    together = model.embed(texts)
    alone = np.concatenate([model.embed(t) for t in texts])
    np.testing.assert_array_equal(together, alone)
    monkeypatch.setattr(embedding, "PASS_TOKENS", 40)
    np.testing.assert_array_equal(model.embed(texts), alone)


def test_rerank_matches_hf(reranker):
    """`<s> q </s></s> d </s>` as HF's tokenizer makes it, HF's logits as the scores, its order."""
    model, f = reranker
    query, docs = str(f["query"]), [str(d) for d in f["documents"]]
    assert [model.tokenizer.encode_input(query, d)[0] for d in docs] == _split(f)
    results = model.rerank(query, docs)
    assert [r["index"] for r in results] == np.argsort(-f["scores"], kind="stable").tolist()
    for r in results:
        assert r["document"] == docs[r["index"]]
        assert r["relevance_score"] == pytest.approx(float(f["scores"][r["index"]]), abs=1e-4)
    assert model.rerank(query, docs, top_n=2) == results[:2]
    assert model.rerank(query, docs[1]) == [{**results[[r["index"] for r in results].index(1)], "index": 0}]


def test_bert_pair_input(bert):
    """A WordPiece pair: [CLS] a [SEP] b [SEP], the second part of token type 1."""
    model, _ = bert
    tok = model.tokenizer
    ids, types = tok.encode_input("the fox", "a dog")
    a, b = tok.encode("the fox", add_bos=False), tok.encode("a dog", add_bos=False)
    assert ids == [tok.bos_id, *a, tok.sep_id, *b, tok.sep_id]
    assert types == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_bad_input(bert, reranker):
    model, _ = bert
    with pytest.raises(ValueError, match="needs at least one text"):
        model.embed([])
    with pytest.raises(ValueError, match="text 1 is empty or not a string"):
        model.embed(["ok", 3])
    long = "fox " * 300
    with pytest.raises(ValueError, match="text 0 is 302 tokens, past the model's context of 256.*truncate=True"):
        model.embed(long)
    # truncated: [CLS], the first 254 'fox', [SEP]
    np.testing.assert_allclose(model.embed(long, truncate=True), model.embed(long[:4 * 254]), atol=1e-6)
    with pytest.raises(ValueError, match="pooling must be one of mean, cls, last"):
        model.embed("x", pooling="max")
    with pytest.raises(ValueError, match="is an embedding model .*cannot generate"):
        model.generate("hello", max_tokens=2)
    with pytest.raises(ValueError, match="is an embedding model"):
        model.generate_batch(["hello"], max_tokens=2)
    with pytest.raises(ValueError, match="not a reranker"):
        model.rerank("q", ["d"])
    rr, _ = reranker
    with pytest.raises(ValueError, match="is a reranker .*rerank"):
        rr.embed("a text")
    assert rr.embed("a text", pooling="cls").shape == (1, 64)
    with pytest.raises(ValueError, match="non-empty query"):
        rr.rerank("", ["d"])
    with pytest.raises(ValueError, match="document 0 is empty"):
        rr.rerank("q", [""])
    with pytest.raises(ValueError, match="top_n must be a positive integer"):
        rr.rerank("q", ["d"], top_n=0)


def test_decoder_pooling_follows_its_hidden_states():
    """A decoder (the qwen3 architecture fixture): "last" and "mean" pool its final hidden states
    (after the output norm) as a session's forward pass computes them; batched equals alone."""
    model = npllama.load(Path(__file__).parent / "fixtures" / "arch" / "qwen3.gguf")
    texts = ["the quick brown fox", "a", "Numbers like 12, 345 and 6789 appear in text."]
    last, mean = model.embed(texts, pooling="last"), model.embed(texts)
    for i, text in enumerate(texts):
        h = model.forward(model.tokenizer.encode_input(text)[0], 0, model.new_cache(), output="hidden")
        for got, v in ((last[i], h[-1].astype(np.float64)), (mean[i], h.astype(np.float64).mean(0))):
            np.testing.assert_allclose(got, v / np.linalg.norm(v), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(model.embed(text, pooling="last")[0], last[i])


def test_relevance_of_pairs_with_different_queries(reranker):
    """Pairs of several queries scored in the same passes: each query's rerank() scores, bit for bit."""
    model, f = reranker
    docs = [str(d) for d in f["documents"]]
    queries = [str(f["query"]), "another question entirely"]
    scores = embedding.relevance(model, [(q, d) for q in queries for d in docs])
    for k, q in enumerate(queries):
        got = scores[k * len(docs):(k + 1) * len(docs)]
        assert embedding.ranking(got, docs) == model.rerank(q, docs)
    with pytest.raises(ValueError, match="needs at least one"):
        embedding.relevance(model, [])
    with pytest.raises(ValueError, match="pair 1 must be a .query, document. tuple"):
        embedding.relevance(model, [("q", "d"), "qd"])
    with pytest.raises(ValueError, match="the document of pair 0 is empty"):
        embedding.relevance(model, [("q", "")])
    with pytest.raises(ValueError, match="pair 0 is .* tokens, past the model's context"):
        embedding.relevance(model, [("q", "fox " * 300)])
