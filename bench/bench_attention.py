"""Benchmark npllama.kernels.attention.attend against plain NumPy attention.

Decode (one query, H=9, KVH=3, D=64) at KV 1024 and 4096, and a prefill case (S=128), each
timed for the Numba kernel reading the interleaved cache buffer and for the NumPy path a
plain user would write: repeat the KV heads, matmul, causal mask, softmax, matmul.

    python bench/bench_attention.py [--threads 2] [--repeats 100]
"""
from __future__ import annotations

import argparse
import os
import sys
import time


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="Numba and BLAS threads (default 2)")
    ap.add_argument("--repeats", type=int, default=100, help="timed calls per case (default 100)")
    return ap.parse_args()


args = parse_args()
# BLAS and OpenMP read these when they load, so set them before NumPy and Numba are imported.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)

import numba  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from machine import print_cpu  # noqa: E402
from npllama.kernels.attention import attend  # noqa: E402

H, KVH, D = 9, 3, 64


def numpy_attention(q: np.ndarray, kv: np.ndarray, kv_len: int) -> np.ndarray:
    """q: (S, H, D), kv: (cap, KVH, 2, D) -> (S, H, D); the queries are the last S positions."""
    S = q.shape[0]
    G = H // KVH
    k = np.repeat(kv[:kv_len, :, 0, :].transpose(1, 0, 2), G, axis=0)  # (H, KV, D)
    v = np.repeat(kv[:kv_len, :, 1, :].transpose(1, 0, 2), G, axis=0)  # (H, KV, D)
    scores = q.transpose(1, 0, 2) @ k.transpose(0, 2, 1) / np.float32(np.sqrt(D))  # (H, S, KV)
    qpos = kv_len - S + np.arange(S)[:, None]
    scores = scores + np.where(np.arange(kv_len)[None, :] <= qpos, 0.0, -np.inf).astype(np.float32)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    scores /= scores.sum(axis=-1, keepdims=True)
    return (scores @ v).transpose(1, 0, 2)  # (S, H, D)


def best_time(fn, repeats: int) -> float:
    """Fastest of `repeats` calls in seconds, after two warm-up calls (robust on a busy machine)."""
    fn()
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    print_cpu()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}  H={H} KVH={KVH} D={D}  (best of {args.repeats} calls)")
    print(f"{'case':<22}{'numba ms':>10}{'numpy ms':>10}{'speedup':>9}{'max err':>10}")
    for name, S, kv_len in (("decode KV=1024", 1, 1024), ("decode KV=4096", 1, 4096),
                            ("prefill S=128 KV=128", 128, 128)):
        kv = rng.standard_normal((kv_len, KVH, 2, D), dtype=np.float32)
        q = rng.standard_normal((S, H, D), dtype=np.float32)
        out = np.empty((S, H, D), dtype=np.float32)
        t_nb = best_time(lambda: attend(q, kv, kv_len, out=out), args.repeats)
        t_np = best_time(lambda: numpy_attention(q, kv, kv_len), args.repeats)
        err = float(np.abs(attend(q, kv, kv_len) - numpy_attention(q, kv, kv_len)).max())
        print(f"{name:<22}{t_nb * 1e3:>10.3f}{t_np * 1e3:>10.3f}{t_np / t_nb:>8.2f}x{err:>10.1e}")


if __name__ == "__main__":
    main()
