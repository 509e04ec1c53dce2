"""BatchPredictor on real local clusters, as the README shows it: Ray Data (2 CPUs, an actor
pool of 2 actors with num_cpus=1) and Dask (a LocalCluster of 2 worker processes, 1 thread
each). Each result equals the single-process run on the same rows, each worker process loads
the model once, workers × threads stay within the CPUs given, and a bad row fails the job
with an error naming it. One Ray and one Dask cluster per test session (module fixtures: no
other module uses them), shut down at the module's end."""
import contextlib
import logging
import os
import sys

import dask
import dask.dataframe as dd
import numpy as np
import pandas as pd
import pytest
import ray
from dask.distributed import Client, LocalCluster

from npllama import BadRowError, BatchPredictor
from npllama.predictor import process_stats

CPUS = 2
GREEDY = dict(max_tokens=6, temperature=0)
TEXTS = [f"{w} number {i} is" for i, w in enumerate(["the", "she", "a", "on", "in", "he", "it", "we"] * 3)]


def pipeline(path):
    """The four tasks on one model, each adding its column (chat's named `chat`)."""
    return [BatchPredictor(path, **GREEDY),
            BatchPredictor(path, task="chat", output_column="chat", **GREEDY),
            BatchPredictor(path, task="embed"),
            BatchPredictor(path, task="score")]


def check_equal(got: pd.DataFrame, expected: pd.DataFrame):
    assert list(got.columns[:6]) == ["id", "prompt", "generated_text", "chat", "embedding", "logprob"]
    assert list(got["id"]) == list(expected["id"])
    assert list(got["generated_text"]) == list(expected["generated_text"])
    assert list(got["chat"]) == list(expected["chat"])
    np.testing.assert_allclose(np.stack(list(got["embedding"])), np.stack(list(expected["embedding"])), atol=1e-5)
    np.testing.assert_allclose(got["logprob"].to_numpy(np.float64), expected["logprob"].to_numpy(np.float64),
                               rtol=1e-6)


@pytest.fixture(scope="module")
def rows():
    return pd.DataFrame({"id": np.arange(len(TEXTS)), "prompt": TEXTS})


@pytest.fixture(scope="module")
def expected(tiny_model_path, rows):
    """The single-process run on the same rows (it also fills Numba's cache for the workers)."""
    out = rows
    for p in pipeline(tiny_model_path):
        out = p(out)
    return out


@contextlib.contextmanager
def cluster_env():
    """Thread variables of the test run stay out of the clusters' processes: the clusters set
    their own (Ray from num_cpus, the Dask nanny to 1)."""
    saved = {k: os.environ.pop(k) for k in ("NPLLAMA_NUM_THREADS", "OMP_NUM_THREADS") if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@pytest.fixture(scope="module")
def ray_data():
    """The test session's one Ray cluster (only this module uses Ray), shut down after the
    module so that its processes do not linger through the rest of the suite."""
    with cluster_env():
        ray.init(num_cpus=CPUS, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Probe, for the actors
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    yield ray.data
    ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    ray.shutdown()


@pytest.fixture(scope="module")
def dask_client():
    with cluster_env():
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
    client = Client(cluster)
    yield client
    client.close()
    cluster.close()


class Probe(BatchPredictor):
    """BatchPredictor (generate), constructed by Ray as the README shows, that also runs the other
    three tasks in its actor and reports the actor's process id, the models that process loaded
    and the most Numba threads its calls computed with."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.others = pipeline(kwargs["model_path"])[1:]

    def __call__(self, batch):
        batch = super().__call__(batch)
        for p in self.others:
            batch = p(batch)
        n, stats = len(batch["id"]), process_stats()
        return {**batch, "pid": np.full(n, os.getpid()), "loads": np.full(n, stats["loads"]),
                "threads": np.full(n, stats["max_threads"])}


def blocks(df, n=4):
    """A dataset's blocks: one per batch of n rows, so that both actors get work."""
    return [df.iloc[i:i + n] for i in range(0, len(df), n)]


def check_workers(stats: dict):
    """stats: per worker process, process_stats() after the job."""
    assert all(s["loads"] == 1 for s in stats.values()), stats  # one load for all four tasks and every batch
    assert len(stats) <= CPUS and sum(s["max_threads"] for s in stats.values()) <= CPUS, stats


@pytest.mark.timeout(240)
def test_ray_map_batches(ray_data, tiny_model_path, rows, expected):
    driver_loads = process_stats()["loads"]
    ds = ray_data.from_pandas(blocks(rows))
    out = ds.map_batches(Probe, fn_constructor_kwargs={"model_path": str(tiny_model_path), **GREEDY},
                         compute=ray_data.ActorPoolStrategy(size=2), num_cpus=1, batch_size=4).to_pandas()
    check_equal(out, expected)  # in input order (preserve_order)
    check_workers({pid: {"loads": g["loads"].max(), "max_threads": g["threads"].max()}
                   for pid, g in out.groupby("pid")})
    assert set(out["threads"]) == {1}  # num_cpus=1: Ray's OMP_NUM_THREADS=1
    assert process_stats()["loads"] == driver_loads  # nothing loaded in the driver


@pytest.mark.timeout(240)
def test_ray_bad_row_fails_naming_it(ray_data, tiny_model_path, rows):
    bad = rows.assign(prompt=[*TEXTS[:5], "the " * 400, *TEXTS[6:]])  # row 5: past the tiny model's context
    ds = ray_data.from_pandas(blocks(bad)).map_batches(
        BatchPredictor, fn_constructor_kwargs={"model_path": str(tiny_model_path), **GREEDY},
        compute=ray_data.ActorPoolStrategy(size=2), num_cpus=1, batch_size=4)
    with pytest.raises(Exception) as err:
        ds.take_all()
    # Ray Data wraps the actor's error (its text holds the BadRowError's)
    assert "BadRowError: row 1 of the batch, column 'prompt'" in str(err.value), str(err.value)
    assert "but the context holds 256 tokens" in str(err.value)


@pytest.mark.timeout(240)
def test_dask_map_partitions(dask_client, tiny_model_path, rows, expected):
    predictors = pipeline(tiny_model_path)
    used = rows
    for p in predictors:  # Dask ships instances that were already used in the driver
        used = p(used)
    ddf = dd.from_pandas(rows.sample(frac=1, random_state=0), npartitions=4)
    meta = ddf.dtypes.to_dict()
    for p, column, dtype in zip(predictors, ["generated_text", "chat", "embedding", "logprob"],
                                [object, object, object, np.float64]):
        meta = {**meta, column: dtype}  # as the README has it
        ddf = ddf.map_partitions(p, meta=meta)
    out = ddf.compute().sort_values("id")
    check_equal(out, expected)
    stats = {w: s for w, s in dask_client.run(process_stats).items() if s["calls"]}
    check_workers(stats)
    assert {s["max_threads"] for s in stats.values()} == {1}  # the nanny's OMP_NUM_THREADS=1


@pytest.mark.timeout(240)
def test_dask_bad_row_fails_naming_it(dask_client, tiny_model_path, rows):
    bad = rows.assign(prompt=[*TEXTS[:9], "", *TEXTS[10:]])
    ddf = dd.from_pandas(bad, npartitions=3)  # row 9 is the second partition's second row
    meta = ddf._meta.assign(generated_text=pd.Series(dtype=object))
    with pytest.raises(BadRowError, match=r"row 1 \(index 9\) of the batch, column 'prompt', value '': the text is empty"):
        ddf.map_partitions(BatchPredictor(tiny_model_path, **GREEDY), meta=meta).compute()


RERANKER = os.path.join(os.path.dirname(__file__), "fixtures", "embed", "roberta-rerank.gguf")
DOCS = [[f"the fox number {i}", f"stock prices fell {i} points", "rain in spain"] for i in range(8)]


def reranked(column) -> list[list[dict]]:
    """A `reranked` column as lists of plain dicts (Ray hands lists back as arrays)."""
    return [[{k: (v.item() if isinstance(v, np.generic) else v) for k, v in r.items()} for r in row]
            for row in column]


@pytest.mark.timeout(240)
def test_rerank_on_ray_and_dask(ray_data, dask_client):
    """task="rerank" with one fixed query, on both clusters: model.rerank's results per row.
    (After the other Dask test: its workers then load a second model.)"""
    from npllama import load
    model = load(RERANKER)
    want = [model.rerank("what does the fox do", ds, top_n=2) for ds in DOCS]
    rows = pd.DataFrame({"id": np.arange(len(DOCS)), "documents": DOCS})
    kwargs = {"model_path": RERANKER, "task": "rerank", "query": "what does the fox do", "top_n": 2}
    out = ray_data.from_pandas(blocks(rows)).map_batches(
        BatchPredictor, fn_constructor_kwargs=kwargs, compute=ray_data.ActorPoolStrategy(size=2), num_cpus=1,
        batch_size=4).to_pandas()
    assert list(out["id"]) == list(range(len(DOCS))) and reranked(out["reranked"]) == want
    with dask.config.set({"dataframe.convert-string": False}):  # else Dask makes the lists strings
        ddf = dd.from_pandas(rows, npartitions=2)
        got = ddf.map_partitions(BatchPredictor(**kwargs), meta={**ddf.dtypes.to_dict(), "reranked": object})
        got = got.compute()
    assert reranked(got.sort_values("id")["reranked"]) == want
