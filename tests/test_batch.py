"""Batched inference over the paged pool: packed varlen forward passes equal single sessions,
masks for padded batches, continuous batching, shared prefixes and beam search."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import npllama
from npllama import quants
from npllama.attention import MASKED, attend
from npllama.batch import (BeamSearch, batch_mask, beam_search, complete_many, forward_batch,
                           generate_many, matmul_rows)
from npllama.kvpool import KVPool, PoolExhaustedError
from npllama.model import QWeight
from npllama.paged_attention import paged_attend

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


def test_packed_batch_in_chunks_and_through_blas(model, monkeypatch):
    from npllama import batch
    monkeypatch.setattr(batch, "CHUNK_TOKENS", 5)  # chunks cut through the sequences
    check_batch_equals_sessions(model, 4)
    monkeypatch.setattr(batch, "USE_ROW_KERNELS", False)  # the tiled-dequant + BLAS products
    monkeypatch.setattr(batch, "_BLAS_CHUNK", 9)
    check_batch_equals_sessions(model, 4)


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
