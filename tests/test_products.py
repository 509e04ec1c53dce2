"""npllama.kernels.quants.matmul against gguf.quants.dequantize(data) @ x, for every supported type."""
import os
import subprocess
import sys
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from numba import njit
import gguf.quants

from npllama.kernels import quants
from npllama.kernels.qtypes import type_mask
from npllama.kernels.threads import using_threads
from test_quants import FLOAT_TYPES, random_blocks


def small_scale_bits(rng, shape):
    """float16 bits of scales/mins of realistic size, either sign."""
    return (rng.normal(0.0, 0.01, shape).astype(np.float16)).view(np.uint16)


def weight(qtype, rows, rng, blocks=3):
    """(rows, row_bytes) uint8 weight data of ``qtype`` with ``blocks`` blocks per row."""
    if qtype in FLOAT_TYPES:
        w = gguf.quants.quantize(rng.normal(0.0, 0.05, (rows, 8 * blocks)).astype(np.float32), qtype)
        return np.ascontiguousarray(w).view(np.uint8)
    return random_blocks(qtype, rows, blocks, rng, scale_bits=small_scale_bits)


def assert_close(y, data, qtype, x):
    """y agrees with the float64 product of gguf's dequantized W, to float32 summation error."""
    w = gguf.quants.dequantize(data, qtype).astype(np.float64)
    x64 = np.asarray(x, np.float64)
    ref = x64 @ w.T
    bound = np.abs(x64) @ np.abs(w).T  # |W| |x|: scale of the rounding error of each output
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert np.all(np.abs(y - ref) <= 3e-5 * bound + 1e-30), np.max(np.abs(y - ref) / (bound + 1e-30))


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_matmul(qtype, rows):
    rng = np.random.default_rng(rows * 100 + int(qtype))
    data = weight(qtype, rows, rng)
    n = quants.row_elems(qtype, data.shape[1])
    x = rng.normal(size=n).astype(np.float32)
    assert_close(quants.matmul(data, qtype, x), data, qtype, x)          # decode
    for s in (1, 3, 17):
        xs = rng.normal(size=(s, n)).astype(np.float32)
        assert_close(quants.matmul(data, qtype, xs), data, qtype, xs)    # prefill


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_0, QT.Q6_K], ids=lambda t: t.name)
def test_one_thread_matches_two(qtype):
    rng = np.random.default_rng(7)
    data = weight(qtype, 9, rng, blocks=5)
    x = rng.normal(size=quants.row_elems(qtype, data.shape[1])).astype(np.float32)
    with using_threads(1):
        y1 = quants.matmul(data, qtype, x)
    np.testing.assert_array_equal(y1, quants.matmul(data, qtype, x))  # rows are independent


def test_float_arrays_as_weights():
    """F32/F16 weights may come as float32/float16 arrays (as GGUFReader gives them)."""
    rng = np.random.default_rng(8)
    w = rng.normal(size=(6, 40)).astype(np.float32)
    x = rng.normal(size=(2, 40)).astype(np.float32)
    assert_close(quants.matmul(w, QT.F32, x), w, QT.F32, x)
    assert_close(quants.matmul(w.astype(np.float16), QT.F16, x[0]), w.astype(np.float16), QT.F16, x[0])


def test_non_contiguous_and_non_float32_x():
    rng = np.random.default_rng(9)
    data = weight(QT.Q4_1, 7, rng)
    n = 96
    big = rng.normal(size=(5, 3 * n)).astype(np.float32)
    x_strided = big[0, ::3]                 # 1-D, stride 3
    x_cols = big[:, ::3]                    # 2-D, strided rows
    x_t = np.ascontiguousarray(big[:, :n].T).T  # 2-D, Fortran order
    for x in (x_strided, x_cols, x_t, big[0, :n].astype(np.float64)):
        assert_close(quants.matmul(data, QT.Q4_1, x), data, QT.Q4_1, x)


def test_non_contiguous_and_read_only_weights():
    rng = np.random.default_rng(10)
    data = weight(QT.Q8_0, 10, rng)
    x = rng.normal(size=96).astype(np.float32)
    assert_close(quants.matmul(data[::2], QT.Q8_0, x), data[::2], QT.Q8_0, x)
    data.setflags(write=False)
    assert_close(quants.matmul(data, QT.Q8_0, x), data, QT.Q8_0, x)


def test_prefill_spans_several_tiles(monkeypatch):
    monkeypatch.setattr(quants, "_TILE_BYTES", 1)  # 16-row tiles: 33 rows -> 16 + 16 + 1
    rng = np.random.default_rng(11)
    for qtype in (QT.Q4_1, QT.F16):
        data = weight(qtype, 33, rng)
        x = rng.normal(size=(4, quants.row_elems(qtype, data.shape[1]))).astype(np.float32)
        assert_close(quants.matmul(data, qtype, x), data, qtype, x)


def test_out_argument():
    rng = np.random.default_rng(12)
    data = weight(QT.Q4_1, 5, rng)
    x = rng.normal(size=(3, 96)).astype(np.float32)
    out = np.full((3, 5), np.nan, np.float32)
    assert quants.matmul(data, QT.Q4_1, x, out=out) is out
    assert_close(out, data, QT.Q4_1, x)
    out1 = np.empty(5, np.float32)
    assert quants.matmul(data, QT.Q4_1, x[1], out=out1) is out1
    assert_close(out1, data, QT.Q4_1, x[1])
    for bad in (np.empty((3, 6), np.float32), np.empty((3, 5), np.float64), np.empty((5, 3), np.float32).T):
        with pytest.raises(ValueError, match=r"C-contiguous float32 array of shape \(3, 5\)"):
            quants.matmul(data, QT.Q4_1, x, out=bad)


def test_size_mismatch():
    data = weight(QT.Q4_1, 4, np.random.default_rng(13))
    with pytest.raises(ValueError, match=r"x has 95 features.*Q4_1 weight rows have 96 elements"):
        quants.matmul(data, QT.Q4_1, np.zeros(95, np.float32))
    with pytest.raises(ValueError, match=r"x must have shape \(n,\) or \(S, n\)"):
        quants.matmul(data, QT.Q4_1, np.zeros((1, 1, 96), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        quants.matmul(data[0], QT.Q4_1, np.zeros(96, np.float32))
    with pytest.raises(ValueError, match="not supported"):
        quants.matmul(data, QT.IQ4_NL, np.zeros(96, np.float32))


def test_empty_shapes():
    np.testing.assert_array_equal(quants.matmul(np.zeros((3, 0), np.uint8), QT.Q4_1, np.zeros(0, np.float32)),
                                  np.zeros(3, np.float32))
    assert quants.matmul(np.zeros((0, 20), np.uint8), QT.Q4_1, np.zeros((2, 32), np.float32)).shape == (2, 0)
    assert quants.matmul(np.zeros((4, 20), np.uint8), QT.Q4_1, np.zeros((0, 32), np.float32)).shape == (0, 4)


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0, QT.Q4_0, QT.Q5_K, QT.BF16], ids=lambda t: t.name)
def test_njit_dispatcher(qtype):
    """_matvec(mask, code, ...), the njit-level product that matmul and other njit code call, on
    more rows than one parallel task holds."""
    rng = np.random.default_rng(14)
    rows = 2 * quants._MATVEC_ROWS + 5
    data = weight(qtype, rows, rng)
    x = rng.normal(size=quants.row_elems(qtype, data.shape[1])).astype(np.float32)
    out = np.full(rows, np.nan, np.float32)
    quants._matvec(type_mask([qtype]), int(qtype), data, x, out)
    assert_close(out, data, qtype, x)


@pytest.mark.parametrize("qtype", quants.SUPPORTED_TYPES, ids=lambda t: t.name)
def test_row_range_kernel(qtype):
    """_rows_f32 (the fused decode step's serial product) computes exactly rows r0..r1-1:
    single rows, the last row, a middle range; the other outputs are left alone."""
    rng = np.random.default_rng(int(qtype) + 50)
    data = weight(qtype, 9, rng, blocks=2)
    n = quants.row_elems(qtype, data.shape[1])
    x = rng.normal(size=n).astype(np.float32)
    xsum = np.empty(max(1, n // 32), np.float32)
    quants._block_sums(x, xsum)
    for r0, r1 in ((0, 1), (8, 9), (2, 7), (0, 9)):
        out = np.full(9, np.nan, np.float32)
        quants._rows_f32(type_mask([qtype]), int(qtype), data, r0, r1, x, xsum, np.empty(n, np.float32), out)
        assert np.isnan(out[:r0]).all() and np.isnan(out[r1:]).all()
        assert_close(out[r0:r1], data[r0:r1], qtype, x)


def test_prefetch_past_the_end_is_harmless():
    """The row loops prefetch _PREFETCH_AHEAD bytes past the row they dot, beyond the end of
    the weight for its last rows: a prefetch there must not fault, and no prefetch changes a
    byte (here: rows of a 1-row and a 3-row array, ahead by up to a megabyte past the end)."""
    rng = np.random.default_rng(7)
    for rows in (1, 3):
        data = rng.integers(0, 256, (rows, 40), dtype=np.uint8)
        before = data.copy()
        for r in range(rows):
            quants._prefetch_ahead(data, r)
        _prefetch_bytes(data, 1 << 20)
        np.testing.assert_array_equal(data, before)


_TOUCH_SCRIPT = r"""
import ctypes, mmap
import numpy as np
from numba import njit
from npllama.kernels.quants import _touch_lines

@njit
def touch_tail(a, k):
    _touch_lines(a[a.shape[0] - k:])

# a page of records followed by a page that may not be read: any byte touched past a view's
# end faults
page = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
libc = ctypes.CDLL(None, use_errno=True)
assert libc.mprotect(ctypes.c_void_p(base + page), ctypes.c_size_t(page), 0) == 0, ctypes.get_errno()
for dtype, record in ((np.uint16, (3, 2, 64)), (np.float32, (1, 2, 5)), (np.uint16, (1,))):
    per = int(np.prod(record))
    n = page // (per * np.dtype(dtype).itemsize)
    recs = np.frombuffer(buf, dtype, n * per, page - n * per * np.dtype(dtype).itemsize).reshape(n, *record)
    recs[:] = np.arange(recs.size).reshape(recs.shape).astype(dtype)
    before = recs.copy()
    for k in (1, 2, 3, n):
        touch_tail(recs, k)
    touch_tail(recs, 0)
    assert (recs == before).all()
print("ok")
"""


def test_touch_lines_reads_inside_the_view_only():
    """_touch_lines (the paged attention's loads of the next block's records) loads a byte of
    every line of a view and nothing past its end: views of 1, 2, 3 and all records (float16
    bits and float32, records of 768, 40 and 2 bytes) and an empty one, ending where the next
    page may not be read (a fresh process: a fault would kill it), change no byte."""
    tests = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _TOUCH_SCRIPT], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(tests)))
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-3000:])


@njit
def _prefetch_bytes(data, end):
    for i in range(0, end, 64):
        quants._prefetch(data, i)


DIRECT_DOT_TYPES = [QT.Q4_1, QT.Q8_0, QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q3_K, QT.Q2_K]


def test_direct_dot_types():
    """Every quantized type is dotted straight from its blocks; only the float types are
    dequantized into a row first."""
    for qtype in quants.SUPPORTED_TYPES:
        assert quants._has_dot(int(qtype)) == (qtype in DIRECT_DOT_TYPES), qtype.name


@pytest.mark.parametrize("qtype", DIRECT_DOT_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 1), (5, 4), (13, 9)])
def test_direct_dot(qtype, rows, blocks):
    """The direct row dots (through _rows_f32, the decode step's products, and _dot_row, the
    prefill rows') against gguf's dequantization and a float64 dot: rows of one block (256
    elements for the K-quants) and of several, odd row counts, x of mixed magnitudes."""
    rng = np.random.default_rng(rows * 1000 + blocks * 10 + int(qtype))
    data = weight(qtype, rows, rng, blocks=blocks)
    n = quants.row_elems(qtype, data.shape[1])
    x = (rng.normal(size=n) * rng.choice([0.01, 1.0, 30.0], n)).astype(np.float32)
    xsum = np.empty(n // 32, np.float32)
    quants._block_sums(x, xsum)
    out = np.full(rows, np.nan, np.float32)
    quants._rows_f32(type_mask([qtype]), int(qtype), data, 0, rows, x, xsum, np.empty(0, np.float32), out)
    assert_close(out, data, qtype, x)
    one = np.array([_dot_row(type_mask([qtype]), int(qtype), data[r], x, xsum) for r in range(rows)], np.float32)
    assert_close(one, data, qtype, x)


@pytest.mark.parametrize("qtype", DIRECT_DOT_TYPES, ids=lambda t: t.name)
def test_direct_dot_non_contiguous_x(qtype):
    """matmul's decode product (the direct dots) on a strided and a float64 x."""
    rng = np.random.default_rng(int(qtype) + 70)
    data = weight(qtype, 3, rng, blocks=2)
    n = quants.row_elems(qtype, data.shape[1])
    big = rng.normal(size=3 * n)
    for x in (big[::3].astype(np.float32), big[:n]):
        assert_close(quants.matmul(data, qtype, x), data, qtype, x)


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q2_K], ids=lambda t: t.name)
@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_prefill_rows_with_direct_dots(qtype, T):
    """rows._matmul_rows (prefill and batched products): up to rows._FEW activation rows by
    the direct dots, more by dequantized tiles; 9 weight rows, a partial last tile."""
    from npllama.kernels import rows
    rng = np.random.default_rng(T + int(qtype))
    data = weight(qtype, 9, rng, blocks=2)
    x = rng.normal(size=(T, quants.row_elems(qtype, data.shape[1]))).astype(np.float32)
    out = np.full((T, 9), np.nan, np.float32)
    rows._matmul_rows(type_mask([qtype]), int(qtype), data, x, out)
    assert_close(out, data, qtype, x)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K, QT.Q6_K],
                         ids=lambda t: t.name)
def test_prefill_rows_dequantize_exactly(qtype):
    """The row kernels' tiles (fast-math code) dequantize their weight rows exactly as gguf
    does (quants._deq_row_vec keeps its own roundings: no fused d q + m): products with the
    identity, one activation row per element, are the dequantized weights."""
    from npllama.kernels import rows
    rng = np.random.default_rng(int(qtype) + 90)
    data = weight(qtype, 5, rng, blocks=2)
    n = quants.row_elems(qtype, data.shape[1])
    out = np.empty((n, 5), np.float32)
    rows._matmul_rows(type_mask([qtype]), int(qtype), data, np.eye(n, dtype=np.float32), out)
    np.testing.assert_array_equal(out.T, gguf.quants.dequantize(data, qtype))


@njit
def _dot_row(mask, code, row, x, xsum):
    return quants._dot_row(mask, code, row, x, xsum)


_LOAD_ORDER_SCRIPT = """
import sys
import numpy as np
from gguf import GGMLQuantizationType as QT
from npllama.kernels import quants, quants_int8 as qi
from npllama.kernels.qtypes import type_mask
import test_products as t
rng = np.random.default_rng(5)
cases = []
for qt in (QT[name] for name in sys.argv[2:]):
    spec = quants._spec(qt)
    data = t.weight(qt, 37, rng, blocks=(18 if spec.block_size == 32 else 3))
    cases.append((qt, data, rng.normal(size=data.shape[1] // spec.type_size * spec.block_size).astype(np.float32)))
if sys.argv[1] == "rows_first":  # the row routines' own libraries, loaded before their callers
    for qt, data, x in cases:
        xsum, row, out = np.ones(x.shape[0] // 32, np.float32), np.empty_like(x), np.empty(37, np.float32)
        quants._block_sums(x, xsum)
        quants._rows_f32(type_mask([qt]), int(qt), data, 0, 1, x, xsum, row, out)
        if qt in qi.INT8_TYPES:
            qi._rows_i8(type_mask([qt]), int(qt), data, 0, 1, *qi.quantize_x(x), out)
for qt, data, x in cases:
    print(qt.name, quants.matmul(data, qt, x).tobytes().hex())
    print(qt.name + "/int8", qi.matmul_int8(data, qt, x).tobytes().hex())
"""


@pytest.mark.slow
def test_bits_do_not_depend_on_what_was_loaded_first(tmp_path):
    """A kernel carries its own copy of each routine it calls, and a process runs the first
    copy it loaded. The copies must compute the same bits: the products of a weight (exact
    and int8) are checked in fresh processes on one Numba cache, after compiling, after
    loading the products alone, and after loading their routines (quants._block_sums,
    quants._rows_f32, quants_int8._rows_i8) on their own first."""
    tests = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([os.path.dirname(tests), tests]))
    names = [qt.name for qt in DIRECT_DOT_TYPES + list(FLOAT_TYPES)]

    def run(mode):
        r = subprocess.run([sys.executable, "-c", _LOAD_ORDER_SCRIPT, mode, *names], env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return dict(line.split() for line in r.stdout.splitlines())

    compiled = run("plain")
    assert len(compiled) == 2 * len(names)
    for mode in ("plain", "rows_first"):
        bits = run(mode)
        assert [k for k in compiled if bits[k] != compiled[k]] == [], mode
