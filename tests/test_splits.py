"""kernels.splits: every split of a piece into two pieces, against a plain-Python scan of the
decoded strings; and the SentencePiece merges ranked from them, against the Python ranking
they replaced (one sort of every split by the whole piece's score)."""
import numpy as np
import pytest

from npllama.gguf.reader import GGUFFile, StringArray
from npllama.kernels.splits import piece_splits
from npllama.text.tokenizer import _spm_merges


def splits_reference(pieces: list[str]) -> list[tuple[int, int, int]]:
    """(whole, left, right) ids, pieces in order, then places; a repeated piece's first id."""
    index: dict[str, int] = {}
    for i, p in enumerate(pieces):
        index.setdefault(p, i)
    return [(i, index[p[:k]], index[p[k:]]) for i, p in enumerate(pieces) for k in range(1, len(p))
            if p[:k] in index and p[k:] in index]


def splits_of(pieces: list[str]) -> list[tuple[int, int, int]]:
    whole, left, right = piece_splits(*StringArray.from_strings(pieces).spans())
    assert whole.dtype == left.dtype == right.dtype == np.int64
    return list(zip(whole.tolist(), left.tolist(), right.tolist()))


def random_vocabulary(seed: int, n: int) -> list[str]:
    rng = np.random.default_rng(seed)
    alphabet = list("ab▁é日") + ["🦙"]
    out = set(alphabet)
    while len(out) < n:
        out.add("".join(rng.choice(alphabet, size=rng.integers(1, 7))))
    return sorted(out, key=lambda s: (rng.random(), s))


@pytest.mark.parametrize("pieces", [
    [],
    ["a"],
    ["abc"],
    ["a", "b", "ab", "abc", "bc", "c"],
    ["", "a", "a"],                                   # an empty piece; a repeat (its first id)
    ["é", "日本", "日", "本", "▁日本", "▁", "é日"],      # splits only between characters
    ["x" * 40] + ["x" * k for k in range(1, 40)],     # more splits than pieces: the output grows
])
def test_piece_splits(pieces):
    assert splits_of(pieces) == splits_reference(pieces)


@pytest.mark.parametrize("seed", range(3))
def test_piece_splits_random(seed):
    pieces = random_vocabulary(seed, 400)
    assert splits_of(pieces) == splits_reference(pieces)


def test_piece_splits_strided_spans():
    """Spans given by non-contiguous arrays, over bytes that are not one array's layout."""
    data = np.frombuffer("ab|a|b|abab".encode(), np.uint8)
    bounds = np.array([[0, 2], [3, 4], [5, 6], [7, 11]], np.int64)  # "ab", "a", "b", "abab"
    whole, left, right = piece_splits(data, bounds[:, 0], bounds[:, 1])
    assert list(zip(whole, left, right)) == [(0, 1, 2), (3, 0, 0)]


def test_piece_splits_refuses_what_it_cannot_read():
    data = np.zeros(8, np.uint8)
    with pytest.raises(ValueError, match="1-D uint8"):
        piece_splits(data.astype(np.int8), np.zeros(1, np.int64), np.ones(1, np.int64))
    with pytest.raises(ValueError, match="one length"):
        piece_splits(data, np.zeros(2, np.int64), np.ones(1, np.int64))
    with pytest.raises(ValueError, match="one length"):
        piece_splits(data, np.zeros(1), np.ones(1))
    for starts, ends in (([-1], [2]), ([3], [2]), ([0], [9])):
        with pytest.raises(ValueError, match="lie in the 8 bytes"):
            piece_splits(data, np.array(starts), np.array(ends))


def spm_merges_reference(pieces: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The derivation the kernel replaced: every split, sorted by the whole piece's score."""
    vocab = dict(zip(pieces, range(len(pieces))))
    ranked = [(scores[pid], piece[:k], piece[k:]) for piece, pid in vocab.items() for k in range(1, len(piece))
              if piece[:k] in vocab and piece[k:] in vocab]
    ranked.sort(key=lambda m: -m[0])
    return [(left, right) for _, left, right in ranked]


@pytest.mark.parametrize("seed", range(3))
def test_spm_merges_ranked_as_before(seed):
    """Ranked by score, ties in the pieces' order and then the split's (scores drawn from a few
    values, so that many tie), from a list of strings or from their StringArray."""
    pieces = random_vocabulary(seed, 300)
    scores = np.random.default_rng(seed).choice([-1.0, -2.5, -3.0, 0.0], size=len(pieces)).tolist()
    want = spm_merges_reference(pieces, scores)
    assert _spm_merges(pieces, scores) == want
    assert _spm_merges(pieces, scores, StringArray.from_strings(pieces)) == want


@pytest.mark.model
def test_gemma3_merges_ranked_as_before(gemma3_path):
    """Gemma 3's 262k pieces: 515k merges, the same as the Python derivation's."""
    meta = GGUFFile(gemma3_path).metadata
    pieces, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"].tolist()
    strings = pieces.tolist()
    assert _spm_merges(strings, scores, pieces) == spm_merges_reference(strings, scores)
