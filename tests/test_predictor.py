"""BatchPredictor in one process: the three batch shapes (pandas, dict of NumPy arrays, dict of
lists), HF datasets, results equal to the single-call API, pickling, threads and bad rows.
The same predictor on Ray and Dask clusters is tested in test_pipelines_cluster.py."""
import json
import os
import pickle
import subprocess
import sys
import threading

import numba
import numpy as np
import pandas as pd
import pytest

import npllama
from npllama import BadRowError, BatchPredictor
from npllama.predictor import process_stats
from npllama.kernels.threads import physical_cores, threads_from_environment

PROMPTS = ["hello there", "the sky is", "a", "on the other hand", "she said", "in the"]
GREEDY = dict(max_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    return npllama.load(tiny_model_path)


def frame(texts=PROMPTS, column="prompt"):
    """A DataFrame with an id column before the input and an index that is not 0..n-1."""
    return pd.DataFrame({"id": np.arange(len(texts)) * 10, column: texts}, index=np.arange(len(texts)) + 100)


def test_generate_pandas_equals_single_calls(tiny_model_path, tiny):
    df = frame()
    out = BatchPredictor(tiny_model_path, stop="zz", **GREEDY)(df)
    assert list(out.columns) == ["id", "prompt", "generated_text"]
    assert list(out.index) == list(df.index) and list(out["id"]) == list(df["id"])
    assert list(out["generated_text"]) == [tiny.generate(p, stop="zz", **GREEDY) for p in PROMPTS]
    assert list(df.columns) == ["id", "prompt"]  # the input is left as it was


def test_generate_dict_shapes(tiny_model_path, tiny):
    expected = [tiny.generate(p, **GREEDY) for p in PROMPTS]
    p = BatchPredictor(tiny_model_path, **GREEDY)
    ids = np.arange(len(PROMPTS))
    arrays = {"id": ids, "prompt": np.array(PROMPTS, dtype=object)}  # Ray Data's default format
    out = p(arrays)
    assert list(out) == ["id", "prompt", "generated_text"] and out["id"] is ids
    assert isinstance(out["generated_text"], np.ndarray) and out["generated_text"].tolist() == expected
    assert p({"prompt": np.array(PROMPTS)})["generated_text"].tolist() == expected  # a '<U' array
    lists = p({"id": ids.tolist(), "prompt": list(PROMPTS)})
    assert list(lists) == ["id", "prompt", "generated_text"] and lists["generated_text"] == expected


def test_pandas_string_dtypes(tiny_model_path, tiny):
    expected = [tiny.generate(p, **GREEDY) for p in PROMPTS]
    p = BatchPredictor(tiny_model_path, **GREEDY)
    for dtype in ("string[pyarrow]", "string[python]", object):
        df = pd.DataFrame({"prompt": pd.Series(PROMPTS, dtype=dtype)})
        assert list(p(df)["generated_text"]) == expected, dtype


def test_seeded_sampling_is_per_row(tiny_model_path, tiny):
    opts = dict(max_tokens=8, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=7)
    expected = [tiny.generate(p, **opts) for p in PROMPTS]
    p = BatchPredictor(tiny_model_path, **opts)
    whole = p({"prompt": PROMPTS})["generated_text"]
    assert whole == expected
    # split in other batches, in another order, with a smaller running batch: the same rows
    pieces = p({"prompt": PROMPTS[3:]})["generated_text"] + p({"prompt": PROMPTS[:3]})["generated_text"]
    assert pieces == expected[3:] + expected[:3]
    assert BatchPredictor(tiny_model_path, max_batch=2, **opts)({"prompt": PROMPTS})["generated_text"] == expected
    assert len(set(expected)) > 1


def test_chat_equals_model_chat(tiny_model_path, tiny):
    conversations = ["hello there", [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    expected = [tiny.chat([{"role": "user", "content": "hello there"}], **GREEDY),
                tiny.chat(conversations[1], **GREEDY)]
    p = BatchPredictor(tiny_model_path, task="chat", input_column="messages", **GREEDY)
    assert p({"messages": conversations})["generated_text"] == expected
    column = np.empty(2, object)
    column[:] = [conversations[0], np.array(conversations[1], dtype=object)]  # as Ray hands a list column
    assert p({"messages": column})["generated_text"].tolist() == expected


def test_embed_and_score(tiny_model_path, tiny):
    expected = tiny.embed(PROMPTS)
    scores = [float(tiny.score(t)[1].astype(np.float64).sum()) for t in PROMPTS]
    embed = BatchPredictor(tiny_model_path, task="embed", input_column="text")
    arrays = embed({"text": np.array(PROMPTS, dtype=object)})["embedding"]
    assert arrays.dtype == np.float32 and arrays.shape == expected.shape
    np.testing.assert_allclose(arrays, expected, atol=1e-5)
    df = embed(frame(column="text"))
    assert list(df.columns) == ["id", "text", "embedding"]
    np.testing.assert_allclose(np.stack(df["embedding"].tolist()), expected, atol=1e-5)
    np.testing.assert_allclose(embed({"text": PROMPTS})["embedding"], expected, atol=1e-5)
    score = BatchPredictor(tiny_model_path, task="score", input_column="text", output_column="lp")
    out = score(frame(column="text"))
    assert list(out.columns) == ["id", "text", "lp"]
    np.testing.assert_allclose(out["lp"], scores, rtol=1e-6)
    np.testing.assert_allclose(score({"text": PROMPTS})["lp"], scores, rtol=1e-6)


def test_hf_datasets_map(tiny_model_path, tiny):
    from datasets import Dataset
    from datasets.fingerprint import Hasher
    p = BatchPredictor(tiny_model_path, task="score", input_column="text")
    before = Hasher.hash(p)
    ds = Dataset.from_dict({"id": list(range(len(PROMPTS))), "text": PROMPTS})
    out = ds.map(p, batched=True, batch_size=4)
    assert out.column_names == ["id", "text", "logprob"] and out["id"] == list(range(len(PROMPTS)))
    np.testing.assert_allclose(out["logprob"], [float(tiny.score(t)[1].astype(np.float64).sum()) for t in PROMPTS],
                               rtol=1e-6)
    assert Hasher.hash(p) == before == Hasher.hash(BatchPredictor(tiny_model_path, task="score", input_column="text"))
    assert Hasher.hash(BatchPredictor(tiny_model_path, task="embed", input_column="text")) != before
    emb = ds.map(BatchPredictor(tiny_model_path, task="embed", input_column="text"), batched=True, batch_size=4)
    np.testing.assert_allclose(np.array(emb["embedding"]), tiny.embed(PROMPTS), atol=1e-5)


def test_pickles_small_and_works_in_another_process(tiny_model_path, tiny, tmp_path):
    p = BatchPredictor(tiny_model_path, **GREEDY)
    fresh = pickle.dumps(p)
    p({"prompt": PROMPTS[:2]})
    used = pickle.dumps(p)
    assert len(fresh) < 4096 and used == fresh  # configuration only, before and after its first call
    assert pickle.loads(used)({"prompt": PROMPTS[:2]})["generated_text"] == [tiny.generate(q, **GREEDY)
                                                                              for q in PROMPTS[:2]]
    (tmp_path / "p.pkl").write_bytes(used)
    script = ("import json, pickle, sys; from npllama.predictor import process_stats; "
              "p = pickle.load(open(sys.argv[1], 'rb')); out = p({'prompt': json.loads(sys.argv[2])}); "
              "print(json.dumps([out['generated_text'], process_stats()['loads']]))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(npllama.__file__)),
                                                        os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "p.pkl"), json.dumps(PROMPTS)],
                         capture_output=True, text=True, env=env, timeout=240)
    assert run.returncode == 0, run.stderr
    texts, loads = json.loads(run.stdout)
    assert texts == [tiny.generate(q, **GREEDY) for q in PROMPTS] and loads == 1


def test_one_load_per_process(tiny_q8_path):
    before = process_stats()["loads"]
    gen = BatchPredictor(tiny_q8_path, **GREEDY)
    assert gen({"prompt": []})["generated_text"] == [] and process_stats()["loads"] == before  # nothing to load for
    gen({"prompt": PROMPTS[:2]})
    for task in ("embed", "score"):  # other predictors and unpickled copies share the process's model
        pickle.loads(pickle.dumps(BatchPredictor(tiny_q8_path, task=task)))({"prompt": PROMPTS[:2]})
    pickle.loads(pickle.dumps(gen))({"prompt": PROMPTS[:2]})
    assert process_stats()["loads"] == before + 1
    BatchPredictor(tiny_q8_path, kv_dtype="float16", **GREEDY)({"prompt": PROMPTS[:1]})  # another configuration
    assert process_stats()["loads"] == before + 2


def test_threads_from_environment(monkeypatch):
    monkeypatch.delenv("NPLLAMA_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_from_environment() == physical_cores()
    monkeypatch.setenv("OMP_NUM_THREADS", "1,1")
    assert threads_from_environment() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "512")
    assert threads_from_environment() == numba.config.NUMBA_NUM_THREADS
    monkeypatch.setenv("NPLLAMA_NUM_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")
    assert threads_from_environment() == 1 and threads_from_environment(2) == 2
    monkeypatch.setenv("NPLLAMA_NUM_THREADS", "0")
    with pytest.raises(ValueError, match="NPLLAMA_NUM_THREADS"):
        threads_from_environment()
    with pytest.raises(ValueError, match="threads must be"):
        threads_from_environment(0)


@pytest.mark.parametrize("task", ["generate", "embed"])
def test_threads_are_set_in_the_calling_thread(tiny_model_path, monkeypatch, task):
    """Ray and Dask call from threads other than the constructor's, and Numba's thread count is
    per thread: the engine must compute with the predictor's count whatever the caller's is."""
    from npllama.engine import block
    seen = []
    run_layers = block.run_layers

    def spy(*args, **kwargs):
        seen.append(numba.get_num_threads())
        return run_layers(*args, **kwargs)

    monkeypatch.setattr(block, "run_layers", spy)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("NPLLAMA_NUM_THREADS", raising=False)
    p = BatchPredictor(tiny_model_path, task=task, **(GREEDY if task == "generate" else {}))
    caller = []

    def work():
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        p({"prompt": PROMPTS[:2]})
        caller.append(numba.get_num_threads())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen and set(seen) == {1}  # from $OMP_NUM_THREADS, as a Ray actor or Dask worker has it
    assert caller == [numba.config.NUMBA_NUM_THREADS]  # the caller's own count is restored
    assert p.model.threads == 1


@pytest.mark.parametrize("bad, problem", [
    ("", "the text is empty"),
    (None, "the value is missing"),
    (7, "expected a string, got int 7"),
    ("the " * 400, "context"),
])
def test_bad_row_raises_naming_it(tiny_model_path, bad, problem):
    texts = list(PROMPTS)
    texts[3] = bad
    for task in ("generate", "embed", "score"):
        p = BatchPredictor(tiny_model_path, task=task, **(GREEDY if task == "generate" else {}))
        for batch in (frame(texts), {"prompt": np.array(texts, dtype=object)}, {"prompt": texts}):
            with pytest.raises(BadRowError, match=problem) as err:
                p(batch)
            assert err.value.row == 3 and "row 3" in str(err.value), (task, str(err.value))
            if isinstance(batch, pd.DataFrame):
                assert "(index 103)" in str(err.value)
    restored = pickle.loads(pickle.dumps(err.value))  # as Dask and Ray send it back
    assert type(restored) is BadRowError and restored.row == 3 and str(restored) == str(err.value)


def test_bad_chat_rows(tiny_model_path):
    p = BatchPredictor(tiny_model_path, task="chat", **GREEDY)
    for bad in ([], [{"role": "nobody", "content": "x"}], [{"role": "user"}], 3.5):
        with pytest.raises(BadRowError, match="row 1"):
            p({"prompt": ["hi", bad]})


def test_configuration_errors(tiny_model_path):
    with pytest.raises(ValueError, match="task must be one of"):
        BatchPredictor(tiny_model_path, task="classify")
    with pytest.raises(TypeError, match="takes no generation options"):
        BatchPredictor(tiny_model_path, task="embed", max_tokens=3)
    with pytest.raises(TypeError, match="stream"):
        BatchPredictor(tiny_model_path, stream=True)
    with pytest.raises(ValueError, match="temperature"):
        BatchPredictor(tiny_model_path, temperature=-1)
    with pytest.raises(ValueError, match="threads"):
        BatchPredictor(tiny_model_path, threads=0)
    with pytest.raises(ValueError, match="kv_dtype"):
        BatchPredictor(tiny_model_path, kv_dtype="int4")
    with pytest.raises(ValueError, match="is the input column"):
        BatchPredictor(tiny_model_path, output_column="prompt")
    p = BatchPredictor(tiny_model_path, **GREEDY)
    with pytest.raises(KeyError, match="no column 'prompt'.*'text'"):
        p(pd.DataFrame({"text": ["x"]}))
    with pytest.raises(ValueError, match="already has a column 'generated_text'"):
        p({"prompt": ["x"], "generated_text": ["y"]})
    with pytest.raises(TypeError, match="takes a pandas DataFrame"):
        p(["x"])
    with pytest.raises(TypeError, match="unexpected keyword"):  # unknown keywords are the engine's to judge
        BatchPredictor(tiny_model_path, no_such_option=1, **GREEDY)({"prompt": ["x"]})


@pytest.mark.model
def test_default_model(default_model):
    """model_path=None loads the default model; generate and chat equal the single calls on it."""
    df = pd.DataFrame({"prompt": ["The capital of France is", "Write a haiku about rain."]})
    out = BatchPredictor(**GREEDY)(df)
    assert list(out["generated_text"]) == [default_model.generate(p, **GREEDY) for p in df["prompt"]]
    chat = BatchPredictor(task="chat", **GREEDY)(df)
    assert list(chat["generated_text"]) == [default_model.chat([{"role": "user", "content": p}], **GREEDY)
                                           for p in df["prompt"]]


def test_structured_output_passes_through_to_every_row():
    """json_schema= is a generation keyword like any other: every row's text conforms, equal
    to the single call's, and the predictor still pickles small."""
    import jsonschema
    path = os.path.join(os.path.dirname(__file__), "fixtures", "arch", "llama.gguf")  # a real tokenizer
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 1,
                                                                                "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}  # compact: a random tiny model would indent forever
    p = BatchPredictor(path, json_schema=schema, max_tokens=40, temperature=0.9, seed=5)
    out = p(frame())
    model = npllama.load(path)
    for prompt, text in zip(PROMPTS, out["generated_text"]):
        jsonschema.validate(json.loads(text), schema)
        assert text == model.generate(prompt, json_schema=schema, max_tokens=40, temperature=0.9, seed=5)
    assert len(pickle.dumps(p)) < 4096


RERANKER = os.path.join(os.path.dirname(__file__), "fixtures", "embed", "roberta-rerank.gguf")
QUERIES = ["what does the fox do", "stock market news", "weather"]
DOCUMENTS = [["the fox jumps over the dog", "stock prices fell today", "a quick brown fox"],
             ["rain in spain", "markets rallied on friday"],
             ["sunny with clouds", "the fox", "heavy rain expected", "snow"]]


def test_rerank_rows_equal_single_calls():
    """Each row's documents against its own query (or one fixed query): model.rerank's results,
    the same whether the batch is a DataFrame, NumPy arrays (Ray Data) or lists, though every
    pair of the batch ran in the same packed passes."""
    model = npllama.load(RERANKER)
    want = [model.rerank(q, ds) for q, ds in zip(QUERIES, DOCUMENTS)]
    p = BatchPredictor(RERANKER, task="rerank")
    df = p(pd.DataFrame({"query": QUERIES, "documents": DOCUMENTS}, index=[7, 8, 9]))
    assert list(df.columns) == ["query", "documents", "reranked"] and list(df.index) == [7, 8, 9]
    assert df["reranked"].tolist() == want
    docs = np.empty(3, object)
    docs[:] = [np.array(ds) for ds in DOCUMENTS]
    assert p({"query": np.array(QUERIES, object), "documents": docs})["reranked"].tolist() == want
    assert p({"query": QUERIES, "documents": DOCUMENTS})["reranked"] == want
    top = BatchPredictor(RERANKER, task="rerank", query="the fox", input_column="docs", top_n=2)
    got = top(pd.DataFrame({"docs": DOCUMENTS}))["reranked"].tolist()
    assert got == [model.rerank("the fox", ds, top_n=2) for ds in DOCUMENTS]
    one = BatchPredictor(RERANKER, task="rerank", query="the fox")({"documents": [["a fox"]]})["reranked"]
    assert one == [model.rerank("the fox", "a fox")]
    assert "query='the fox'" in repr(top) and pickle.loads(pickle.dumps(top)).query == "the fox"


def test_bad_rerank_rows_and_configuration(tiny_model_path):
    p = BatchPredictor(RERANKER, task="rerank")
    for bad, problem in ([[], "non-empty list of document strings"], [["ok", ""], "document 1 is empty"],
                         [["fox " * 300], "context"], ["['a', 'b']", "got a string .*convert-string"]):
        with pytest.raises(BadRowError, match=problem) as err:
            p({"query": QUERIES[:2], "documents": [DOCUMENTS[0], bad]})
        assert err.value.row == 1 and "column 'documents'" in str(err.value)
    with pytest.raises(BadRowError, match="row 0 .*column 'query'.*the text is empty"):
        p({"query": ["", "q"], "documents": DOCUMENTS[:2]})
    with pytest.raises(KeyError, match="no column 'query'"):
        p({"documents": DOCUMENTS})
    with pytest.raises(BadRowError, match="not a reranker"):
        BatchPredictor(tiny_model_path, task="rerank", query="q")({"documents": [["d"]]})
    with pytest.raises(ValueError, match="not both"):
        BatchPredictor(RERANKER, task="rerank", query="q", query_column="q")
    with pytest.raises(TypeError, match="are for task='rerank'"):
        BatchPredictor(RERANKER, task="embed", query="q")
    with pytest.raises(TypeError, match="takes only top_n and truncate"):
        BatchPredictor(RERANKER, task="rerank", max_tokens=3)
    with pytest.raises(ValueError, match="top_n must be a positive integer"):
        BatchPredictor(RERANKER, task="rerank", top_n=0)
    with pytest.raises(ValueError, match="is the documents' column"):
        BatchPredictor(RERANKER, task="rerank", query_column="documents")
