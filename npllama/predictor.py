"""Batch inference inside data pipelines: `BatchPredictor`, one picklable callable that pandas,
HF datasets (`map(batched=True)`), Dask (`map_partitions`) and Ray Data (`map_batches`) call
on batches of rows.

    df = npllama.BatchPredictor(path, max_tokens=64, temperature=0)(df)

A predictor carries only its configuration: it pickles small, hashes stably (HF datasets'
fingerprints) and loads nothing until its first call. The model is then loaded once per
process and shared by every predictor of that process with the same model, activations, KV
dtype and thread count (Dask unpickles a predictor for each task; each would otherwise load).

Each row's result is the single-call API's on that row (`model.generate`, `model.chat`,
`model.embed`, `model.rerank`, the sum of `model.score`'s logprobs), whatever the batching: every row samples
with its own sampler seeded with `seed`, so a seeded result depends on the seed and the row's
content only (two identical rows give identical text), never on the batch or partition it
came in. A bad row (not a string, empty, past the context) raises one BadRowError naming it,
before any generation of its batch; no row is ever dropped.
"""
from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping

import numba
import numpy as np

from .engine.session import check_ctx
from .engine.transformer import _kv_dtype
from .errors import BadRowError, show
from .generation.embedding import ranking, relevance
from .generation.generate import SAMPLING_KEYS, check_max_tokens, check_stop, fit_prompt, prompt_ids
from .generation.sampling import SamplingParams
from .gguf.hub import resolve_model
from .kernels.threads import check_threads, threads_from_environment, using_threads
from .model import Model

__all__ = ["BatchPredictor", "process_stats"]

OUTPUT_COLUMNS = {"generate": "generated_text", "chat": "generated_text", "embed": "embedding", "score": "logprob",
                  "rerank": "reranked"}
_RERANK_OPTIONS = ("top_n", "truncate")  # model.rerank's keywords
_NOT_IN_A_BATCH = ("stream", "session")  # generation keywords that mean nothing for a batch

_lock = threading.Lock()
_models: dict[tuple, Model] = {}  # (path, activations, kv dtype, threads) -> the model this process loaded
_stats = {"loads": 0, "calls": 0, "rows": 0, "max_threads": 0}


def process_stats() -> dict:
    """This process's BatchPredictor counts: `loads` (models loaded), `calls`, `rows`, and
    `max_threads` (the most Numba threads any call computed with)."""
    with _lock:
        return dict(_stats)


class BatchPredictor:
    """A callable that adds one output column to a batch of rows (see the module's docstring).

    `task`: "generate" (prompt strings -> `generated_text`), "chat" (a user message string, or a
    list of {"role", "content"} messages -> `generated_text`), "embed" (-> `embedding`, float32),
    "score" (-> `logprob`, the text's total log-probability) or "rerank" (a reranker model: each
    row's documents, a list of strings in `input_column` (default "documents"), ranked against
    the row's query in `query_column` (default "query"), or against one fixed `query=` for every
    row -> `reranked`, `model.rerank`'s list of {"index", "relevance_score", "document"}, most
    relevant first; options `top_n` and `truncate`; every pair of the batch runs in the same
    packed passes). `model_path` is a .gguf path,
    or None for $NPLLAMA_MODEL or the default model. `threads`: else $NPLLAMA_NUM_THREADS, else
    $OMP_NUM_THREADS (Ray sets it from num_cpus, the Dask nanny to 1), else the physical cores
    of the process's CPU affinity; set in the calling thread on every call. `options` are the
    keywords of `model.generate` / `model.chat` (max_tokens, temperature, seed, stop...) and of
    the continuous batching (max_batch...); unknown ones are left for the engine to judge.

    A call takes a pandas DataFrame, a dict of NumPy arrays (Ray Data) or a dict of lists (HF
    datasets) and returns the same kind: the input columns, in order, then the output column.
    """

    def __init__(self, model_path: str | os.PathLike | None = None, *, task: str = "generate",
                 input_column=None, output_column=None, query: str | None = None, query_column=None,
                 threads: int | None = None, activations: str = "f32", kv_dtype=None, **options):
        if task not in OUTPUT_COLUMNS:
            raise ValueError(f"task must be one of {', '.join(map(repr, OUTPUT_COLUMNS))}, got {show(task)}")
        if input_column is None:
            input_column = "documents" if task == "rerank" else "prompt"
        query, query_column = _rerank_query(task, query, query_column, input_column)
        output_column = OUTPUT_COLUMNS[task] if output_column is None else output_column
        if output_column == input_column:
            raise ValueError(f"output_column {output_column!r} is the input column; name the output differently")
        if activations not in ("f32", "int8"):
            raise ValueError(f"activations must be 'f32' or 'int8', got {show(activations)}")
        if task in ("embed", "score") and options:
            raise TypeError(f"task {task!r} takes no generation options, got {', '.join(sorted(options))}")
        if task == "rerank" and set(options) - set(_RERANK_OPTIONS):
            raise TypeError(f"task 'rerank' takes only {' and '.join(_RERANK_OPTIONS)}, got "
                            f"{', '.join(sorted(set(options) - set(_RERANK_OPTIONS)))}")
        top_n = options.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise ValueError(f"top_n must be a positive integer or None, got {show(top_n)}")
        for name in _NOT_IN_A_BATCH:
            if name in options:
                raise TypeError(f"{name}= is not an option of a batch: each row's text is returned whole")
        # what can be checked here is, so that a mistake fails in the driver, not in every worker
        SamplingParams(**{k: v for k, v in options.items() if k in SAMPLING_KEYS})
        if "max_tokens" in options:
            check_max_tokens(options["max_tokens"])
        if "stop" in options:
            check_stop(options["stop"])
        self.model_path = None if model_path is None else os.fspath(model_path)
        self.task, self.input_column, self.output_column = task, input_column, output_column
        self.query, self.query_column = query, query_column
        self.threads = check_threads(threads)
        self.activations = activations
        kv = _kv_dtype(kv_dtype, activations) if kv_dtype is not None else None
        self.kv_dtype = None if kv is None else kv.name
        self.options = dict(options)
        self._model: Model | None = None

    # ---- configuration only: pickles, hashes and prints without the model --------------------
    _CONFIG = ("model_path", "task", "input_column", "output_column", "query", "query_column", "threads",
               "activations", "kv_dtype", "options")

    def __getstate__(self) -> dict:
        return {name: getattr(self, name) for name in self._CONFIG}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._model = None

    def __repr__(self) -> str:
        args = [repr(self.model_path)] + [f"{n}={getattr(self, n)!r}" for n in self._CONFIG[1:-1]]
        args += [f"{k}={v!r}" for k, v in self.options.items()]
        return f"BatchPredictor({', '.join(args)})"

    @property
    def model(self) -> Model:
        """The model, loaded on first use, once per process (shared with other predictors)."""
        if self._model is None:
            threads = threads_from_environment(self.threads)
            path = resolve_model(self.model_path)
            key = (os.path.realpath(path), self.activations, self.kv_dtype, threads)
            with _lock:
                model = _models.get(key)
                if model is None:
                    model = Model(path, threads=threads, activations=self.activations, kv_dtype=self.kv_dtype)
                    _models[key] = model
                    _stats["loads"] += 1
            self._model = model
        return self._model

    # ---- a batch ------------------------------------------------------------------------------
    def __call__(self, batch):
        kind, values, labels = _read(batch, self.input_column)
        if self.output_column in (batch.columns if kind == "pandas" else batch.keys()):
            raise ValueError(f"the batch already has a column {self.output_column!r}; pass output_column= "
                             f"to name the output differently")
        rows = _Rows(self.input_column, values, labels)
        if not values and not (self.task == "embed" and kind == "numpy"):
            out = np.empty(0, np.float64 if self.task == "score" else object)
        else:
            model = self.model
            with using_threads(model.threads):  # Numba's count is per thread: set it in the caller's
                if self.task == "rerank":
                    out = self._rerank(model, values, rows, self._queries(batch, len(values)))
                else:
                    out = getattr(self, "_" + self.task)(model, values, rows)
                used = numba.get_num_threads()
            with _lock:
                _stats["calls"] += 1
                _stats["rows"] += len(values)
                _stats["max_threads"] = max(_stats["max_threads"], used)
        return _write(batch, kind, self.output_column, out)

    def _generate(self, model, values, rows):
        defaults = Model.generate.__kwdefaults__  # the single-call API's, which the results equal
        opts = self.options
        max_tokens = check_max_tokens(opts.get("max_tokens", defaults["max_tokens"]))
        truncate = opts.get("truncate", defaults["truncate"])
        ctx = check_ctx(opts.get("ctx", defaults["ctx"]), model.config.n_ctx)
        room = None if truncate else ctx - max_tokens
        prompts = []
        for i, value in enumerate(values):
            if self.task == "generate":
                text = rows.text(i, value)
                ids = rows.run(i, prompt_ids, model, text, room)
            else:
                ids = rows.run(i, _chat_ids, model, rows.messages(i, value))
            prompts.append(rows.run(i, fit_prompt, ids, ctx, max_tokens, truncate))
        texts = model.generate_batch(prompts, **{"progress": False, **opts})
        return np.array(texts, dtype=object)

    _chat = _generate

    def _embed(self, model, values, rows):
        texts = [rows.text(i, v) for i, v in enumerate(values)]
        if not texts:  # an empty Ray Data batch: an empty (0, n_embd) column
            return np.empty((0, model.config.n_embd), np.float32)
        try:
            return model.embed(texts)  # packed into batched passes: the same bits as one at a time
        except ValueError:  # a row's own problem (past the context): its row named
            for i, text in enumerate(texts):
                rows.run(i, model.embed, text)
            raise

    def _queries(self, batch, n: int) -> list[str]:
        """Each row's query: the fixed one, or the query column's, checked."""
        if self.query is not None:
            return [self.query] * n
        _, values, labels = _read(batch, self.query_column)
        rows = _Rows(self.query_column, values, labels)
        return [rows.text(i, v) for i, v in enumerate(values)]

    def _rerank(self, model, values, rows, queries):
        docs = [rows.documents(i, v) for i, v in enumerate(values)]
        opts = self.options
        pairs = [(q, d) for q, ds in zip(queries, docs) for d in ds]
        try:
            scores = relevance(model, pairs, truncate=opts.get("truncate", False))
        except ValueError:  # a row's own problem (a pair past the context): its row named
            for i, (q, ds) in enumerate(zip(queries, docs)):
                rows.run(i, model.rerank, q, ds, **opts)
            raise
        out = np.empty(len(values), object)
        at = 0
        for i, ds in enumerate(docs):
            out[i] = ranking(scores[at:at + len(ds)], ds, opts.get("top_n"))
            at += len(ds)
        return out

    def _score(self, model, values, rows):
        texts = [rows.text(i, v) for i, v in enumerate(values)]
        return np.array([float(rows.run(i, model.score, t)[1].astype(np.float64).sum())
                         for i, t in enumerate(texts)], np.float64)


def _rerank_query(task: str, query, query_column, input_column) -> tuple:
    """(query, query_column) as a rerank predictor keeps them (one of the two), checked."""
    if task != "rerank":
        if query is not None or query_column is not None:
            raise TypeError(f"query= and query_column= are for task='rerank', not {task!r}")
        return None, None
    if query is not None:
        if query_column is not None:
            raise ValueError("pass query= (one query for every row) or query_column= (each row's), not both")
        if not isinstance(query, str) or not query:
            raise ValueError(f"query must be a non-empty string, got {show(query)}")
        return query, None
    query_column = "query" if query_column is None else query_column
    if query_column == input_column:
        raise ValueError(f"query_column {query_column!r} is the documents' column (input_column); name them apart")
    return None, query_column


def _chat_ids(model, messages) -> list[int]:
    """A chat's prompt ids, as `model.chat` makes them."""
    return model.tokenize(model.format_chat(messages, add_generation_prompt=True), special=True)


class _Rows:
    """Checks the rows of one batch, raising BadRowError that names the row."""

    def __init__(self, column, values, labels):
        self.column, self.values, self.labels = column, values, labels

    def fail(self, i: int, problem: str):
        label = ""
        if self.labels is not None:
            key = self.labels[i]
            label = f" (index {(key.item() if isinstance(key, np.generic) else key)!r})"
        raise BadRowError(f"row {i}{label} of the batch, column {self.column!r}, value {show(self.values[i])}: "
                          f"{problem}. Every row must be valid; filter or fix the bad rows before this step", row=i)

    def text(self, i: int, value) -> str:
        if value is None or value is getattr(sys.modules.get("pandas"), "NA", None) or (
                isinstance(value, float) and value != value):
            self.fail(i, f"the value is missing ({value})")
        if not isinstance(value, str):
            self.fail(i, f"expected a string, got {type(value).__name__} {show(value)}")
        if not value:
            self.fail(i, "the text is empty")
        return value

    def documents(self, i: int, value) -> list[str]:
        """A rerank row: a non-empty list of document strings. A string is refused, not taken as
        one document: Dask turns list columns into their text unless told not to."""
        if isinstance(value, str):
            self.fail(i, "expected a list of document strings, got a string (one document: ['...']; Dask "
                         "makes list columns strings unless dask.config.set({'dataframe.convert-string': False}))")
        if not isinstance(value, (list, tuple, np.ndarray)) or not len(value):
            self.fail(i, f"expected a non-empty list of document strings, got {type(value).__name__} {show(value)}")
        for j, d in enumerate(value):
            if not isinstance(d, str) or not d:
                self.fail(i, f"document {j} is empty or not a string ({type(d).__name__} {show(d)})")
        return [str(d) for d in value]

    def messages(self, i: int, value) -> list:
        """A chat row: a user message string, or a list of message mappings."""
        if isinstance(value, str):
            return [{"role": "user", "content": self.text(i, value)}]
        if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(isinstance(m, Mapping) for m in value):
            return [dict(m) for m in value]
        self.fail(i, f"expected a message string or a non-empty list of {{'role', 'content'}} messages, "
                     f"got {type(value).__name__} {show(value)}")

    def run(self, i: int, fn, *args):
        """fn(*args), its ValueError (the engine's word on bad input) turned into this row's."""
        try:
            return fn(*args)
        except BadRowError:
            raise
        except ValueError as e:
            self.fail(i, str(e))


def _read(batch, column):
    """(kind, the column's values as a list, the row labels or None) of a batch."""
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(batch, pd.DataFrame):
        if column not in batch.columns:
            raise KeyError(f"the DataFrame has no column {column!r} (its columns: {list(batch.columns)}); "
                           f"pass input_column=")
        return "pandas", batch[column].tolist(), batch.index
    if isinstance(batch, Mapping):
        if column not in batch:
            raise KeyError(f"the batch has no column {column!r} (its columns: {list(batch.keys())}); "
                           f"pass input_column=")
        values = batch[column]
        if isinstance(values, np.ndarray):
            if values.ndim != 1:
                raise ValueError(f"column {column!r} must be 1-D (one value per row), got shape {values.shape}")
            return "numpy", values.tolist(), None
        if isinstance(values, (list, tuple)):
            return "lists", list(values), None
        if pd is not None and isinstance(values, pd.Series):
            return "lists", values.tolist(), None
        raise TypeError(f"column {column!r} must be a NumPy array or a list, got {type(values).__name__}")
    raise TypeError(f"BatchPredictor takes a pandas DataFrame, a dict of NumPy arrays (Ray Data) or a dict of "
                    f"lists (HF datasets), got {type(batch).__name__}")


def _write(batch, kind, column, out: np.ndarray):
    """The batch with `out` (one value or row per input row) added as the last column."""
    if kind == "pandas":
        import pandas as pd
        result = batch.copy(deep=False)
        if out.ndim == 2:  # embeddings: one float32 vector per row
            values = np.empty(len(out), object)
            values[:] = list(out)
            out = values
        result[column] = pd.Series(out, index=batch.index)
        return result
    result = dict(batch.items())
    result[column] = out if kind == "numpy" else out.tolist()
    return result
