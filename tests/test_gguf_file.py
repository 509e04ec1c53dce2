"""GGUFFile: config and tensors of tiny models, zero-copy views, and one test per validation error."""
import mmap
import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from npllama.errors import GGUFError
from npllama.arch import Rope
from npllama.gguf.reader import GGUFFile, ModelConfig, StringArray, TensorInfo, read_metadata
from tinygguf import tiny_vocab, write_tiny_llama

N_VOCAB = len(tiny_vocab()[0])


def _tensor_info_at(data: bytes, name: str) -> int:
    """Byte offset of the n_dims field of tensor `name` in the tensor table of `data`."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _patch(path, offset: int, fmt: str, *values) -> None:
    """Overwrite the struct `fmt` at byte `offset` of the file at `path` with `values`."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack(fmt, *values))


def _patch_tensor_info(path, name: str, field: str, value: int, dim: int = 0) -> None:
    """Overwrite one field ('dim', 'type' or 'offset') of the tensor-table entry for `name`."""
    data = open(path, "rb").read()
    at = _tensor_info_at(data, name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    offsets = {"dim": at + 4 + 8 * dim, "type": at + 4 + 8 * n_dims, "offset": at + 8 + 8 * n_dims}
    _patch(path, offsets[field], "<I" if field == "type" else "<Q", value)


def _kv_at(path, key: str) -> int:
    """Byte offset of the value type field of metadata `key`."""
    encoded = key.encode()
    return open(path, "rb").read().index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _raises(path, *words) -> str:
    """Open `path`, expect GGUFError naming the file and each of `words`; return the message."""
    with pytest.raises(GGUFError) as exc:
        GGUFFile(path)
    msg = str(exc.value)
    assert os.path.basename(path) in msg
    for word in words:
        assert word.lower() in msg.lower(), (word, msg)
    return msg


@pytest.fixture
def tiny(tmp_path):
    """A fresh tiny F32 model that a test may corrupt."""
    return write_tiny_llama(tmp_path / "tiny.gguf")


# ---- loading valid files ----

def test_tiny_config(tiny_model_path):
    cfg = GGUFFile(tiny_model_path).config
    assert isinstance(cfg, ModelConfig)
    assert cfg == ModelConfig(
        arch="llama", n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=96, n_vocab=N_VOCAB,
        n_ctx=256, rope_base=10000.0, rope_dim=16, rope_scaling_type=None, rope_scaling_factor=1.0,
        rope_neox=False, rms_eps=cfg.rms_eps, tied_output=True, attn_bias=False, has_rope_freqs=False,
        attn_scale=0.25, ropes=(Rope(10000.0),), layer_rope=(0, 0), layer_window=(0, 0),
    )
    assert cfg.rms_eps == pytest.approx(1e-5)


def test_tiny_f32_tensors_match_gguf_reader(tiny_model_path):
    gf = GGUFFile(tiny_model_path)
    reader = gguf.GGUFReader(tiny_model_path)
    assert list(gf.tensors) == [t.name for t in reader.tensors]
    for rt in reader.tensors:
        t = gf.tensor(rt.name)
        assert isinstance(t, TensorInfo) and t.qtype == QT.F32
        assert t.data.dtype == np.float32 and t.data.shape == t.shape
        assert t.offset == rt.data_offset and t.n_bytes == rt.n_bytes
        np.testing.assert_array_equal(t.data, rt.data)
    assert gf.tensor("blk.1.attn_k.weight").shape == (32, 64)
    assert gf.tensor("blk.0.ffn_down.weight").shape == (64, 96)
    assert gf.tensor("output_norm.weight").shape == (64,)
    assert gf.tensor("token_embd.weight").shape == (N_VOCAB, 64)
    assert gf.quant_mix() == {"F32": (len(gf.tensors), sum(t.n_bytes for t in gf.tensors.values()))}


def test_tiny_q8_tensors(tiny_q8_path):
    gf = GGUFFile(tiny_q8_path)
    q = gf.tensor("blk.0.ffn_up.weight")
    assert q.qtype == QT.Q8_0 and q.shape == (96, 64)
    assert q.data.dtype == np.uint8 and q.data.shape == (96, 64 // 32 * 34)
    assert q.n_bytes == q.data.nbytes
    reader_data = {t.name: t.data for t in gguf.GGUFReader(tiny_q8_path).tensors}
    np.testing.assert_array_equal(q.data, reader_data[q.name])
    assert gf.tensor("blk.0.attn_norm.weight").qtype == QT.F32
    mix = gf.quant_mix()
    assert set(mix) == {"Q8_0", "F32"} and mix["F32"][0] == 2 * 2 + 1
    assert mix["Q8_0"][0] == 1 + 2 * 7


def test_tensor_data_is_zero_copy(tiny_q8_path):
    gf = GGUFFile(tiny_q8_path)
    for t in gf.tensors.values():
        assert np.shares_memory(t.data, gf.buffer)
        assert not t.data.flags.owndata and not t.data.flags.writeable
        assert t.data.ctypes.data == gf.buffer.ctypes.data + t.offset


def test_metadata_types(tiny_model_path):
    meta = GGUFFile(tiny_model_path).metadata
    tokens, types, merges = tiny_vocab()
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2 and type(meta["llama.block_count"]) is int
    assert type(meta["llama.rope.freq_base"]) is float
    assert meta["tokenizer.ggml.add_bos_token"] is False
    assert meta["tokenizer.ggml.tokens"] == tokens
    assert meta["tokenizer.ggml.merges"] == merges
    assert isinstance(meta["tokenizer.ggml.token_type"], np.ndarray)
    assert meta["tokenizer.ggml.token_type"].tolist() == types


def test_string_arrays(tiny_model_path):
    """Arrays of strings are StringArrays: decoded on access, equal to the file's lists, and
    independent of the file's memory map (read_metadata closes it)."""
    tokens, _, merges = tiny_vocab()
    for meta in (GGUFFile(tiny_model_path).metadata, read_metadata(tiny_model_path)):
        arr = meta["tokenizer.ggml.tokens"]
        assert isinstance(arr, StringArray) and len(arr) == len(tokens)
        assert list(arr) == tokens and arr == tokens and arr == tuple(tokens) and arr != tokens[:-1]
        assert [arr[i] for i in range(-len(tokens), len(tokens))] == tokens + tokens
        assert arr[1:7:2] == tokens[1:7:2] and arr[::-1] == tokens[::-1] and arr[5:2] == []
        for i in (len(tokens), -len(tokens) - 1):
            with pytest.raises(IndexError):
                arr[i]
        assert arr[np.int64(3)] == tokens[3] and tokens[3] in arr and arr.index(tokens[3]) == 3
        assert meta["tokenizer.ggml.merges"] == merges and arr != meta["tokenizer.ggml.merges"]
        assert f"{len(tokens)} strings" in repr(arr)
        made = StringArray.from_strings(tokens)  # laid out as the file lays them out
        assert made == arr and bytes(made._data) == bytes(arr._data) and (made._edges == arr._edges).all()
        data, starts, ends = arr.spans()
        assert [bytes(data[a:b]).decode() for a, b in zip(starts, ends)] == tokens



@pytest.mark.parametrize("texts", [["<|im_end|>"], ["<|im_end|>", "b", "héllo", "", "absent", "b"], [], ["a\0b"]])
def test_indexes_of(texts):
    """The indexes of the strings equal to any of `texts`, in order, as a scan of the decoded
    strings finds them: multi-byte characters, an empty string, repeats, a NUL inside, none."""
    strings = ["<|im_end|>", "b", "héllo", "", "b", "<|im_end|", "<|im_end|>x", "hello", "a\0b", "ab", "<|im_end|>"]
    arr = StringArray.from_strings(strings)
    assert arr.tolist() == strings
    assert arr.indexes_of(texts) == [i for i, s in enumerate(strings) if s in texts]
    assert StringArray.from_strings([]).indexes_of(texts) == []


@pytest.mark.parametrize("strings", [["Ġ t", "a b", "héllo wörld", "x ", "ĠĠ ĠĠ"], [], ["a b"],
                                     ["a b", "c"], ["a b", "c d e"], ["a b", " c"], [" a", "b c"], ["a b", "c\0 d"],
                                     ["a b", "", "c d"], ["ab", "c  "]])
def test_halves(strings):
    """Each string split at its one space, all at once, as str.split(" ", 1) splits it; None
    where a string has no space, two, a leading one, or a NUL."""
    one_each = all(s.count(" ") == 1 and not s.startswith(" ") and "\0" not in s for s in strings)
    want = [tuple(s.split(" ", 1)) for s in strings] if one_each else None
    assert StringArray.from_strings(strings).halves(" ") == want


def _strings_reference(buf: bytes, start: int, count: int) -> tuple[list[int], int]:
    """`string_edges` in plain Python: the strings' ends from `start`, and how many fit."""
    edges, pos = [0], start
    for i in range(count):
        if pos + 8 > len(buf) or pos + 8 + struct.unpack_from("<Q", buf, pos)[0] > len(buf):
            return edges + [0] * (count - i), i
        pos += 8 + struct.unpack_from("<Q", buf, pos)[0]
        edges.append(pos - start)
    return edges, count


@pytest.mark.parametrize("case", ["none", "one", "mixed", "cut", "cut length", "huge length", "strided"])
def test_string_edges(case):
    """The compiled loop that finds an array's strings, against a plain Python one: empty,
    non-ASCII and NUL-holding strings, a buffer cut inside a string or a length, a length past
    the end; StringArray's decoding of them (tolist splits at NULs where no string holds one,
    and decodes one by one where one does)."""
    from npllama.kernels.strings import string_edges
    strings = {"none": [], "one": ["x"]}.get(case, ["a", "", "Ġthe", "x\0y", "é" * 40, "zz"])
    buf = b"HEAD" + b"".join(struct.pack("<Q", len(t.encode())) + t.encode() for t in strings)
    count = len(strings)
    if case == "cut":
        buf = buf[:-1]
    elif case == "cut length":
        buf += b"\1\0\0"
        count += 1
    elif case == "huge length":
        buf += struct.pack("<Q", (1 << 64) - 1) + b"xyz"
        count += 1
    raw = np.frombuffer(buf, np.uint8)
    if case == "strided":  # every other byte of a buffer twice as long
        raw = np.repeat(raw, 2)[::2]
    edges, n = string_edges(raw, 4, count)
    want_edges, want_n = _strings_reference(buf, 4, count)
    assert (edges.tolist(), n) == (want_edges, want_n)
    if n == count == len(strings):
        arr = StringArray(buf[4:4 + edges[-1]], edges)
        assert arr.tolist() == list(arr) == strings and arr.byte_lengths().tolist() == [len(t.encode()) for t in strings]
        if "x\0y" in strings:
            assert StringArray(buf[4:4 + edges[4]], edges[:5]).tolist() == strings[:4]


def test_string_edges_refuses_what_it_cannot_read():
    from npllama.kernels.strings import string_edges
    for buf, start, count in ((np.zeros(8, np.int32), 0, 1), (np.zeros((2, 8), np.uint8), 0, 1),
                              (np.zeros(8, np.uint8), 9, 1), (np.zeros(8, np.uint8), 0, -1)):
        with pytest.raises(ValueError):
            string_edges(buf, start, count)



# byte strings at the edges of UTF-8's rules (RFC 3629, as Python's strict decoder keeps them)
UTF8_CASES = [b"", b"plain", b"\0", b"\x7f", "é日🦙".encode(), b"\xc2\x80", b"\xdf\xbf", b"\xe0\xa0\x80",
              b"\xed\x9f\xbf", b"\xee\x80\x80", b"\xf0\x90\x80\x80", b"\xf4\x8f\xbf\xbf",  # valid
              b"\x80", b"\xbf", b"\xc0\x80", b"\xc1\xbf", b"\xe0\x80\x80", b"\xe0\x9f\xbf",  # stray, overlong
              b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf",  # surrogates, overlong
              b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80", b"\xff", b"\xfe",  # past U+10FFFF, never UTF-8
              b"\xc3", b"\xe6\x97", b"\xf0\x9f\xa6", b"a\xc3(", b"\xe6(\x97", b"\xf0\x9f(\x99"]  # cut, broken


def _first_bad_reference(strings: list[bytes]) -> int:
    for i, b in enumerate(strings):
        try:
            b.decode("utf-8")
        except UnicodeDecodeError:
            return i
    return -1


@pytest.mark.parametrize("seed", range(4))
def test_first_bad_string(seed):
    """The compiled UTF-8 check against Python's decoder: strings drawn from the cases above and
    from random bytes, in strided and offset buffers. A string cut inside a character is bad even
    where the next string's length would continue it."""
    from npllama.kernels.strings import first_bad_string, string_edges
    rng = np.random.default_rng(seed)
    for _ in range(200):
        strings = [UTF8_CASES[i] for i in rng.integers(0, len(UTF8_CASES), rng.integers(0, 6))]
        if rng.random() < 0.3:
            strings.append(rng.integers(0, 256, rng.integers(1, 8)).astype(np.uint8).tobytes())
        buf = b"HEAD" + b"".join(struct.pack("<Q", len(b)) + b for b in strings) + b"\x80\x80"
        raw = np.frombuffer(buf, np.uint8)
        if rng.random() < 0.5:  # every other byte of a buffer twice as long
            raw = np.repeat(raw, 2)[::2]
        edges, n = string_edges(raw, 4, len(strings))
        assert n == len(strings)
        assert first_bad_string(raw, 4, edges) == _first_bad_reference(strings), strings


def test_first_bad_string_refuses_what_it_cannot_read():
    from npllama.kernels.strings import first_bad_string
    ok = np.array([0, 9], np.int64)
    for buf, start, edges in ((np.zeros(16, np.int32), 0, ok), (np.zeros(16, np.uint8), 8, ok),
                              (np.zeros(16, np.uint8), 0, np.array([1, 10])), (np.zeros(16, np.uint8), 0, np.array([0, 5])),
                              (np.zeros(16, np.uint8), 0, np.zeros(0, np.int64)), (np.zeros(16, np.uint8), -1, ok)):
        with pytest.raises(ValueError, match="must be"):
            first_bad_string(buf, start, edges)
    assert first_bad_string(np.zeros(16, np.uint8), 3, np.zeros(1, np.int64)) == -1  # no strings

def _string_at(path, key: str, i: int) -> int:
    """Byte offset of the 8-byte length of string #i of the string array `key`."""
    data = open(path, "rb").read()
    at = _kv_at(path, key) + 4 + 4 + 8  # value type, item type, count
    for _ in range(i):
        at += 8 + struct.unpack_from("<Q", data, at)[0]
    return at


def test_huge_string_length_in_array(tiny):
    _patch(tiny, _string_at(tiny, "tokenizer.ggml.tokens", 5), "<Q", (1 << 64) - 1)
    _raises(tiny, "string #5 of 'tokenizer.ggml.tokens'", "truncated or corrupt")


@pytest.mark.parametrize("where", ["first byte", "last byte"])
def test_invalid_utf8_in_string_array(tiny, where):
    """A bad byte in one string of an array (a stray continuation byte, or a character cut
    short at its end) names that string."""
    at = _string_at(tiny, "tokenizer.ggml.merges", 7)
    n = struct.unpack_from("<Q", open(tiny, "rb").read(), at)[0]
    _patch(tiny, at + 8 + (0 if where == "first byte" else n - 1), "<B", 0x80 if where == "first byte" else 0xC3)
    _raises(tiny, "string #7 of 'tokenizer.ggml.merges'", "UTF-8")


def test_untied_output(tmp_path):
    gf = GGUFFile(write_tiny_llama(tmp_path / "untied.gguf", tied=False))
    assert not gf.config.tied_output
    assert gf.tensor("output.weight").shape == (N_VOCAB, 64)


def test_qwen2_with_biases(tmp_path):
    biases = {f"blk.{i}.attn_{x}.bias": np.zeros(64 if x == "q" else 32, np.float32) for i in range(2) for x in "qkv"}
    cfg = GGUFFile(write_tiny_llama(tmp_path / "qwen.gguf", arch="qwen2", tensor_overrides=biases)).config
    assert cfg.arch == "qwen2" and cfg.attn_bias and cfg.rope_neox


def test_mistral_reads_like_llama(tmp_path):
    cfg = GGUFFile(write_tiny_llama(tmp_path / "mistral.gguf", arch="mistral")).config
    assert cfg.arch == "mistral" and not cfg.rope_neox and cfg.n_layer == 2


def test_rope_freqs_and_scaling(tmp_path):
    path = write_tiny_llama(tmp_path / "rope.gguf", tensor_overrides={"rope_freqs.weight": np.ones(8, np.float32)},
                            extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    cfg = GGUFFile(path).config
    assert cfg.has_rope_freqs and cfg.rope_scaling_type == "linear" and cfg.rope_scaling_factor == 4.0


def test_missing_tensor_lookup_names_file_and_tensor(tiny_model_path):
    with pytest.raises(GGUFError, match="tiny.gguf.*'blk.9.attn_q.weight'"):
        GGUFFile(tiny_model_path).tensor("blk.9.attn_q.weight")


@pytest.mark.model
def test_default_model(default_model_path):
    gf = GGUFFile(default_model_path)
    cfg = gf.config
    assert (cfg.arch, cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_ff, cfg.n_vocab) == (
        "llama", 30, 576, 9, 3, 64, 1536, 49152)
    assert cfg.tied_output and not cfg.attn_bias and not cfg.rope_neox
    assert len(gf.tensors) == 272
    assert gf.tensor("token_embd.weight").qtype == QT.Q8_0
    assert {name: count for name, (count, _) in gf.quant_mix().items()} == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == 49152


# ---- validation: each malformed file raises GGUFError naming the file and the problem ----

def test_bad_magic(tiny):
    _patch(tiny, 0, "4s", b"GGML")
    _raises(tiny, "not a GGUF file", "magic")


def test_bad_version(tiny):
    _patch(tiny, 4, "<I", 7)
    _raises(tiny, "version 7")


def test_big_endian_version(tiny):
    _patch(tiny, 4, ">I", 3)
    _raises(tiny, "big-endian")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    _raises(path, "truncated")


def test_truncated_header(tiny):
    os.truncate(tiny, 20)
    _raises(tiny, "truncated")


def test_truncated_metadata(tiny):
    os.truncate(tiny, _kv_at(tiny, "tokenizer.ggml.tokens") + 500)
    _raises(tiny, "truncated", "tokenizer.ggml.tokens")


def test_truncated_tensor_info(tiny):
    os.truncate(tiny, GGUFFile(tiny).data_offset - 40)
    _raises(tiny, "truncated", "tensor")


def test_truncated_tensor_data(tiny):
    os.truncate(tiny, os.path.getsize(tiny) - 100)
    _raises(tiny, "truncated", "outside the file")


def test_tensor_offset_outside_file(tiny):
    _patch_tensor_info(tiny, "blk.0.attn_q.weight", "offset", 1 << 40)
    _raises(tiny, "blk.0.attn_q.weight", "outside the file")


def test_misaligned_tensor_offset(tiny):
    _patch_tensor_info(tiny, "blk.0.attn_q.weight", "offset", 4)
    _raises(tiny, "blk.0.attn_q.weight", "alignment")


def test_size_not_multiple_of_block(tmp_path):
    path = write_tiny_llama(tmp_path / "q8.gguf", qtype=QT.Q8_0)
    _patch_tensor_info(path, "blk.1.ffn_gate.weight", "dim", 48, dim=0)
    _raises(path, "blk.1.ffn_gate.weight", "multiple of the Q8_0 block size 32")


def test_zero_size_dimension(tiny):
    _patch_tensor_info(tiny, "blk.0.ffn_up.weight", "dim", 0, dim=1)
    _raises(tiny, "blk.0.ffn_up.weight", "zero-size")


def test_huge_tensor_count(tiny):
    _patch(tiny, 8, "<Q", 1 << 62)
    _raises(tiny, "tensors", "truncated or corrupt")


def test_huge_metadata_count(tiny):
    _patch(tiny, 16, "<Q", 1 << 62)
    _raises(tiny, "metadata entries", "truncated or corrupt")


def test_huge_array_count(tiny):
    _patch(tiny, _kv_at(tiny, "tokenizer.ggml.tokens") + 8, "<Q", 1 << 60)
    _raises(tiny, "tokenizer.ggml.tokens", "truncated or corrupt")


def test_huge_string_length(tiny):
    _patch(tiny, _kv_at(tiny, "general.name") + 4, "<Q", (1 << 64) - 1)
    _raises(tiny, "general.name", "truncated or corrupt")


def test_invalid_utf8_key(tiny):
    with open(tiny, "r+b") as f:
        data = f.read()
        f.seek(data.index(b"general.name"))
        f.write(b"\xff")
    _raises(tiny, "UTF-8")


@pytest.mark.parametrize("name", ["token_embd.weight", "output_norm.weight", "blk.0.attn_k.weight",
                                  "blk.1.ffn_down.weight", "blk.1.attn_norm.weight"])
def test_missing_required_tensor(tmp_path, name):
    path = write_tiny_llama(tmp_path / "missing.gguf", skip_tensors=(name,))
    _raises(path, "missing required tensor", name)


def test_missing_required_key(tiny):
    at = _kv_at(tiny, "llama.block_count") - len("llama.block_count")
    _patch(tiny, at, "17s", b"llama.block_cXunt")
    _raises(tiny, "missing required metadata key", "llama.block_count")


def test_wrong_type_for_key(tmp_path):
    path = write_tiny_llama(tmp_path / "strkey.gguf", extra_kv={"llama.embedding_length": "sixty-four"})
    _raises(path, "llama.embedding_length", "should be int")


@pytest.mark.parametrize("name, shape, needs", [
    ("blk.1.attn_q.weight", (64, 48), "(n_head=4, head_dim=16, n_embd=64) needs (64, 64)"),
    ("blk.0.attn_k.weight", (64, 64), "(n_head_kv=2, head_dim=16, n_embd=64) needs (32, 64)"),
    ("blk.0.ffn_gate.weight", (80, 64), "(n_ff=96, n_embd=64) needs (96, 64)"),
    ("token_embd.weight", (N_VOCAB - 1, 64), f"needs ({N_VOCAB}, 64)"),
    ("blk.1.ffn_norm.weight", (32,), "(n_embd=64) needs (64,)"),
])
def test_shape_disagrees_with_config(tmp_path, name, shape, needs):
    path = write_tiny_llama(tmp_path / "shape.gguf", tensor_overrides={name: np.zeros(shape, np.float32)})
    _raises(path, f"tensor '{name}' has shape {shape}", needs)


def test_heads_not_divisible(tmp_path):
    _raises(write_tiny_llama(tmp_path / "heads.gguf", n_head_kv=3), "n_head (4) is not divisible by n_head_kv (3)")


def test_zero_size_key(tmp_path):
    path = write_tiny_llama(tmp_path / "zero.gguf", extra_kv={"llama.attention.head_count_kv": 0})
    _raises(path, "llama.attention.head_count_kv", "must be positive")


def test_negative_size_key(tiny):
    at = _kv_at(tiny, "llama.feed_forward_length")
    _patch(tiny, at, "<Ii", 5, -96)  # retype the value as INT32 -96
    _raises(tiny, "llama.feed_forward_length", "must be positive")


def test_unsupported_quant_type(tmp_path):
    path = write_tiny_llama(tmp_path / "q4.gguf", qtype=QT.Q4_0)
    _patch_tensor_info(path, "blk.0.attn_v.weight", "type", int(QT.IQ4_NL))  # same block size as Q4_0
    _raises(path, "blk.0.attn_v.weight", "IQ4_NL", "not support")


def test_unknown_tensor_type(tiny):
    _patch_tensor_info(tiny, "blk.0.attn_v.weight", "type", 250)
    _raises(tiny, "blk.0.attn_v.weight", "unknown type id 250")


def test_unsupported_architecture(tmp_path):
    _raises(write_tiny_llama(tmp_path / "gpt99.gguf", arch="gpt99"), "architecture 'gpt99'", "llama", "qwen2")


def test_partial_attention_biases(tmp_path):
    path = write_tiny_llama(tmp_path / "bias.gguf", arch="qwen2",
                            tensor_overrides={"blk.0.attn_q.bias": np.zeros(64, np.float32)})
    _raises(path, "missing required tensor", "blk.0.attn_k.bias")


def test_rope_freqs_wrong_shape(tmp_path):
    path = write_tiny_llama(tmp_path / "freqs.gguf", tensor_overrides={"rope_freqs.weight": np.ones(16, np.float32)})
    _raises(path, "rope_freqs.weight", "needs (8,)")


def test_more_tokens_than_vocab(tmp_path):
    path = write_tiny_llama(tmp_path / "vocab.gguf", extra_kv={"llama.vocab_size": 100},
                            tensor_overrides={"token_embd.weight": np.zeros((100, 64), np.float32)})
    _raises(path, f"{N_VOCAB} tokens", "n_vocab")


def test_duplicate_tensor_name(tiny):
    data = open(tiny, "rb").read()
    at = data.index(b"blk.0.attn_k.weight")
    _patch(tiny, at, "19s", b"blk.0.attn_q.weight")
    _raises(tiny, "duplicate tensor 'blk.0.attn_q.weight'")


def _resident_kib(path) -> int:
    """KiB of this process's mappings of the file `path` that are resident (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: address range ... path
                ours = len(head) >= 6 and head[5] == os.fspath(path)
            elif ours and head[0] == "Rss:":
                total += int(head[1])
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads /proc/self/smaps (Linux)")
def test_release_drops_the_pages_and_keeps_the_data(tmp_path):
    """GGUFFile.release: the whole pages inside a view of the buffer leave the resident set;
    reading the view again gives the same bytes (from the page cache)."""
    path = write_tiny_llama(tmp_path / "m.gguf", n_embd=256, n_ff=512)
    f = GGUFFile(path)
    data = f.tensor("blk.0.ffn_up.weight").data  # 512 x 256 float32: 128 pages
    want = np.array(data)  # reads every page
    before = _resident_kib(path)
    f.release(data)
    dropped = before - _resident_kib(path)
    pages = data.nbytes // mmap.PAGESIZE - 1  # the whole pages inside the view
    assert dropped >= pages * mmap.PAGESIZE // 1024 > 0
    np.testing.assert_array_equal(data, want)
    tail = f.buffer[f.data_offset:]  # to the end of the file, which ends inside a page: that page too
    assert f.buffer.size % mmap.PAGESIZE
    np.array(tail)  # every page of it read in
    assert _resident_kib(path) > -(-f.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE // 1024
    f.release(tail)
    assert _resident_kib(path) <= -(-f.data_offset // mmap.PAGESIZE) * mmap.PAGESIZE // 1024
    with pytest.raises(ValueError, match="view of the file's buffer"):
        f.release(np.zeros(8, np.uint8))
