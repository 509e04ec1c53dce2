"""A model computed on a CUDA device (or in Numba's CUDA simulator): the CPU engine's
`Transformer`, with the same architecture description (`engine/block.run_layers`) executed by
`DeviceOps` on device arrays, a `DeviceKVCache` for sessions and a `DeviceKVPool` for batches
(`batch.forward_batch` runs `CudaModel.forward_packed`). Everything above the forward pass
(sessions, generation, batching, chat, scoring, embeddings) is the CPU engine's own code.

Weights are uploaded once, at load, in a layout the kernels read (`upload`): Q8_0, Q4_0 and
Q4_1 as float32 block scales (and Q4_1's minimums) beside their quants, exactly as stored;
Q5_0 in Q8_0's form (its 5-bit values as int8), Q4_K in Q4_1's (a scale and a negated minimum
per 32 elements, the products gguf's dequantization forms), Q5_1 and Q5_K as a byte an element
with a scale and minimum per 32, Q6_K, Q3_K and Q2_K as a byte an element with a scale (and
Q2_K a minimum) per 16, all exact; floats as float32 rows. Every product is the fused mat-vec
kernel on those blocks, a prompt's rows too: a row's sums never depend on the rows beside it,
so a token gets the same bits alone, in a prompt or in a batch (cuBLAS's would not).
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import quants as gguf_quants

from ...arch.weights import QWeight
from ...cache.kvcache import KVCache
from ...cache.kvpool import KVPool
from ...engine import block
from ...model import Model
from . import kernels as K

_ACTS = {"silu": K.ACT_SILU, "gelu_tanh": K.ACT_GELU_TANH}
CHUNK_TOKENS = 512  # packed tokens a batched pass runs through the layers at once (its activations' size)
STEPS_KEPT = 8  # shapes of batched decode step (and their graphs) a pool keeps


@dataclass(frozen=True)
class DeviceWeight:
    """A weight on the device: its kernel kind, (scales, quants) and shape."""
    kind: int
    scales: object  # float32 (rows, blocks, 1 or 2), or (rows, cols, 1) for float rows
    quants: object  # int8 / uint8 (rows, blocks, 32 or 16); a placeholder for float rows
    rows: int
    cols: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """float16 fields (two bytes on the last axis) as float32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values (..., 32) from their high-bit words (..., 4) and nibbles (..., 16)."""
    high = (qh.copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & 1  # element j: bit j
    return np.concatenate([qs & 15, qs >> 4], axis=-1) | (high.astype(np.uint8) << 4)


def _k_scales(raw: np.ndarray, rows: int, n_super: int) -> np.ndarray:
    """Q4_K / Q5_K super-blocks' (d sc, -(dmin m)) for each 32 elements, (rows, n_super * 8, 2):
    the products gguf's dequantization forms, in its order."""
    d, dmin = _f16(raw[:, :, 0:2]), _f16(raw[:, :, 2:4])
    sc, m = (a.reshape(rows, n_super, 8).astype(np.float32)
             for a in gguf_quants.Q4_K.get_scale_min(np.ascontiguousarray(raw[:, :, 4:16]).reshape(-1, 12)))
    return np.stack([d * sc, -(dmin * m)], axis=-1).reshape(rows, n_super * 8, 2)


def upload(w: QWeight, xp) -> DeviceWeight:
    """`w` in the kernels' layout, on the device (see the module docstring)."""
    rows, nblk, n_super = w.rows, w.cols // 32, w.cols // 256
    if w.qtype == QT.Q8_0:
        raw = w.data.reshape(rows, nblk, 34)
        scales, quants, kind = _f16(raw[:, :, :2]), raw[:, :, 2:].view(np.int8), K.Q8_0
    elif w.qtype in (QT.Q4_0, QT.Q4_1):
        head = 2 if w.qtype == QT.Q4_0 else 4
        raw = w.data.reshape(rows, nblk, head + 16)
        scales, quants = _f16(raw[:, :, :head]), raw[:, :, head:]
        kind = K.Q4_0 if w.qtype == QT.Q4_0 else K.Q4_1
    elif w.qtype == QT.Q5_0:  # (q - 16) d: Q8_0's form, the 5-bit values widened to int8
        raw = w.data.reshape(rows, nblk, 22)
        scales = _f16(raw[:, :, :2])
        quants = (_five_bits(raw[:, :, 2:6], raw[:, :, 6:]).astype(np.int16) - 16).astype(np.int8)
        kind = K.Q8_0
    elif w.qtype == QT.Q5_1:  # d q + m
        raw = w.data.reshape(rows, nblk, 24)
        scales, quants, kind = _f16(raw[:, :, :4]), _five_bits(raw[:, :, 4:8], raw[:, :, 8:]), K.A8_32
    elif w.qtype == QT.Q4_K:  # (d sc) q - (dmin m) per 32 elements: Q4_1's form, the minimum negated
        raw = w.data.reshape(rows, n_super, 144)
        qs = raw[:, :, 16:].reshape(rows, n_super, 4, 1, 32)  # 4 chunks of 64: low nibbles, then high ones
        sub = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, nblk, 32)  # each 32 elements' values
        scales, quants, kind = _k_scales(raw, rows, n_super), sub[:, :, :16] | (sub[:, :, 16:] << 4), K.Q4_1
    elif w.qtype == QT.Q5_K:  # as Q4_K, with a fifth bit: a byte an element
        raw = w.data.reshape(rows, n_super, 176)
        qs = raw[:, :, 48:].reshape(rows, n_super, 4, 1, 32)
        low = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(rows, n_super, 8, 32)
        high = (raw[:, :, 16:48].reshape(rows, n_super, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        scales, quants, kind = _k_scales(raw, rows, n_super), (low | (high << 4)).reshape(rows, nblk, 32), K.A8_32
    elif w.qtype == QT.Q6_K:  # (d sc) (q - 32) per 16 elements
        raw = w.data.reshape(rows, n_super, 210)
        ql = raw[:, :, :128].reshape(rows, n_super, 2, 1, 64)
        ql = np.concatenate([ql & 15, ql >> 4], axis=3).reshape(rows, n_super, 8, 32)
        qh = (raw[:, :, 128:192].reshape(rows, n_super, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        q = (ql | (qh.reshape(rows, n_super, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        sc = raw[:, :, 192:208].view(np.int8).astype(np.float32) * _f16(raw[:, :, 208:210])
        scales = np.stack([sc, np.zeros_like(sc)], axis=-1).reshape(rows, n_super * 16, 2)
        quants, kind = q.reshape(rows, n_super * 16, 16), K.A8_16
    elif w.qtype == QT.Q3_K:  # (d (sc - 32)) q per 16 elements, q in -4..3
        raw = w.data.reshape(rows, n_super, 110)
        ql = (raw[:, :, 32:96].reshape(rows, n_super, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        qh = (raw[:, :, :32].reshape(rows, n_super, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        q = ql.reshape(rows, n_super, 8, 32).astype(np.int8) - ((qh ^ 1) << 2).astype(np.int8)
        low = (raw[:, :, 96:104].reshape(rows, n_super, 1, 8) >> np.array([0, 4], np.uint8)[:, None]) & 15
        high = (raw[:, :, 104:108].reshape(rows, n_super, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        sc = (low.reshape(rows, n_super, 16) | (high.reshape(rows, n_super, 16) << 4)).astype(np.int8) - np.int8(32)
        sc = _f16(raw[:, :, 108:110]) * sc.astype(np.float32)
        scales = np.stack([sc, np.zeros_like(sc)], axis=-1).reshape(rows, n_super * 16, 2)
        quants, kind = q.reshape(rows, n_super * 16, 16), K.A8_16
    elif w.qtype == QT.Q2_K:  # (d sc) q - (dmin m) per 16 elements, q in 0..3
        raw = w.data.reshape(rows, n_super, 84)
        q = (raw[:, :, 16:80].reshape(rows, n_super, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
        sc = raw[:, :, :16]
        scales = np.stack([_f16(raw[:, :, 80:82]) * (sc & 15).astype(np.float32),
                           -(_f16(raw[:, :, 82:84]) * (sc >> 4).astype(np.float32))], axis=-1)
        scales, quants, kind = scales.reshape(rows, n_super * 16, 2), q.reshape(rows, n_super * 16, 16), K.A8_16
    else:  # floats: float32 rows
        scales = w.rows_of(np.arange(rows)).reshape(rows, w.cols, 1)
        quants = np.zeros((1, 1, 1), np.uint8)
        kind = K.F32
    return DeviceWeight(kind, xp.asarray(np.ascontiguousarray(scales)), xp.asarray(np.ascontiguousarray(quants)),
                        rows, w.cols)


def upload_all(model, xp) -> tuple[dict, dict]:
    """Every product weight of `model` on the device (name -> DeviceWeight), and the groups a
    token's products may take in one mat-vec: each layer's q, k and v, and its gate and up,
    where their layouts agree (fused: the first weight's name -> (a DeviceWeight of all their
    rows, each weight's rows)). A fused group is uploaded once; its weights are views of it."""
    weights, fused = {}, {}
    for L in model.layers:
        for group in ((L.wq, L.wk, L.wv), (L.w_gate, L.w_up)):
            if any(w is None for w in group):
                continue
            host = [upload(w, np) for w in group]
            first = host[0]
            if first.kind == K.F32 or any((h.kind, h.cols, h.scales.shape[1:], h.quants.shape[1:], h.quants.dtype)
                                          != (first.kind, first.cols, first.scales.shape[1:],
                                              first.quants.shape[1:], first.quants.dtype) for h in host):
                for w, h in zip(group, host):  # each on its own, from the layouts made above
                    weights[w.name] = DeviceWeight(h.kind, xp.asarray(h.scales), xp.asarray(h.quants), h.rows, h.cols)
                continue
            scales = xp.asarray(np.concatenate([h.scales for h in host]))
            quants = xp.asarray(np.concatenate([h.quants for h in host]))
            r0 = 0
            for w, h in zip(group, host):
                weights[w.name] = DeviceWeight(h.kind, scales[r0:r0 + h.rows], quants[r0:r0 + h.rows], h.rows, h.cols)
                r0 += h.rows
            fused[group[0].name] = (DeviceWeight(first.kind, scales, quants, r0, first.cols), [h.rows for h in host])
    for w in model.product_weights():
        if w.name not in weights:
            weights[w.name] = upload(w, xp)
    return weights, fused


class DeviceKVCache(KVCache):
    """`KVCache` with its buffer on the device: the same interleaved layout, preallocation,
    doubling and capacity-0 rules; `append` takes device arrays. Its copies (growth, fork,
    append) run on the model's stream, and wait for it, so they are ordered with the forward
    passes. `graph` holds the decode step captured for this buffer (CudaModel._decode)."""

    def __init__(self, n_layers, n_kv_heads, head_dim, capacity=0, dtype=np.float32, *, xp, stream):
        self._xp, self._stream = xp, stream
        self.graph = None
        with stream:
            super().__init__(n_layers, n_kv_heads, head_dim, capacity, dtype)

    def _alloc(self, capacity: int):
        return self._xp.empty((self.n_layers, capacity, self.n_kv_heads, 2, self.head_dim), dtype=self.dtype)

    def ensure_capacity(self, n: int) -> None:
        before = self.capacity
        with self._stream:
            super().ensure_capacity(n)
        if self.capacity != before:  # waits only after a copy, not on every decode step
            self._stream.synchronize()

    def append(self, layer: int, k, v) -> int:
        layer = self._check_layer(layer)
        want = (k.shape[0], self.n_kv_heads, self.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"DeviceKVCache.append: k {k.shape} and v {v.shape} must both be {want}")
        with self._stream:
            end = self._store(layer, k, v)
        self._stream.synchronize()
        return end

    def fork(self) -> "DeviceKVCache":
        with self._stream:
            other = super().fork()
        self._stream.synchronize()
        return other

    def _empty(self, capacity: int) -> "DeviceKVCache":
        return DeviceKVCache(self.n_layers, self.n_kv_heads, self.head_dim, capacity, self.dtype, xp=self._xp,
                             stream=self._stream)


class DeviceKVPool(KVPool):
    """`KVPool` with its pages on the device: the same layout, page tables, copy on write and
    prefix cache (kept on the host); `write` takes device arrays. Its copies run on the model's
    stream, and wait for it. `steps` keeps the last STEPS_KEPT shapes of batched decode step
    run on it, with their CUDA graphs (CudaModel._batch_step)."""

    device = "cuda"

    def __init__(self, *args, xp, stream, launch_stream, **options):
        self._xp, self._stream, self._launch = xp, stream, launch_stream
        self.steps: OrderedDict = OrderedDict()  # the batched decode steps run on this pool (_BatchStep)
        with stream:
            super().__init__(*args, **options)
        stream.synchronize()

    def _alloc(self, shape):
        return self._xp.zeros(shape, self.dtype)

    def reserve(self, seqs, counts):
        with self._stream:
            out = super().reserve(seqs, counts)  # copies shared pages before they are written
        self._stream.synchronize()
        return out

    def write(self, layer: int, slots, k, v) -> None:
        xp = self._xp
        with self._stream:
            K.store_kv(self._flat[layer], xp.ascontiguousarray(k, np.float32), xp.ascontiguousarray(v, np.float32),
                       xp.asarray(slots, np.int64), stream=self._launch)
        self._stream.synchronize()


class DeviceOps(block.Ops):
    """`block.Ops` on device arrays: products, norms, GLU, RoPE and attention by the kernels,
    on the model's stream, with the fused launches of kernels.py where a layer allows them.
    Each layer's new keys and values go to the flat `slots` (a device array) of its records,
    `pages(li)` (pages, page_size, KVH, 2, D); query s finds its keys through the page table
    tables[seq_of[s]] (a pool's pages, or a session cache's buffer as one page) and attention
    launches `splits` blocks of keys (the caller commits the cache)."""

    def __init__(self, model: "CudaModel", pages, slots, tables, seq_of, positions, splits: int):
        super().__init__(model.config)
        self.model, self.xp, self.pages = model, model.xp, pages
        self.slots, self.tables, self.seq_of, self.positions, self.splits = slots, tables, seq_of, positions, splits
        self.stream = model.launch_stream

    @classmethod
    def for_cache(cls, model: "CudaModel", cache: "DeviceKVCache", positions, splits: int) -> "DeviceOps":
        """A session's pass: its cache's layer buffer is one page, the positions its slots."""
        return cls(model, lambda li: cache.buffer(li)[None], positions, model.device_zeros(1, np.int32).reshape(1, 1),
                   model.device_zeros(len(positions), np.int64), positions, splits)

    def product(self, w: QWeight, h):
        """h (S, cols) @ W.T on the device, by the mat-vec kernel: a row's sums do not depend
        on the rows beside it, so a token gets the same bits alone, in a prompt or in a batch."""
        d = self.model.device_weights[w.name]
        return self._matvec(d, h, self.xp.empty((h.shape[0], d.rows), np.float32))

    def _matvec(self, d, h, out, **kw):
        """`kernels.matvec` of the activation rows h with the device weight d (a `DeviceWeight`,
        one or a fused group's) into out, on the model's stream; kw: its groups, act, add."""
        return K.matvec(d.kind, d.scales, d.quants, self.xp.ascontiguousarray(h), out, d.rows, d.cols,
                        stream=self.stream, **kw)

    def _group(self, first: QWeight):
        """`first`'s fused group (`upload_all`): (a DeviceWeight of all its weights' rows, each
        weight's rows); None where the group is not fused, or NPLLAMA_CUDA_FUSE=0."""
        return self.model.fused.get(first.name) if self.model.fuse else None

    def _fused(self, first: QWeight, h):
        """The products with the weights of `first`'s fused group by one mat-vec over all their
        rows (the same sums as each alone, one launch instead of two or three), each weight's a
        C-contiguous (S, rows); None where the group is not fused."""
        group = self._group(first)
        if group is None:
            return None
        d, rows = group
        S, edges = h.shape[0], np.cumsum([0, *rows])
        out = self._matvec(d, h, self.xp.empty(S * d.rows, np.float32), groups=edges[1:-1])
        return [out[S * a:S * b].reshape(S, b - a) for a, b in zip(edges[:-1], edges[1:])]

    def qkv(self, L, h):
        return self._fused(L.wq, h) or super().qkv(L, h)

    def norm(self, x, w):
        xp = self.xp
        shape = x.shape
        flat = xp.ascontiguousarray(x).reshape(-1, shape[-1])
        return K.rmsnorm(flat, self.model.device_vector(w), self.cfg.rms_eps, xp.empty_like(flat),
                         stream=self.stream).reshape(shape)

    def qk_norm(self, q, k, wq, wk):
        xp = self.xp
        q, k = xp.ascontiguousarray(q), xp.ascontiguousarray(k)
        return K.head_norms(q, k, self.model.device_vector(wq), self.model.device_vector(wk), self.cfg.rms_eps,
                            xp.empty_like(q), xp.empty_like(k), stream=self.stream)

    def glu(self, gate, up, h):
        """act(h @ gate.T) * (h @ up.T): one mat-vec with the GLU in it where gate and up are a
        fused group (`_group`), else their two products and the GLU's kernel."""
        group = self._group(gate)
        act = _ACTS[self.cfg.act]
        if group is not None:
            d, _ = group
            return self._matvec(d, h, self.xp.empty((h.shape[0], d.rows // 2), np.float32), groups=(d.rows // 2,),
                                act=act)
        g, u = self.product(gate, h), self.product(up, h)
        return K.glu(g, u, self.xp.empty_like(g), act, stream=self.stream)

    def add(self, x, b):
        x += self.model.device_vector(b)

    def residual(self, x, y, w):
        """A post-norm and its add in one launch (`block.Ops.residual` without a post-norm)."""
        if w is None:
            super().residual(x, y, w)
        else:
            K.add_rmsnorm(x, self.xp.ascontiguousarray(y), self.model.device_vector(w), self.cfg.rms_eps,
                          stream=self.stream)

    def add_product(self, x, W, h, w):
        """Without a post-norm, the mat-vec adds its products to x itself (one launch)."""
        if w is not None:
            return super().add_product(x, W, h, w)
        self._matvec(self.model.device_weights[W.name], h, x, add=True)

    def rope_attention(self, li, q, k, v, rope, window):
        """RoPE of q and k and the layer's cache write in one launch (the keys and values of
        a layer without RoPE by the store's), then attention."""
        xp = self.xp
        pages = self.pages(li)
        records = pages.reshape(-1, *pages.shape[2:])
        q, k, v = xp.ascontiguousarray(q), xp.ascontiguousarray(k), xp.ascontiguousarray(v)
        if rope is None:
            K.store_kv(records, k, v, self.slots, stream=self.stream)
        else:
            _, cos, sin = rope  # the positions: self.positions, on the device
            K.rope_store(q, k, v, records, self.slots, self.positions, self.model.device_vector(cos),
                         self.model.device_vector(sin), self.cfg.rope_neox, stream=self.stream)
        return K.attention(q, pages, self.tables, self.seq_of, self.positions, self.splits, int(window),
                           self.cfg.attn_scale, xp.empty_like(q), xp, stream=self.stream)


class _Stream:
    """The model's CUDA stream (`cupy`, a CuPy stream), made current by one thread at a time:
    another thread's launches on it would otherwise join a decode graph's capture."""

    def __init__(self, cupy_stream):
        self.cupy, self._lock = cupy_stream, threading.RLock()

    def __enter__(self):
        self._lock.acquire()
        try:
            self.cupy.__enter__()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc):
        try:
            return self.cupy.__exit__(*exc)
        finally:
            self._lock.release()

    def synchronize(self):
        self.cupy.synchronize()


class _NoStream:
    """The simulator's stand-in for `_Stream`: everything runs in order already."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass


@dataclass
class _DecodeGraph:
    """One decode step of one cache buffer, captured as a CUDA graph: the token's embedding
    goes into `x` and its position into `positions`, and the logits come out in `out`. `pool`
    is the memory pool its temporaries came from, kept for the graph alone."""
    key: tuple
    graph: object
    x: object
    positions: object
    out: object
    pool: object


class CudaModel(Model):
    """`npllama.Model` with its forward pass on the device (made by `backends.cuda.load`).

    On a GPU every pass runs on one CUDA stream of the model's. A session's decode steps
    replay a CUDA graph: the second step at a cache's capacity captures the whole step (every
    layer and the head, some 500 launches), which later steps replay with one launch; the
    first step runs the same kernels eagerly with the graph's memory pool, which compiles the
    kernels and gives the capture memory it need not allocate. NPLLAMA_CUDA_GRAPHS=0 runs
    every step eagerly (for comparison)."""

    device = "cuda"

    def __init__(self, path, *, xp, **options):
        super().__init__(path, **options)
        cfg = self.config
        if cfg.n_expert:
            raise ValueError(f"{self.path}: device='cuda' does not run mixtures of experts yet; load it with "
                             f"device='cpu'")
        if self.activations != "f32":
            raise ValueError("device='cuda' computes in float32: load it with activations='f32'")
        self.xp = xp
        if xp is np:
            self.stream, self.launch_stream, self.graphs = _NoStream(), 0, False
        else:
            from numba import cuda
            self.stream = _Stream(xp.cuda.Stream(non_blocking=True))
            self.launch_stream = cuda.external_stream(self.stream.cupy.ptr)
            self.graphs = os.environ.get("NPLLAMA_CUDA_GRAPHS", "1") != "0"
        self.fuse = os.environ.get("NPLLAMA_CUDA_FUSE", "1") != "0"
        with self.stream:
            self.device_weights, self.fused = upload_all(self, xp)
        self.stream.synchronize()
        self._vectors: dict[tuple, tuple] = {}
        self._zeros: dict[np.dtype, list] = {}
        self._local = threading.local()  # forward(device_arrays=True) of this thread

    def _shared_pool(self):
        """Allocations from CuPy's shared pool, even inside a decode graph's first step or a
        batched step's, whose allocations are the graph's (a no-op in the simulator)."""
        xp = self.xp
        return contextlib.nullcontext() if xp is np else xp.cuda.using_allocator(xp.get_default_memory_pool().malloc)

    def device_vector(self, a: np.ndarray):
        """A host array (a norm's weights, a RoPE table or a view of one) on the device, uploaded
        once: keyed by its memory, which the entry keeps alive."""
        key = (a.__array_interface__["data"][0], a.shape, a.strides, a.dtype.str)
        got = self._vectors.get(key)
        if got is None:
            xp = self.xp
            with self._shared_pool():
                got = self._vectors[key] = (a, xp.asarray(np.ascontiguousarray(a, dtype=np.float32)))
        return got[1]

    def device_zeros(self, n: int, dtype):
        """n zeros of `dtype` on the device, from the shared pool like `device_vector`: the page
        tables and sequence indices of a session's pass, which has one page and one sequence. A
        view of one array per dtype, replaced by one twice as long when too short; the shorter
        ones stay alive, as decode graphs captured earlier read them."""
        dtype = np.dtype(dtype)
        kept = self._zeros.setdefault(dtype, [])
        if not kept or len(kept[-1]) < n:
            xp = self.xp
            with self._shared_pool():
                kept.append(xp.zeros(max(n, 2 * len(kept[-1]) if kept else n), dtype))
        return kept[-1][:n]

    def new_cache(self, capacity: int = 0) -> DeviceKVCache:
        cfg = self.config
        return DeviceKVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, capacity, self.kv_dtype, xp=self.xp,
                             stream=self.stream)

    def new_pool(self, n_pages: int, page_size: int, dtype) -> DeviceKVPool:
        cfg = self.config
        return DeviceKVPool(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_pages, page_size, dtype, xp=self.xp,
                            stream=self.stream, launch_stream=self.launch_stream)

    def check_cache(self, cache) -> None:
        """ValueError unless `cache` is a device cache shaped for this model."""
        if not isinstance(cache, DeviceKVCache):
            raise ValueError("a device='cuda' model needs its own cache: make one with model.new_cache()")
        super().check_cache(cache)

    def _pass(self, x, positions_host, ops, end, all_logits, output):
        """The layers and the head on the residual stream x (on the device)."""
        x = block.run_layers(self, x, positions_host, ops, end)
        if output == "hidden":
            return ops.norm(x, self.output_norm)
        out = block.softcap(ops.product(self.output, ops.norm(x if all_logits else x[-1:], self.output_norm)),
                            self.config.softcap)
        return out if all_logits else out[0]

    def _run(self, ids, cache, all_logits, output, threads):
        xp = self.xp
        pos = cache.length
        self.ropes.check_range(pos, pos + len(ids))
        cache.ensure_capacity(pos + len(ids))
        positions = np.arange(pos, pos + len(ids), dtype=np.int64)
        try:
            with self.stream:
                out = None
                if self.graphs and len(ids) == 1 and output == "logits" and not all_logits:
                    out = self._decode(ids, cache)
                if out is None:
                    ops = DeviceOps.for_cache(self, cache, xp.asarray(positions), -(-(pos + len(ids)) // K.SPLIT))
                    out = self._pass(xp.asarray(block.embed(self, ids)), positions, ops, pos + len(ids), all_logits,
                                     output)
                if getattr(self._local, "device_arrays", False):
                    out = out.copy()  # a graph's output buffer is overwritten by its next replay
                    self.stream.synchronize()
                else:
                    out = _host(out)
        except BaseException:
            cache.truncate(pos)
            raise
        cache.commit(len(ids))
        return out

    def forward_packed(self, pool: DeviceKVPool, ids, positions, slots, seq_of, tables, want) -> np.ndarray:
        """The packed pass of `batch.forward_batch` on the device: tokens `ids` at `positions`,
        of the sequences seq_of (indices into the page tables `tables`), their keys and values
        into the pool's flat `slots`; returns the logits (len(want), n_vocab) of the tokens
        `want`. In chunks of CHUNK_TOKENS, each attending to the keys the earlier ones wrote.
        Every product, norm and attention of a token is computed as in a session's pass (the
        mat-vec's sums do not depend on the other rows, attention reads the same keys in the
        same order), so a sequence gets a session's bits."""
        xp = self.xp
        if len(ids) == len(tables):  # a decode pass: one token a sequence (a token list is never empty)
            with self.stream:
                return _host(self._batch_step(pool, ids, positions, slots, tables))
        with self.stream:
            tables_d, hidden, ops = xp.asarray(tables), [], None
            for c0 in range(0, len(ids), CHUNK_TOKENS):
                c1 = min(len(ids), c0 + CHUNK_TOKENS)
                end = int(positions[c0:c1].max()) + 1
                ops = DeviceOps(self, pool.buffer, xp.asarray(slots[c0:c1]), tables_d, xp.asarray(seq_of[c0:c1]),
                                xp.asarray(positions[c0:c1]), -(-end // K.SPLIT))
                x = block.run_layers(self, xp.asarray(block.embed(self, ids[c0:c1])), positions[c0:c1], ops, end)
                lo, hi = np.searchsorted(want, (c0, c1))
                hidden.append(x[xp.asarray(want[lo:hi] - c0)])
            x = xp.concatenate(hidden)
            logits = _host(block.softcap(ops.product(self.output, ops.norm(x, self.output_norm)), self.config.softcap))
        return logits

    def _batch_step(self, pool: DeviceKVPool, ids, positions, slots, tables):
        """The logits (on the device) of a decode pass over B pool sequences, one token each, by
        a step of fixed shapes (`_BatchStep`) for B sequences, page tables `width` wide and
        `splits` blocks of keys (both rounded up to powers of two, so that a step serves many
        passes): eager at its first run, captured as a CUDA graph at its second, replayed after
        (on a GPU with graphs on; eager otherwise)."""
        B, end = len(ids), int(positions.max()) + 1
        width, splits = _pow2(tables.shape[1]), _pow2(-(-end // K.SPLIT))
        cos, _ = self.ropes.tables(end)
        key = (B, width, splits, cos.__array_interface__["data"][0])
        st = pool.steps.pop(key, None) or _BatchStep(self, B, width, splits)
        pool.steps[key] = st  # the most recently used last
        while len(pool.steps) > STEPS_KEPT:
            pool.steps.popitem(last=False)
        padded = np.full((B, width), -1, np.int32)
        padded[:, :tables.shape[1]] = tables
        for buf, host in ((st.x, block.embed(self, ids)), (st.positions, positions), (st.slots, slots),
                          (st.tables, padded)):
            _put(buf, host)
        if st.graph is None:
            with st.allocator():
                if not (self.graphs and st.runs):
                    st.runs += 1
                    return st.run(pool, end)
                try:
                    st.capture(pool, end)
                except Exception as e:  # noqa: BLE001 - a driver or library that cannot capture: run eagerly
                    warnings.warn(f"npllama: capturing a batched decode step as a CUDA graph failed "
                                  f"({type(e).__name__}: {e}); batched steps run eagerly")
                    self.graphs = False
                    return st.run(pool, end)
        st.graph.launch(self.stream.cupy)
        return st.out

    def _decode(self, ids, cache):
        """One token's logits (on the device) by the cache's decode graph, or None where the
        step must run eagerly: its first at this capacity (see the class docstring)."""
        import cupy
        pos = cache.length
        cos, _ = self.ropes.tables(pos + 1)
        key = (cache.capacity, cache.buffers().data.ptr, cos.__array_interface__["data"][0])
        g = cache.graph
        if g is None or g.key != key:
            if g is None or g.key != key + ("warm",):
                pool = cupy.cuda.MemoryPool()
                with cupy.cuda.using_allocator(pool.malloc):
                    out = self._decode_pass(ids, cache, xp_positions=self.xp.asarray(np.array([pos])))
                cache.graph = _DecodeGraph(key + ("warm",), None, None, None, None, pool)
                return out
            try:
                g = self._capture(cache, key, g.pool)
            except Exception as e:  # noqa: BLE001 - a driver or library that cannot capture: run eagerly
                warnings.warn(f"npllama: capturing the decode step as a CUDA graph failed ({type(e).__name__}: "
                              f"{e}); decode steps run eagerly")
                self.graphs, cache.graph = False, None
                return None
            cache.graph = g
        g.x.set(block.embed(self, ids))
        g.positions.set(np.array([pos], np.int64))
        g.graph.launch(self.stream.cupy)
        return g.out

    def _decode_pass(self, ids, cache, *, xp_positions, x=None):
        """A decode step's kernels for the graph: attention launches the splits of the whole
        capacity, so that the captured step serves every position below it."""
        ops = DeviceOps.for_cache(self, cache, xp_positions, -(-cache.capacity // K.SPLIT))
        if x is None:
            x = self.xp.asarray(block.embed(self, ids))
        end = cache.length + 1
        return self._pass(x, np.arange(end - 1, end, dtype=np.int64), ops, end, False, "logits")

    def _capture(self, cache, key, pool) -> _DecodeGraph:
        import cupy
        xp = self.xp
        with cupy.cuda.using_allocator(pool.malloc):
            x = xp.empty((1, self.config.n_embd), np.float32)
            positions = xp.zeros(1, np.int64)
            self.stream.cupy.begin_capture(getattr(cupy.cuda.runtime, "streamCaptureModeRelaxed", None))
            try:
                out = self._decode_pass(None, cache, xp_positions=positions, x=x)
            finally:
                graph = self.stream.cupy.end_capture()
        return _DecodeGraph(key, graph, x, positions, out, pool)

    def forward(self, ids, pos: int, cache, *, all_logits: bool = False, output: str = "logits",
                threads: int | None = None, device_arrays: bool = False):
        """`Transformer.forward`; with `device_arrays=True` the logits (or hidden states) stay on
        the device, a CuPy array (NumPy's in the simulator), instead of coming back as NumPy."""
        self._local.device_arrays = device_arrays
        try:
            return super().forward(ids, pos, cache, all_logits=all_logits, output=output, threads=threads)
        finally:
            self._local.device_arrays = False


class _BatchStep:
    """A decode pass of B pool sequences (one token each) in shapes fixed for a CUDA graph: its
    inputs in device buffers of its own (the tokens' embeddings x, positions, slots, page
    tables `width` wide padded with -1, sequence indices 0..B-1), attention over `splits`
    blocks of keys (those past a query's keys hold none). Its temporaries come from a memory
    pool of its own (on a GPU), which the first, eager, run fills and the graph keeps."""

    def __init__(self, model: "CudaModel", B: int, width: int, splits: int):
        self.model, self.splits, self.runs, self.graph, self.out = model, splits, 0, None, None
        xp = model.xp
        self.memory = None if xp is np else xp.cuda.MemoryPool()
        with self.allocator():
            self.x = xp.empty((B, model.config.n_embd), np.float32)
            self.positions, self.slots = xp.empty(B, np.int64), xp.empty(B, np.int64)
            self.tables, self.seq_of = xp.empty((B, width), np.int32), xp.arange(B, dtype=np.int64)

    def allocator(self):
        if self.memory is None:
            return contextlib.nullcontext()
        return self.model.xp.cuda.using_allocator(self.memory.malloc)

    def run(self, pool: DeviceKVPool, end: int):
        """The pass's kernels on the inputs in the buffers: the logits (B, n_vocab)."""
        m = self.model
        ops = DeviceOps(m, pool.buffer, self.slots, self.tables, self.seq_of, self.positions, self.splits)
        x = block.run_layers(m, self.x, None, ops, end)  # the positions: on the device, in ops
        return block.softcap(ops.product(m.output, ops.norm(x, m.output_norm)), m.config.softcap)

    def capture(self, pool: DeviceKVPool, end: int) -> None:
        """The pass captured as the step's graph (not launched); no graph where it fails."""
        stream = self.model.stream.cupy
        stream.begin_capture(getattr(self.model.xp.cuda.runtime, "streamCaptureModeRelaxed", None))
        try:
            out = self.run(pool, end)
        except BaseException:
            stream.end_capture()
            raise
        self.graph, self.out = stream.end_capture(), out


def _pow2(n: int) -> int:
    """The least power of two >= n (>= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def _put(buf, host: np.ndarray) -> None:
    """Copy a host array into a device buffer of its shape (CuPy's .set; the simulator's NumPy)."""
    if hasattr(buf, "set"):
        buf.set(np.ascontiguousarray(host, dtype=buf.dtype))
    else:
        buf[...] = host


def _host(a) -> np.ndarray:
    """A device array as a NumPy array (CuPy's .get(); the simulator's arrays are NumPy's)."""
    return a.get() if hasattr(a, "get") else np.asarray(a)
