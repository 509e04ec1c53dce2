"""The fuzzing campaign of issue 20 (section 3), and the regression tests of what it found.

Each target of tests/fuzz_targets.py, and the tokenizer's (tests/fuzz_targets_tokenizer.py, whose
corpus and regressions test_tokenizer.py replays), runs for NPLLAMA_FUZZ_SECONDS (default 20) under atheris
(coverage-guided, in a subprocess: libFuzzer exits the process when it ends), or, where atheris
cannot be installed, under a seeded random mutator in-process. A crash, a hang (20 s on one
input) or a process over 3 GiB fails the test and shows the input. The committed corpus
(tests/fuzz_corpus/<target>/) is replayed by a fast test of its own. bench/fuzz.py runs longer
campaigns and prints executions and coverage.
"""
import math
import os

import numpy as np
import pytest

import fuzz_targets as ft
from npllama.generation import api as textapi
from npllama.generation.generate import check_logprobs, check_max_tokens, check_stop
from npllama.generation.sampling import SamplingParams, logit_bias, make_sampler, penalties

FUZZ_SECONDS = int(os.environ.get("NPLLAMA_FUZZ_SECONDS", "20"))

try:
    import atheris  # noqa: F401
    HAVE_ATHERIS = True
except ImportError:
    HAVE_ATHERIS = False


@pytest.mark.parametrize("target", ft.TARGETS)
def test_committed_corpus_replays(target):
    entries = ft.corpus(target)
    assert entries, f"tests/fuzz_corpus/{target}/ is empty; run `python tests/fuzz_targets.py --write-seeds`"
    fn = ft.target_function(target)
    for name, raw in entries:
        try:
            fn(raw)
        except Exception as e:
            raise AssertionError(f"tests/fuzz_corpus/{target}/{name} fails: {type(e).__name__}: {e}") from e


def test_gguf_seeds_load():
    """The GGUF seeds are valid models, so that mutations start from a file that passes every check."""
    from npllama.gguf.reader import GGUFFile
    for name, head in ft.gguf_seeds().items():
        path = ft._scratch()
        path.unlink(missing_ok=True)
        path.write_bytes(head + bytes(ft.GGUF_DATA_BYTES))
        assert GGUFFile(path).config.n_layer == 1, name


@pytest.mark.slow
@pytest.mark.parametrize("target", ft.CAMPAIGN_TARGETS)
def test_fuzz_campaign(target, tmp_path):
    if not HAVE_ATHERIS:
        n, raw, error = ft.run_random(target, FUZZ_SECONDS)
        assert raw is None, f"{target}: {error} on input {raw!r:.4000}"
        assert n > 0
        return
    r = ft.run_campaign(target, FUZZ_SECONDS, work_dir=tmp_path)
    if r.crash is not None or r.returncode != 0:
        raise AssertionError(
            f"{target}: {r.crash_kind or 'exit code ' + str(r.returncode)} on input {r.crash!r:.4000} "
            f"(saved under {tmp_path}/artifacts-{target}/; add it to tests/fuzz_corpus/{target}/ and a "
            f"regression test here once fixed)\n--- fuzzer output (tail) ---\n{r.output[-6000:]}")
    assert r.executions and r.executions > 0 and r.coverage, r.output[-3000:]


def test_driver_reports_a_crash_and_a_hang_with_the_input(tmp_path):
    """The campaign test above can fail: the driver finds a planted crash and a planted hang."""
    pytest.importorskip("atheris")
    dictionary = tmp_path / "crash.dict"
    dictionary.write_text('"*"\n')
    crashed = ft.run_campaign("selftest_crash", 60, work_dir=tmp_path, extra_args=(f"-dict={dictionary}",))
    assert crashed.crash_kind == "crash" and crashed.crash[:1] == b"*", crashed.output[-3000:]
    assert "planted crash" in crashed.output
    hung = ft.run_campaign("selftest_hang", 60, work_dir=tmp_path, timeout_per_input=1)
    assert hung.crash_kind == "timeout" and hung.crash, hung.output[-3000:]


# --------------------------------------------------------------------------------------------
# Regressions: sampling parameters (each raised TypeError, IndexError, OverflowError or
# AttributeError, crashed the process, or sampled silently wrong before the fix)

LOGITS = np.array([1.0, 3.0, 2.0], np.float32)


def _cyclic():
    x = []
    x.append(x)
    return x


@pytest.mark.parametrize("options", [
    {"temperature": "hot"},           # TypeError from a comparison
    {"temperature": True},            # accepted as 1.0
    {"temperature": math.inf},
    {"top_k": 2.5},                   # TypeError from argpartition at the first token
    {"repeat_last_n": 1.5},           # TypeError from slicing at the first token
    {"presence_penalty": math.nan},   # greedy then returned an arbitrary token
    {"frequency_penalty": math.inf},
    {"top_p": 10**5000},              # OverflowError converting to float
    {"seed": 1.5},                    # TypeError from numpy
    {"seed": "x"},
    {"seed": -1},
    {"seed": [_cyclic()]},            # numpy recursed until the process died (SIGSEGV)
    {"logit_bias": [(1, 2.0)]},       # AttributeError
    {"logit_bias": {"1": 2.0}},       # accepted: numpy parsed the string
    {"logit_bias": {-1: -math.inf}},  # banned the last token through negative indexing
    {"logit_bias": {2**70: 1.0}},     # OverflowError
    {"logit_bias": {1: math.inf}},    # every probability NaN
    {"logit_bias": {1: math.nan}},
    {"logit_bias": {1: "x"}},
    {"logit_bias": {True: 1.0}},
])
def test_sampling_params_refuse_bad_values(options):
    with pytest.raises(ValueError):
        make_sampler(SamplingParams(**options))(LOGITS, [])


def test_sampling_params_store_plain_numbers():
    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), seed=np.uint64(2**64 - 1),
                       logit_bias={np.int64(2): np.float32(1.5), 0: -math.inf})
    assert (type(p.temperature), type(p.top_k), type(p.seed)) == (float, int, int)
    assert p.logit_bias == {2: 1.5, 0: -math.inf} and all(type(k) is int for k in p.logit_bias)
    assert (p.temperature, p.top_k, p.seed) == (0.5, 3, 2**64 - 1)


def test_sampler_refuses_ids_outside_the_vocabulary():
    with pytest.raises(ValueError, match="token id 5, outside the vocabulary of 3"):
        make_sampler(SamplingParams(logit_bias={5: 1.0}))(LOGITS, [])  # IndexError before
    with pytest.raises(ValueError, match="history names token id 7"):
        make_sampler(SamplingParams(repeat_penalty=1.1))(LOGITS, [7])  # IndexError before
    with pytest.raises(ValueError, match="history names token id -1"):
        penalties(repeat=1.1)(LOGITS, [-1])  # penalised the last token before


def test_sampler_refuses_when_every_token_is_banned():
    ban_all = {i: -math.inf for i in range(3)}
    for temperature in (0.0, 0.8):  # greedy returned banned token 0; sampling a numpy error
        with pytest.raises(ValueError, match="every token"):
            make_sampler(SamplingParams(temperature=temperature, logit_bias=ban_all))(LOGITS, [])


def test_sampler_never_draws_a_banned_token():
    s = make_sampler(SamplingParams(temperature=5.0, top_k=0, top_p=1.0, min_p=0.0, seed=0,
                                    logit_bias={1: -math.inf, 2: -math.inf}))
    assert {s(LOGITS, []) for _ in range(50)} == {0}


def test_tiny_temperature_is_greedy():
    # 3 / 1e-320 overflowed to inf, inf - inf gave NaN probabilities and a numpy error
    s = make_sampler(SamplingParams(temperature=1e-320, top_k=0, top_p=1.0, min_p=0.0))
    assert s(LOGITS, []) == 1


def test_huge_penalties_and_biases_do_not_overflow_float32():
    big = np.array([3e38, -3e38, 0.0], np.float32)
    s = make_sampler(SamplingParams(temperature=0, logit_bias={0: 1e38, 2: 1e38}))
    assert s(big, []) == 0  # 3e38 + 1e38 overflowed float32 to inf; it is 4e38 in float64
    out = penalties(repeat=1e-10)(big, [0, 1])
    assert out.dtype == np.float64 and np.isfinite(out).all() and out[1] == pytest.approx(-3e28, rel=1e-6)
    assert logit_bias({0: -math.inf})(big, [])[0] == -math.inf


@pytest.mark.parametrize("logits", [np.zeros((2, 2)), np.zeros(0), np.arange(3), ["a", "b"]])
def test_sampler_refuses_logits_that_are_not_a_float_vector(logits):
    with pytest.raises(ValueError, match="logits must be"):
        make_sampler(SamplingParams(temperature=0))(logits, [])


def test_sampler_leaves_the_logits_alone():
    logits = LOGITS.copy()
    make_sampler(SamplingParams(repeat_penalty=2.0, logit_bias={0: 5.0}))(logits, [1, 1])
    assert np.array_equal(logits, LOGITS)


# --------------------------------------------------------------------------------------------
# Regressions: generation keywords


@pytest.mark.parametrize("check, value", [
    (check_max_tokens, -1), (check_max_tokens, 2.0), (check_max_tokens, True), (check_max_tokens, "9"),
    (check_logprobs, -3),    # returned all but 3 alternatives: argsort()[:-3]
    (check_logprobs, "2"),   # TypeError from slicing
    (check_stop, None),      # TypeError: 'NoneType' object is not iterable
    (check_stop, 7), (check_stop, ["ok", 7]), (check_stop, b"stop"), (check_stop, {"a": 1}),
])
def test_generation_keywords_refuse_bad_values(check, value):
    with pytest.raises(ValueError):
        check(value)


def test_generation_keywords_accept_numpy_integers_and_one_string():
    assert check_max_tokens(np.int64(5)) == 5 and check_logprobs(np.uint8(2)) == 2
    assert check_stop("\n\n") == ["\n\n"] and check_stop(("a", "")) == ["a", ""]


def _stub_model():
    return ft._StubModel(ft._tiny_tokenizer(), n_ctx=64, seed=0, peak=40)  # a likely token that is no end of turn


@pytest.mark.parametrize("keywords", [{"stop": None}, {"logprobs": -1}, {"stop": [3]}])
def test_stream_checks_its_arguments_when_called(keywords):
    # the errors came (as TypeError or not at all) only while iterating
    with pytest.raises(ValueError):
        textapi.generate(_stub_model(), [5, 6], stream=True, max_tokens=4, **keywords)


def test_logprobs_lists_the_requested_number_of_alternatives():
    c = textapi.complete_text(_stub_model(), [5, 6], max_tokens=3, logprobs=2, temperature=0)
    assert c.tokens and all(len(t.top_logprobs) == 2 for t in c.tokens)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("bad, at", [(math.nan, 70_000), (math.inf, 3), (math.nan, 3)])
def test_sampler_refuses_nan_or_inf_logits(dtype, bad, at):
    """A NaN or +inf logit anywhere (here after an +inf, or alone) is refused by name, greedy or not."""
    logits = np.zeros(100_000, dtype)
    logits[1] = math.inf if math.isnan(bad) else 0.0
    logits[at] = bad
    for temperature in (0.0, 0.8):
        with pytest.raises(ValueError, match=f"contain {'nan' if math.isnan(bad) else 'inf'}"):
            make_sampler(SamplingParams(temperature=temperature))(logits, [])
