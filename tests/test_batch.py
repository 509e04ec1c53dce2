"""Batched inference over the paged pool: packed varlen forward passes equal single sessions,
masks for padded batches, continuous batching, shared prefixes and beam search."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import npllama
from npllama.kernels import quants
from npllama.kernels.qtypes import type_mask
from npllama.kernels.attention import MASKED, attend
from npllama.engine.batch import batch_mask, forward_batch
from npllama.generation.beam import BeamSearch, beam_search
from npllama.generation.scheduler import complete_many, generate_many
from npllama.kernels.rows import matmul_rows
from npllama.cache.kvpool import KVPool, PoolExhaustedError
from npllama.arch.weights import QWeight
from npllama.kernels.paged_attention import paged_attend

LENGTHS = (3, 7, 12, 20)


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return npllama.Model(tiny_model_path, threads=2)


@pytest.fixture(scope="module")
def q8_model(tiny_q8_path):
    return npllama.Model(tiny_q8_path, threads=2)


def prompts_of(lengths, seed=0, vocab=250):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def check_batch_equals_sessions(m, page_size, rtol=1e-4, atol=1e-4):
    """Prefill B sequences of different lengths in one pass, then decode one token each in one
    pass (query length 1): every result equals the sequence run alone."""
    pool = KVPool.for_model(m, tokens=128, page_size=page_size)
    prompts = prompts_of(LENGTHS)
    seqs = [pool.new_seq() for _ in prompts]
    prefill = forward_batch(m, pool, seqs, prompts, all_logits=True)
    nxt = [[11], [12], [13], [14]]
    decode = forward_batch(m, pool, seqs, nxt)
    for p, seq, pre, dec, n in zip(prompts, seqs, prefill, decode, nxt):
        s = m.session()
        ref_pre = s.feed(p, all_logits=True)
        ref_dec = s.feed(n)
        assert pre.shape == (len(p), m.config.n_vocab) and dec.shape == (m.config.n_vocab,)
        np.testing.assert_allclose(pre, ref_pre, rtol=rtol, atol=atol)
        np.testing.assert_allclose(dec, ref_dec, rtol=rtol, atol=atol)
        assert seq.length == len(p) + 1 and seq.tokens == p + n


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_packed_batch_equals_single_sessions(model, page_size):
    check_batch_equals_sessions(model, page_size)


def test_packed_batch_equals_single_sessions_q8(q8_model):
    check_batch_equals_sessions(q8_model, 4)


def test_parallel_workers_compile_once(q8_model):
    """The parallel regions' workers take their index as a signed integer. prange's index is
    unsigned inside a region and signed where Numba first types the loop, so a worker called
    with it compiled twice (the decode step's: minutes on a 2-core Zen 3)."""
    from numba import types
    from npllama.engine import decode, packed
    from npllama.kernels import panels
    check_batch_equals_sessions(q8_model, 4)  # the decode step, the packed pass, the panel products
    wq = q8_model.layers[0].wq
    panels.matmul_panels(panels.pack_panels(wq.data, wq.qtype), wq.qtype, wq.rows,
                         np.ones((2, q8_model.config.n_embd), np.float32))
    workers = ((decode._worker, 2), (packed._worker, 1), (panels._panel_rows, 3), (panels._store, 2))
    # a worker compiles only with its caller: where the caller came from Numba's cache, it has
    # no signature in this process (a cold cache, CI's, compiles them all)
    compiled = [(w, index) for w, index in workers if w.signatures]
    if not compiled:
        pytest.skip("their callers were loaded from Numba's cache, so no worker compiled in this process")
    for worker, index in compiled:
        for sig in worker.signatures:
            assert sig[index] == types.int64, (worker, sig[index])


@pytest.mark.parametrize("activations", ["int8", "f32"])
@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1])
def test_packed_pass_does_not_depend_on_the_batch(tmp_path, qtype, activations):
    """On the panel kernels (int8 or float32 activations) a sequence's logits in a packed pass
    are the same bits as in a pass of its own, prefill and decode; int8's near the exact mode's."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=qtype)
    prompts, nxt = prompts_of(LENGTHS), [[11], [12], [13], [14]]

    def run(m, prompts, nxt):
        pool = KVPool.for_model(m, tokens=128, page_size=4)
        seqs = [pool.new_seq() for _ in prompts]
        pre = forward_batch(m, pool, seqs, prompts, all_logits=True)
        return pre, forward_batch(m, pool, seqs, nxt)

    fast = npllama.Model(path, threads=2, activations=activations, kv_dtype=np.float16)
    pre, dec = run(fast, prompts, nxt)
    for i in range(len(prompts)):
        pre1, dec1 = run(fast, prompts[i:i + 1], nxt[i:i + 1])
        np.testing.assert_array_equal(pre1[0], pre[i])
        np.testing.assert_array_equal(dec1[0], dec[i])
    if activations == "int8":
        ref_pre, ref_dec = run(npllama.Model(path, threads=2, kv_dtype=np.float16), prompts, nxt)
        for a, b in zip(ref_pre + ref_dec, pre + dec):
            assert 0 < np.abs(a - b).max() < 3e-2 * np.abs(a).max()


@pytest.mark.parametrize("activations", ["int8", "f32"])
@pytest.mark.parametrize("window", [0, 5])
def test_packed_pass_does_not_depend_on_chunking(tmp_path, window, activations):
    """A prompt fed in one pass or in chunks cut anywhere gives the same bits (the scheduler cuts
    prompts by its token budget, which other requests share): the panel products are per row,
    and paged attention groups a row's sums the same in any query block, also with a window."""
    extra = {"llama.attention.sliding_window": window} if window else None
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q8_0, extra_kv=extra), threads=2,
                      activations=activations)
    ids = prompts_of((41,), seed=9)[0]

    def run(cuts):
        pool = KVPool.for_model(m, tokens=64, page_size=4)
        seq = pool.new_seq()
        out = [forward_batch(m, pool, [seq], [ids[a:b]], all_logits=True)[0]
               for a, b in zip([0] + cuts, cuts + [len(ids)])]
        return np.concatenate(out + [forward_batch(m, pool, [seq], [[7]])[0][None]])

    whole = run([])
    for cuts in ([1], [7], [13, 14], [3, 22, 40]):
        np.testing.assert_array_equal(run(cuts), whole)


def test_int8_generate_many_does_not_depend_on_the_batch(tmp_path):
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1), threads=2, activations="int8")
    prompts = prompts_of((4, 9, 2, 15, 6), seed=5)
    alone = [generate_many(m, [p], temperature=0, max_tokens=8)[0] for p in prompts]
    assert generate_many(m, prompts, temperature=0, max_tokens=8, max_batch=3, page_size=4) == alone


def test_int8_generate_batch_equals_each_prompt_alone(tmp_path):
    """int8 activations: generate_batch (continuous batching, packed passes) gives each prompt
    the tokens that it gives alone through a session (prefill, then the fused decode step),
    a prompt past attention's first chunk of keys (_CHUNK = 512) included."""
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1, n_ctx=1024), threads=2,
                      activations="int8")
    prompts = prompts_of((4, 9, 600, 15), seed=6)
    alone = [m.generate(p, temperature=0, max_tokens=10) for p in prompts]
    assert m.generate_batch(prompts, temperature=0, max_tokens=10, max_batch=3) == alone


def test_int8_lone_sequence_takes_the_fused_step(tmp_path, monkeypatch):
    """int8 mode with every product weight in panels: a sequence decoding alone takes the fused
    decode step over its pages (whose bits are the packed pass's) and gets a session's tokens;
    a model with a weight without panels (float16) fails the condition (`steps_match`) under
    which the scheduler does so and generate_batch batches; the exact mode meets it."""
    from npllama.engine import batch
    from npllama.generation import scheduler
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1), threads=2, activations="int8")
    calls = []
    monkeypatch.setattr(scheduler, "decode_alone", lambda *a, **k: calls.append(1) or batch.decode_alone(*a, **k))
    prompts = prompts_of((5, 11), seed=7)
    alone = [m.generate(p, temperature=0, max_tokens=6) for p in prompts]
    assert m.generate_batch(prompts, temperature=0, max_tokens=6, max_batch=1) == alone
    assert len(calls) == 2 * 5  # every token after each prompt's first
    f16 = npllama.Model(write_tiny_llama(tmp_path / "f.gguf", qtype=QT.F16), activations="int8")
    assert not batch.steps_match(f16) and not batch.decodes_alone(f16)
    assert batch.steps_match(npllama.Model(tmp_path / "f.gguf"))  # the exact mode


def test_packed_batch_in_chunks_and_through_blas(model, monkeypatch):
    from npllama.engine import batch
    monkeypatch.setattr(batch, "CHUNK_TOKENS", 5)  # chunks cut through the sequences
    check_batch_equals_sessions(model, 4)
    monkeypatch.setattr(batch, "USE_ROW_KERNELS", False)  # the tiled-dequant + BLAS products
    monkeypatch.setattr(batch, "_BLAS_CHUNK", 9)
    check_batch_equals_sessions(model, 4)


def _with_biases(tmp_path):
    rng = np.random.default_rng(3)
    biases = {f"blk.{i}.attn_{x}.bias": (rng.standard_normal(n) * 0.5).astype(np.float32)
              for i in range(2) for x, n in (("q", 64), ("k", 32), ("v", 32))}
    return write_tiny_llama(tmp_path / "bias.gguf", qtype=QT.Q4_1, tensor_overrides=biases)


def _arch_fixture(name):
    def make(tmp_path):
        from pathlib import Path
        from requant import requantize
        src = Path(__file__).parent / "fixtures" / "arch" / f"{name}.gguf"
        return requantize(src, tmp_path / f"{name}-q8.gguf", QT.Q8_0)
    return make


@pytest.mark.parametrize("activations, kv_dtype", [("int8", np.float16), ("f32", np.float32)])
@pytest.mark.parametrize("make", [_with_biases, _arch_fixture("gemma3"), _arch_fixture("qwen3"),
                                  _arch_fixture("phi3")], ids=["llama-biases", "gemma3", "qwen3", "phi3"])
def test_compiled_layers_are_run_layers_bit_for_bit(tmp_path, monkeypatch, make, activations, kv_dtype):
    """The packed pass's layers in one compiled call (engine/packed.py) give every token the
    bits of block.run_layers with PanelOps, prefill and decode, over the architectures' pieces:
    q/k/v biases, q/k norms, post-norms, sliding windows (Gemma 3), a fused qkv split (Phi-3).
    A model with a product weight without panels takes run_layers."""
    from npllama.engine import batch, packed
    m = npllama.Model(make(tmp_path), threads=2, activations=activations, kv_dtype=kv_dtype)
    assert packed.fits(m)
    calls, compiled_layers = [], packed.run_layers
    monkeypatch.setattr(packed, "run_layers", lambda *a: calls.append(1) or compiled_layers(*a))
    prompts, nxt = prompts_of((3, 17, 40, 9), seed=4), [[11], [12], [13], [14]]

    def run():
        pool = KVPool.for_model(m, tokens=128, page_size=4)
        seqs = [pool.new_seq() for _ in prompts]
        pre = forward_batch(m, pool, seqs, prompts, all_logits=True)
        return pre + forward_batch(m, pool, seqs, nxt)

    compiled = run()
    assert len(calls) == 2
    monkeypatch.setattr(batch, "COMPILED_LAYERS", False)
    for a, b in zip(compiled, run()):
        np.testing.assert_array_equal(a, b)
    assert not packed.fits(npllama.Model(write_tiny_llama(tmp_path / "f32.gguf")))


@pytest.mark.parametrize("threads, workers", [(2, 5), (1, 2), (2, 1)])
def test_compiled_layers_do_not_depend_on_the_threads(tmp_path, monkeypatch, threads, workers):
    """The compiled layers' work sharing finishes, with the same bits, whether the region has
    more workers than threads (one thread then runs several, one after another) or fewer."""
    from npllama.engine import packed
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1), threads=2, activations="int8")
    prompts, nxt = prompts_of((5, 30, 12), seed=8), [[21], [22], [23]]

    def run(**kw):
        pool = KVPool.for_model(m, tokens=64, page_size=4)
        seqs = [pool.new_seq() for _ in prompts]
        return forward_batch(m, pool, seqs, prompts, all_logits=True, **kw) + forward_batch(m, pool, seqs, nxt, **kw)

    want = run()
    compiled_layers = packed.run_layers
    monkeypatch.setattr(packed, "run_layers", lambda *a: compiled_layers(*a[:-1], workers))
    for a, b in zip(run(threads=threads), want):
        np.testing.assert_array_equal(a, b)


def test_mixed_prefill_and_decode_in_one_pass(model):
    pool = KVPool.for_model(model, 32, page_size=4)
    a, b, c = pool.new_seq(), pool.new_seq(), pool.new_seq()
    pa, pb, pc = prompts_of((9, 5, 6), seed=1)
    forward_batch(model, pool, [a, b], [pa, pb])
    # a decodes one token, b feeds three more, c starts from scratch: one pass
    out = forward_batch(model, pool, [a, b, c], [[20], [21, 22, 23], pc], all_logits=True)
    for prefix, new, got in ((pa, [20], out[0]), (pb, [21, 22, 23], out[1]), ([], pc, out[2])):
        s = model.session()
        if prefix:
            s.feed(prefix)
        np.testing.assert_allclose(got, s.feed(new, all_logits=True), rtol=1e-4, atol=1e-4)


def test_forward_batch_errors_leave_sequences_unchanged(model):
    pool = KVPool.for_model(model, 3, page_size=4)
    a, b = pool.new_seq(), pool.new_seq()
    forward_batch(model, pool, [a], [[5, 6, 7]])
    with pytest.raises(PoolExhaustedError):
        forward_batch(model, pool, [a, b], [[8, 9], [1] * 9])
    assert a.length == 3 and b.length == 0 and pool.n_free == 2
    with pytest.raises(ValueError, match="out of range"):
        forward_batch(model, pool, [a], [[10 ** 6]])
    with pytest.raises(npllama.ContextOverflowError):
        big = KVPool.for_model(model, 80, page_size=4)
        forward_batch(model, big, [big.new_seq()], [[5] * (model.config.n_ctx + 1)])
    with pytest.raises(ValueError, match="shaped for"):
        forward_batch(model, KVPool(1, 1, 8, 4), [a], [[1]])


def test_float16_pool_is_close_to_float32(model):
    prompts = prompts_of(LENGTHS, seed=2)
    outs = []
    for dtype in (np.float32, np.float16):
        pool = KVPool.for_model(model, 32, page_size=4, dtype=dtype)
        outs.append(forward_batch(model, pool, [pool.new_seq() for _ in prompts], prompts, all_logits=True))
    for a, b in zip(*outs):
        np.testing.assert_allclose(a, b, atol=0.05)
        assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.9


# ---- kernels ------------------------------------------------------------------------------

@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q5_1, QT.F16, QT.F32])
@pytest.mark.parametrize("T", [1, 2, 3, 4, 7, 17])
def test_matmul_rows_matches_quants_matmul(qtype, T):
    import gguf
    rng = np.random.default_rng(T)
    rows, n = 37, 256
    w = rng.standard_normal((rows, n)).astype(np.float32)
    if qtype == QT.F32:
        data = w.view(np.uint8)
    elif qtype == QT.F16:
        data = w.astype(np.float16).view(np.uint8)
    else:
        data = gguf.quants.quantize(w, qtype)
    qw = QWeight("w", np.ascontiguousarray(data).reshape(rows, -1), qtype, rows, n)
    x = rng.standard_normal((T, n)).astype(np.float32)
    ref = quants.dequantize(qw.data, qtype).reshape(rows, n).astype(np.float64) @ x.T.astype(np.float64)
    np.testing.assert_allclose(matmul_rows(qw, x), ref.T, rtol=1e-4, atol=1e-3)


def random_pool(rng, n_pages, ps, KVH, D, dtype=np.float32):
    buf = rng.standard_normal((n_pages, ps, KVH, 2, D)).astype(dtype)
    return buf


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_attend_equals_attend_on_each_sequence(dtype):
    rng = np.random.default_rng(3)
    H, KVH, D, ps = 6, 2, 16, 4
    lengths = [5, 1, 13, 9]
    n_new = [2, 1, 5, 1]  # queries per sequence: the last n_new positions of each
    kv = random_pool(rng, 20, ps, KVH, D, dtype)
    perm = rng.permutation(20)  # scattered, out-of-order pages
    tables, at = np.full((4, 4), -1, np.int32), 0
    for b, n in enumerate(lengths):
        k = -(-n // ps)
        tables[b, :k] = perm[at:at + k]
        at += k
    seq_of_token = np.repeat(np.arange(4), n_new)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, n_new)])
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    out = paged_attend(q, kv, tables, seq_of_token, positions)
    assert out.dtype == np.float32
    row = 0
    for b, (n, m) in enumerate(zip(lengths, n_new)):
        contiguous = kv[tables[b, :-(-n // ps)]].reshape(-1, KVH, 2, D).astype(np.float32)
        ref = attend(q[row:row + m], np.ascontiguousarray(contiguous), n)
        np.testing.assert_allclose(out[row:row + m], ref, rtol=1e-5, atol=1e-5)
        row += m


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window", [0, 600])
@pytest.mark.parametrize("rows", [9, 64])
@pytest.mark.parametrize("H, KVH, D", [(6, 2, 64), (8, 1, 256), (10, 2, 128), (3, 3, 48)])
def test_paged_attend_is_attend_bit_for_bit_past_a_chunk(dtype, window, rows, H, KVH, D):
    """Sequences longer than two chunks of keys (attention._CHUNK = 512), a prefill chunk of
    `rows` queries and two decoding tokens: the batched attention gives the session kernels'
    bits (both fold chunks at multiples of 512 and merge them in order), with tasks of one KV
    head (9 rows: 4 query blocks) or of every KV head (64 rows: 10 blocks); and the float64
    reference's values. A decoding token's heads read the records directly where the head
    size is a multiple of 64 (in groups of four heads and the rest: 3, 8 and 5 a KV head),
    else through float32 scratch as a prefill block's do."""
    rng = np.random.default_rng(7)
    ps = 16
    lengths, n_new = [1100, 530, 7], [rows, 1, 1]
    pages = [-(-n // ps) for n in lengths]
    kv = random_pool(rng, sum(pages), ps, KVH, D, dtype)
    tables, perm, at = np.zeros((3, max(pages)), np.int32), rng.permutation(sum(pages)), 0
    for b, k in enumerate(pages):
        tables[b, :k] = perm[at:at + k]
        at += k
    seq_of_token = np.repeat(np.arange(3), n_new)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, n_new)])
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    out = paged_attend(q, kv, tables, seq_of_token, positions, window=window)
    row = 0
    for b, (n, m) in enumerate(zip(lengths, n_new)):
        seq = np.ascontiguousarray(kv[tables[b, :pages[b]]].reshape(-1, KVH, 2, D))
        np.testing.assert_array_equal(out[row:row + m], attend(q[row:row + m], seq, n, window=window))
        ref = _attention_reference(q[row:row + m], seq[:n, :, 0].astype(np.float32), seq[:n, :, 1].astype(np.float32),
                                   positions[row:row + m], window, 1 / np.sqrt(D))
        np.testing.assert_allclose(out[row:row + m], ref, rtol=1e-4, atol=1e-5)
        row += m


def _attention_reference(q, k, v, qpos, window, scale):
    """Causal (optionally windowed) attention of queries q (S, H, D) at positions qpos over
    keys/values (n, KVH, D), in float64 with an explicit softmax: query at p sees key t when
    t <= p and, with a window, p - t < window."""
    S, H, D = q.shape
    G = H // k.shape[1]
    out = np.zeros((S, H, D))
    for i, p in enumerate(qpos):
        t = np.arange(k.shape[0])
        seen = (t <= p) & ((p - t < window) if window else True)
        for h in range(H):
            s = (k[seen, h // G].astype(np.float64) @ q[i, h].astype(np.float64)) * scale
            w = np.exp(s - s.max())
            out[i, h] = w @ v[seen, h // G] / w.sum()
    return out


@pytest.mark.parametrize("window", [0, 1, 3, 7, 40])
def test_paged_attend_window_against_numpy(window):
    """Sliding windows in the batched attention: a prefill chunk and single decoding tokens of
    sequences of different lengths, against the float64 reference."""
    rng = np.random.default_rng(5)
    H, KVH, D, ps = 4, 2, 8, 4
    lengths, n_new = [11, 3, 17], [6, 1, 1]
    kv = random_pool(rng, 16, ps, KVH, D)
    tables = np.full((3, 5), -1, np.int32)
    perm, at = rng.permutation(16), 0
    for b, n in enumerate(lengths):
        tables[b, :-(-n // ps)] = perm[at:at - (-n // ps)]
        at += -(-n // ps)
    seq_of_token = np.repeat(np.arange(3), n_new)
    positions = np.concatenate([np.arange(n - m, n) for n, m in zip(lengths, n_new)])
    q = rng.standard_normal((len(positions), H, D)).astype(np.float32)
    out = paged_attend(q, kv, tables, seq_of_token, positions, window=window, scale=0.3)
    row = 0
    for b, (n, m) in enumerate(zip(lengths, n_new)):
        seq = kv[tables[b, :-(-n // ps)]].reshape(-1, KVH, 2, D)[:n]
        ref = _attention_reference(q[row:row + m], seq[:, :, 0], seq[:, :, 1], positions[row:row + m], window, 0.3)
        np.testing.assert_allclose(out[row:row + m], ref, rtol=1e-5, atol=1e-5)
        row += m
    with pytest.raises(ValueError, match="window must be an integer >= 0"):
        paged_attend(q, kv, tables, seq_of_token, positions, window=-1)


# ---- masks for padded batches ---------------------------------------------------------------

def test_batch_mask_shape_broadcasts_per_request():
    lengths, K, H = [3, 8, 5, 1], 8, 6
    mask = batch_mask(lengths, K)
    assert mask.shape == (4, 1, 1, K) and mask.dtype == np.float32 and np.isfinite(mask).all()
    assert (mask[1, 0, 0] == 0).all() and (mask[0, 0, 0, 3:] == MASKED).all()
    scores = np.zeros((4, H, 1, K), np.float32)  # decode: one query per request
    assert np.all((scores + mask)[2, :, 0, 5:] == MASKED) and np.all((scores + mask)[2, :, 0, :5] == 0)
    with pytest.raises(ValueError):
        batch_mask([9], 8)


def test_padded_batch_through_attend_with_mask_equals_unpadded():
    rng = np.random.default_rng(4)
    H, KVH, D, K = 4, 2, 8, 12
    lengths = [3, 7, 12, 5]
    mask = batch_mask(lengths, K)
    kv = rng.standard_normal((4, K, KVH, 2, D)).astype(np.float32)  # right-padded caches
    kv_before = kv.copy()
    q = rng.standard_normal((4, 1, H, D)).astype(np.float32)
    for b, n in enumerate(lengths):
        padded = attend(q[b], kv[b], K, mask=mask[b, 0])  # (1, K) mask, query sees the whole cache
        alone = attend(q[b], np.ascontiguousarray(kv[b, :n]), n)
        np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-6)
        # a float64 mask does not widen the scores or the output, and the cache stays as stored
        wide = attend(q[b], kv[b], K, mask=mask[b, 0].astype(np.float64))
        assert wide.dtype == np.float32 and kv.dtype == np.float32
        np.testing.assert_array_equal(wide, padded)
    np.testing.assert_array_equal(kv, kv_before)
    # a padding row (every key masked) is finite: zeros, not NaN
    dead = attend(q[0], kv[0], K, mask=batch_mask([0], K)[0, 0])
    assert np.isfinite(dead).all() and not dead.any()


# ---- continuous batching ------------------------------------------------------------------

def test_generate_many_equals_generate_one_by_one(model):
    prompts = prompts_of((4, 9, 2, 15, 6), seed=5)
    alone = [model.generate(p, temperature=0, max_tokens=8) for p in prompts]
    stats = {}
    together = generate_many(model, prompts, temperature=0, max_tokens=8, max_batch=2, stats=stats,
                             page_size=4)
    assert together == alone
    assert stats["steps"] < sum(len(p) + 8 for p in prompts)


def test_complete_many_matches_complete_with_stops_and_seeds(model):
    prompts = prompts_of((5, 11, 3), seed=6)
    opts = dict(max_tokens=10, temperature=0.9, seed=3, stop=["e"], logprobs=2)
    alone = [model.complete(p, **opts) for p in prompts]
    together = complete_many(model, prompts, max_batch=3, page_size=4, **opts)
    for a, b in zip(alone, together):
        assert a.text == b.text and a.finish_reason == b.finish_reason
        assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
        assert b.prompt_tokens == a.prompt_tokens
        np.testing.assert_allclose([t.logprob for t in a.tokens], [t.logprob for t in b.tokens], atol=1e-4)
    assert complete_many(model, prompts, max_tokens=0)[0].text == ""
    with pytest.raises(TypeError, match="unexpected"):
        complete_many(model, prompts, bogus=1)


def test_shared_prefix_is_computed_once(model):
    rng = np.random.default_rng(7)
    header = rng.integers(3, 250, 40).tolist()
    prompts = [header + rng.integers(3, 250, n).tolist() for n in (3, 8, 1, 12)]
    unshared = generate_many(model, prompts, temperature=0, max_tokens=6, page_size=8, prefix_cache=False)
    stats = {}
    shared = generate_many(model, prompts, temperature=0, max_tokens=6, page_size=8, stats=stats)
    assert shared == unshared == [model.generate(p, temperature=0, max_tokens=6) for p in prompts]
    total = sum(len(p) for p in prompts)
    assert stats["prompt_tokens"] == total
    # the 40-token header holds 5 full pages of 8: the later prompts reuse them
    assert stats["cached_tokens"] == 3 * 40 and stats["prefill_tokens"] == total - 3 * 40


def test_generate_many_reports_a_pool_too_small(model):
    pool = KVPool.for_model(model, 2, page_size=4)
    with pytest.raises(PoolExhaustedError, match="prompt 0"):
        generate_many(model, [[5] * 20], max_tokens=4, pool=pool)
    assert pool.n_free == 2


# ---- beam search --------------------------------------------------------------------------

def test_beam_search_beams_keep_their_own_histories(model):
    prompt = prompts_of((6,), seed=8)[0]
    search = BeamSearch(model, prompt, beams=4, max_tokens=6, page_size=4)
    for _ in range(4):
        search.step()
    live = search.live
    assert len(live) == 4 and len({tuple(b.tokens) for b in live}) == 4  # the beams diverge
    for b in live:
        assert b.seq.tokens == prompt + b.tokens  # what its own cache was fed
        fresh = model.session().feed(b.seq.tokens)
        np.testing.assert_allclose(b.logits, fresh, rtol=1e-4, atol=1e-4)
    # beams that share a parent share its full pages, never write through each other's table
    pool = search.pool
    shared = set(live[0].seq.pages).intersection(*(set(b.seq.pages) for b in live[1:]))
    assert shared and all(pool.refcount(p) >= 2 for p in shared)
    last = {b.seq.pages[-1] for b in live}
    assert len(last) == 4  # each beam's newest rows live in its own page
    search.close()
    assert pool.n_free == pool.n_pages


def test_beam_search_results(model):
    prompt = prompts_of((5,), seed=9)[0]
    out = beam_search(model, prompt, beams=3, max_tokens=5, page_size=4)
    assert len(out) == 3 and len({tuple(b.tokens) for b in out}) == 3
    assert [b.score for b in out] == sorted((b.score for b in out), reverse=True)
    # the best beam's score is the sum of its tokens' log-probabilities
    s, total = model.session(), 0.0
    logits = s.feed(prompt)
    for t in out[0].tokens:
        lg = logits.astype(np.float64)
        total += lg[t] - (lg.max() + np.log(np.exp(lg - lg.max()).sum()))
        logits = s.feed([t])
    assert out[0].score == pytest.approx(total, abs=1e-3)
    assert all(isinstance(b.text, str) for b in out)
    one = beam_search(model, prompt, beams=1, max_tokens=5)
    assert one[0].tokens == [t.id for t in model.complete(prompt, temperature=0, max_tokens=5).tokens][:len(one[0].tokens)]


# ---- the default model --------------------------------------------------------------------

@pytest.mark.model
def test_default_model_decode_batch_equals_sessions(default_model):
    m = default_model
    pool = KVPool.for_model(m, 16, page_size=16)
    prompts = prompts_of(LENGTHS, seed=10, vocab=40000)
    seqs = [pool.new_seq() for _ in prompts]
    forward_batch(m, pool, seqs, prompts)
    out = forward_batch(m, pool, seqs, [[100], [200], [300], [400]])
    for p, o, n in zip(prompts, out, (100, 200, 300, 400)):
        s = m.session()
        s.feed(p)
        ref = s.feed([n])
        np.testing.assert_allclose(o, ref, rtol=1e-4, atol=2e-4)
        assert o.argmax() == ref.argmax()


@pytest.mark.model
def test_default_model_generate_many_is_token_identical(default_model):
    m = default_model
    prompts = ["Once upon a time", "The capital of France is",
               m.format_chat([{"role": "user", "content": "Name three colors."}]),
               "def fibonacci(n):", "1, 2, 3, 4,",
               "In a distant galaxy, far beyond the reach of any telescope, a small robot"]
    alone = [m.complete(p, temperature=0, max_tokens=12) for p in prompts]
    together = complete_many(m, prompts, temperature=0, max_tokens=12, max_batch=4)
    for a, b in zip(alone, together):
        assert [t.id for t in a.tokens] == [t.id for t in b.tokens]
        assert a.text == b.text


@pytest.mark.model
def test_default_model_int8_complete_many_is_token_identical(default_model_path):
    """int8 activations: requests batched together give the tokens each gives through the
    scheduler alone (the packed pass, whose products do not depend on the batch)."""
    m = npllama.Model(default_model_path, activations="int8")
    prompts = ["Once upon a time", m.format_chat([{"role": "user", "content": "Name three colors."}]),
               "def fibonacci(n):", "In a distant galaxy, far beyond the reach of any telescope, a small robot"]
    alone = [complete_many(m, [p], temperature=0, max_tokens=12)[0] for p in prompts]
    together = complete_many(m, prompts, temperature=0, max_tokens=12, max_batch=4)
    assert [[t.id for t in a.tokens] for a in alone] == [[t.id for t in b.tokens] for b in together]


# =============================================================================================
# Independent oracles for the batched path (issue 20 §4): the row kernels, the packed forward
# pass and paged attention against gguf.quants.dequantize and float64 NumPy references, never
# against npllama's own single-sequence path.
# =============================================================================================

import gguf.quants as gguf_quants  # noqa: E402  (this section's imports, kept with it)
from gguf.constants import GGML_QUANT_SIZES  # noqa: E402

import naive  # noqa: E402
from npllama.kernels import rows as row_kernels
from npllama.kernels.nn import ACTS, RopeTable  # noqa: E402
from test_products import assert_close, weight  # noqa: E402
from tinygguf import write_tiny_llama  # noqa: E402

ROW_TYPES = list(quants.SUPPORTED_TYPES)  # F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K
ROW_COUNTS = [1, 2, 3, 5, 33]  # activation rows: 1..3 take _tile's few-rows path (direct dots), 5 and 33 the tiles


def _weight(qtype, rows, cols, rng):
    """(rows, row_bytes) uint8 block data of `qtype` for a (rows, cols) weight (see test_products.weight)."""
    per_block = GGML_QUANT_SIZES[qtype][0]
    return weight(qtype, rows, rng, blocks=cols // 8 if per_block == 1 else cols // per_block)


def _cols(qtype, quantized_k=256, other=96):
    return quantized_k if GGML_QUANT_SIZES[qtype][0] == 256 else other


def _acts(T, n, rng):
    """T activation rows of mixed magnitudes."""
    return (rng.normal(size=(T, n)) * rng.choice([0.01, 1.0, 30.0], (T, n))).astype(np.float32)


def _ref_product(data, qtype, x):
    """x @ W.T in float64 with W dequantized by gguf."""
    return np.asarray(x, np.float64) @ gguf_quants.dequantize(data, qtype).astype(np.float64).T


@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("qtype", ROW_TYPES, ids=lambda t: t.name)
def test_matmul_rows_kernel_against_gguf_dequantize(qtype, T):
    """rows._matmul_rows (every packed product of a pass) for every type the row kernels take:
    9 weight rows (two full _TILEs and a partial one), T activation rows (odd counts, the
    few-rows direct dots for T <= 3, the dequantized tiles with a lone last row for T = 5, 33);
    every output written (NaN-filled before)."""
    rng = np.random.default_rng(100 * T + int(qtype))
    rows, n = 9, _cols(qtype)
    data = _weight(qtype, rows, n, rng)
    x = _acts(T, n, rng)
    out = np.full((T, rows), np.nan, np.float32)
    row_kernels._matmul_rows(type_mask([qtype]), int(qtype), data, x, out)
    assert_close(out, data, qtype, x)


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q4_0, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K],
                         ids=lambda t: t.name)
def test_matmul_rows_wrapper_takes_any_activation_layout(qtype):
    """The public wrapper on strided, Fortran-ordered and float64 activations, one row (the
    decode kernels) and several, against gguf's dequantization and a float64 product."""
    rng = np.random.default_rng(int(qtype) + 7)
    rows, n = 6, _cols(qtype)
    data = _weight(qtype, rows, n, rng)
    w = QWeight("w", data, qtype, rows, n)
    big = _acts(10, 2 * n, rng)
    for x in (big[:5, ::2], big[:1, 1::2], np.asfortranarray(big[:3, :n]), big[:7, :n].astype(np.float64),
              big[::3, n:]):
        got = matmul_rows(w, x)
        assert got.shape == (x.shape[0], rows)
        assert_close(got, data, qtype, x)


def test_matmul_rows_wrapper_on_partial_blocks():
    """A weight whose rows are not whole 32-element blocks takes the tiled-dequant + BLAS path."""
    rng = np.random.default_rng(11)
    for qtype, n in ((QT.F32, 40), (QT.F16, 72)):
        data = _weight(qtype, 5, n, rng)
        x = _acts(5, n, rng)
        assert_close(matmul_rows(QWeight("w", data, qtype, 5, n), x), data, qtype, x)


QKV_TYPES = [(QT.Q4_K, QT.Q8_0, QT.F16), (QT.Q4_1, QT.Q4_0, QT.Q6_K), (QT.F32, QT.Q5_0, QT.Q5_1),
             (QT.Q2_K, QT.Q3_K, QT.BF16), (QT.Q5_K, QT.Q4_1, QT.Q4_1)]


@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("types", QKV_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
def test_qkv_rows_against_gguf_dequantize(types, T):
    """rows._qkv_rows: q, k, v of different types in one parallel region over all their
    tiles, 13/6/5 rows (each ending in a partial tile, next to the q/k and k/v boundaries of
    the task range); every output written (NaN-filled before)."""
    rng = np.random.default_rng(T + 10 * sum(map(int, types)))
    n = 256
    ws = [_weight(t, r, n, rng) for t, r in zip(types, (13, 6, 5))]
    x = _acts(T, n, rng)
    outs = [np.full((T, d.shape[0]), np.nan, np.float32) for d in ws]
    row_kernels._qkv_rows(type_mask(types), int(types[0]), ws[0], int(types[1]), ws[1], int(types[2]), ws[2], x, *outs)
    for out, data, qtype in zip(outs, ws, types):
        assert_close(out, data, qtype, x)


def _gelu_tanh(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))


def _silu(g):
    return g / (1.0 + np.exp(-g))


GLU_TYPES = [(QT.Q4_0, QT.Q4_0), (QT.Q8_0, QT.Q4_1), (QT.F16, QT.F32), (QT.Q4_K, QT.Q6_K), (QT.Q5_0, QT.Q5_1),
             (QT.Q2_K, QT.Q3_K), (QT.BF16, QT.Q5_K)]


@pytest.mark.parametrize("T", ROW_COUNTS)
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("types", GLU_TYPES, ids=lambda ts: "-".join(t.name for t in ts))
def test_gate_up_rows_against_float64_glu(types, act, T):
    """rows._gate_up_rows: act(x @ Wg.T) * (x @ Wu.T) fused per tile, for SiLU (code 0) and
    GELU-tanh (code 1), against float64 products of gguf's dequantized weights and the
    activations written out; 11 rows (a partial last tile); gate values of order 1, where
    the activations are far from linear."""
    rng = np.random.default_rng(T + 10 * ACTS[act] + 100 * sum(map(int, types)))
    n, rows = 256, 11
    wg, wu = (_weight(t, rows, n, rng) for t in types)
    x = _acts(T, n, rng)
    x = (x * (2.0 / np.abs(_ref_product(wg, types[0], x)).max())).astype(np.float32)  # |gate| <= 2
    g, u = _ref_product(wg, types[0], x), _ref_product(wu, types[1], x)
    f = {"silu": _silu, "gelu_tanh": _gelu_tanh}[act]
    ref = f(g) * u
    out = np.full((T, rows), np.nan, np.float32)
    row_kernels._gate_up_rows(type_mask(types), int(types[0]), wg, int(types[1]), wu, x, out, ACTS[act])
    # error of each product (see test_products.assert_close), carried through act(g) * u
    # (|act'| <= 1.2, |act(g)| <= |g|), plus the kernels' exp approximation
    x64 = np.abs(x.astype(np.float64))
    bg = x64 @ np.abs(gguf_quants.dequantize(wg, types[0]).astype(np.float64)).T
    bu = x64 @ np.abs(gguf_quants.dequantize(wu, types[1]).astype(np.float64)).T
    tol = 3e-5 * (1.2 * np.abs(u) * bg + np.abs(g) * bu) + 1e-6 * np.abs(ref) + 1e-30
    assert np.all(np.abs(out - ref) <= tol), np.max(np.abs(out - ref) / tol)
    # the activation matters here: the other one (or none) is far off
    other = {"silu": _gelu_tanh, "gelu_tanh": _silu}[act](g) * u
    assert np.abs(other - ref).max() > 100 * tol.max()


@pytest.mark.parametrize("T", ROW_COUNTS)
def test_rmsnorm_rows_against_float64(T):
    """rows._rmsnorm_rows: rows of tiny values (where eps = 1e-5 dominates mean(x^2)) and of
    ordinary ones, against x / sqrt(mean(x^2) + eps) * w in float64."""
    rng = np.random.default_rng(T + 3)
    n, eps = 96, 1e-5
    x = rng.normal(size=(T, n)) * np.where(np.arange(T) % 2 == 0, 1e-3, 3.0)[:, None]
    x = x.astype(np.float32)
    w = (1.0 + 0.3 * rng.normal(size=n)).astype(np.float32)
    out = np.full_like(x, np.nan)
    row_kernels._rmsnorm_rows(x, w, np.float32(eps), out)
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + eps) * w
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=0)
    no_eps = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True)) * w
    assert np.abs(no_eps[0] - ref[0]).max() > 0.5 * np.abs(ref[0]).max()  # eps is visible in row 0


def _rope_reference(x, positions, base, rope_dim, neox):
    """x (T, H, D) rotated by angle p * base^(-2i / rope_dim) per pair, in float64; the dims
    past rope_dim unchanged. Pairs: (2i, 2i + 1), or (i, i + rope_dim / 2) for NeoX."""
    half = rope_dim // 2
    theta = np.asarray(positions, np.float64)[:, None] * base ** (-np.arange(half) * 2.0 / rope_dim)
    rot = np.exp(1j * theta)[:, None, :]
    out = x.astype(np.float64)
    lo, hi = (np.arange(half), np.arange(half) + half) if neox else (np.arange(half) * 2, np.arange(half) * 2 + 1)
    z = (out[..., lo] + 1j * out[..., hi]) * rot
    out[..., lo], out[..., hi] = z.real, z.imag
    return out


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("T", ROW_COUNTS)
def test_rope_rows_against_float64(T, neox):
    """rows._rope_rows: each token at its own position (out of order, repeated, far apart, as
    in a packed batch), full and partial rotary dims, against float64 rotations."""
    rng = np.random.default_rng(T + 20 * neox)
    H, D, n_ctx, base = 3, 16, 512, 10000.0
    positions = rng.integers(0, n_ctx, T).astype(np.int64)
    positions[-1] = n_ctx - 1
    for rope_dim in (D, D // 2):
        table = RopeTable(n_ctx, rope_dim, base, neox=neox)
        x = rng.normal(size=(T, H, D)).astype(np.float32)
        got = x.copy()
        row_kernels._rope_rows(got, positions, table.cos, table.sin, neox)
        ref = _rope_reference(x, positions, base, rope_dim, neox)
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(x).max())
        assert np.array_equal(got[..., rope_dim:], x[..., rope_dim:])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_paged_attend_against_numpy(dtype):
    """paged_attend without a window against the float64 reference: grouped heads (6 query
    heads on 2 KV heads), scattered pages, queries in the middle of a sequence whose later
    keys are already in the pool (they must stay unseen), a prefill run longer than a query
    block and spanning key blocks (40 keys > 32), decoding tokens, a sequence of one key,
    queries of one sequence split around another's, default scale 1/sqrt(D), and queries
    given as a strided float64 array."""
    rng = np.random.default_rng(21)
    H, KVH, D, ps, n_pages = 6, 2, 12, 4, 24
    lengths = [40, 1, 13, 7]              # keys written per sequence
    # (sequence, positions) of the packed queries, in packed order
    runs = [(0, range(27, 36)), (2, range(3, 6)), (1, range(0, 1)), (2, range(12, 13)), (0, range(39, 40)),
            (3, range(6, 7))]
    kv = rng.standard_normal((n_pages, ps, KVH, 2, D)).astype(dtype)
    tables, perm, at = np.full((4, 11), -1, np.int32), rng.permutation(n_pages), 0
    for b, n in enumerate(lengths):
        k = -(-n // ps)
        tables[b, :k] = perm[at:at + k]
        at += k
    seq_of_token = np.concatenate([[b] * len(r) for b, r in runs])
    positions = np.concatenate([list(r) for _, r in runs])
    q64 = rng.standard_normal((len(positions), H, 2 * D))
    q = q64[:, :, ::2]  # non-contiguous float64: the wrapper converts it
    out = paged_attend(q, kv, tables, seq_of_token, positions)
    assert out.shape == (len(positions), H, D) and out.dtype == np.float32
    for b, n in enumerate(lengths):
        rows = np.flatnonzero(seq_of_token == b)
        seq = kv[tables[b, :-(-n // ps)]].reshape(-1, KVH, 2, D)[:n].astype(np.float64)
        ref = _attention_reference(q[rows], seq[:, :, 0], seq[:, :, 1], positions[rows], 0, 1 / np.sqrt(D))
        np.testing.assert_allclose(out[rows], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("activations", ["f32", "int8"])
@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.Q8_0, QT.Q4_0, QT.Q4_1], ids=lambda t: t.name)
def test_forward_batch_against_naive_reference(tmp_path, qtype, activations):
    """Whole packed passes (panel products for the quantized types, the row kernels for the
    floats; paged attention, per-token RoPE) on a tiny llama in each type against the naive
    float64 forward pass of tests/naive.py: three sequences prefilled in one pass (lengths 5,
    1, 12: odd token counts), then three decoding tokens in one pass (T = 3), then one sequence
    alone (T = 1), then a mixed pass of a prefill chunk and a decoding token. With int8
    activations the bound is int8 quantization's (as test_model's), else float rounding's."""
    m = npllama.Model(write_tiny_llama(tmp_path / "m.gguf", qtype=qtype, tied=False), threads=2,
                      activations=activations, kv_dtype=np.float32)
    prompts = prompts_of((5, 1, 12), seed=12)
    pool = KVPool.for_model(m, tokens=64, page_size=4)
    seqs = [pool.new_seq() for _ in prompts]
    got = [[lg] for lg in forward_batch(m, pool, seqs, prompts, all_logits=True)]
    for i, lg in enumerate(forward_batch(m, pool, seqs, [[30], [31], [32]])):
        got[i].append(lg[None])
    got[1].append(forward_batch(m, pool, [seqs[1]], [[33]])[0][None])
    for i, lg in zip((0, 2), forward_batch(m, pool, [seqs[0], seqs[2]], [[34, 35, 36, 37, 38], [39]], all_logits=True)):
        got[i].append(lg)
    for seq, rows in zip(seqs, got):
        ref = naive.forward(m.file, seq.tokens)
        logits = np.concatenate(rows)
        assert logits.shape == ref.shape
        bound = 3e-2 if activations == "int8" and qtype not in (QT.F32, QT.F16) else 2e-4
        assert np.abs(logits - ref).max() <= bound * np.abs(ref).max(), np.abs(logits - ref).max() / np.abs(ref).max()
