"""The continuous-batching Scheduler driven step by step, as a server's engine thread drives it:
requests that join mid-run, cancellation, and a request the pool can never hold."""
import numpy as np
import pytest

import npllama
from npllama.cache.kvpool import KVPool, PoolExhaustedError
from npllama.generation.sampling import GREEDY, make_sampler
from npllama.generation.scheduler import Request, Scheduler


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return npllama.Model(tiny_model_path, threads=2)


def prompt(seed, n):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


def request(model, ids, max_tokens=6, tag=None):
    return Request(model, ids, max_tokens=max_tokens, sampler=make_sampler(GREEDY), tag=tag)


def alone(model, ids, max_tokens=6):
    return [t.id for t in model.complete(ids, temperature=0, max_tokens=max_tokens).tokens]


def test_a_request_submitted_mid_run_joins_and_both_equal_their_runs_alone(model):
    pool = KVPool.for_model(model, tokens=128, page_size=4)
    sched = Scheduler(model, pool, max_batch=4)
    a, b = request(model, prompt(1, 9)), request(model, prompt(2, 5))
    sched.submit(a)
    for _ in range(3):
        sched.step()
    assert len(a.tokens) == 3 and not a.done
    sched.submit(b)
    changed = sched.step()
    assert a in changed and b in changed and len(b.tokens) == 1  # b's prompt ran in the same pass
    while not sched.idle:
        sched.step()
    assert [t.id for t in a.tokens] == alone(model, a.ids)
    assert [t.id for t in b.tokens] == alone(model, b.ids)
    assert a.finish_reason == b.finish_reason == "length"
    assert pool.n_available == pool.n_pages  # every page is free or an unused prefix-cache page


def test_cancel_frees_pages_and_leaves_the_others_intact(model):
    pool = KVPool.for_model(model, tokens=256, page_size=4)
    sched = Scheduler(model, pool, max_batch=2, prefix_cache=False)
    reqs = [request(model, prompt(10 + i, 7), max_tokens=8) for i in range(3)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    assert reqs[0] in sched.running and reqs[2] in sched.waiting
    sched.cancel(reqs[0])   # running: its pages go back now
    sched.cancel(reqs[2])   # waiting: never runs
    assert reqs[0].finish_reason == reqs[2].finish_reason == "cancelled" and reqs[0].seq is None
    while not sched.idle:
        sched.step()
    assert [t.id for t in reqs[1].tokens] == alone(model, reqs[1].ids, 8)
    assert reqs[2].tokens == [] and pool.n_free == pool.n_pages
    sched.cancel(reqs[1])   # finished: left as it is
    assert reqs[1].finish_reason == "length"


def test_a_request_the_pool_cannot_hold_fails_alone(model):
    pool = KVPool.for_model(model, 4, page_size=4)   # 16 tokens
    sched = Scheduler(model, pool)
    big, small = request(model, prompt(3, 20), tag="big"), request(model, prompt(4, 3), max_tokens=4)
    sched.submit(big)
    sched.submit(small)
    changed = sched.step()
    assert big in changed and big.done and big.finish_reason == "error"
    assert isinstance(big.error, PoolExhaustedError) and "prompt big (20 tokens + 6 new)" in str(big.error)
    while not sched.idle:
        sched.step()
    assert [t.id for t in small.tokens] == alone(model, small.ids, 4)
    assert pool.n_free == pool.n_pages


def test_close_cancels_everything(model):
    pool = KVPool.for_model(model, tokens=128, page_size=4)
    sched = Scheduler(model, pool, max_batch=1, prefix_cache=False)
    reqs = [request(model, prompt(20 + i, 5)) for i in range(2)]
    for r in reqs:
        sched.submit(r)
    sched.step()
    sched.close()
    assert sched.idle and all(r.finish_reason == "cancelled" for r in reqs) and pool.n_free == pool.n_pages


def test_scheduler_checks_its_arguments(model):
    pool = KVPool.for_model(model, tokens=32, page_size=4)
    with pytest.raises(ValueError, match="max_batch"):
        Scheduler(model, pool, max_batch=0)
    with pytest.raises(ValueError, match="step_tokens"):
        Scheduler(model, pool, step_tokens=0)


# ---- a request decoding alone: the fused decode step over its pages ---------------------------
ARCH = __import__("pathlib").Path(__file__).parent / "fixtures" / "arch"


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])  # gemma3: sliding layers (window 6) and post-norms
def test_decode_alone_equals_a_session(arch, page_size):
    from npllama.engine.batch import decode_alone, forward_batch
    m = npllama.Model(ARCH / f"{arch}.gguf", threads=2)
    ids = prompt(7, 9)
    pool = KVPool.for_model(m, tokens=64, page_size=page_size)
    seq = pool.new_seq()
    forward_batch(m, pool, [seq], [ids])
    s = m.session()
    s.feed(ids)
    for tok in prompt(8, 20):  # past the window, across pages
        np.testing.assert_allclose(decode_alone(m, pool, seq, tok), s.feed([tok]), rtol=1e-4, atol=1e-4)
    assert seq.tokens == s.tokens


def test_decode_alone_copies_a_shared_page_first(model):
    from npllama.engine.batch import decode_alone, forward_batch
    pool = KVPool.for_model(model, tokens=64, page_size=4, dtype=np.float16)
    a = pool.new_seq()
    forward_batch(model, pool, [a], [prompt(9, 6)])   # 1.5 pages: the second one half full
    before = [pool.gather(a, li) for li in range(model.config.n_layer)]
    b = pool.fork(a)
    logits = decode_alone(model, pool, b, 17)
    for li, (k, v) in enumerate(before):
        ka, va = pool.gather(a, li)
        assert np.array_equal(ka, k) and np.array_equal(va, v)  # the source's rows are untouched
    c = pool.new_seq()
    ref = forward_batch(model, pool, [c], [prompt(9, 6) + [17]])[0]
    np.testing.assert_allclose(logits, ref, rtol=1e-3, atol=1e-3)
    assert b.tokens == a.tokens + [17] and b.pages[1] != a.pages[1]


def test_a_lone_request_takes_the_fused_step(model, monkeypatch):
    import npllama.generation.scheduler as sch
    calls = []
    real = sch.decode_alone
    monkeypatch.setattr(sch, "decode_alone", lambda *a, **k: calls.append(1) or real(*a, **k))
    pool = KVPool.for_model(model, tokens=64, page_size=4)
    sched = Scheduler(model, pool)
    r = request(model, prompt(5, 6), max_tokens=6)
    sched.submit(r)
    while not sched.idle:
        sched.step()
    assert [t.id for t in r.tokens] == alone(model, r.ids) and len(calls) == 5  # every token after the first
