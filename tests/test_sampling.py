"""Samplers: each filter against a direct NumPy statement of it, and seeded reproducibility."""
import numpy as np
import pytest

from npllama.generation.sampling import (SamplingParams, filter_candidates, logit_bias, make_sampler, penalties)

rng = np.random.default_rng(0)
LOGITS = rng.standard_normal(1000).astype(np.float32) * 3


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def test_defaults_are_llama_cpp():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.repeat_last_n) == (0.8, 40, 0.95, 0.05, 1.0, 64)


def test_top_k():
    ids, _ = filter_candidates(LOGITS, 5, 1.0, 0.0)
    assert list(ids) == list(np.argsort(-LOGITS)[:5])


def test_top_p_keeps_smallest_prefix_reaching_p():
    ids, _ = filter_candidates(LOGITS, 0, 0.5, 0.0)
    order = np.argsort(-LOGITS)
    cum = np.cumsum(softmax(LOGITS.astype(np.float64))[order])
    n = int(np.argmax(cum >= 0.5)) + 1
    assert list(ids) == list(order[:n])


def test_min_p():
    ids, _ = filter_candidates(LOGITS, 0, 1.0, 0.2)
    p = softmax(LOGITS.astype(np.float64))
    assert set(ids) == set(np.flatnonzero(p >= 0.2 * p.max()))


def test_penalties_over_last_n():
    logits = np.array([2.0, -2.0, 1.0, 0.5], np.float32)
    out = penalties(repeat=2.0, last_n=3)(logits, [0, 3, 1, 1])  # token 0 is outside the last 3
    np.testing.assert_allclose(out, [2.0, -4.0, 1.0, 0.25])
    out = penalties(presence=0.5, frequency=0.25, last_n=-1)(logits, [1, 1, 2])
    np.testing.assert_allclose(out, [2.0, -2.0 - 0.5 - 0.5, 1.0 - 0.25 - 0.5, 0.5])
    assert penalties(repeat=2.0, last_n=0)(logits, [0, 1]) is logits


def test_logit_bias_can_ban_and_force():
    s = make_sampler(SamplingParams(temperature=0, logit_bias={int(np.argmax(LOGITS)): -np.inf, 7: 100.0}))
    assert s(LOGITS, []) == 7


def test_greedy_and_seeded_reproducibility():
    assert make_sampler(SamplingParams(temperature=0))(LOGITS, []) == int(np.argmax(LOGITS))
    a = make_sampler(SamplingParams(seed=42))
    b = make_sampler(SamplingParams(seed=42))
    assert [a(LOGITS, []) for _ in range(20)] == [b(LOGITS, []) for _ in range(20)]
    c = make_sampler(SamplingParams(seed=43, temperature=5.0, top_k=0, top_p=1.0, min_p=0.0))
    d = make_sampler(SamplingParams(seed=42, temperature=5.0, top_k=0, top_p=1.0, min_p=0.0))
    assert [c(LOGITS, []) for _ in range(20)] != [d(LOGITS, []) for _ in range(20)]


def test_sampled_frequencies_follow_the_tempered_distribution():
    logits = np.array([0.0, 1.0, 2.0], np.float32)
    s = make_sampler(SamplingParams(seed=0, temperature=2.0, top_k=0, top_p=1.0, min_p=0.0))
    counts = np.bincount([s(logits, []) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, softmax(logits / 2.0), atol=0.03)


@pytest.mark.parametrize("kw,msg", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"min_p": 2.0}, "min_p"), ({"top_k": -1}, "top_k"), ({"repeat_penalty": 0.0}, "repeat_penalty"),
    ({"repeat_last_n": -2}, "repeat_last_n"),
])
def test_bad_parameters(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_samplers_compose():
    """A processor is a plain callable and can be chained by hand."""
    chain = [penalties(repeat=1.5), logit_bias({3: 1.0})]
    x = LOGITS.copy()
    for f in chain:
        x = f(x, [3, 4])
    assert x[3] != LOGITS[3] and x[4] != LOGITS[4] and x[5] == LOGITS[5]
