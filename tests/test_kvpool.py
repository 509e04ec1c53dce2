"""The paged KV pool: in-place scatters, page tables, free-list reuse, exhaustion, copy on write
and the prefix cache."""
import numpy as np
import pytest

from npllama.cache.kvpool import KVPool, PoolExhaustedError, PoolSeq

L, KVH, D, PS = 2, 3, 8, 4


def rows(rng, n):
    return [(rng.standard_normal((n, KVH, D), dtype=np.float32),
             rng.standard_normal((n, KVH, D), dtype=np.float32)) for _ in range(L)]


def make(n_pages=8, dtype=np.float32):
    return KVPool(L, KVH, D, n_pages, page_size=PS, dtype=dtype)


def test_layout_and_sizes():
    pool = make(5)
    assert pool.buffer(0).shape == (5, PS, KVH, 2, D) and pool.buffer(0).dtype == np.float32
    assert pool.nbytes == L * 5 * PS * KVH * 2 * D * 4
    assert pool.bytes_per_token == L * KVH * 2 * D * 4
    half = make(5, np.float16)
    assert half.nbytes * 2 == pool.nbytes and half.bytes_per_token * 2 == pool.bytes_per_token
    with pytest.raises(ValueError, match="float32 or float16"):
        make(5, np.float64)
    with pytest.raises(ValueError, match="n_pages"):
        KVPool(L, KVH, D, 0)


def test_write_scatters_into_the_pool_buffer_in_place():
    pool, rng = make(), np.random.default_rng(0)
    seq = pool.new_seq()
    kv = rows(rng, 6)
    (slots,) = pool.reserve([seq], [6])
    buf_before = pool.buffer(1)
    for li, (k, v) in enumerate(kv):
        pool.write(li, slots, k, v)
    pool.commit(seq, range(6))
    assert pool.buffer(1) is buf_before  # the same memory, not a replaced array
    for p in range(6):
        page, row = seq.slot(p)
        assert (page, row) == (seq.pages[p // PS], p % PS)
        np.testing.assert_array_equal(pool.buffer(1)[page, row, :, 0], kv[1][0][p])
        np.testing.assert_array_equal(pool.buffer(1)[page, row, :, 1], kv[1][1][p])
    # the seed's mistake: an indexed read is a gathered copy, so writing into it misses the pool
    flat = pool.buffer(0).reshape(-1, KVH, 2, D)
    assert np.shares_memory(flat, pool.buffer(0))
    gathered = flat[slots]
    gathered[:] = 123.0
    assert not (pool.buffer(0) == 123.0).any()


def test_positions_follow_the_page_table_across_pages():
    pool, rng = make(), np.random.default_rng(1)
    seq = pool.new_seq()
    parts = [rows(rng, n) for n in (3, 1, 5, 2)]
    for part in parts:
        pool.append(seq, part, range(len(part[0][0])))
    assert seq.length == seq.pos == 11 == len(seq.tokens)
    assert len(seq.pages) == 3 and seq.page_table.dtype == np.int32
    for li in range(L):
        k, v = pool.gather(seq, li)
        np.testing.assert_array_equal(k, np.concatenate([p[li][0] for p in parts]))
        np.testing.assert_array_equal(v, np.concatenate([p[li][1] for p in parts]))


def test_freed_pages_are_reused():
    pool, rng = make(4), np.random.default_rng(2)
    a = pool.new_seq()
    pool.append(a, rows(rng, 2 * PS), range(2 * PS))
    held = list(a.pages)
    assert pool.n_free == 2 and all(pool.refcount(p) == 1 for p in held)
    pool.free(a)
    assert pool.n_free == 4 and all(pool.refcount(p) == 0 for p in held)
    with pytest.raises(ValueError, match="freed"):
        pool.reserve([a], [1])
    b = pool.new_seq()
    pool.append(b, rows(rng, 4 * PS), range(4 * PS))  # the whole pool: needs the freed pages back
    assert sorted(b.pages) == [0, 1, 2, 3] and pool.n_free == 0


def test_exhaustion_is_a_clear_error_and_changes_nothing():
    pool, rng = make(3), np.random.default_rng(3)
    a, b = pool.new_seq(), pool.new_seq()
    pool.append(a, rows(rng, 5), range(5))  # 2 pages
    snapshot = [buf.copy() for buf in pool.buffers()]
    with pytest.raises(PoolExhaustedError, match=r"needs 3 pages but only 1 are free") as e:
        pool.reserve([a, b], [4, 6])  # a needs 1 more page, b needs 2
    assert isinstance(e.value, RuntimeError) and (e.value.needed, e.value.free) == (3, 1)
    assert pool.n_free == 1 and a.length == 5 and len(a.pages) == 2 and b.pages == []
    for buf, old in zip(pool.buffers(), snapshot):
        np.testing.assert_array_equal(buf, old)
    pool.reserve([a, b], [4, 0])  # what fits still works


def test_fork_shares_pages_and_copies_on_write():
    pool, rng = make(8), np.random.default_rng(4)
    a = pool.new_seq()
    prefix = rows(rng, PS + 2)  # one full page and a partial one
    pool.append(a, prefix, range(PS + 2))
    b = pool.fork(a)
    assert b.pages == a.pages and all(pool.refcount(p) == 2 for p in a.pages)
    assert b.tokens == a.tokens and b.length == a.length
    full, partial = a.pages
    snapshot = [pool.buffer(li)[[full, partial]].copy() for li in range(L)]
    ka, kb = rows(rng, 3), rows(rng, 3)
    pool.append(a, ka, [1, 1, 1])
    pool.append(b, kb, [2, 2, 2])
    # the full shared page is still shared and unchanged; the partial one was copied first
    assert a.pages[0] == b.pages[0] == full and pool.refcount(full) == 2
    assert a.pages[1] != b.pages[1]
    assert pool.refcount(a.pages[1]) == 1 and pool.refcount(b.pages[1]) == 1
    for li in range(L):
        np.testing.assert_array_equal(pool.buffer(li)[full], snapshot[li][0])
        ga, gb = pool.gather(a, li), pool.gather(b, li)
        for x, y, ref in ((ga, gb, prefix[li]),):
            np.testing.assert_array_equal(x[0][:PS + 2], ref[0])
            np.testing.assert_array_equal(y[0][:PS + 2], ref[0])
        np.testing.assert_array_equal(ga[0][PS + 2:], ka[li][0])
        np.testing.assert_array_equal(gb[0][PS + 2:], kb[li][0])
        assert not np.array_equal(ga[0][PS + 2:], gb[0][PS + 2:])
    assert a.tokens[-3:] == [1, 1, 1] and b.tokens[-3:] == [2, 2, 2]
    pool.free(a)
    assert pool.refcount(full) == 1
    pool.free(b)
    assert pool.n_free == 8


def test_truncate_releases_pages():
    pool, rng = make(8), np.random.default_rng(5)
    s = pool.new_seq()
    pool.append(s, rows(rng, 3 * PS), range(3 * PS))
    pool.truncate(s, PS + 1)
    assert s.length == PS + 1 and len(s.pages) == 2 and pool.n_free == 6
    with pytest.raises(ValueError, match="truncate"):
        pool.truncate(s, PS + 2)


def test_bad_batches_are_rejected():
    pool, other = make(), make()
    s = pool.new_seq()
    with pytest.raises(ValueError, match="twice"):
        pool.reserve([s, s], [1, 1])
    with pytest.raises(ValueError, match="not a sequence of this pool"):
        pool.reserve([other.new_seq()], [1])
    with pytest.raises(ValueError, match="reserve first"):
        pool.commit(s, [1])


def test_float16_pool_stores_rounded_values():
    pool, rng = make(4, np.float16), np.random.default_rng(6)
    s = pool.new_seq()
    kv = rows(rng, 5)
    pool.append(s, kv, range(5))
    k, _ = pool.gather(s, 0)
    assert k.dtype == np.float16
    np.testing.assert_array_equal(k, kv[0][0].astype(np.float16))


def test_prefix_cache_shares_full_pages():
    pool, rng = make(10), np.random.default_rng(7)
    toks = list(range(100, 100 + 2 * PS + 3))
    a = pool.new_seq()
    pool.append(a, rows(rng, len(toks)), toks)
    assert pool.prefix.publish(a) == 2  # only full pages
    b = pool.new_seq()
    assert pool.prefix.attach(b, toks[:2 * PS] + [7, 8]) == 2 * PS
    assert b.pages == a.pages[:2] and b.tokens == toks[:2 * PS]
    assert all(pool.refcount(p) == 3 for p in b.pages)  # a, b and the cache
    c = pool.new_seq()  # at least one token is left to compute
    assert pool.prefix.attach(c, toks[:2 * PS]) == PS
    d = pool.new_seq()
    assert pool.prefix.attach(d, [1] + toks[1:]) == 0  # a different first page matches nothing
    for s in (a, b, c, d):
        pool.free(s)
    assert pool.n_free == 8 and pool.prefix.n_evictable == 2 and pool.n_available == 10


def test_prefix_cache_is_evicted_when_pages_run_out():
    pool, rng = make(4), np.random.default_rng(8)
    a = pool.new_seq()
    pool.append(a, rows(rng, 2 * PS), range(2 * PS))
    pool.prefix.publish(a)
    pool.free(a)
    assert pool.n_free == 2 and len(pool.prefix) == 2
    b = pool.new_seq()
    pool.append(b, rows(rng, 3 * PS), range(50, 50 + 3 * PS))  # needs one cached page back
    assert len(pool.prefix) == 1 and pool.n_free == 0
    c = pool.new_seq()  # the remaining cached page is still usable
    assert pool.prefix.attach(c, list(range(PS)) + [9]) == PS
    assert isinstance(c, PoolSeq)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_write_records_kernel_against_numpy(dtype):
    """paged_attention.write_records (the pool's write): the NumPy scatter's results, float16
    rounded as astype (ties, overflow to inf, NaN, subnormals), for one token and several,
    odd head counts and sizes, strided k and v, in any slot order."""
    from npllama.kernels.paged_attention import write_records
    rng = np.random.default_rng(9)
    for n, KVH_, D_, T in ((7, 1, 5, 1), (40, 3, 64, 16), (9, 2, 33, 9)):
        kv, ref = np.zeros((n, KVH_, 2, D_), dtype), np.zeros((n, KVH_, 2, D_), dtype)
        both = rng.normal(size=(T, 2 * KVH_ * D_ + 3)).astype(np.float32) * 100
        both[0, 3:7] = [65520.0, np.nan, 2.0 ** -25 * 3, 1 + 2.0 ** -11]  # inf, NaN, subnormal, a tie (in k)
        k = both[:, 3:3 + KVH_ * D_].reshape(T, KVH_, D_)  # strided views
        v = both[:, 3 + KVH_ * D_:].reshape(T, KVH_, D_)[:, :, ::-1]
        slots = rng.choice(n, T, replace=False)
        write_records(kv, slots, k, v)
        with np.errstate(over="ignore"):  # 65520 rounds to inf in float16
            ref[slots, :, 0, :] = k
            ref[slots, :, 1, :] = v
        np.testing.assert_array_equal(kv.view(np.uint8), ref.view(np.uint8))
    with pytest.raises(ValueError, match="k and v must be"):
        write_records(kv, slots, k[:, :1], v[:, :1])
    with pytest.raises(ValueError, match="slots must be"):
        write_records(kv, np.full(T, n), k, v)
