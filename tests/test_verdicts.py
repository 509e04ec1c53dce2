"""A model file's vocabulary checked once: later opens of the unchanged file skip the checks
that read the whole vocabulary (gguf/verdicts.py), and anything changed checks again."""
import json
import os

import pytest

import npllama
from npllama.gguf import verdicts
from npllama.gguf.reader import GGUFFile
from npllama.text import tokenizer
from tinygguf import write_tiny_llama


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "checks.json"


def _open(path, monkeypatch, checks: bool):
    """A model of `path`; `checks`: whether its open must run the whole-vocabulary checks."""
    calls = []
    index, pairs = tokenizer._vocab_index, tokenizer._merge_pairs
    monkeypatch.setattr(tokenizer, "_vocab_index", lambda *a: (calls.append(1), index(*a))[1])
    monkeypatch.setattr(tokenizer, "_merge_pairs", lambda *a: (calls.append(1), pairs(*a))[1])
    m = npllama.Model(path)
    monkeypatch.setattr(tokenizer, "_vocab_index", index)
    monkeypatch.setattr(tokenizer, "_merge_pairs", pairs)
    assert bool(calls) == checks
    return m


def test_checked_once_then_believed(tmp_path, cache, monkeypatch):
    """The first open checks and records the pass; the next believes it, and its tokenizer
    (built from the vocabulary then) is the same: ids, end-of-turn ids, text."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    first = _open(path, monkeypatch, checks=True)
    assert len(json.loads(cache.read_text())) == 1
    second = _open(path, monkeypatch, checks=False)
    text = "the quick brown fox"
    assert second.tokenize(text) == first.tokenize(text)
    assert second.tokenizer.eot_ids == first.tokenizer.eot_ids
    assert second.detokenize(second.tokenize(text)) == first.detokenize(first.tokenize(text))


def test_a_changed_file_or_check_is_checked_again(tmp_path, cache, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf")
    _open(path, monkeypatch, checks=True)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _open(path, monkeypatch, checks=True)
    _open(path, monkeypatch, checks=False)
    monkeypatch.setattr(tokenizer, "CHECK_VERSION", "another version")
    _open(path, monkeypatch, checks=True)


def test_a_failed_check_is_not_recorded(tmp_path, cache, monkeypatch):
    path = write_tiny_llama(tmp_path / "m.gguf", merges=["Ġ t", "zz qq"])
    for _ in range(2):
        with pytest.raises(npllama.GGUFError, match="m.gguf.*merge"):
            npllama.Model(path)
    assert not cache.exists()


@pytest.mark.parametrize("record", ["not json", "[1, 2]", None])
def test_a_foreign_or_unwritable_record_means_checking(tmp_path, cache, monkeypatch, record):
    """A file of the record's name that is not a record is left as it is (it may be somebody
    else's), and a cache that cannot be written records nothing: every open checks."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    if record is None:  # a file where a folder of the cache's path would be
        (tmp_path / "blocker").write_text("not a directory")
        monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "blocker" / "cache"))
    else:
        cache.parent.mkdir(parents=True)
        cache.write_text(record)
    _open(path, monkeypatch, checks=True)
    _open(path, monkeypatch, checks=True)
    if record is not None:
        assert cache.read_text() == record


def test_the_latest_passes_are_kept(tmp_path, cache, monkeypatch):
    monkeypatch.setattr(verdicts, "KEEP", 3)
    files = [GGUFFile(write_tiny_llama(tmp_path / f"m{i}.gguf")) for i in range(4)]
    for f in files[:3]:
        verdicts.record("vocabulary", "v", f)
    verdicts.record("vocabulary", "v", files[0])  # passed again: now the latest
    verdicts.record("vocabulary", "v", files[3])  # the oldest (files[1]) goes
    assert [verdicts.passed("vocabulary", "v", f) for f in files] == [True, False, True, True]


def test_a_pass_is_the_file_as_opened(tmp_path, cache):
    """A pass is of the file as it was opened: a file changed after it was opened, and then
    checked, is recorded as it was; opening it again finds it changed."""
    path = write_tiny_llama(tmp_path / "m.gguf")
    opened = GGUFFile(path)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    verdicts.record("vocabulary", "v", opened)
    assert verdicts.passed("vocabulary", "v", opened)
    assert not verdicts.passed("vocabulary", "v", GGUFFile(path))
