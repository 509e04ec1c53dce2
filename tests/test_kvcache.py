import numpy as np
import pytest

from npllama.cache.kvcache import _SPARES, KVCache

KVH, D = 3, 8


def rows(rng, n, kvh=KVH, d=D):
    """Random (n, kvh, d) float32 keys and values."""
    return rng.standard_normal((n, kvh, d), dtype=np.float32), rng.standard_normal((n, kvh, d), dtype=np.float32)


def fill(cache, k, v):
    """Append the same k, v to every layer."""
    for layer in range(cache.n_layers):
        cache.append(layer, k, v)


def test_growth_by_doubling_from_zero():
    c = KVCache(2, KVH, D)
    assert (c.length, c.capacity) == (0, 0)
    rng = np.random.default_rng(0)
    for want in (1, 2, 4, 4, 8):
        fill(c, *rows(rng, 1))
        assert c.capacity == want
    assert c.length == 5
    assert c.buffer(0).shape == (8, KVH, 2, D)
    assert c.nbytes == 2 * 8 * KVH * 2 * D * 4


def test_growth_jumps_to_next_power_of_two():
    c = KVCache(1, KVH, D)
    c.append(0, *rows(np.random.default_rng(0), 5))
    assert c.capacity == 8
    c.ensure_capacity(100)
    assert c.capacity == 128
    c.ensure_capacity(3)  # never shrinks
    assert c.capacity == 128


def test_appends_keep_content():
    rng = np.random.default_rng(1)
    c = KVCache(3, KVH, D)
    ks, vs = [], []
    for n in (3, 1, 1, 10):
        k, v = rows(rng, n)
        fill(c, k, v)
        ks.append(k)
        vs.append(v)
        assert c.length == sum(len(x) for x in ks)
    want_k, want_v = np.concatenate(ks), np.concatenate(vs)
    for layer in range(3):
        k, v = c.get(layer)
        assert k.shape == v.shape == (15, KVH, D)
        np.testing.assert_array_equal(k, want_k)
        np.testing.assert_array_equal(v, want_v)
        buf = c.buffer(layer)
        assert np.shares_memory(k, buf) and np.shares_memory(v, buf)  # zero-copy views
        np.testing.assert_array_equal(buf[:15, :, 0], want_k)  # interleaved layout
        np.testing.assert_array_equal(buf[:15, :, 1], want_v)


def test_transposed_multi_token_append():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((KVH, D, 6), dtype=np.float32)
    k = np.ascontiguousarray(x).transpose(2, 0, 1)  # (6, KVH, D), odd strides
    v = (2 * x)[:, :, ::-1].transpose(2, 0, 1)
    assert not k.flags.c_contiguous and not v.flags.c_contiguous
    c = KVCache(1, KVH, D)
    assert c.append(0, k, v) == 6
    got_k, got_v = c.get(0)
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, v)


def test_single_token_decode_and_float64_input():
    c = KVCache(1, KVH, D, capacity=4)
    k = np.arange(KVH * D, dtype=np.float64).reshape(1, KVH, D)
    c.append(0, k, -k)
    got_k, got_v = c.get(0)
    assert got_k.dtype == np.float32
    np.testing.assert_array_equal(got_k, k)
    np.testing.assert_array_equal(got_v, -k)


def test_append_writes_in_place_without_growth():
    rng = np.random.default_rng(3)
    c = KVCache(1, KVH, D, capacity=16)
    k0, v0 = rows(rng, 4)
    c.append(0, k0, v0)
    buf = c.buffer(0)
    whole = c.buffers()
    old_k, _ = c.get(0)
    snapshot = buf.copy()
    c.append(0, *rows(rng, 3))
    assert c.buffers() is whole  # no reallocation
    np.testing.assert_array_equal(old_k, k0)  # an earlier view still sees the same rows
    np.testing.assert_array_equal(buf[:4], snapshot[:4])  # old rows untouched
    np.testing.assert_array_equal(buf[7:], snapshot[7:])  # rows past the end untouched


def test_layer_lengths_during_a_forward_pass():
    rng = np.random.default_rng(4)
    c = KVCache(3, KVH, D)
    fill(c, *rows(rng, 2))
    c.append(0, *rows(rng, 5))
    assert (c.layer_length(0), c.layer_length(1), c.length) == (7, 2, 2)
    assert c.get(0)[0].shape[0] == 7 and c.get(2)[0].shape[0] == 2
    c.append(1, *rows(rng, 5))
    c.append(2, *rows(rng, 5))
    assert c.length == 7


def test_fork_is_independent():
    rng = np.random.default_rng(5)
    src = KVCache(2, KVH, D)
    base = rows(rng, 5)
    fill(src, *base)
    a, b = src.fork(), src.fork()
    for layer in range(2):
        for f in (a, b):
            assert not np.shares_memory(f.buffer(layer), src.buffer(layer))
        assert not np.shares_memory(a.buffer(layer), b.buffer(layer))
    ka, kb = rows(rng, 1), rows(rng, 1)
    fill(a, *ka)
    fill(b, *kb)
    assert (src.length, a.length, b.length) == (5, 6, 6)
    for layer in range(2):
        np.testing.assert_array_equal(src.get(layer)[0], base[0])
        np.testing.assert_array_equal(a.get(layer)[0][:5], base[0])
        np.testing.assert_array_equal(a.get(layer)[0][5:], ka[0])
        np.testing.assert_array_equal(b.get(layer)[1][5:], kb[1])


def test_truncate_and_reset():
    rng = np.random.default_rng(6)
    c = KVCache(2, KVH, D)
    k, v = rows(rng, 10)
    fill(c, k, v)
    c.truncate(4)
    assert c.length == 4
    np.testing.assert_array_equal(c.get(1)[0], k[:4])
    k2, v2 = rows(rng, 2)
    fill(c, k2, v2)
    np.testing.assert_array_equal(c.get(0)[1], np.concatenate([v[:4], v2]))
    with pytest.raises(ValueError, match=r"length=6.*got 7"):
        c.truncate(7)
    with pytest.raises(ValueError, match="got -1"):
        c.truncate(-1)
    cap = c.capacity
    c.reset()
    assert (c.length, c.capacity) == (0, cap)
    assert c.get(0)[0].shape == (0, KVH, D)


@pytest.mark.parametrize("k_shape, v_shape, match", [
    ((2, KVH + 1, D), (2, KVH + 1, D), r"n_kv_heads=3.*\(2, 4, 8\)"),
    ((2, KVH, D - 1), (2, KVH, D - 1), r"head_dim=8.*\(2, 3, 7\)"),
    ((KVH, D), (KVH, D), r"\(seq, n_kv_heads"),
    ((2, KVH, D), (3, KVH, D), "k and v shapes differ"),
])
def test_append_shape_errors(k_shape, v_shape, match):
    c = KVCache(1, KVH, D)
    with pytest.raises(ValueError, match=match):
        c.append(0, np.zeros(k_shape, np.float32), np.zeros(v_shape, np.float32))
    assert c.length == 0


def test_append_dtype_and_layer_errors():
    c = KVCache(2, KVH, D)
    k = np.zeros((1, KVH, D), np.float32)
    with pytest.raises(ValueError, match="float array"):
        c.append(0, k.astype(np.int32), k)
    for bad in (2, -1, 1.0):
        with pytest.raises(ValueError, match=r"layer must be an integer in \[0, 2\)"):
            c.append(bad, k, k)
    with pytest.raises(ValueError, match="n_kv_heads"):
        KVCache(1, 0, D)
    with pytest.raises(ValueError, match="dtype"):
        KVCache(1, KVH, D, dtype=np.int8)


def test_float16_storage():
    """A float16 cache rounds what it stores to float16, grows and forks as a float32 one,
    in half the bytes."""
    rng = np.random.default_rng(7)
    c16, c32 = KVCache(2, KVH, D, dtype=np.float16), KVCache(2, KVH, D)
    for n in (3, 1, 6):  # growth 0 -> 4 -> 16 with a copy of the filled rows
        k, v = rows(rng, n)
        fill(c16, k, v[::-1])  # a reversed (negative-stride) view for v
        fill(c32, k, v[::-1])
    assert c16.capacity == c32.capacity == 16 and c16.nbytes * 2 == c32.nbytes
    k16, v16 = c16.get(1)
    k32, v32 = c32.get(1)
    assert k16.dtype == np.float16
    np.testing.assert_array_equal(k16, k32.astype(np.float16))
    np.testing.assert_array_equal(v16, v32.astype(np.float16))
    other = c16.fork()
    assert other.dtype == np.float16 and not np.shares_memory(other.buffers(), c16.buffers())
    np.testing.assert_array_equal(other.get(0)[0], c16.get(0)[0])


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def test_a_freed_cache_buffer_serves_the_next_cache_of_its_shape():
    rng = np.random.default_rng(5)
    c = KVCache(3, KVH, 16, capacity=64)
    fill(c, *rows(rng, 40, d=16))
    old = _address(c.buffers())
    del c
    c = KVCache(3, KVH, 16, capacity=64)
    assert _address(c.buffers()) == old and (c.length, c.capacity) == (0, 64)
    k, v = rows(rng, 5, d=16)
    fill(c, k, v)  # the old values beyond length are never read
    np.testing.assert_array_equal(c.get(2)[0], k)
    other = KVCache(3, KVH, 16, capacity=32)  # another shape: its own memory
    assert not np.shares_memory(other.buffers(), c.buffers())


def test_an_outgrown_buffer_is_not_kept():
    """Kept, it would add to a growing session's peak memory."""
    rng = np.random.default_rng(6)
    c = KVCache(2, KVH, 24, capacity=8)
    fill(c, *rows(rng, 8, d=24))
    fill(c, *rows(rng, 1, d=24))  # grows to 16
    assert c.capacity == 16 and _SPARES.take((2, 8, KVH, 2, 24), np.float32) is None
    f = c.fork()  # the same capacity: fresh memory, not c's
    assert not np.shares_memory(f.buffers(), c.buffers())


def test_a_buffer_with_a_view_held_is_never_reused():
    rng = np.random.default_rng(7)
    c = KVCache(2, KVH, 40, capacity=16)
    k, v = rows(rng, 10, d=40)
    fill(c, k, v)
    keys = c.get(1)[0]  # a user's zero-copy view outlives the cache
    del c
    c = KVCache(2, KVH, 40, capacity=16)
    fill(c, *rows(rng, 16, d=40))
    assert not np.shares_memory(keys, c.buffers())
    np.testing.assert_array_equal(keys, k)


def test_a_session_alive_at_exit_says_nothing(tiny_model_path):
    """A script that ends with a session in its globals, and one of its functions kept by a
    module that outlives it (a hook, a callback): at interpreter exit the script's globals
    go after npllama's modules have lost theirs, and the cache's __del__ must then keep
    quiet rather than print an ignored exception."""
    import subprocess
    import sys
    code = (f"import json, npllama\nm = npllama.Model({str(tiny_model_path)!r})\ns = m.session()\n"
            "s.feed([1, 2, 3])\njson.hook = lambda: None\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == "", r.stderr
