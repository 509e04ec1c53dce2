"""Generation, chat, scoring and embeddings on the default model, and stop-string scanning."""
import threading

import numpy as np
import pytest

from npllama import ContextOverflowError
from npllama.generation.generate import _StopScanner

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def scan(pieces, stops):
    sc, out = _StopScanner(stops), []
    for p in pieces:
        text, stopped = sc.push(p)
        out.append(text)
        if stopped:
            return "".join(out), True
    return "".join(out) + sc.flush(), False


def test_stop_scanner_spans_pieces_and_hides_the_stop():
    assert scan(["Hello wo", "rld! Bye"], ["world"]) == ("Hello ", True)
    assert scan(["a<", "|e", "nd|>b"], ["<|end|>"]) == ("a", True)
    assert scan(["abc", "abd"], ["abx"]) == ("abcabd", False)  # a held-back prefix is released
    assert scan(["x\n", "\ny"], ["\n\n", "zz"]) == ("x", True)
    sc = _StopScanner(["STOP"])
    assert sc.push("go ST") == ("go ", False)  # "ST" may start "STOP": held back



@pytest.mark.model
def test_greedy_chat_and_stream_agree(default_model):
    text = default_model.chat(QUESTION, temperature=0, max_tokens=24)
    assert "Paris" in text
    pieces = list(default_model.chat(QUESTION, temperature=0, max_tokens=24, stream=True))
    assert len(pieces) > 1 and "".join(pieces) == text


@pytest.mark.model
def test_stop_string_across_token_boundary(default_model):
    m = default_model
    prompt = m.format_chat(QUESTION)
    full = m.complete(prompt, temperature=0, max_tokens=24)
    i = full.text.index("Paris")
    stop = full.text[i - 3:i + 2]  # e.g. "is Pa": ends inside a token
    ids = [t.id for t in full.tokens]
    assert len({m.detokenize(ids[:k]).find(stop) for k in range(len(ids))}) > 1  # spans tokens
    cut = m.complete(prompt, temperature=0, max_tokens=24, stop=[stop])
    assert cut.text == full.text[:i - 3] and cut.finish_reason == "stop"


@pytest.mark.model
def test_seeded_sampling_is_reproducible(default_model):
    m = default_model
    a = m.generate("Once upon a time", max_tokens=16, seed=7, temperature=1.0)
    b = m.generate("Once upon a time", max_tokens=16, seed=7, temperature=1.0)
    c = [m.generate("Once upon a time", max_tokens=16, seed=s, temperature=1.0) for s in (1, 2, 3)]
    assert a == b and len(set(c + [a])) > 1


@pytest.mark.model
def test_eos_and_max_tokens(default_model):
    m = default_model
    done = m.complete(m.format_chat(QUESTION), temperature=0, max_tokens=200)
    assert done.finish_reason == "stop" and len(done.tokens) < 200
    short = m.complete(m.format_chat(QUESTION), temperature=0, max_tokens=3)
    assert short.finish_reason == "length" and len(short.tokens) == 3
    assert m.generate("Hi", max_tokens=0) == ""


@pytest.mark.model
def test_logprobs(default_model):
    out = default_model.complete("The capital of France is", temperature=0, max_tokens=4, logprobs=3)
    for t in out.tokens:
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0][0] == t.id
        assert t.logprob == pytest.approx(t.top_logprobs[0][1]) and t.logprob <= 0


@pytest.mark.model
@pytest.mark.parametrize("call,msg", [
    (lambda m: m.generate(""), "prompt is empty"),
    (lambda m: m.generate("hi", max_tokens=-1), "max_tokens"),
    (lambda m: m.generate("hi", temperature=-1), "temperature"),
    (lambda m: m.generate("hi", top_p=0), "top_p"),
    (lambda m: m.chat([{"content": "hi"}]), "no 'role'"),
    (lambda m: m.chat([{"role": "user"}]), "no 'content'"),
    (lambda m: m.chat([{"role": "wizard", "content": "hi"}]), "role 'wizard'"),
])
def test_bad_input_gives_value_error(default_model, call, msg):
    with pytest.raises(ValueError, match=msg):
        call(default_model)


@pytest.mark.model
def test_prompt_longer_than_context(default_model):
    m = default_model
    long = "word " * 300
    with pytest.raises(ContextOverflowError, match=r"the prompt is \d+ tokens .* context holds 128 .*truncate=True"):
        m.generate(long, ctx=128, max_tokens=8)
    tail = m.tokenize(long)[-(128 - 8):]  # truncate=True keeps the prompt's last ctx - max_tokens tokens
    assert m.generate(long, ctx=128, max_tokens=8, truncate=True, temperature=0) == \
        m.generate(tail, ctx=128, max_tokens=8, temperature=0)


@pytest.mark.model
def test_chat_session_reuses_cache_and_equals_fresh_chat(default_model):
    m = default_model
    conv = m.chat_session(temperature=0, max_tokens=20)
    first = conv.send("What is the capital of France?")
    fed = []
    real_feed = conv.session.feed
    conv.session.feed = lambda ids, *a, **k: (fed.append(len(ids)), real_feed(ids, *a, **k))[1]
    held = conv.session.pos
    second = conv.send("And of Italy?")
    history = conv.messages[:-1]
    assert fed[0] < len(m.tokenize(m.format_chat(history), special=True)) - held + 5  # only new tokens
    assert second == m.chat(history, temperature=0, max_tokens=20)
    conv.reset()
    assert conv.session.pos == 0 and conv.send("What is the capital of France?") == first


@pytest.mark.model
def test_score_perplexity_embed(default_model):
    m = default_model
    ids, lp = m.score("The quick brown fox jumps over the lazy dog.")
    assert len(ids) == len(lp) and (lp <= 0).all() and lp.dtype == np.float32
    text = "The cat sat on the mat. " * 12
    toks = m.tokenize(text)
    ctx = 32
    # llama-perplexity: windows of ctx, the tokens after the middle of each scored
    nll = []
    for c in range(len(toks) // ctx):
        w = toks[c * ctx:(c + 1) * ctx]
        logits = m.session().feed(w, all_logits=True).astype(np.float64)
        lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        nll += [lse[i - 1] - logits[i - 1, w[i]] for i in range(ctx // 2 + 1, ctx)]
    assert m.perplexity(text, ctx=ctx) == pytest.approx(np.exp(np.mean(nll)), rel=1e-5)
    with pytest.raises(ValueError, match="shorter than one window"):
        m.perplexity("short", ctx=64)
    e = m.embed(["A cat sits on a mat.", "A kitten rests on a rug.", "Quarterly revenue rose 4%."])
    assert e.shape == (3, m.config.n_embd) and e.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1, rtol=1e-5)
    assert e[0] @ e[1] > e[0] @ e[2]


@pytest.mark.model
def test_generate_batch_in_order_and_threads(default_model):
    m = default_model
    prompts = ["One, two,", "Red, green,", "Monday, Tuesday,"]
    alone = [m.generate(p, temperature=0, max_tokens=6) for p in prompts]
    assert m.generate_batch(prompts, temperature=0, max_tokens=6) == alone
    results = [None] * 3

    def work(i):
        results[i] = m.generate(prompts[i], temperature=0, max_tokens=6)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone
