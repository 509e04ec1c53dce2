"""BatchPredictor three ways on this machine: one process with 2 threads, Ray Data with 2 actors
x 1 thread (ActorPoolStrategy, num_cpus=1), and Dask with 2 worker processes x 1 thread
(LocalCluster). Two jobs: generation (256 prompts, 32 tokens, greedy) and embedding (2,000 texts).
Never a pass/fail test.

    python bench/bench_pipeline.py [--model PATH] [--prompts 256] [--max-tokens 32] [--texts 2000]
                                   [--ways single,ray,dask] [--jobs generate,embed]

For each way and job it prints rows/s over the whole run (wall) and once warm (from the first
batch's start to the last batch's end, as each worker timed them), and where the time went:
the cluster's startup, the time before the first batch (Ray starts its actors and they load
the model; Dask's workers load it at their first task, which a warm-up run does first), the
workers' busy share of the warm window (the rest is scheduling and serialization between
batches, or a worker idle at the end), and the time after the last batch (results gathered in
the driver). Warm rows/s are compared with the single process's.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import npllama  # noqa: E402
from machine import print_cpu  # noqa: E402
from npllama.gguf.hub import resolve_model  # noqa: E402

SUBJECTS = ["the ocean", "volcanoes", "honeybees", "the Roman Empire", "black holes", "photosynthesis",
            "jazz music", "the internet", "mountain climbing", "ancient Egypt", "electric cars", "chess",
            "the moon", "rain forests", "coffee", "the printing press"]
TASKS = ["Write a short poem about {}.", "Explain {} to a ten-year-old.", "List three surprising facts about {}.",
         "Write the opening paragraph of an adventure story about {}."]
SENTENCES = ["{} changed the way people think about the world.", "Nobody expected {} to matter this much.",
             "A short note on {} and why it is interesting.", "Here is what most guides get wrong about {}."]


class Timed(npllama.BatchPredictor):
    """A BatchPredictor that adds, per row, the worker's pid and its batch's start and end times."""

    def __call__(self, batch):
        t0 = time.time()
        out = super().__call__(batch)
        t1 = time.time()
        extra = {"_pid": os.getpid(), "_t0": t0, "_t1": t1}
        if isinstance(out, pd.DataFrame):
            return out.assign(**extra)
        n = len(batch[self.input_column])
        return {**out, **{k: np.full(n, v) for k, v in extra.items()}}


def job_data(job: str, n: int) -> pd.DataFrame:
    forms = TASKS if job == "generate" else SENTENCES
    texts = [forms[i % len(forms)].format(SUBJECTS[(i // len(forms)) % len(SUBJECTS)]) + ("" if i < 64 else f" ({i})")
             for i in range(n)]
    return pd.DataFrame({"id": np.arange(n), "text": texts})


def report(way: str, job: str, df: pd.DataFrame, wall: float, startup: float, t_start: float, single=None):
    """Print one line; returns the warm rows/s."""
    n = len(df)
    first, last = df["_t0"].min(), df["_t1"].max()
    window = last - first
    batches = df.drop_duplicates(["_pid", "_t0"])
    workers = batches["_pid"].nunique()
    busy = float((batches["_t1"] - batches["_t0"]).sum()) / max(workers, 1)
    warm = n / window
    versus = f"{100 * (warm / single - 1):+6.1f}%" if single else "      -"
    print(f"{way:7} {job:9} {n:6} rows  {n / wall:8.1f} rows/s wall  {warm:8.1f} rows/s warm ({versus})  "
          f"startup {startup:5.1f}s  before 1st batch {first - t_start:5.1f}s  window {window:6.1f}s "
          f"(busy {100 * busy / window:5.1f}%, {workers} worker(s))  after {t_start + wall - last:4.1f}s", flush=True)
    return warm


def run_single(path, job, df, opts, batch_size):
    p = Timed(path, input_column="text", threads=2, **opts)
    p(df.iloc[:2])  # load and warm up, as the cluster runs are measured warm
    t = time.time()
    out = pd.concat([p(df.iloc[i:i + batch_size]) for i in range(0, len(df), batch_size)])
    return out, time.time() - t, 0.0, t


def run_ray(path, job, df, opts, batch_size, state):
    import ray
    if "ray" not in state:
        t = time.time()
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True
        ctx.enable_progress_bars = False
        state["ray"] = time.time() - t
    t = time.time()
    blocks = [df.iloc[i:i + batch_size] for i in range(0, len(df), batch_size)]
    out = ray.data.from_pandas(blocks).map_batches(
        Timed, fn_constructor_kwargs={"model_path": str(path), "input_column": "text", **opts},
        compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1, batch_size=batch_size).to_pandas()
    return out, time.time() - t, state["ray"], t


def run_dask(path, job, df, opts, batch_size, state):
    import dask.dataframe as dd
    from dask.distributed import Client, LocalCluster
    if "dask" not in state:
        t = time.time()
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None)
        state["dask"], state["dask_client"] = time.time() - t, Client(cluster)
    p = Timed(path, input_column="text", **opts)
    meta = df.iloc[:0].assign(**{p.output_column: pd.Series(dtype=np.float64 if job == "score" else object),
                                 "_pid": pd.Series(dtype=np.int64), "_t0": pd.Series(dtype=np.float64),
                                 "_t1": pd.Series(dtype=np.float64)})
    t = time.time()
    dd.from_pandas(df.iloc[:4], npartitions=2).map_partitions(p, meta=meta).compute()  # each worker loads
    load = time.time() - t
    t = time.time()
    out = dd.from_pandas(df, chunksize=batch_size).map_partitions(p, meta=meta).compute().sort_values("id")
    return out, time.time() - t, state["dask"] + load, t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf (default: the default model)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--ways", default="single,ray,dask")
    ap.add_argument("--jobs", default="generate,embed")
    args = ap.parse_args()
    print_cpu()
    for name in ("NPLLAMA_NUM_THREADS", "OMP_NUM_THREADS"):  # the clusters set their own
        os.environ.pop(name, None)
    path = resolve_model(args.model)
    ways = args.ways.split(",")
    print(f"{path.name}, {os.cpu_count()} CPUs; single: 1 process x 2 threads; ray: 2 actors x 1 thread; "
          f"dask: 2 workers x 1 thread")
    state, expected = {}, {}
    for job in args.jobs.split(","):
        df = job_data(job, args.prompts if job == "generate" else args.texts)
        opts = dict(max_tokens=args.max_tokens, temperature=0) if job == "generate" else dict(task=job)
        batch_size = 64 if job == "generate" else 250
        single = None
        for way in ways:
            if way == "single":
                out, wall, startup, t = run_single(path, job, df, opts, batch_size)
            else:
                out, wall, startup, t = (run_ray if way == "ray" else run_dask)(path, job, df, opts, batch_size, state)
            col = out.columns[2]
            if job not in expected:
                expected[job] = out[col].tolist()
            elif job == "generate" and out[col].tolist() != expected[job]:
                print(f"  {way}: results differ from the first way's!")
            elif job != "generate" and not np.allclose(np.stack(out[col].tolist()), np.stack(expected[job]), atol=1e-5):
                print(f"  {way}: embeddings differ from the first way's by more than 1e-5!")
            warm = report(way, job, out, wall, startup, t, single)
            single = warm if way == "single" else single
    if "dask_client" in state:
        state["dask_client"].close()
    if "ray" in state:
        import ray
        ray.shutdown()


if __name__ == "__main__":
    main()
