"""Sessions own their position: the seeds' position bugs cannot happen."""
import numpy as np
import pytest

import npllama
from npllama import ContextOverflowError, PositionError
from npllama.engine.session import Session
from tinygguf import write_tiny_llama


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return npllama.Model(tiny_model_path, threads=2)


def test_feed_shapes_and_pos(model):
    s = model.session()
    assert s.pos == 0 and s.cache.length == 0
    last = s.feed([5, 6, 7])
    assert last.shape == (model.config.n_vocab,) and last.dtype == np.float32
    assert s.pos == 3 == s.cache.length
    every = s.feed([8, 9], all_logits=True)
    assert every.shape == (2, model.config.n_vocab)
    assert s.pos == 5 == s.cache.length and s.tokens == [5, 6, 7, 8, 9]


def test_incremental_equals_one_shot(model):
    ids = [3, 40, 41, 42, 100, 7, 9]
    whole = model.session().feed(ids, all_logits=True)
    s = model.session()
    parts = [s.feed(ids[:3], all_logits=True), s.feed(ids[3:4], all_logits=True), s.feed(ids[4:], all_logits=True)]
    np.testing.assert_allclose(np.concatenate(parts), whole, rtol=1e-4, atol=1e-5)


def test_restarted_conversation_equals_fresh_session(model):
    """The seed's scenario: clear and restart a conversation through the session."""
    first, second = [10, 11, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22, 23, 24]
    s = model.session()
    s.feed(first)
    s.feed([19])
    s.reset()
    assert s.pos == 0
    again = s.feed(second, all_logits=True)
    fresh = model.session().feed(second, all_logits=True)
    np.testing.assert_array_equal(again, fresh)


def test_stale_explicit_position_raises_position_error(model):
    cache = model.new_cache()
    model.forward([1, 2, 3, 4], 0, cache)
    cache.reset()
    with pytest.raises(PositionError, match=r"position 4 does not match the KV cache length 0"):
        model.forward([5, 6], 4, cache)  # the caller forgot to reset its counter
    assert cache.length == 0


def test_counter_advanced_per_call_is_caught_at_second_call(model):
    """A counter that counts calls instead of tokens is caught, not left to produce garbage."""
    cache, calls = model.new_cache(), 0
    model.forward([1, 2, 3], calls, cache)
    calls += 1
    with pytest.raises(PositionError, match=r"position 1 does not match the KV cache length 3"):
        model.forward([4], calls, cache)


def test_cache_of_another_shape_is_refused(model):
    cfg = model.config
    bad = npllama.KVCache(cfg.n_layer, cfg.n_head_kv, cfg.head_dim + 2)
    with pytest.raises(ValueError, match="KV cache is shaped for"):
        Session(model, cache=bad)  # at construction, before any feed
    with pytest.raises(ValueError, match="KV cache is shaped for"):
        model.forward([1], 0, bad)


def test_fork_truncate_keep_cache_and_position_together(model):
    s = model.session()
    s.feed([1, 2, 3, 4, 5])
    f = s.fork()
    a = s.feed([6])
    b = f.feed([7])
    assert s.tokens[-1] == 6 and f.tokens[-1] == 7 and s.pos == f.pos == 6
    assert not np.allclose(a, b)
    for layer in range(model.config.n_layer):
        assert not np.shares_memory(s.cache.buffer(layer), f.cache.buffer(layer))
    s.truncate(5)
    assert s.pos == 5 == s.cache.length and s.tokens == [1, 2, 3, 4, 5]
    np.testing.assert_allclose(s.feed([7]), b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        s.truncate(99)
    assert s.pos == 6


def test_bad_token_ids_fail_before_any_kernel(model):
    s = model.session()
    n = model.config.n_vocab
    with pytest.raises(ValueError, match=rf"token id {n} at index 1 is out of range"):
        s.feed([1, n])
    with pytest.raises(ValueError, match="out of range"):
        s.feed([-1])
    with pytest.raises(ValueError, match="non-empty"):
        s.feed([])
    with pytest.raises(ValueError, match="integers"):
        s.feed([1.5])
    assert s.pos == 0


def test_context_overflow(tmp_path):
    m = npllama.Model(write_tiny_llama(tmp_path / "short.gguf", n_ctx=8))
    s = m.session()
    s.feed(list(range(1, 8)))
    with pytest.raises(ContextOverflowError, match=r"position 7 .* context of 8"):
        s.feed([1, 2])
    assert s.pos == 7
    s.feed([1])
    with pytest.raises(ContextOverflowError):
        m.forward([1], 8, s.cache)  # the low-level path checks too
    with pytest.raises(ContextOverflowError, match="context of 4"):
        m.session(ctx=4).feed(list(range(1, 6)))


def test_threads_per_model_and_per_call(tiny_model_path):
    m1 = npllama.Model(tiny_model_path, threads=1)
    ids = [4, 5, 6, 7]
    a = m1.session().feed(ids, all_logits=True)
    b = m1.session().feed(ids, all_logits=True, threads=2)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="threads"):
        npllama.Model(tiny_model_path, threads=0)


def test_error_mid_forward_leaves_cache_unchanged(model, monkeypatch):
    s = model.session()
    s.feed([1, 2, 3])
    import npllama.engine.transformer as mm
    calls = {"n": 0}
    real = mm.attend

    def failing(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(mm, "attend", failing)
    with pytest.raises(KeyboardInterrupt):
        s.feed([4, 5])
    monkeypatch.setattr(mm, "attend", real)
    assert s.pos == 3 and all(s.cache.layer_length(i) == 3 for i in range(model.config.n_layer))
    np.testing.assert_allclose(s.feed([4, 5]), model.session().feed([1, 2, 3, 4, 5]), rtol=1e-5, atol=1e-6)


def test_long_prompt_runs_in_chunks_with_the_same_result(model, monkeypatch):
    import npllama.engine.transformer as mm
    ids = [int(i) for i in np.random.default_rng(3).integers(0, model.config.n_vocab, 23)]
    whole = model.session().feed(ids, all_logits=True)
    whole_hidden = model.forward(ids, 0, model.new_cache(), output="hidden")
    monkeypatch.setattr(mm, "PREFILL_CHUNK", 5)
    s = model.session()
    np.testing.assert_allclose(s.feed(ids, all_logits=True), whole, rtol=1e-4, atol=1e-5)
    assert s.pos == 23
    np.testing.assert_allclose(model.session().feed(ids), whole[-1], rtol=1e-4, atol=1e-5)
    hidden = model.forward(ids, 0, model.new_cache(), output="hidden")
    assert hidden.shape == (23, model.config.n_embd)
    np.testing.assert_allclose(hidden, whole_hidden, rtol=1e-4, atol=1e-5)


def test_long_prompt_allocates_the_cache_once(model, monkeypatch):
    import npllama.engine.transformer as mm
    from npllama.cache.kvcache import KVCache
    monkeypatch.setattr(mm, "PREFILL_CHUNK", 5)
    sizes = []
    real = KVCache._alloc
    monkeypatch.setattr(KVCache, "_alloc", lambda self, capacity: sizes.append(capacity) or real(self, capacity))
    s = model.session()
    s.feed([1] * 23)
    assert sizes == [0, 32]  # the empty cache, then one buffer for the 23 tokens and the next (no doubling per chunk)
    s.feed([2] * 8)          # room left, with the next token's: nothing allocated
    assert sizes == [0, 32] and s.cache.capacity == 32


@pytest.mark.parametrize("activations", ["f32", "int8"])
def test_a_dropped_session_frees_its_cache_at_once_for_the_next(tiny_model_path, activations):
    """No cycle holds a session's cache after a prefill and a decode step: it goes when the
    session does, without the collector, and the next session of the same length takes its
    buffer (first writes into fresh memory are slow)."""
    import gc
    import weakref
    m = npllama.Model(tiny_model_path, threads=2, activations=activations)
    ids = list(range(3, 40))
    s = m.session()
    first = s.feed(ids)
    s.feed([int(np.argmax(first))])
    gone, where = weakref.ref(s.cache), s.cache.buffers().__array_interface__["data"][0]
    gc.disable()
    try:
        del s
        assert gone() is None
        s = m.session()
        np.testing.assert_array_equal(s.feed(ids), first)
        s.feed([int(np.argmax(first))])
        assert s.cache.buffers().__array_interface__["data"][0] == where
    finally:
        gc.enable()
