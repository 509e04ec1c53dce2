"""The text API offline, on tiny models, with exact assertions (issue 20 §4): complete,
generate, stream, chat, ChatSession, score, perplexity and embed.

Two tiny llamas are written here with tests/tinygguf.py:
- `model`: random weights with an untied output head, so that what it generates depends on
  the context (the tied tiny model only echoes its last token);
- `chain`: a model whose greedy continuation of "q" is exactly CHAIN and then EOS. Its blocks
  add nothing (attention and FFN outputs are zero), so its logits depend on the current token
  only, and its output head maps each token of "q" + CHAIN to the next one. Stop strings and
  length limits can then be placed exactly, multi-byte characters included.
The values the API reports are checked against float64 log-softmaxes of the logits of a
session fed the same tokens, and the hidden states against the naive forward pass.
"""
from pathlib import Path

import numpy as np
import pytest

import npllama
import naive
from npllama.errors import ContextOverflowError
from npllama.generation.generate import complete as complete_on_session, fit_prompt
from tinygguf import SPECIALS, tiny_vocab, write_tiny_llama

CHAIN = "abcdéx€yz"   # é: 2 bytes, €: 3 bytes; one byte token each
EOS = SPECIALS.index("<|im_end|>")


def byte_id(b: int) -> int:
    """The tiny vocabulary's token for byte b (the specials come first)."""
    return len(SPECIALS) + b


Q = [byte_id(ord("q"))]
CHAIN_IDS = [byte_id(b) for b in CHAIN.encode()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return npllama.Model(write_tiny_llama(tmp_path_factory.mktemp("untied") / "m.gguf", tied=False), threads=2)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    n_embd, n_ff, n_layer = 64, 96, 2
    n_vocab = len(tiny_vocab()[0])
    rng = np.random.default_rng(42)
    emb = rng.normal(size=(n_vocab, n_embd)).astype(np.float32)
    head = np.zeros((n_vocab, n_embd), np.float32)
    seq = Q + CHAIN_IDS + [EOS]
    for t, nxt in zip(seq, seq[1:]):
        head[nxt] = 0.1 * emb[t]  # the logit of nxt is large exactly when the hidden state is emb[t]
    overrides = {"token_embd.weight": emb, "output.weight": head}
    for i in range(n_layer):
        overrides[f"blk.{i}.attn_output.weight"] = np.zeros((n_embd, n_embd), np.float32)
        overrides[f"blk.{i}.ffn_down.weight"] = np.zeros((n_embd, n_ff), np.float32)
    path = write_tiny_llama(tmp_path_factory.mktemp("chain") / "chain.gguf", n_embd=n_embd, n_ff=n_ff,
                            n_layer=n_layer, tied=False, tensor_overrides=overrides)
    m = npllama.Model(path, threads=2)
    c = m.complete(Q, max_tokens=20, temperature=0)
    assert (c.text, c.finish_reason, [t.id for t in c.tokens]) == (CHAIN, "stop", CHAIN_IDS)  # the construction
    return m


@pytest.fixture(scope="module")
def fixture_model():
    """Models of tests/fixtures/arch by name, each read once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = npllama.Model(Path(__file__).parent / "fixtures" / "arch" / f"{name}.gguf", threads=2)
        return cache[name]
    return get


def log_softmax(logits) -> np.ndarray:
    lg = np.asarray(logits, np.float64)
    m = lg.max(-1, keepdims=True)
    return lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))


def render(messages, generation_prompt=True) -> str:
    """The tiny models' ChatML template, written out."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if generation_prompt else "")


# ---- logprobs ------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [dict(temperature=0), dict(temperature=0.9, seed=5, top_k=40)],
                         ids=["greedy", "sampled"])
def test_logprobs_are_log_softmax_of_the_logits(model, options):
    """Each token's logprob and its top-4 alternatives are the float64 log-softmax of the raw
    logits it was drawn from (not of the tempered or truncated distribution), replayed here
    by a session fed the prompt and then the generated tokens one by one."""
    prompt = model.tokenize("Hello there")
    c = model.complete(prompt, max_tokens=8, logprobs=4, **options)
    assert len(c.tokens) == 8 and c.finish_reason == "length" and c.prompt_tokens == len(prompt)
    s = model.session()
    logits = s.feed(prompt)
    for t in c.tokens:
        lp = log_softmax(logits)
        assert t.logprob == pytest.approx(lp[t.id], abs=1e-6)
        top = np.argsort(-lp)[:4]
        assert [i for i, _ in t.top_logprobs] == top.tolist()
        np.testing.assert_allclose([v for _, v in t.top_logprobs], lp[top], rtol=0, atol=1e-6)
        if options["temperature"] == 0:
            assert t.id == int(np.argmax(lp))
        logits = s.feed([t.id])
    if options["temperature"]:
        assert any(t.id != t.top_logprobs[0][0] for t in c.tokens)  # it did sample below the top
    plain = model.complete(prompt, max_tokens=8, **options)
    assert [t.id for t in plain.tokens] == [t.id for t in c.tokens]
    assert all(t.logprob is None and t.top_logprobs is None for t in plain.tokens)


# ---- score ---------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny", "llama-fixture", "qwen3-fixture"])
def test_score_is_log_softmax_of_the_session_logits(model, fixture_model, which):
    """score(text): the tokens of text (no BOS) and the log-probability of each, the first
    conditioned on BOS, or on EOS for a vocabulary without BOS (the qwen3 fixture)."""
    m = model if which == "tiny" else fixture_model(which.split("-")[0])
    text = "The cat sat on the mat, then it ran."
    ids, lp = m.score(text)
    assert ids == m.tokenize(text, add_bos=False)
    start = m.tokenizer.bos_id if m.tokenizer.bos_id is not None else m.tokenizer.eos_id
    assert start == {"tiny": 0, "llama-fixture": 1, "qwen3-fixture": 2}[which]
    logits = m.session().feed([start] + ids[:-1], all_logits=True)
    ref = log_softmax(logits)[np.arange(len(ids)), ids]
    assert lp.dtype == np.float32 and lp.shape == (len(ids),)
    np.testing.assert_allclose(lp, ref, rtol=1e-6, atol=1e-6)


# ---- embed ---------------------------------------------------------------------------------

def test_embed_is_the_normalised_mean_of_the_hidden_states(model):
    texts = ["A cat sits on a mat.", "x", "Quarterly revenue rose 4%."]
    e = model.embed(texts)
    assert e.shape == (3, model.config.n_embd) and e.dtype == np.float32
    out_w = naive._w(model.file, "output.weight")
    for text, row in zip(texts, e):
        ids = model.tokenize(text)
        hidden = model.forward(ids, 0, model.new_cache(), output="hidden").astype(np.float64)
        # the hidden states are the final ones after the output norm: the naive forward
        # pass's logits are their product with the output head
        ref_logits = naive.forward(model.file, ids)
        assert np.abs(hidden @ out_w.T - ref_logits).max() <= 2e-4 * np.abs(ref_logits).max()
        v = hidden.mean(0)
        np.testing.assert_allclose(row, v / np.linalg.norm(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.embed(texts[2])[0], e[2])  # one text alone is the same
    with pytest.raises(ValueError, match="text 1 is empty"):
        model.embed(["ok", ""])


# ---- perplexity ----------------------------------------------------------------------------

PPL_TEXT = "The cat sat on the mat. The dog lay on the rug; a bird sang in the tree. " * 2


def llama_perplexity(m, ids, ctx):
    """Perplexity as llama.cpp's llama-perplexity computes it: windows of ctx tokens (the
    tail that does not fill one is dropped), each window's first token replaced by BOS when
    the vocabulary adds one, first = ctx // 2, and the logits at positions first..ctx-2
    scoring the tokens at first+1..ctx-1 (ctx - 1 - first tokens per window:
    `process_logits(..., logits + first * n_vocab, tokens + start + first, n_ctx - 1 - first)`)."""
    first, nll = ctx // 2, []
    for c in range(len(ids) // ctx):
        window = list(ids[c * ctx:(c + 1) * ctx])
        if m.tokenizer.add_bos:
            window[0] = m.tokenizer.bos_id
        lp = log_softmax(m.session().feed(window, all_logits=True))
        nll += [-lp[j, window[j + 1]] for j in range(first, ctx - 1)]
    return float(np.exp(np.mean(nll)))


@pytest.mark.parametrize("ctx", [14, 15])
@pytest.mark.parametrize("which", ["tiny", "llama-fixture"])
def test_perplexity_is_llama_perplexity(model, fixture_model, which, ctx):
    m = model if which == "tiny" else fixture_model("llama")
    ids = m.tokenize(PPL_TEXT)
    assert len(ids) // ctx >= 2 and len(ids) % ctx  # several windows and a dropped tail
    assert m.perplexity(PPL_TEXT, ctx=ctx) == pytest.approx(llama_perplexity(m, ids, ctx), rel=1e-6)


@pytest.mark.parametrize("which", ["tiny", "llama-fixture"])
def test_perplexity_windows(model, fixture_model, which, monkeypatch):
    """The window rules, whatever the tokens scored in each: the tail that does not fill a
    window is ignored; with a vocabulary that adds BOS (the llama fixture) every window
    starts with BOS, so the token the text has there does not matter; without (the tiny
    model) it does."""
    m = model if which == "tiny" else fixture_model("llama")
    ctx = 10
    rng = np.random.default_rng(8)
    ids = [int(i) for i in rng.integers(3, 250, 2 * ctx + 4)]
    if m.tokenizer.add_bos:
        ids[0] = m.tokenizer.bos_id

    def ppl(tokens):
        monkeypatch.setattr(m, "tokenize", lambda text, **kw: list(tokens))
        return m.perplexity("the text", ctx=ctx)

    base = ppl(ids)
    assert ppl(ids[:2 * ctx]) == base
    assert ppl(ids[:2 * ctx] + [7, 8, 9]) == base
    assert ppl(ids[:-2]) == base
    other = ids[:ctx] + [ids[ctx] + 1] + ids[ctx + 1:]   # the second window's first token
    if m.tokenizer.add_bos:
        assert ppl(other) == base
    else:
        assert ppl(other) != base
    last = ids[:2 * ctx - 1] + [ids[2 * ctx - 1] + 1] + ids[2 * ctx:]   # scored in window 2
    assert ppl(last) != base


def test_perplexity_errors(model):
    for ctx in (2, 1, 0, model.config.n_ctx + 1, 8.0, "8", True):
        with pytest.raises(ValueError, match="ctx must be an integer from 3"):
            model.perplexity(PPL_TEXT, ctx=ctx)
    n = len(model.tokenize("abcdefgh"))
    with pytest.raises(ValueError, match=f"the text is {n} tokens, shorter than one window of ctx={n + 1}"):
        model.perplexity("abcdefgh", ctx=n + 1)


# ---- stop strings at the length limit (the chain model) -------------------------------------

STOP_CASES = [
    # stops, max_tokens, text, finish reason, tokens generated, streamed pieces
    (["abcd", "bc"], 20, "a", "stop", 3, ["a"]),            # overlapping: "bc" completes first
    (["cd", "abcd"], 20, "", "stop", 4, []),               # both complete at "d": the earlier start wins
    (["x€y", "€"], 20, "abcdéx", "stop", 10, ["a", "b", "c", "d", "é", "x"]),  # held "x" released by "€"
    (["bc"], 2, "ab", "length", 2, ["a", "b"]),             # cut by max_tokens: the held "b" comes out
    (["abcd", "bc"], 2, "ab", "length", 2, ["ab"]),         # everything held until the limit
    (["cd"], 4, "ab", "stop", 4, ["a", "b"]),               # completes exactly at max_tokens
    (["dé"], 6, "abc", "stop", 6, ["a", "b", "c"]),         # multi-byte, completes exactly at max_tokens
    (["dé"], 5, "abcd\ufffd", "length", 5, ["a", "b", "c", "d\ufffd"]),  # cut inside é: half a character
    (["x€"], 7, "abcdéx", "length", 7, ["a", "b", "c", "d", "é", "x"]),
    (["x€"], 8, "abcdéx\ufffd", "length", 8, ["a", "b", "c", "d", "é", "x\ufffd"]),
    (["x€"], 20, "abcdé", "stop", 10, ["a", "b", "c", "d", "é"]),
    (["zq"], 20, CHAIN, "stop", 12, list("abcdéx€yz")),     # EOS releases the held "z"
    ([], 12, CHAIN, "length", 12, list("abcdéx€yz")),       # the last token at max_tokens, no EOS
]


@pytest.mark.parametrize("stops,max_tokens,text,reason,n_tokens,pieces", STOP_CASES)
def test_stop_strings_and_length_limit(chain, stops, max_tokens, text, reason, n_tokens, pieces):
    c = chain.complete(Q, max_tokens=max_tokens, stop=stops, temperature=0)
    assert (c.text, c.finish_reason, len(c.tokens)) == (text, reason, n_tokens)
    assert [t.id for t in c.tokens] == CHAIN_IDS[:n_tokens]
    assert chain.generate(Q, max_tokens=max_tokens, stop=stops, temperature=0) == text
    assert list(chain.generate(Q, max_tokens=max_tokens, stop=stops, temperature=0, stream=True)) == pieces
    if reason == "length":  # nothing was cut: the text is the decoded tokens
        assert text == chain.detokenize(CHAIN_IDS[:n_tokens])


def test_a_single_stop_string_and_text_prompts(chain):
    """`stop` as one string, and a text prompt (tokenized, specials allowed)."""
    assert chain.generate("q", stop="é", temperature=0, max_tokens=20) == "abcd"
    assert chain.complete("q", max_tokens=3, temperature=0).prompt_tokens == 1


# ---- the context limit ---------------------------------------------------------------------

@pytest.mark.parametrize("ctx", [2, 4, 5, 6])
def test_generation_stops_at_the_session_context(chain, ctx):
    """A session of ctx positions fed a 1-token prompt: tokens are drawn until the cache is
    full (the last one drawn is never fed), finish reason "length", and the text is that of
    the ctx tokens (a character cut by the limit comes out as U+FFFD)."""
    s = chain.session(ctx=ctx)
    c = complete_on_session(s, Q, max_tokens=50)
    assert c.finish_reason == "length" and len(c.tokens) == ctx
    assert [t.id for t in c.tokens] == CHAIN_IDS[:ctx]
    assert c.text == CHAIN.encode()[:ctx].decode("utf-8", errors="replace")
    assert s.pos == ctx and s.tokens == Q + CHAIN_IDS[:ctx - 1]


def test_fit_prompt_boundaries():
    ids = list(range(10))
    assert fit_prompt(ids, 14, 4, False) is ids          # exactly fits: 10 + 4 = 14
    assert fit_prompt(ids, 14, 4, True) is ids
    assert fit_prompt(ids, 15, 4, False) is ids
    with pytest.raises(ContextOverflowError, match=r"the prompt is 10 tokens and max_tokens is 5, but the context "
                                                    r"holds 14 tokens.*keep only the last 9 prompt tokens"):
        fit_prompt(ids, 14, 5, False)                     # one over
    assert fit_prompt(ids, 14, 5, True) == ids[1:]
    assert fit_prompt(ids, 11, 10, True) == [9]           # room for one prompt token
    for max_tokens in (11, 12):                           # no room for any prompt token
        with pytest.raises(ContextOverflowError, match="keep only the last 0 prompt tokens"):
            fit_prompt(ids, 11, max_tokens, True)
    assert issubclass(ContextOverflowError, ValueError)


def test_prompt_fitting_through_the_api(model):
    """complete(ctx=..., max_tokens=...): a prompt that exactly fits runs, one token more is
    refused unless truncate=True, which keeps the prompt's tail (the same result as giving the
    tail); on a session that already holds tokens, the room left is what counts."""
    ids = model.tokenize("Hello there, how are you doing today?")
    n = len(ids)
    c = model.complete(ids, ctx=n + 5, max_tokens=5, temperature=0)
    assert c.prompt_tokens == n and len(c.tokens) == 5 and c.finish_reason == "length"
    with pytest.raises(ContextOverflowError, match=f"the prompt is {n} tokens and max_tokens is 6"):
        model.complete(ids, ctx=n + 5, max_tokens=6)
    cut = model.complete(ids, ctx=n + 5, max_tokens=6, truncate=True, temperature=0)
    tail = model.complete(ids[1:], max_tokens=6, temperature=0)
    assert cut.prompt_tokens == n - 1
    assert [t.id for t in cut.tokens] == [t.id for t in tail.tokens] and cut.text == tail.text
    s = model.session(ctx=20)
    s.feed(ids[:8])
    assert model.complete(ids[8:15], session=s, max_tokens=5, temperature=0).prompt_tokens == 7  # 8 + 7 + 5 = 20
    s.truncate(8)
    with pytest.raises(ContextOverflowError, match="the prompt is 8 tokens and max_tokens is 5, but the context "
                                                   "holds 12 tokens"):
        model.complete(ids[8:16], session=s, max_tokens=5)
    assert s.pos == 8  # refused before anything was fed
    c = model.complete(ids[8:16], session=s, max_tokens=5, truncate=True, temperature=0)
    assert c.prompt_tokens == 7 and s.tokens[:8] == ids[:8] and s.tokens[8:15] == ids[9:16]


# ---- streaming, chat and ChatSession ---------------------------------------------------------

@pytest.mark.parametrize("options", [dict(temperature=0, max_tokens=12), dict(temperature=0, max_tokens=12, stop=["e", "th"]),
                                     dict(temperature=0.8, seed=3, max_tokens=16, stop="a")],
                         ids=["greedy", "stops", "sampled"])
def test_stream_equals_generate(model, options):
    prompt = "Once upon a time"
    text = model.generate(prompt, **options)
    pieces = list(model.generate(prompt, stream=True, **options))
    assert "".join(pieces) == text and all(pieces)
    assert model.complete(prompt, **options).text == text


def test_chat_is_generation_on_the_rendered_conversation(model):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = model.tokenize(render(messages), special=True)
    assert ids.count(1) == 3 and ids.count(2) == 2  # the template's specials are tokens
    want = model.complete(ids, temperature=0, max_tokens=10).text
    assert model.chat(messages, temperature=0, max_tokens=10) == want
    assert "".join(model.chat(messages, temperature=0, max_tokens=10, stream=True)) == want


def test_chat_session_feeds_only_the_new_turn(model):
    """Turn 2 re-renders the conversation and feeds only the tokens after the longest prefix
    already in the cache; the cache then holds exactly the conversation's tokens, and the
    reply equals a fresh chat over the whole conversation."""
    opts = dict(temperature=0, max_tokens=6)
    conv = model.chat_session(**opts)
    r1 = conv.send("Hi")
    p1 = model.tokenize(render([{"role": "user", "content": "Hi"}]), special=True)
    c1 = model.complete(p1, **opts)
    assert r1 == c1.text
    ids1 = [t.id for t in c1.tokens]
    # the last token drawn is fed only when generation goes on (never at max_tokens or at EOS)
    assert conv.session.tokens == p1 + (ids1[:-1] if c1.finish_reason == "length" else ids1)
    held = conv.session.tokens

    fed = []
    real_feed = conv.session.feed
    conv.session.feed = lambda ids, *a, **k: (fed.append([int(i) for i in ids]), real_feed(ids, *a, **k))[1]
    r2 = conv.send("Tell me more")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": r1},
                {"role": "user", "content": "Tell me more"}]
    assert conv.messages == messages + [{"role": "assistant", "content": r2}]
    p2 = model.tokenize(render(messages), special=True)
    common = 0
    while common < min(len(held), len(p2) - 1) and held[common] == p2[common]:
        common += 1
    assert common >= len(p1)  # the first turn's prompt stays in the cache
    assert fed[0] == p2[common:]  # one feed of the new tokens, then one per generated token
    c2 = model.complete(p2, **opts)
    ids2 = [t.id for t in c2.tokens]
    assert r2 == c2.text == model.chat(messages[:3], **opts)
    n_fed2 = len(ids2) - 1 if c2.finish_reason == "length" else len(ids2)
    assert fed[1:] == [[t] for t in ids2[:n_fed2]]
    assert conv.session.pos == len(p2) + n_fed2 and conv.session.tokens == p2 + ids2[:n_fed2]
    # the kept cache gives the logits a fresh session gives
    fresh = model.session()
    fresh.feed(conv.session.tokens)
    np.testing.assert_allclose(real_feed([5]), fresh.feed([5]), rtol=1e-5, atol=1e-5)

    conv.reset()
    assert conv.session.pos == 0 and conv.messages == []
    assert conv.send("Hi") == r1


def test_chat_session_system_prompt_and_stream(model):
    opts = dict(temperature=0, max_tokens=5)
    conv = model.chat_session(system="Be brief.", **opts)
    pieces = list(conv.send("Hi", stream=True))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert "".join(pieces) == model.chat(messages, **opts)
    assert conv.messages == messages + [{"role": "assistant", "content": "".join(pieces)}]
    with pytest.raises(ValueError, match="non-empty string"):
        conv.send("")


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing(model, monkeypatch):
    """Megabytes of text that cannot fit the context whatever its tokens are refused at once,
    without running the tokenizer (which takes seconds on them); truncate=True still
    tokenizes and keeps the tail."""
    text = "word " * 200_000
    calls = []
    real = model.tokenize
    monkeypatch.setattr(model, "tokenize", lambda *a, **k: calls.append(1) or real(*a, **k))
    with pytest.raises(npllama.ContextOverflowError, match="at least .* tokens, but only"):
        model.complete(text, max_tokens=4)
    with pytest.raises(npllama.ContextOverflowError, match="at least .* tokens, but only"):
        npllama.complete_many(model, [text], max_tokens=4)
    assert calls == []
    long = "word " * 2000  # past the context too, but kept to its tail
    c = model.complete(long, max_tokens=4, temperature=0, truncate=True)
    assert calls and c.prompt_tokens == model.config.n_ctx - 4
