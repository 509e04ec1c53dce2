"""The splits of a vocabulary's pieces into two pieces of the same vocabulary: the merges that a
SentencePiece vocabulary implies (text/tokenizer.py ranks them by the whole piece's score).

A piece of n characters has n - 1 splits, each two lookups of the vocabulary. In Python that is
a loop of ~1.5M dict lookups for Gemma 3's 262k pieces (0.6-0.8 s of its tokenizer's build);
here the pieces are the file's UTF-8 bytes, found through a hash table of byte strings, and a
split falls between two characters (before a byte that does not continue a character).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .strings import check_bytes

__all__ = ["piece_splits"]


def piece_splits(data: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every split of a piece into two pieces, as int64 arrays (whole, left, right) of piece
    ids: piece i is the UTF-8 bytes data[starts[i]:ends[i]] (1-D uint8 data), and left + right
    = whole. In the order of the pieces, then of the split's place. Where two pieces are the
    same bytes (a checked vocabulary's are not), a half that is those bytes is the first."""
    check_bytes("data", data)
    starts, ends = np.asarray(starts), np.asarray(ends)
    if starts.shape != ends.shape or starts.ndim != 1 or starts.dtype.kind not in "iu" or ends.dtype.kind not in "iu":
        raise ValueError(f"starts and ends must be 1-D integer arrays of one length, got {starts.shape} "
                         f"{starts.dtype} and {ends.shape} {ends.dtype}")
    if starts.size and not (starts.min() >= 0 and (ends >= starts).all() and ends.max() <= data.size):
        raise ValueError(f"each piece must lie in the {data.size} bytes of data: 0 <= start <= end <= {data.size}")
    return _piece_splits(np.ascontiguousarray(data), np.ascontiguousarray(starts, np.int64),
                         np.ascontiguousarray(ends, np.int64))


_BASIS, _PRIME = 14695981039346656037, 1099511628211  # FNV-1a's, 64-bit


@njit(cache=True, inline="always")
def _hash(data, a, b):
    """FNV-1a of data[a:b], as an int64."""
    h = np.uint64(_BASIS)
    for i in range(a, b):
        h = (h ^ np.uint64(data[i])) * np.uint64(_PRIME)
    return np.int64(h)


@njit(cache=True)
def _find(data, slots, a, b, h):
    """The id of the piece that is the bytes data[a:b] (whose hash is h), or -1. A slot holds a
    piece's id, hash, start and end side by side, so that a probe reads one cache line of the
    table and, for a piece of the same hash, one of the bytes (Gemma 3's vocabulary takes
    ~2.1M lookups, two thirds of them hits)."""
    mask = slots.shape[0] - 1
    at = h & mask
    n = b - a
    while True:
        i = slots[at, 0]
        if i < 0:
            return -1
        if slots[at, 1] == h and slots[at, 3] - slots[at, 2] == n:
            s = slots[at, 2]
            same = True
            for k in range(n):
                if data[s + k] != data[a + k]:
                    same = False
                    break
            if same:
                return i
        at = (at + 1) & mask


@njit(cache=True)
def _piece_splits(data, starts, ends):
    n = starts.size
    size = 1
    while size < 2 * n:
        size *= 2
    slots = np.full((size, 4), -1, np.int64)  # open addressing, at most half full: (id, hash, start, end)
    mask = size - 1
    for i in range(n):
        h = _hash(data, starts[i], ends[i])
        if _find(data, slots, starts[i], ends[i], h) >= 0:
            continue  # the same bytes again: lookups find the first
        at = h & mask
        while slots[at, 0] >= 0:
            at = (at + 1) & mask
        slots[at, 0], slots[at, 1], slots[at, 2], slots[at, 3] = i, h, starts[i], ends[i]
    out = np.empty((3, max(16, n)), np.int64)
    m = 0
    for i in range(n):
        s, e = starts[i], ends[i]
        hl = np.uint64(_BASIS)  # the hash of the left half data[s:k], extended a byte at a time
        for k in range(s + 1, e):
            hl = (hl ^ np.uint64(data[k - 1])) * np.uint64(_PRIME)
            if data[k] & 0xC0 == 0x80:  # inside a character
                continue
            left = _find(data, slots, s, k, np.int64(hl))
            if left < 0:
                continue
            right = _find(data, slots, k, e, _hash(data, k, e))
            if right < 0:
                continue
            if m == out.shape[1]:
                grown = np.empty((3, 2 * m), np.int64)
                grown[:, :m] = out
                out = grown
            out[0, m], out[1, m], out[2, m] = i, left, right
            m += 1
    return out[0, :m].copy(), out[1, :m].copy(), out[2, :m].copy()
