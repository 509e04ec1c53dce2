"""/v1/embeddings in OpenAI's shape and /v1/rerank in the Jina / Cohere shape that llama-server
serves: the requests' checks, the model calls (run on the engine thread), and the answers.
Every bad request is a 400 in OpenAI's error shape naming the field.

Embeddings: `input` is a string or a list of strings (token ids are refused: they would be
another tokenizer's ids). The vectors are the model's pooled, L2-normalised ones
(`Model.embed`: the file's pooling), as lists of floats or, with `encoding_format: "base64"`,
as the base64 of their little-endian float32 bytes (what OpenAI sends, and what its Python
client asks for by default). `usage` counts the tokens the model ran, special ones included.

`dimensions` keeps a vector's first components and normalises them again, as OpenAI does for
its Matryoshka-trained models. Only a Matryoshka-trained model's leading components are an
embedding on their own, and no GGUF key says whether a model was trained that way, so the
server's operator says it, as vLLM's `is_matryoshka` / `matryoshka_dimensions` do:
`npllama serve --matryoshka` (any size from 1 to the model's) or `--matryoshka 64,128,256`
(the sizes the model card lists). Without it, `dimensions` other than the model's own size is
a 400 saying so, rather than vectors that would silently rank worse; with a list, a size not
in it is a 400. `dimensions` equal to the model's size is always accepted: it changes nothing.

Rerank: `{"query", "documents": [string or {"text"}], "top_n", "return_documents"}` answers
`{"results": [{"index", "relevance_score", "document": {"text"}}], "usage"}`, most relevant
first (`Model.rerank`: the cross-encoder's logits); `document` is left out with
`return_documents: false`. Also served at `/rerank`, as llama-server does.
"""
from __future__ import annotations

import base64

import numpy as np
from starlette.concurrency import run_in_threadpool

from ..generation.embedding import is_reranker
from .protocol import APIError, _bad, show

MAX_INPUTS = 2048     # texts per /v1/embeddings request (OpenAI's limit)
MAX_DOCUMENTS = 1000  # documents per /v1/rerank request (the most Cohere recommends)


def matryoshka_sizes(matryoshka, n_embd: int):
    """The sizes below `n_embd` that `dimensions` may ask for: None when the model was not
    declared Matryoshka-trained (`matryoshka` False or None), every size from 1 (True), or the
    listed sizes. ValueError for a size that is not an integer from 1 to n_embd."""
    if matryoshka is None or matryoshka is False:
        return None
    if matryoshka is True:
        return range(1, n_embd + 1)
    try:
        sizes = sorted(set(matryoshka))
    except TypeError:
        raise ValueError(f"matryoshka must be True, False or a list of sizes, got {show(matryoshka)}") from None
    bad = [d for d in sizes if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= n_embd]
    if bad or not sizes:
        raise ValueError(f"matryoshka sizes must be integers from 1 to {n_embd} (the model's embedding size), "
                         f"got {show(bad[0] if bad else matryoshka)}")
    return tuple(sizes)


def _model_field(body: dict) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("model", f"must be a string, got {show(model)}", "invalid_type")


def parse_embeddings(body: dict, n_embd: int, sizes) -> tuple[list[str], bool, int | None]:
    """(texts, base64?, dimensions or None for the model's own size) of an embeddings request;
    `sizes` as `matryoshka_sizes` gives them."""
    _model_field(body)
    v = body.get("input")
    texts = [v] if isinstance(v, str) else v
    if isinstance(texts, list) and texts and all(isinstance(t, int) or isinstance(t, list) for t in texts):
        raise _bad("input", "token ids are not accepted (they would be another tokenizer's): send the texts "
                            "(LangChain's OpenAIEmbeddings: check_embedding_ctx_length=False)", "invalid_type")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise _bad("input", f"must be a non-empty string or a list of non-empty strings, got {show(v)}",
                   "missing_required_parameter" if v is None else "invalid_type")
    if len(texts) > MAX_INPUTS:
        raise _bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(texts)}")
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise _bad("encoding_format", f"must be 'float' or 'base64', got {show(fmt)}")
    return texts, fmt == "base64", _dimensions(body.get("dimensions"), n_embd, sizes)


def _dimensions(d, n_embd: int, sizes) -> int | None:
    if d is None:
        return None
    if isinstance(d, bool) or not isinstance(d, int):
        raise _bad("dimensions", f"must be an integer, got {show(d)}", "invalid_type")
    if not 1 <= d <= n_embd:
        raise _bad("dimensions", f"must be from 1 to the model's embedding size {n_embd}, got {d}")
    if d == n_embd:
        return None
    if sizes is None:
        raise _bad("dimensions", f"this server's model was not declared Matryoshka-trained, so its first {d} "
                                 f"components are not an embedding on their own; leave dimensions out (the "
                                 f"model's size is {n_embd}), or, if the model is Matryoshka-trained, start the "
                                 f"server with --matryoshka", "unsupported_value")
    if d not in sizes:
        raise _bad("dimensions", f"the model was declared Matryoshka-trained at sizes "
                                 f"{', '.join(map(str, sizes))} and {n_embd}; got {d}", "unsupported_value")
    return d


def parse_rerank(body: dict) -> tuple[str, list[str], int | None, bool]:
    """(query, documents, top_n, return_documents) of a rerank request."""
    _model_field(body)
    query = body.get("query")
    if not isinstance(query, str) or not query:
        raise _bad("query", f"must be a non-empty string, got {show(query)}",
                   "missing_required_parameter" if query is None else "invalid_type")
    docs = body.get("documents")
    if not isinstance(docs, list) or not docs:
        raise _bad("documents", f"must be a non-empty list of strings, got {show(docs)}",
                   "missing_required_parameter" if docs is None else "invalid_type")
    if len(docs) > MAX_DOCUMENTS:
        raise _bad("documents", f"at most {MAX_DOCUMENTS} documents per request, got {len(docs)}")
    texts = []
    for i, d in enumerate(docs):
        text = d.get("text") if isinstance(d, dict) else d
        if not isinstance(text, str) or not text:
            raise _bad("documents", f"document {i} must be a non-empty string or an object with a non-empty "
                                    f"'text', got {show(d)}", "invalid_type")
        texts.append(text)
    top_n = body.get("top_n")
    if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
        raise _bad("top_n", f"must be a positive integer, got {show(top_n)}")
    keep = body.get("return_documents", True)
    if not isinstance(keep, bool):
        raise _bad("return_documents", f"must be true or false, got {show(keep)}", "invalid_type")
    return query, texts, top_n, keep


def _check_lengths(counts: list[int], ctx: int, what: str, param: str) -> None:
    for i, n in enumerate(counts):
        if n > ctx:
            raise APIError(400, f"{param}: {what} {i} is {n} tokens; the server's context holds {ctx}; shorten it",
                           code="context_length_exceeded", param=param)


def _usage(counts: list[int]) -> dict:
    return {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}


def shorten(vectors: np.ndarray, d: int) -> np.ndarray:
    """(n, d) float32: each vector's first d components, L2-normalised again."""
    v = vectors[:, :d].astype(np.float64)
    return (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)).astype(np.float32)


async def embeddings(server, body: dict) -> dict:
    """The answer to a /v1/embeddings request (`server`: the app's handlers, bound to its engine)."""
    model = server.model
    if is_reranker(model):
        raise APIError(400, f"{server.model_id} is a reranker (a cross-encoder), not an embedding model: POST a "
                            f"query and documents to /v1/rerank", code="model_not_supported", param="model")
    texts, b64, dims = parse_embeddings(body, model.config.n_embd, server.matryoshka)
    tok = model.tokenizer
    counts = await run_in_threadpool(lambda: [len(tok.encode_input(t)[0]) for t in texts])
    _check_lengths(counts, server.engine.ctx, "input", "input")
    vectors = await server.call(lambda m: m.embed(texts))
    if dims is not None:
        vectors = shorten(vectors, dims)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist()}
            for i, v in enumerate(np.asarray(vectors, np.float32))]
    return {"object": "list", "data": data, "model": server.model_id, "usage": _usage(counts)}


async def rerank(server, body: dict) -> dict:
    """The answer to a /v1/rerank request."""
    model = server.model
    if not is_reranker(model):
        raise APIError(400, f"{server.model_id} is not a reranker (its file has neither pooling type 'rank' nor a "
                            f"classification head): serve a cross-encoder such as bge-reranker, or compare "
                            f"/v1/embeddings vectors", code="model_not_supported", param="model")
    query, docs, top_n, keep = parse_rerank(body)
    tok = model.tokenizer
    counts = await run_in_threadpool(lambda: [len(tok.encode_input(query, d)[0]) for d in docs])
    _check_lengths(counts, server.engine.ctx, "the query with document", "documents")
    ranked = await server.call(lambda m: m.rerank(query, docs, top_n=top_n))
    results = [{"index": r["index"], "relevance_score": r["relevance_score"],
                **({"document": {"text": r["document"]}} if keep else {})} for r in ranked]
    return {"object": "list", "model": server.model_id, "results": results, "usage": _usage(counts)}
