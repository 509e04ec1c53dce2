"""Embeddings and reranking: `Model.embed` and `Model.rerank`.

A text's input is its tokens with the special tokens the file says to add (`Tokenizer.
encode_input`: ``[CLS] text [SEP]`` for BERT, BOS and EOS as the flags say for a decoder). Many
inputs run together: they are packed one after another into passes of up to `PASS_TOKENS`
tokens (no padding), through the model's own layers (`engine.block.run_layers`), each token at
its position within its own text, and attention reads only the keys of the token's own text
(bidirectional for an encoder, causal for a decoder). Every other piece of a layer treats each
token alone, so a text gets the same vectors in a pass as alone.

Pooling follows the file's `{arch}.pooling_type` (as sentence-transformers' config declares it
and llama.cpp's converter writes it): "mean" over the text's tokens, "cls" (the first token's
state) or "last" (the last token's: Qwen3-Embedding); a decoder without one is mean-pooled over
its final hidden states (after the output norm). Vectors are L2-normalised unless
`normalize=False`.

A reranker is a cross-encoder (BERT / RoBERTa / XLM-RoBERTa `*ForSequenceClassification`, its
head written as `cls` and `cls.output`): it reads a query and a document as one input and
scores the first token's state: `cls.output(tanh(cls(h)))`, or `cls.output(h)` alone.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..engine import block
from ..engine.ops import PanelOps, fits_rows
from ..kernels.attention import attend
from ..kernels.nn import rmsnorm
from ..kernels.rows import matmul_rows as mm
from ..kernels.threads import using_threads

__all__ = ["embed", "rerank", "relevance", "ranking", "is_reranker", "PASS_TOKENS"]

PASS_TOKENS = 2048  # tokens of packed texts per batched pass (a longer text has a pass of its own)
_POOLINGS = ("mean", "cls", "last")


def embed(model, texts: str | Sequence[str], *, normalize: bool = True, pooling: str | None = None,
          truncate: bool = False) -> np.ndarray:
    """(n, n_embd) float32: one vector per text, pooled as the file says (`pooling` overrides:
    "mean", "cls" or "last") and L2-normalised unless `normalize=False`.

    The texts run in batched passes. A text longer than the model's context is a ValueError
    unless `truncate=True`, which keeps its first tokens (and the closing special token).
    A reranker's file (pooling type "rank", or a classification head) asks for `pooling=`."""
    how = _pooling(model, pooling)
    texts = _texts(texts, "text", "embed()")
    inputs = [_input(model, t, None, truncate, f"text {i}") for i, t in enumerate(texts)]
    out = np.empty((len(texts), model.config.n_embd), np.float32)
    for i, h in _hidden(model, inputs):
        v = h[0] if how == "cls" else h[-1] if how == "last" else h.astype(np.float64).mean(0)
        if normalize:
            v = v / max(float(np.linalg.norm(v.astype(np.float64))), 1e-12)
        out[i] = v
    return out


def rerank(model, query: str, documents: Sequence[str], *, top_n: int | None = None,
           truncate: bool = False) -> list[dict]:
    """The documents by relevance to `query`, most relevant first: ``{"index", "relevance_score",
    "document"}`` each (index: the document's place in `documents`; the score: the
    cross-encoder's logit, ties in input order), the first `top_n` of them if given.

    ValueError for a model that is not a reranker (a pooling type "rank" or a classification
    head), an empty query or document list, a non-string, or a pair past the context (unless
    `truncate=True`)."""
    head = _rank_head(model)
    if not isinstance(query, str) or not query:
        raise ValueError(f"rerank() needs a non-empty query string, got {type(query).__name__} {query!r:.40}")
    documents = _texts(documents, "document", "rerank()")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise ValueError(f"top_n must be a positive integer or None, got {top_n!r}")
    scores = _scores(model, head, [(query, d) for d in documents], truncate, "document")
    return ranking(scores, documents, top_n)


def ranking(scores: np.ndarray, documents: Sequence[str], top_n: int | None = None) -> list[dict]:
    """`rerank`'s results from the documents' scores: most relevant first, ties in input order."""
    order = np.argsort(-scores, kind="stable")[:top_n]
    return [{"index": int(i), "relevance_score": float(scores[i]), "document": documents[i]} for i in order]


def relevance(model, pairs: Sequence[tuple[str, str]], *, truncate: bool = False) -> np.ndarray:
    """(n,) float32: the cross-encoder's score of each (query, document) pair, all of them in
    batched passes whatever their queries (what `rerank` computes for one query; a data
    pipeline scores every row's pairs at once). ValueError as `rerank` gives, naming the pair."""
    head = _rank_head(model)
    pairs = list(pairs)
    if not pairs:
        raise ValueError("relevance() needs at least one (query, document) pair; the list is empty")
    for i, pair in enumerate(pairs):
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise ValueError(f"pair {i} must be a (query, document) tuple, got {type(pair).__name__} {pair!r:.40}")
        for name, t in zip(("query", "document"), pair):
            if not isinstance(t, str) or not t:
                raise ValueError(f"the {name} of pair {i} is empty or not a string ({type(t).__name__} {t!r:.40})")
    return _scores(model, head, pairs, truncate, "pair")


def _scores(model, head, pairs: list[tuple[str, str]], truncate: bool, name: str) -> np.ndarray:
    """(n,) float32 scores of checked (query, document) pairs, from packed passes."""
    inputs = [_input(model, q, d, truncate, f"{name} {i}") for i, (q, d) in enumerate(pairs)]
    scores = np.empty(len(pairs), np.float32)
    for i, h in _hidden(model, inputs):
        scores[i] = head(h[:1])[0]
    return scores


# ---- inputs ---------------------------------------------------------------------------------

def _texts(texts, name: str, what: str) -> list[str]:
    """`texts` as a list of non-empty strings (one string is a list of one), else ValueError."""
    if isinstance(texts, str):
        texts = [texts]
    texts = list(texts)
    if not texts:
        raise ValueError(f"{what} needs at least one text; the list of {name}s is empty")
    for i, t in enumerate(texts):
        if not isinstance(t, str) or not t:
            raise ValueError(f"{name} {i} is empty or not a string ({type(t).__name__} {t!r:.40}); "
                             f"{what} needs non-empty strings")
    return texts


def _input(model, text: str, pair: str | None, truncate: bool, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids, token types) of a text (or a query and document pair), checked against the context."""
    tok = model.tokenizer
    ids, types = tok.encode_input(text, pair)
    n_ctx = model.config.n_ctx
    if len(ids) > n_ctx:
        if not truncate:
            raise ValueError(f"{what} is {len(ids)} tokens, past the model's context of {n_ctx}; shorten it "
                             f"or pass truncate=True (which keeps its first {n_ctx} tokens)")
        keep = n_ctx - 1 if tok.add_eos else n_ctx  # the closing EOS / [SEP] stays
        ids, types = ids[:keep] + ids[len(ids) - (n_ctx - keep):], types[:keep] + types[len(types) - (n_ctx - keep):]
    return np.array(ids, np.int64), np.array(types, np.int64)


def _pooling(model, pooling: str | None) -> str:
    cfg = model.config
    if pooling is not None:
        if pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(_POOLINGS)} (or None: the file's), got {pooling!r}")
        return pooling
    how = cfg.pooling
    if is_reranker(model):
        raise ValueError("this model is a reranker (a cross-encoder): use model.rerank(query, documents), or "
                         "pass pooling='mean', 'cls' or 'last' to embed with its hidden states")
    if how == "none":
        raise ValueError(f"the file's pooling type ('{cfg.arch}.pooling_type') is 'none', one vector per token; "
                         f"pass pooling='mean', 'cls' or 'last' for one per text")
    return how or "mean"


def is_reranker(model) -> bool:
    """Whether the file is a reranker's: pooling type "rank", or none and a classification head
    (what `embed` refuses without `pooling=` and `rerank` reads)."""
    how = model.config.pooling
    return how == "rank" or (how is None and _has_head(model))


def _has_head(model) -> bool:
    return model.encoder is not None and model.encoder.cls_out is not None


def _rank_head(model):
    """The cross-encoder's scoring of first-token states h (n, n_embd) -> (n,), or ValueError."""
    if not _has_head(model):
        if model.config.pooling == "rank":
            raise ValueError("the file's pooling type is 'rank' but it has no classification head (cls.output); "
                             "npllama reranks with cross-encoders (BERT / RoBERTa / XLM-RoBERTa "
                             "*ForSequenceClassification converted by llama.cpp)")
        raise ValueError("this model is not a reranker: its file has neither pooling type 'rank' nor a "
                         "classification head (cls.output). Use a cross-encoder (bge-reranker...), or "
                         "model.embed() and compare vectors")
    enc = model.encoder
    if enc.cls_out.rows != 1:
        raise ValueError(f"the classification head has {enc.cls_out.rows} outputs; rerank() reads a "
                         f"one-output (relevance) head")

    def score(h):
        if enc.cls is not None:
            h = np.tanh(mm(enc.cls, h) + enc.cls_b)
        return (mm(enc.cls_out, h) + enc.cls_out_b)[:, 0]
    return score


# ---- the batched pass -----------------------------------------------------------------------

def _hidden(model, inputs: list[tuple[np.ndarray, np.ndarray]]) -> Iterator[tuple[int, np.ndarray]]:
    """(index, final hidden states (n_i, n_embd)) of every input, in order, from packed passes."""
    if model.device != "cpu":  # a device model: its own forward pass, one text at a time
        for i, (ids, _) in enumerate(inputs):
            yield i, model.forward(ids, 0, model.new_cache(), output="hidden")
        return
    start = 0
    while start < len(inputs):
        end, total = start, 0
        while end < len(inputs) and (end == start or total + len(inputs[end][0]) <= PASS_TOKENS):
            total += len(inputs[end][0])
            end += 1
        x = _pass(model, inputs[start:end])
        at = 0
        for i in range(start, end):
            n = len(inputs[i][0])
            yield i, x[at:at + n]
            at += n
        start = end


def _pass(model, inputs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The final hidden states (T, n_embd) of the inputs packed one after another."""
    cfg = model.config
    lengths = [len(ids) for ids, _ in inputs]
    bounds = np.cumsum([0] + lengths)
    ids = np.concatenate([ids for ids, _ in inputs])
    types = np.concatenate([t for _, t in inputs])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])  # each from 0 in its text

    def attention(li, q, k, v, window):
        """Each text's queries over its own keys (all of them, or causally with the layer's window)."""
        out = np.empty(q.shape, np.float32)
        for a, b in zip(bounds[:-1], bounds[1:]):
            kv = np.stack((k[a:b], v[a:b]), axis=2)  # (n, KVH, 2, D)
            if cfg.causal:
                attend(q[a:b], kv, b - a, window=window, scale=cfg.attn_scale, out=out[a:b])
            else:
                attend(q[a:b], kv, b - a, causal=False, scale=cfg.attn_scale, out=out[a:b])
        return out

    with using_threads(model.threads):
        if cfg.norm == "rms" and fits_rows(cfg):  # the products of the model's prefill
            ops = PanelOps(model, attention, int8=model.activations == "int8")
        else:
            ops = block.Ops(cfg, mm, attention)
        x = block.run_layers(model, block.embed(model, ids, positions, types), positions, ops, max(lengths))
        return x if model.output_norm is None else rmsnorm(x, model.output_norm, cfg.rms_eps)
