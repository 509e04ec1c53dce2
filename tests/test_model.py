"""The forward pass against a naive NumPy reference, on tiny random models of each variant."""
import mmap
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import npllama
import naive
from test_gguf_file import _resident_kib
from tinygguf import write_tiny_llama

IDS = [0, 7, 100, 3, 260, 44, 45, 46, 9, 1, 2]


def check(path, ids=IDS, rtol=2e-4):
    m = npllama.Model(path)
    ref = naive.forward(m.file, ids)
    got = m.session().feed(ids, all_logits=True)
    scale = np.abs(ref).max()
    assert np.abs(got - ref).max() <= rtol * scale, np.abs(got - ref).max() / scale
    return m, got


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_1])
def test_llama_matches_reference(tmp_path, qtype):
    check(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype))


def test_untied_output_head(tmp_path):
    m, _ = check(write_tiny_llama(tmp_path / "m.gguf", tied=False))
    assert not m.config.tied_output and m.output is not m.token_embd


def test_gqa_9_3_heads(tmp_path):
    check(write_tiny_llama(tmp_path / "m.gguf", n_embd=72, n_head=9, n_head_kv=3, n_ff=80))


def test_llama3_rope_freqs(tmp_path):
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)  # head_dim 16 -> 8 frequencies
    m, _ = check(write_tiny_llama(tmp_path / "m.gguf", rope_base=500000.0,
                                  tensor_overrides={"rope_freqs.weight": factors}))
    assert m.config.has_rope_freqs


def test_qwen2_biases_and_neox_rope(tmp_path):
    rng = np.random.default_rng(1)
    biases = {f"blk.{i}.attn_{n}.bias": rng.standard_normal(d).astype(np.float32)
              for i in range(2) for n, d in (("q", 64), ("k", 32), ("v", 32))}
    m, got = check(write_tiny_llama(tmp_path / "m.gguf", arch="qwen2", tensor_overrides=biases))
    assert m.config.attn_bias and m.config.rope_neox
    m_nobias = npllama.Model(write_tiny_llama(tmp_path / "nb.gguf", arch="qwen2"))
    assert not np.allclose(got, m_nobias.session().feed(IDS, all_logits=True))


def test_single_token(tiny_model_path):
    check(tiny_model_path, ids=[42])


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q4_1, QT.Q5_0])
@pytest.mark.parametrize("n", [1, 37])
def test_exact_prefill_fused_products_match_one_at_a_time(tmp_path, qtype, n):
    """The exact prefill computes q/k/v in one parallel region and gate/up with their GLU in
    another (engine.ops: the row kernels for F16), or every layer in one compiled call on the
    int24 panels (engine/packed.py, for the others); its logits are the bits of one product
    at a time (block.Ops on matmul_rows or matmul_panels, then the GLU: the panels' own GLU
    is strict float32 arithmetic, nn.glu's fast-math, so there the logits agree to float32
    rounding), for one token and for an odd count."""
    from npllama.engine import block
    from npllama.kernels.attention import attend
    from npllama.kernels.nn import rmsnorm
    from npllama.kernels.panels import matmul_panels
    from npllama.kernels.rows import matmul_rows
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype))

    def product(w, h):
        pw = m.panels(w)
        return matmul_rows(w, h) if pw is None else matmul_panels(pw, w.qtype, w.rows, h, int8=False)

    cfg, ids = m.config, np.array([(11 * i) % 250 for i in range(n)])
    got = m.forward(ids, 0, m.new_cache(), all_logits=True)
    cache = m.new_cache(n)

    def attention(li, q, k, v, window):
        cache.append(li, k, v)
        return attend(q, cache.buffer(li), cache.layer_length(li), window=window, scale=cfg.attn_scale)

    ops = block.Ops(cfg, product, attention)
    x = block.run_layers(m, block.embed(m, ids), np.arange(n), ops, n)
    want = ops.product(m.output, rmsnorm(x, m.output_norm, cfg.rms_eps))
    if qtype == QT.F16:
        np.testing.assert_array_equal(got, want)
    else:
        assert m.panels(m.layers[0].w_gate) is not None
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(got - naive.forward(m.file, list(ids))).max() <= 3e-2 * np.abs(got).max()


@pytest.mark.parametrize("kv_dtype", [np.float32, np.float16])
def test_prompt_in_pieces_through_the_compiled_layers(tmp_path, monkeypatch, kv_dtype):
    """A session's prompts where every product has panels run every layer in one compiled
    call over the cache's buffer (engine/packed.py): a prompt in three pieces, each growing
    the cache from capacity 0, and in chunks (PREFILL_CHUNK), gives the reference's logits,
    with a float32 or float16 cache; the cache holds them all (a decoded token after them)."""
    from npllama.engine import packed, transformer
    monkeypatch.setattr(transformer, "PREFILL_CHUNK", 7)
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q8_0, n_embd=96, n_head=6, n_head_kv=2,
                                       n_ff=128), kv_dtype=kv_dtype)
    assert packed.fits(m)
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 256, 40)]
    s = m.session()
    assert s.cache.capacity == 0
    got = np.concatenate([s.feed(ids[:3], all_logits=True), s.feed(ids[3:19], all_logits=True),
                          s.feed(ids[19:39], all_logits=True), s.feed(ids[39:])[None]])
    assert s.cache.length == s.pos == 40
    ref = naive.forward(m.file, ids)
    assert np.abs(got - ref).max() <= (2e-4 if kv_dtype == np.float32 else 3e-3) * np.abs(ref).max()


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0])
def test_token_by_token_decode_matches_reference(tmp_path, qtype):
    """The fused single-token decode path, for each family of product kernels."""
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype))
    ref = naive.forward(m.file, IDS)
    s = m.session()
    got = np.stack([s.feed([t]) for t in IDS])
    assert np.abs(got - ref).max() <= 2e-4 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["gqa", "qwen2"])
def test_long_decode_matches_reference(tmp_path, variant, threads):
    """Decoding past several attention chunks (of 16+ keys, split among the threads), with
    grouped KV heads, and with Qwen2's biases and NeoX RoPE: the fused step's other paths."""
    if variant == "gqa":
        path = write_tiny_llama(tmp_path / "m.gguf", n_embd=72, n_head=9, n_head_kv=3, n_ff=80)
    else:
        rng = np.random.default_rng(2)
        biases = {f"blk.{i}.attn_{n}.bias": rng.standard_normal(d).astype(np.float32)
                  for i in range(2) for n, d in (("q", 64), ("k", 32), ("v", 32))}
        path = write_tiny_llama(tmp_path / "m.gguf", arch="qwen2", tensor_overrides=biases)
    m = npllama.Model(path, threads=threads)
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 256, 90)]
    ref = naive.forward(m.file, ids)
    s = m.session()
    got = np.concatenate([s.feed(ids[:5], all_logits=True), np.stack([s.feed([t]) for t in ids[5:]])])
    assert np.abs(got - ref).max() <= 2e-4 * np.abs(ref).max()


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1])
def test_int8_activations_decode_is_close(tmp_path, qtype):
    """The opt-in int8 mode: prefill and decode (the fused step; both on the weights' panels
    for the quantized types) logits near the exact ones and near the float64 reference of
    tests/naive.py (activations quantized per block of 32 to int8 lose about 2^-8 relative
    precision), with the same float32 KV cache (int8 mode's default float16 cache is tested
    apart)."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=qtype)
    exact, fast = npllama.Model(path), npllama.Model(path, activations="int8", kv_dtype=np.float32)
    la, lb = (np.concatenate([s.feed(IDS[:4], all_logits=True)] + [s.feed([t])[None] for t in IDS[4:]])
              for s in (exact.session(), fast.session()))
    ref = naive.forward(fast.file, IDS)
    for rows in slice(0, 4), slice(4, None):  # prefill, decode
        err = np.abs(la[rows] - lb[rows]).max() / np.abs(la[rows]).max()
        assert err < (1e-6 if qtype == QT.F32 else 3e-2)
        assert np.abs(lb[rows] - ref[rows]).max() <= (2e-4 if qtype == QT.F32 else 3e-2) * np.abs(ref[rows]).max()
        if qtype != QT.F32:
            assert err > 0  # the int8 kernels really ran
    with pytest.raises(ValueError, match="activations must be"):
        npllama.Model(path, activations="int4")


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_decode_scratch_is_reused_and_needs_no_clearing(tmp_path, activations):
    """The fused step's working memory is allocated once per plan (again only for more
    threads) and reused: filled with garbage before every step, it gives the same logits
    as fresh memory; threads=1 after threads=2 keeps the larger scratch."""
    from npllama.engine.decode import DecodePlan
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1, n_embd=96, n_head=6, n_head_kv=2, n_ff=128)
    m = npllama.Model(path, activations=activations)
    ids = [(7 * i) % 250 for i in range(70)]  # up to 4 attention chunks per step
    threads = [2 if i % 3 else 1 for i in range(len(ids))]
    cache = m.new_cache()
    want = np.stack([DecodePlan(m, int8=activations == "int8").step(t, i, cache, threads[i])  # fresh memory
                     for i, t in enumerate(ids)])
    plan, cache = DecodePlan(m, int8=activations == "int8"), m.new_cache()
    got = []
    for i, t in enumerate(ids):
        for a in plan._scratch or ():
            if a is not None:  # the int8 rows: none in the exact mode
                a[...] = -1 if a.dtype.kind in "iu" else np.nan
        got.append(plan.step(t, i, cache, threads[i]))
    np.testing.assert_array_equal(np.stack(got), want)
    first = plan._scratch
    plan.step(5, len(ids), cache, 1)
    assert plan._scratch is first and plan._scratch_threads == 2


@pytest.mark.parametrize("units, unit_bytes, nr", [
    (1, 360, 2), (12, 5760, 2), (36, 5760, 2), (576, 360, 2), (1536, 360, 3), (7, 100_000, 4),
    (16384, 10880, 2),  # Gemma 3's output head in int8 panels: 178 MB
])
def test_decode_work_items_split_a_product_evenly(units, unit_bytes, nr):
    """A product's work items cover its rows once; every range gets the same number of them,
    so the ranges' shares differ by at most one item; items hold at least _ITEM_BYTES where
    the weight has that many bytes, and a range has at most _RANGE_ITEMS."""
    from npllama.engine.decode import _ITEM_BYTES, _RANGE_ITEMS, _item_rows
    per = _item_rows(np.zeros((units, unit_bytes), np.uint8), nr)
    n_items = -(-units // per)
    sizes = [min(units, (i + 1) * per) - i * per for i in range(n_items)]
    shares = [sum(sizes[r * n_items // nr:(r + 1) * n_items // nr]) for r in range(nr)]  # workshare's ranges
    assert sum(sizes) == units and min(sizes) > 0
    assert max(shares) - min(shares) <= per
    assert n_items <= nr * _RANGE_ITEMS
    if units * unit_bytes >= nr * _ITEM_BYTES:
        assert per * unit_bytes >= _ITEM_BYTES
    else:
        assert n_items <= nr


@pytest.mark.parametrize("sizes", [
    [(576, 6336), (192, 6336), (192, 9792)],   # SmolLM2 Q4_K_M's q, k (Q5_0) and v (Q8_0)
    [(96, 320), (32, 320), (32, 320)], [(1, 544), (17, 352), (40, 9792)],
])
@pytest.mark.parametrize("n_items", [1, 2, 3, 8, 64])
def test_decode_qkv_run_splits_by_bytes(sizes, n_items):
    """_unit_at, which cuts a run of adjacent products (q, k, v) into items of about equal
    bytes: it maps byte offsets to panel boundaries in order, from 0 to the run's panels, each
    within half a panel of the offset, so the items cover every panel once."""
    from npllama.engine.decode import _unit_at
    entries = np.array([[0, 0, rows, pb, 1] for rows, pb in sizes], np.int64)
    units = [-(-rows // 16) for rows, _ in sizes]
    bounds = np.concatenate([[0], np.cumsum([u * pb for u, (_, pb) in zip(units, sizes)])])  # bytes
    total = int(bounds[-1])
    cuts = [_unit_at(entries, 3, i * total // n_items) for i in range(n_items + 1)]
    assert cuts[0] == 0 and cuts[-1] == sum(units) and cuts == sorted(cuts)
    starts = np.concatenate([[0], np.cumsum(units)])  # each product's first panel
    for i, u in enumerate(cuts):
        s = min(int(np.searchsorted(starts, u, side="right")) - 1, 2)
        at = bounds[s] + (u - starts[s]) * sizes[s][1]  # the byte where panel u starts
        assert abs(at - i * total // n_items) <= sizes[s][1] // 2 + (sizes[s - 1][1] // 2 if s else 0)


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_decode_qkv_run_gives_the_products_bits(tmp_path, activations):
    """q, k and v, adjacent in the panel arena, run as one phase (`_product_run`); with k's
    panels copied elsewhere they run as three (`_product`). The logits are the same bits."""
    from npllama.engine.decode import DecodePlan, _adjacent
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1, n_embd=96, n_head=6, n_head_kv=2, n_ff=128)
    m = npllama.Model(path, activations=activations)
    n = m.config.n_layer
    run, apart = DecodePlan(m, int8=activations == "int8"), DecodePlan(m, int8=activations == "int8")
    table, extra, at = apart.table.copy(), [], apart.panels.size
    for li in range(n):
        k = table[li, 1]
        size = -(-int(k[2]) // 16) * int(k[3])
        extra.append(apart.panels[k[1]:k[1] + size])
        table[li, 1, 1], at = at, at + size
    apart.panels, apart.table = np.concatenate([apart.panels, *extra]), table
    assert all(_adjacent(run.table[li], 3) for li in range(n))
    assert not any(_adjacent(apart.table[li], 3) for li in range(n))
    ids = [(7 * i) % 250 for i in range(40)]
    caches = m.new_cache(), m.new_cache()
    for i, t in enumerate(ids):
        np.testing.assert_array_equal(run.step(t, i, caches[0], 2), apart.step(t, i, caches[1], 2))


def test_sessions_decode_from_several_threads(tmp_path):
    """Sessions of one model decoding at once from several Python threads (their steps share
    the plan's working memory, and the parallel region runs without the GIL) get the logits
    they get one after another."""
    import threading
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q8_0, n_embd=128, n_ff=256, n_layer=4)
    m = npllama.Model(path)
    streams = [[(31 * k + 7 * i) % 250 for i in range(60)] for k in range(4)]

    def decode(ids):
        s = m.session()
        return np.stack([s.feed([t]) for t in ids])

    want = [decode(ids) for ids in streams]
    got = [None] * len(streams)

    def work(k):
        got[k] = decode(streams[k])
    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)  # steps that raced on shared counters would spin forever
    assert not any(t.is_alive() for t in threads), "concurrent decode steps did not finish"
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0])
def test_panels_packed_in_parts(tmp_path, monkeypatch, qtype):
    """The model packs its weights a part of rows at a time (here 16 rows: the weights' row
    counts are not all multiples of the part), releasing each part's file pages: every weight's
    panels are pack_panels' of the whole weight, and the file's rows read as before."""
    from npllama.engine import transformer
    from npllama.kernels.panels import pack_panels
    monkeypatch.setattr(transformer, "_PACK_PART_BYTES", 1)
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype, tied=False))
    before = {w.name: w.data.copy() for w in m.product_weights()}
    weights = [w for w in m.product_weights() if m.panels(w) is not None]
    assert weights and any(w.rows % 16 for w in weights) and any(w.rows > 16 for w in weights)
    for w in weights:
        np.testing.assert_array_equal(m.panels(w), pack_panels(w.data, w.qtype))
    for w in m.product_weights():
        np.testing.assert_array_equal(w.data, before[w.name])


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q5_0, QT.F16])
def test_plan_reads_panels(tmp_path, qtype, activations):
    """In both modes the decode step reads the product weights of types with panels from the
    model's panels, the arrays the prefill and the batched pass read (no other copy); other
    weights (here float16) and the embedding lookup read the file."""
    from npllama.kernels.panels import has_panels
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=qtype, tied=False)
    m = npllama.Model(path, activations=activations)
    plan = m.decode_plan
    assert plan.int8 == (activations == "int8") and plan.panels is m.panel_arena
    n = m.config.n_layer
    weights = [getattr(L, a) for L in m.layers for a in ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")]
    entries = list(plan.table[:n].reshape(-1, 5)) + [plan.table[n, 0]]
    in_panels = 0
    for w, e in zip(weights + [m.output], entries):
        code, off, rows, row_bytes, panels = (int(v) for v in e)
        assert code == int(w.qtype) and rows == w.rows
        if has_panels(w.qtype):
            assert panels and row_bytes == m.panels(w).shape[1]
            start = m.panel_arena.__array_interface__["data"][0] + off
            assert m.panels(w).__array_interface__["data"][0] == start
            in_panels += 1
        else:
            assert not panels and row_bytes == w.data.shape[1]
            np.testing.assert_array_equal(m.file.buffer[off:off + w.data.nbytes], w.data.reshape(-1))
    assert in_panels == (len(weights) + 1 if has_panels(qtype) else 0)
    code, off, rows, row_bytes, panels = (int(v) for v in plan.table[n, 1])  # the embedding: the file
    assert code == int(m.token_embd.qtype) and not panels
    np.testing.assert_array_equal(m.file.buffer[off:off + m.token_embd.data.nbytes], m.token_embd.data.reshape(-1))


def test_float16_kv_cache(tmp_path, threads):
    """kv_dtype=float16: the cache stores halves; prefill (attend) and the fused decode step
    (which writes each new key and value as float16 itself) agree with each other and stay
    near the float32-cache logits. int8 activations default to it."""
    path = write_tiny_llama(tmp_path / "m.gguf", n_embd=72, n_head=9, n_head_kv=3, n_ff=80)
    exact, half = npllama.Model(path, threads=threads), npllama.Model(path, threads=threads, kv_dtype="float16")
    ids = [int(t) for t in np.random.default_rng(4).integers(0, 256, 40)]
    ref = exact.session().feed(ids, all_logits=True)
    decoded, prefilled = half.session(), half.session()
    got = np.stack([decoded.feed([t]) for t in ids])      # the fused step, one token at a time
    batch = prefilled.feed(ids, all_logits=True)          # one forward pass through attend
    assert decoded.cache.dtype == np.float16 and decoded.cache.nbytes * 2 == exact.new_cache(64).nbytes
    scale = np.abs(ref).max()
    assert np.abs(got - batch).max() <= 2e-4 * scale
    assert 0 < np.abs(got - ref).max() <= 1e-2 * scale  # float16 keys and values: close, not equal
    for layer in range(2):
        for a, b in zip(decoded.cache.get(layer), prefilled.cache.get(layer)):
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-3, atol=2e-3)
    assert npllama.Model(path, activations="int8").new_cache().dtype == np.float16
    assert npllama.Model(path, activations="int8", kv_dtype=np.float32).new_cache().dtype == np.float32
    for bad in ("float64", np.int8, "half-ish"):
        with pytest.raises(ValueError, match="kv_dtype must be float32 or float16"):
            npllama.Model(path, kv_dtype=bad)


def test_unsupported_rope_scaling_is_refused(tmp_path):
    path = write_tiny_llama(tmp_path / "m.gguf", extra_kv={"llama.rope.scaling.type": "yarn",
                                                            "llama.rope.scaling.factor": 4.0})
    with pytest.raises(npllama.GGUFError, match="RoPE scaling 'yarn' is not supported"):
        npllama.Model(path)


def test_a_broken_vocabulary_fails_when_the_model_loads(tmp_path):
    """A merge naming a token the vocabulary lacks is a GGUFError naming the file at load time,
    not an exception from the tokenizers library at the first tokenize()."""
    path = write_tiny_llama(tmp_path / "m.gguf", merges=["Ġ t", "zz qq"])
    with pytest.raises(npllama.GGUFError, match="m.gguf.*merge"):
        npllama.Model(path)


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_a_prompt_loads_the_decode_step_before_it_fills_the_cache(tmp_path, monkeypatch, activations):
    """Feeding a prompt for its next token's logits loads the fused decode step (for the
    session's cache) before the prefill, so that the tokens decoded next need no loading;
    a prompt fed for all its logits (scoring) does not load it."""
    from npllama.engine import decode
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1, n_embd=96, n_head=6, n_head_kv=2, n_ff=128)
    m = npllama.Model(path, activations=activations)
    loads = []
    load = decode.DecodePlan.load
    monkeypatch.setattr(decode.DecodePlan, "load", lambda self, cache, threads: loads.append(cache.length)
                        or load(self, cache, threads))
    m.session().feed(IDS, all_logits=True)
    assert loads == []
    s = m.session()
    s.feed(IDS[:3])
    s.feed(IDS[3:])
    assert loads == [0, 3]

    def compile_for_args(*args, **kws):
        raise AssertionError("the decode step was not loaded for this call")
    monkeypatch.setattr(decode._decode_step, "_compile_for_args", compile_for_args)
    want = npllama.Model(path, activations=activations).session().feed(IDS + [5], all_logits=True)[-1]
    np.testing.assert_allclose(s.feed([5]), want, rtol=0, atol=5e-2 if activations == "int8" else 1e-4)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_a_loaded_model_holds_no_pages_of_the_files_tensor_data(tmp_path):
    """The norms are copied at load, and the file's pages that held them (with the neighbours
    that reading them mapped) leave the resident set: only the header and metadata stay."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.F32, n_layer=4, n_embd=512, n_ff=1024)
    m = npllama.Model(path)
    header_kib = -(-m.file.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE // 1024
    assert _resident_kib(path) <= header_kib
    assert m.file.buffer.size - m.file.data_offset > 64 * header_kib * 1024  # most of the file: data
    np.testing.assert_array_equal(m.layers[3].ffn_norm, m.file.tensor("blk.3.ffn_norm.weight").data)
    check(path)  # and it runs, the weights' rows paged in again
