"""A transformer computed on GGUF weights, as its architecture describes it (npllama.arch):
the llama family (SmolLM2, TinyLlama, Llama 2/3, Mistral, Qwen2), Gemma 3, Qwen 3, Qwen 3 MoE,
SmolLM3 and Phi-3. The text API (npllama.generation) runs on it; `npllama.Model` is this class
with that API as methods.

`Transformer.forward(ids, pos, cache)` is the one place a single sequence's forward pass happens. It reads the position
it is given only to check it against `cache.length`: the cache is the single owner of position
state, and a `Session` (session.py) is the friendly way to drive it.
"""
from __future__ import annotations

import os
import threading

import numpy as np
from numba import get_num_threads

from ..arch import ARCHS
from ..arch.weights import Layer, QWeight, f32
from ..cache.kvcache import KVCache
from ..errors import GGUFError, PositionError
from ..gguf import panelfile, verdicts
from ..gguf.reader import GGUFFile, ModelConfig
from ..kernels import aligned, cachestamp
from ..kernels.attention import attend
from ..kernels.nn import rmsnorm
from ..kernels.paged_attention import plan_blocks
from ..kernels.panels import PANEL, has_panels, pack_panels, panel_shape
from ..kernels.rope import Ropes
from ..kernels.rows import matmul_rows as mm  # x @ W.T reading each weight row once, for a few to hundreds of rows
from ..kernels.threads import check_threads, physical_cores, using_threads
from . import block, packed
from .ops import PanelOps, fits_rows

__all__ = ["Transformer", "Layer", "QWeight"]


def _kv_dtype(kv_dtype, activations: str) -> np.dtype:
    """The KV storage dtype asked for: float32 or float16; by default float16 with int8
    activations (the fast mode, as llama.cpp stores its cache), float32 otherwise (exact)."""
    if kv_dtype is None:
        return np.dtype(np.float16 if activations == "int8" else np.float32)
    try:
        dtype = np.dtype(kv_dtype)
    except TypeError:
        dtype = None
    if dtype not in (np.float32, np.float16):
        raise ValueError(f"kv_dtype must be float32 or float16 (or None: float16 with int8 activations, "
                         f"else float32), got {kv_dtype!r}")
    return dtype


PREFILL_CHUNK = 512  # tokens per forward chunk of a long prompt
_PACK_PART_BYTES = 4 << 20  # a weight's GGUF rows are packed into panels (and released) this much at a time
_ONE_PAGE = np.zeros((1, 1), np.int32)  # the page table of a session's cache as the packed pass reads it


class Transformer:
    """A loaded GGUF model: its weights, tokenizer and forward pass. Cheap to create: weights
    stay memory-mapped until used.

    Thread safety: the weights are read-only and every Session owns its own cache, so several
    threads may each drive their own session (or call generate/score/...) on one Model at once;
    their single-token decode steps take turns (they share the fused step's working memory).
    A single Session must not be used from two threads at the same time.
    """

    device = "cpu"  # where the forward pass runs (npllama.backends.cuda's models say "cuda")

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, activations: str = "f32",
                 kv_dtype=None):
        if activations not in ("f32", "int8"):
            raise ValueError(f"activations must be 'f32' (exact, the default) or 'int8' (faster decode, "
                             f"activations quantized per block as llama.cpp does), got {activations!r}")
        self.activations = activations
        self.kv_dtype = _kv_dtype(kv_dtype, activations)
        self.file = GGUFFile(path)
        self.path = self.file.path
        self.config: ModelConfig = self.file.config
        self.threads = check_threads(threads) or physical_cores()
        cfg, t, opt = self.config, self.file.tensor, self.file.tensors.get
        arch = ARCHS[cfg.arch]
        self.layers = [arch.load_layer(cfg, t, opt, i) for i in range(cfg.n_layer)]
        self.token_embd = QWeight.from_tensor(t("token_embd.weight"))
        # an encoder (bidirectional attention) has no output norm or LM head, and its input and
        # classification head's weights (arch/bert.py) in `encoder`; a decoder's `encoder` is None
        self.encoder = arch.load_model(cfg, t, opt, self.path) if hasattr(arch, "load_model") else None
        self.output_norm = f32(t("output_norm.weight")) if cfg.causal else None
        self.output = (None if not cfg.causal else
                       self.token_embd if cfg.tied_output else QWeight.from_tensor(t("output.weight")))
        names = {n for r in cfg.ropes for n in (r.factors, r.long_factors) if n}
        self.ropes = Ropes(cfg, {n: f32(t(n)) for n in names})
        # the small tensors (norms, biases, RoPE factors) are copies now: the file's pages that
        # held them leave the resident set, with the neighbours that reading them mapped in
        # (Linux maps up to 64 KiB around a fault: ~4 MiB over a model's norms). The weights'
        # rows are read from their panels, or paged in again from the page cache.
        self.file.release(self.file.buffer[self.file.data_offset:])
        self._vocabulary = None  # checked now, so a broken vocabulary fails here, not at tokenize()
        if "tokenizer.ggml.tokens" in self.file.metadata:
            from ..text.tokenizer import CHECK_VERSION, check_metadata
            passed = CHECK_VERSION is not None and verdicts.passed("vocabulary", CHECK_VERSION, self.file)
            try:
                self._vocabulary = check_metadata(self.file.metadata, passed=passed)
            except GGUFError as e:
                raise GGUFError(f"{self.path}: {e}") from None
            if not passed and CHECK_VERSION is not None:
                verdicts.record("vocabulary", CHECK_VERSION, self.file)
        self._tokenizer = None
        self._plan = None
        self._panels: dict[str, np.ndarray] | None = None  # see panels()
        self._panel_arena = np.empty(0, np.uint8)
        self._panels_lock = threading.Lock()

    # ---- text ---------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The model's tokenizer, built from the GGUF metadata on first use."""
        if self._tokenizer is None:
            from ..text.tokenizer import Tokenizer
            if self._vocabulary is None:  # no vocabulary in the file: from_metadata says so
                self._tokenizer = Tokenizer.from_metadata(self.file.metadata)
            else:
                self._tokenizer = Tokenizer.from_vocabulary(self._vocabulary)
                self._vocabulary = None
        return self._tokenizer

    def tokenize(self, text: str, *, add_bos: bool | None = None, special: bool = False) -> list[int]:
        """Token ids of `text` (BOS added as the model's metadata says unless `add_bos` is given)."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids) -> str:
        """The text of token ids."""
        return self.tokenizer.decode(ids)

    def format_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """`messages` rendered with the model's chat template, as HF's apply_chat_template does.
        A model without one (a base model) raises ValueError: it has no chat format to follow."""
        from ..text.chat import validate_messages  # Jinja2 only once a chat is formatted
        validate_messages(messages)
        if self.tokenizer.chat_template is None:
            raise ValueError(f"{os.path.basename(self.path)} has no chat template (tokenizer.chat_template): it is "
                             f"a base model, not made for chat. Use generate()/complete() with a plain prompt "
                             f"(`npllama run` sends the prompt as it is)")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)

    # ---- inference ----------------------------------------------------------------------
    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty KV cache shaped for this model, storing `kv_dtype`."""
        cfg = self.config
        return KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, capacity=capacity, dtype=self.kv_dtype)

    def check_generates(self) -> None:
        """ValueError unless this model generates text (a decoder): an encoder embeds or reranks."""
        if not self.config.causal:
            raise ValueError(f"{os.path.basename(self.path)} is an embedding model ('{self.config.arch}', an encoder "
                             f"with bidirectional attention): it cannot generate or score text. Use "
                             f"model.embed(texts), or model.rerank(query, documents) for a reranker")

    def new_pool(self, n_pages: int, page_size: int, dtype):
        """A paged KV pool shaped for this model (`KVPool.for_model` makes one by pages or tokens)."""
        self.check_generates()
        from ..cache.kvpool import KVPool
        cfg = self.config
        return KVPool(cfg.n_layer, cfg.n_head_kv, cfg.head_dim, n_pages, page_size, dtype)

    def session(self, *, ctx: int | None = None, threads: int | None = None):
        """A new inference session: one KV cache, and a position that is always its length."""
        self.check_generates()
        from .session import Session
        return Session(self, ctx=ctx, threads=threads)

    def check_ids(self, ids) -> np.ndarray:
        """`ids` as a non-empty int64 array of valid token ids, or a ValueError saying what is wrong."""
        if type(ids) is list and len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] < self.config.n_vocab:
            return np.array(ids, np.int64)  # one decoded token: the common case, kept to one numpy call
        arr = np.asarray(ids)
        if arr.ndim == 0:
            arr = arr.reshape(1)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"token ids must be a non-empty 1-D sequence, got shape {arr.shape}")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
        bad = (arr < 0) | (arr >= self.config.n_vocab)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"token id {int(arr[i])} at index {i} is out of range: this model's "
                             f"vocabulary has ids 0..{self.config.n_vocab - 1}")
        return arr.astype(np.int64)

    def forward(self, ids, pos: int, cache: KVCache, *, all_logits: bool = False,
                output: str = "logits", threads: int | None = None) -> np.ndarray:
        """Run `ids` at positions pos, pos+1, ... and append their keys and values to `cache`.

        `pos` must equal `cache.length`. Returns float32 logits: (n_vocab,) for the last token,
        or (len(ids), n_vocab) with `all_logits=True`; with `output="hidden"`, the final hidden
        states after the output norm, (len(ids), n_embd). On any error the cache is left as it was.
        """
        if output not in ("logits", "hidden"):
            raise ValueError(f"output must be 'logits' or 'hidden', got {output!r}")
        self.check_generates()
        ids = self.check_ids(ids)
        if pos != cache.length:
            raise PositionError(
                f"position {pos} does not match the KV cache length {cache.length}: the next token "
                f"must go at position {cache.length}. Pass pos=cache.length, or truncate/reset the "
                f"cache first (a Session keeps the two together for you)")
        self.check_cache(cache)
        return self._run(ids, cache, all_logits, output, check_threads(threads) or self.threads)

    def check_cache(self, cache: KVCache) -> None:
        """Raise ValueError unless `cache` is shaped for this model."""
        cfg = self.config
        if (cache.n_layers, cache.n_kv_heads, cache.head_dim) != (cfg.n_layer, cfg.n_head_kv, cfg.head_dim):
            raise ValueError(
                f"the KV cache is shaped for (layers, kv heads, head dim) = "
                f"{(cache.n_layers, cache.n_kv_heads, cache.head_dim)}, this model needs "
                f"{(cfg.n_layer, cfg.n_head_kv, cfg.head_dim)}; make one with model.new_cache()")

    @property
    def decode_plan(self):
        """The fused decode step's layout of the weights (engine/decode.py), built at first use."""
        if self._plan is None:
            from .decode import DecodePlan
            self._plan = DecodePlan(self, int8=self.activations == "int8")
        return self._plan

    def panels(self, w: QWeight) -> np.ndarray | None:
        """The panels (kernels/panels.py) of a weight of the model of a type that has them,
        else None. The first call packs every such weight, into one array (`panel_arena`), which
        the prefill, the decode step and the batched pass read in place of the file's rows."""
        return self._panel_views().get(w.name)

    @property
    def panel_arena(self) -> np.ndarray:
        """The one array that every weight's panels (`panels`) are views of, packed at first use."""
        self._panel_views()
        return self._panel_arena

    def _panel_views(self) -> dict[str, np.ndarray]:
        views = self._panels  # packed already: no lock on the products' path
        if views is None:
            with self._panels_lock:
                if self._panels is None:
                    arena, views = self._pack_panels()
                    self._panel_arena = arena
                    self._panels = views
                views = self._panels
        return views

    def product_weights(self) -> list[QWeight]:
        """Every weight a product reads: each layer's (its experts' and router's too), then the
        output's (the token embedding, when tied)."""
        layers = [w for L in self.layers
                  for w in (L.wq, L.wk, L.wv, L.wo, L.w_gate, L.w_up, L.w_down, L.router,
                            *(w for e in L.experts for w in e)) if w is not None]
        return layers + ([self.output] if self.output is not None else [])

    def _pack_panels(self) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(arena, {weight name: its panels, a view of the arena}) for every product weight of a
        type with panel kernels whose inputs are whole blocks of 32: mapped from the model
        cache where an earlier process saved them (gguf/panelfile.py), else packed (and saved).
        No product reads those weights' GGUF rows after that, so their pages leave the resident
        set as they are packed, a few MiB at a time (`GGUFFile.release`; a tied embedding's rows
        come back as tokens look them up): the peak holds the panels and one such part of the
        file, not a whole weight."""
        ws = {w.name: w for w in self.product_weights() if has_panels(w.qtype) and w.cols % 32 == 0}
        shapes = {n: panel_shape(w.qtype, w.rows, w.cols) for n, w in ws.items()}
        layout = [[n, int(w.qtype), w.rows, w.cols] for n, w in ws.items()]
        nbytes = sum(p * b for p, b in shapes.values())
        saved = panelfile.load(self.file, layout, cachestamp.module_stamp("kernels.panels"), nbytes)
        arena = aligned.zeros(nbytes, np.uint8) if saved is None else saved  # the panels on cache lines
        views, at = {}, 0
        for n, (p, b) in shapes.items():
            views[n] = arena[at:at + p * b].reshape(p, b)
            at += p * b
        if saved is not None:
            return arena, views
        for n, w in ws.items():
            step = max(1, _PACK_PART_BYTES // (w.data.shape[1] * PANEL)) * PANEL  # rows: whole panels
            for r in range(0, w.rows, step):
                part = w.data[r:r + step]
                pack_panels(part, w.qtype, out=views[n][r // PANEL:-(-(r + len(part)) // PANEL)])
                self.file.release(part)
            self.file.release(w.data)  # the pages two parts share
        panelfile.save(self.file, layout, cachestamp.module_stamp("kernels.panels"), arena)
        return arena, views

    def _run(self, ids: np.ndarray, cache: KVCache, all_logits: bool, output: str, threads: int) -> np.ndarray:
        """`forward` for checked arguments (int64 ids, a cache shaped for this model) at
        position cache.length. Kept short for one token: every line runs once per decoded
        token, after the weights have flushed the CPU caches."""
        pos = cache.length
        self.ropes.check_range(pos, pos + len(ids))
        # the fused decode step runs its own threads (mixtures of experts take the prefill path)
        if len(ids) == 1 and output == "logits" and not self.config.n_expert:
            try:
                logits = self.decode_plan.step(int(ids[0]), pos, cache, threads)
            except BaseException:
                cache.truncate(pos)
                raise
            return logits.reshape(1, -1) if all_logits else logits
        with using_threads(threads):
            try:
                # room for the whole prompt at once: growing chunk by chunk would copy the
                # filled cache at each doubling and hold the old and the new buffer together;
                # and for the token a prompt is for, which would else grow it at once
                end = pos + len(ids)
                cache.ensure_capacity(end + 1 if output == "logits" and not all_logits and end < self.config.n_ctx
                                      else end)
                if output == "logits" and not all_logits and not self.config.n_expert:
                    # a prompt for its next token: tokens are decoded next, and the decode
                    # step is loaded now, before the prompt fills the cache
                    self.decode_plan.load(cache, threads)
                positions = np.arange(pos, pos + len(ids), dtype=np.int64)
                # long prompts run in chunks, which bounds the activations' memory
                outs = [self._forward(ids[i:i + PREFILL_CHUNK], positions[i:i + PREFILL_CHUNK], cache,
                                      all_logits, output, pos + len(ids))
                        for i in range(0, len(ids), PREFILL_CHUNK)]
                if output == "logits" and not all_logits:
                    return outs[-1]
                return outs[0] if len(outs) == 1 else np.concatenate(outs)
            except BaseException:
                cache.truncate(pos)
                raise

    def _forward(self, ids, positions, cache, all_logits, output, end):
        cfg = self.config

        def cached_attention(li, q, k, v, window):
            cache.append(li, k, v)
            return attend(q, cache.buffer(li), cache.layer_length(li), window=window, scale=cfg.attn_scale)

        # products by the panel kernels where the weights have them (int8 or int24
        # activations), q/k/v in one parallel region and gate/up with their GLU in another
        if fits_rows(cfg):
            ops = PanelOps(self, cached_attention, int8=self.activations == "int8")
        else:
            ops = block.Ops(cfg, mm, cached_attention)
        x = block.embed(self, ids)
        if fits_rows(cfg) and packed.fits(self):
            # every layer in one compiled call (packed.py), the cache's buffers as one page of
            # the packed pass's records: the same routines as the calls of `ops`, so the same
            # bits, in 0.46-0.95x the time
            cache.ensure_capacity(end)
            packed.run_layers(self, x, positions, cache.buffers(), cache.capacity, positions, _ONE_PAGE,
                              plan_blocks(np.zeros(len(ids), np.int64), positions), end, get_num_threads())
            cache.commit(len(ids))
        else:
            x = block.run_layers(self, x, positions, ops, end)
        if output == "hidden":
            return rmsnorm(x, self.output_norm, cfg.rms_eps)
        if not all_logits:
            x = x[-1:]
        logits = ops.product(self.output, rmsnorm(x, self.output_norm, cfg.rms_eps))  # (S or 1, n_vocab)
        block.softcap(logits, cfg.softcap)
        return logits if all_logits else logits[0]
