"""Opening a GGUF model: a bounds-checked parse of the header, metadata and tensor table,
zero-copy tensor views on a read-only memory map, and the validated `ModelConfig` that the
file's architecture module (npllama.arch) reads from it.

The file is parsed here rather than by `gguf.GGUFReader`, with the format's numbers written
out (`VT` here, the tensor types in `kernels.qtypes`; tests compare them with gguf's), as
importing gguf takes ~0.02 s of a short `npllama run`. GGUFReader builds one numpy view per
string, which makes opening a model with a 49k-token vocabulary take seconds, and on a
corrupted length or count it loops or allocates without bound.
This parser reads GGUF versions 2 and 3 (little-endian), checks every length and count against
the bytes that remain before using it, and turns every problem into a `GGUFError` that names the
file, so nothing malformed ever reaches a kernel. (The lengths of an array of strings are read by
a compiled loop, `kernels.strings`, that checks each against what remains of the file, and
their UTF-8 by another, in place.)
"""
from __future__ import annotations

import math
import mmap
import operator
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from ..arch import ARCHS, SUPPORTED_ARCHS, ModelConfig
from ..arch.base import Meta, read_key as _key
from ..errors import GGUFError
from ..kernels.qtypes import BLOCK_SIZES, QT, type_name
from ..kernels.strings import first_bad_string, string_edges


class VT(IntEnum):
    """The types of GGUF metadata values (gguf's GGUFValueType)."""
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


DEFAULT_ALIGNMENT = 32  # of the tensor data, where general.alignment does not say (gguf's GGUF_DEFAULT_ALIGNMENT)
SUPPORTED_QTYPES = frozenset(QT)
_FLOAT_DTYPES = {QT.F32: np.dtype("<f4"), QT.F16: np.dtype("<f2"), QT.BF16: np.dtype("<u2")}
_SCALAR_FORMATS = {
    VT.UINT8: "<B", VT.INT8: "<b", VT.UINT16: "<H", VT.INT16: "<h", VT.UINT32: "<I",
    VT.INT32: "<i", VT.UINT64: "<Q", VT.INT64: "<q", VT.FLOAT32: "<f", VT.FLOAT64: "<d",
    VT.BOOL: "<B",
}
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_MAX_DIMS = 4
_MIN_KV_BYTES = 8 + 4 + 1            # empty key, value type, one-byte value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # empty name, n_dims, one dim, type, offset


class StringArray(Sequence[str]):
    """A metadata array of strings, each decoded when it is read: what the file holds is kept
    as its bytes (checked to be UTF-8 when the file is opened), since as Python strings a
    49k-token vocabulary and its merges would hold ~8 MiB for as long as the model is open.
    Equal to a list or tuple of the same strings."""

    __slots__ = ("_data", "_edges")

    def __init__(self, data: bytes, edges: np.ndarray):
        # data: the array as the file lays it out, each string after its 8-byte length;
        # string i is data[edges[i] + 8:edges[i + 1]]
        self._data, self._edges = data, edges

    @classmethod
    def from_strings(cls, strings) -> "StringArray":
        """The StringArray of `strings` (str), laid out as a file lays them out."""
        encoded = [s.encode("utf-8") for s in strings]
        lengths = np.fromiter(map(len, encoded), np.int64, len(encoded))
        edges = np.zeros(len(encoded) + 1, np.int64)
        np.cumsum(lengths + 8, out=edges[1:])
        return cls(b"".join(n.tobytes() + b for n, b in zip(lengths.astype("<u8"), encoded)), edges)

    def __len__(self) -> int:
        return len(self._edges) - 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        i = operator.index(i)
        if not -len(self) <= i < len(self):
            raise IndexError(f"string #{i} of an array of {len(self)}")
        i %= len(self)
        return self._data[int(self._edges[i]) + 8:int(self._edges[i + 1])].decode("utf-8")

    def __iter__(self):
        return iter(self.tolist())

    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(data, starts, ends): string i is the UTF-8 bytes data[starts[i]:ends[i]] (uint8, int64)."""
        return np.frombuffer(self._data, np.uint8), self._edges[:-1] + 8, self._edges[1:]

    def byte_lengths(self) -> np.ndarray:
        """Each string's length in bytes (of its UTF-8), int64."""
        return np.diff(self._edges) - 8

    def indexes_of(self, texts) -> list[int]:
        """The indexes of the strings equal to one of `texts`, in order: their bytes compared
        in place, no string decoded (a vocabulary's few end-of-turn pieces found without it)."""
        lengths, raw, found = self.byte_lengths(), np.frombuffer(self._data, np.uint8), []
        for text in set(texts):
            want = np.frombuffer(text.encode("utf-8"), np.uint8)
            at = np.flatnonzero(lengths == want.size)
            if at.size and want.size:
                starts = self._edges[at] + 8
                keep = raw[starts] == want[0]  # the first byte first: few strings of a length share it
                at, starts = at[keep], starts[keep]
                at = at[(raw[starts[:, None] + np.arange(want.size)] == want).all(axis=1)]
            found.extend(at.tolist())
        return sorted(found)

    def tolist(self) -> list[str]:
        """All the strings, decoded at once (`_joined`) and split at the separators: ~3x faster
        than a string at a time for a vocabulary; a string at a time where one holds a NUL itself."""
        if not len(self):
            return []
        out = self._joined().decode("utf-8").split("\0")
        if len(out) == len(self):  # else some string holds a NUL: the split is off
            return out
        return [self[i] for i in range(len(self))]

    def halves(self, sep: str) -> list[tuple[str, str]] | None:
        """Each string split at its one `sep` (an ASCII character), all at once: (before, after)
        for every string, as `str.split(sep, 1)` gives them; None where a string holds `sep`
        other than once or as its first character, or holds a NUL (split those one at a time)."""
        if not len(self):
            return []
        joined = self._joined()
        b = np.frombuffer(joined, np.uint8)
        nul = b == 0
        at = np.flatnonzero(b == ord(sep))
        if (len(at) != len(self) or np.count_nonzero(nul) != len(self) - 1 or at[0] == 0 or nul[at - 1].any()
                or not np.array_equal(np.cumsum(nul)[at], np.arange(len(self)))):
            return None
        # an ASCII byte is never part of a multi-byte character: the separators become NULs
        parts = iter(joined.replace(sep.encode("ascii"), b"\0").decode("utf-8").split("\0"))
        return list(zip(parts, parts))

    def _joined(self) -> bytes:
        """The strings' bytes, NUL between each two: the file's bytes with each string's 8-byte
        length cut to its first byte, set to NUL, and the first one dropped. (Valid UTF-8
        exactly when every string is: a NUL neither ends nor continues a multi-byte character.)"""
        starts = self._edges[:-1]
        raw = np.frombuffer(self._data, np.uint8)
        keep = np.ones(raw.size, bool)
        for k in range(1, 8):
            keep[starts + k] = False
        keep[:1] = False
        joined = raw.copy()
        joined[starts] = 0
        return joined[keep].tobytes()

    def __eq__(self, other):
        if isinstance(other, (StringArray, list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        head = ", ".join(map(repr, self[:3]))
        return f"StringArray([{head}{', ...' if len(self) > 3 else ''}], {len(self)} strings)"


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """One tensor of a GGUF file.

    `shape` is the logical shape in numpy order: (rows, cols) = (out_features, in_features) for a
    2-D weight, (n,) for a vector. `data` is a read-only zero-copy view on the memory map:
    float32 / float16 with `shape` for F32 / F16; uint16 with `shape` (raw bfloat16 bits) for BF16;
    uint8 of shape (*shape[:-1], row_bytes) for block-quantized types, each row holding
    shape[-1] / block_size blocks. `offset` is the absolute byte offset of the data in the file.
    """

    name: str
    qtype: QT
    shape: tuple[int, ...]
    data: np.ndarray
    n_bytes: int
    offset: int


class GGUFFile:
    """A GGUF model file, memory-mapped read-only, parsed and validated on construction.

    Attributes:
        path: the file path as a string.
        identity: [real path, device, inode, size, modification time in ns] of the file as it
            was opened: what the model cache's entries derived from it are keyed by
            (gguf/panelfile.py, gguf/verdicts.py); a file changed or replaced since is another.
        version: the GGUF format version (2 or 3).
        metadata: key -> value, in file order. Scalars are int, float or bool, strings are str,
            arrays of strings (tokenizer.ggml.tokens, .merges) are `StringArray`s (read-only
            sequences of str, equal to the lists of their strings), and arrays of
            numbers or bools (tokenizer.ggml.scores, .token_type) are 1-D numpy arrays (copies).
        tensors: name -> TensorInfo, in file order.
        config: the validated ModelConfig.
        alignment: the tensor data alignment in bytes.
        data_offset: where the tensor data section starts; everything before it is header,
            metadata and tensor table.
        buffer: the whole file as a read-only uint8 array on the memory map; every tensor's
            data is a view on it.

    Raises GGUFError when the file is not a well-formed GGUF of a supported architecture
    (and OSError when it cannot be opened at all). Only the header, metadata and tensor table
    are read while opening; tensor data is paged in when first used.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            if size < 4 + 4 + 8 + 8:
                raise GGUFError(f"{self.path}: file is truncated: {size} bytes is shorter than a GGUF header (24 bytes)")
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.identity = [os.path.realpath(self.path), st.st_dev, st.st_ino, size, st.st_mtime_ns]
        self.buffer = np.frombuffer(mm, dtype=np.uint8)
        self._mm = mm
        parser = _Parser(self.path, mm, size)
        self.version, self.metadata, infos = parser.parse()
        self.alignment = _alignment(self.path, self.metadata)
        self.data_offset = -(-parser.pos // self.alignment) * self.alignment
        self.tensors = {info[0]: self._tensor(*info) for info in infos}
        self.config = _model_config(self.path, self.metadata, self.tensors)
        _check_tensors(self.path, self.config, self.tensors)
        _check_tokenizer(self.path, self.config, self.metadata)

    def tensor(self, name: str) -> TensorInfo:
        """The tensor called `name`; GGUFError naming the file and the tensor if it is absent."""
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: has no tensor '{name}'") from None

    def quant_mix(self) -> dict[str, tuple[int, int]]:
        """Quant type name -> (number of tensors, bytes of data), largest byte count first."""
        mix: dict[str, tuple[int, int]] = {}
        for t in self.tensors.values():
            count, n_bytes = mix.get(t.qtype.name, (0, 0))
            mix[t.qtype.name] = (count + 1, n_bytes + t.n_bytes)
        return dict(sorted(mix.items(), key=lambda kv: -kv[1][1]))

    def __repr__(self) -> str:
        return f"GGUFFile({self.path!r}, arch={self.config.arch!r}, {len(self.tensors)} tensors)"

    def release(self, data: np.ndarray) -> None:
        """Let this process's resident memory drop the pages that hold `data`, a view of the
        buffer (the whole pages inside it): they stay in the OS's page cache and are read
        again from there if `data` is. For tensors that are read from another copy (the int8
        mode's weight panels); a no-op where the OS has no madvise. A view that reaches the end
        of the file has its last page whole (the file's tail shares it with nothing)."""
        lo = data.__array_interface__["data"][0] - self.buffer.__array_interface__["data"][0]
        hi = lo + data.nbytes
        if not 0 <= lo <= hi <= self.buffer.nbytes:
            raise ValueError("release() takes a view of the file's buffer")
        if not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE
        end = hi if hi == self.buffer.nbytes else hi // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _tensor(self, name: str, qtype: QT, dims: tuple[int, ...], rel_offset: int) -> TensorInfo:
        """Check one tensor-table entry against the file and build its zero-copy view."""
        block, type_size = BLOCK_SIZES[qtype]
        if dims[0] % block:
            raise GGUFError(f"{self.path}: tensor '{name}' has {dims[0]} elements per row, which is not a "
                            f"multiple of the {qtype.name} block size {block}; the size is inconsistent with the type")
        if rel_offset % self.alignment:
            raise GGUFError(f"{self.path}: tensor '{name}' data offset {rel_offset} is not a multiple of the "
                            f"alignment {self.alignment}; the tensor table is corrupt")
        row_bytes = dims[0] // block * type_size
        n_bytes = row_bytes * math.prod(dims[1:])
        start = self.data_offset + rel_offset
        if start + n_bytes > self.buffer.size:
            raise GGUFError(f"{self.path}: tensor '{name}' data [{start}, {start + n_bytes}) lies outside the file "
                            f"({self.buffer.size} bytes): the file is truncated or the tensor offset is corrupt")
        shape = tuple(reversed(dims))
        raw = self.buffer[start:start + n_bytes]
        if qtype in _FLOAT_DTYPES:
            data = raw.view(_FLOAT_DTYPES[qtype]).reshape(shape)
        else:
            data = raw.reshape(shape[:-1] + (row_bytes,))
        return TensorInfo(name, qtype, shape, data, n_bytes, start)


def read_metadata(path: str | os.PathLike[str]) -> dict:
    """The metadata of any well-formed GGUF file (of any architecture), without loading a model."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with mm:
        return _Parser(path, mm, mm.size()).parse()[1]


class _Parser:
    """Reads the header, metadata and tensor table, checking each length against what remains."""

    def __init__(self, path: str, buf: mmap.mmap, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def parse(self) -> tuple[int, dict, list[tuple[str, QT, tuple[int, ...], int]]]:
        """(version, metadata, [(name, qtype, dims in GGUF order, offset in data section)])."""
        magic = self.buf[:4]
        if magic != _MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {magic!r}, expected {_MAGIC!r})")
        self.pos = 4
        version = self.scalar("<I", "version")
        if version not in _VERSIONS:
            if version & 0xFFFF == 0 and version >> 24 in _VERSIONS:
                raise GGUFError(f"{self.path}: big-endian GGUF files are not supported; convert it little-endian")
            raise GGUFError(f"{self.path}: unsupported GGUF version {version} (npllama reads versions 2 and 3)")
        n_tensors = self.scalar("<Q", "tensor count")
        n_kv = self.scalar("<Q", "metadata count")
        if n_kv * _MIN_KV_BYTES > self.size - self.pos:
            raise GGUFError(f"{self.path}: file is truncated or corrupt: header claims {n_kv} metadata entries, "
                            f"more than the remaining {self.size - self.pos} bytes can hold")
        metadata: dict = {}
        for i in range(n_kv):
            key = self.string(f"metadata key #{i}")
            if key in metadata:
                raise GGUFError(f"{self.path}: duplicate metadata key '{key}'")
            metadata[key] = self.value(self.scalar("<I", f"value type of '{key}'"), key)
        if n_tensors * _MIN_TENSOR_INFO_BYTES > self.size - self.pos:
            raise GGUFError(f"{self.path}: file is truncated or corrupt: header claims {n_tensors} tensors, "
                            f"more than the remaining {self.size - self.pos} bytes can hold")
        infos = []
        names = set()
        for i in range(n_tensors):
            name = self.string(f"tensor name #{i}")
            if name in names:
                raise GGUFError(f"{self.path}: duplicate tensor '{name}'")
            names.add(name)
            infos.append(self.tensor_info(name))
        return version, metadata, infos

    def need(self, n: int, what: str) -> None:
        """GGUFError unless `n` more bytes remain at the current position."""
        if n > self.size - self.pos:
            raise GGUFError(f"{self.path}: file is truncated or corrupt: {what} at byte {self.pos} needs {n} bytes "
                            f"but only {self.size - self.pos} remain")

    def scalar(self, fmt: str, what: str):
        """Read one little-endian struct scalar."""
        n = struct.calcsize(fmt)
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def string(self, what: str) -> str:
        """Read a u64-length-prefixed UTF-8 string."""
        n = self.scalar("<Q", what)
        self.need(n, what)
        start, self.pos = self.pos, self.pos + n
        try:
            return self.buf[start:self.pos].decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"{self.path}: {what} at byte {start} is not valid UTF-8") from None

    def value(self, vtype: int, key: str):
        """Read a metadata value of GGUF value type `vtype` (see GGUFFile.metadata for the types)."""
        if vtype == VT.STRING:
            return self.string(f"value of '{key}'")
        if vtype in _SCALAR_FORMATS:
            v = self.scalar(_SCALAR_FORMATS[vtype], f"value of '{key}'")
            return bool(v) if vtype == VT.BOOL else v
        if vtype != VT.ARRAY:
            raise GGUFError(f"{self.path}: metadata key '{key}' has unknown value type {vtype}")
        itype = self.scalar("<I", f"array type of '{key}'")
        count = self.scalar("<Q", f"array length of '{key}'")
        if itype == VT.STRING:
            return self.string_array(count, key)
        if itype not in _SCALAR_FORMATS:
            raise GGUFError(f"{self.path}: metadata key '{key}' is an array of unsupported type {itype}")
        dtype = np.dtype(_SCALAR_FORMATS[itype])
        self.need(count * dtype.itemsize, f"array of {count} values of '{key}'")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return arr.astype(bool) if itype == VT.BOOL else arr

    def string_array(self, count: int, key: str) -> StringArray:
        """Read `count` strings, each checked to be UTF-8: a model's vocabulary and merges."""
        self.need(count * 8, f"array of {count} strings of '{key}'")  # bounds the edges' memory by the file's
        first = self.pos
        buf = np.frombuffer(self.buf, np.uint8, count=self.size)
        edges, n = string_edges(buf, first, count)
        bad = first_bad_string(buf, first, edges) if n == count else -1
        del buf  # a view of the map must not outlive an error here: the failed parse closes the map
        if n < count:
            raise GGUFError(f"{self.path}: file is truncated or corrupt: string #{n} of '{key}' "
                            f"runs past the end of the file")
        self.pos = first + int(edges[-1])
        if bad >= 0:
            raise GGUFError(f"{self.path}: string #{bad} of '{key}' is not valid UTF-8")
        return StringArray(self.buf[first:self.pos], edges)

    def tensor_info(self, name: str) -> tuple[str, QT, tuple[int, ...], int]:
        """Read the rest of one tensor-table entry after its name."""
        n_dims = self.scalar("<I", f"dimension count of tensor '{name}'")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GGUFError(f"{self.path}: tensor '{name}' has {n_dims} dimensions (expected 1 to {_MAX_DIMS})")
        dims = tuple(self.scalar("<Q", f"dimensions of tensor '{name}'") for _ in range(n_dims))
        if 0 in dims:
            raise GGUFError(f"{self.path}: tensor '{name}' has a zero-size dimension: {dims}")
        type_id = self.scalar("<I", f"type of tensor '{name}'")
        if type_id not in SUPPORTED_QTYPES:
            known = type_name(type_id)
            if known is None:
                raise GGUFError(f"{self.path}: tensor '{name}' has unknown type id {type_id}")
            supported = ", ".join(sorted(q.name for q in SUPPORTED_QTYPES))
            raise GGUFError(f"{self.path}: tensor '{name}' has quant type {known}, which npllama does not "
                            f"support (supported: {supported}); use a GGUF quantized to one of those")
        qtype = QT(type_id)
        offset = self.scalar("<Q", f"data offset of tensor '{name}'")
        return name, qtype, dims, offset


def _alignment(path: str, metadata: dict) -> int:
    """The tensor data alignment: general.alignment (a power of two) or the GGUF default."""
    align = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
        raise GGUFError(f"{path}: general.alignment is {align!r}; it must be a positive power of two")
    return align


def _model_config(path: str, metadata: dict, tensors: dict[str, TensorInfo]) -> ModelConfig:
    """The architecture's description of the model, read and checked by its module (npllama.arch)."""
    arch = _key(path, metadata, "general.architecture", str)
    if arch not in ARCHS:
        raise GGUFError(f"{path}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")
    return ModelConfig(**ARCHS[arch].configure(Meta(path, metadata, tensors, arch)))


def _check_tensors(path: str, cfg: ModelConfig, tensors: dict[str, TensorInfo]) -> None:
    """GGUFError for a missing required tensor or one whose shape disagrees with the config."""
    arch = ARCHS[cfg.arch]
    per_layer = arch.tensors(cfg)
    vocab = f"n_vocab={cfg.n_vocab}, n_embd={cfg.n_embd}"
    expected = {"token_embd.weight": ((cfg.n_vocab, cfg.n_embd), vocab)}
    if cfg.causal:  # a decoder's output norm; an encoder has none
        expected["output_norm.weight"] = ((cfg.n_embd,), f"n_embd={cfg.n_embd}")
    if hasattr(arch, "model_tensors"):
        expected.update(arch.model_tensors(cfg))
    optional = {
        "output.weight": ((cfg.n_vocab, cfg.n_embd), vocab),
        "rope_freqs.weight": ((cfg.rope_dim // 2,), f"rope_dim={cfg.rope_dim}"),
        "rope_factors_long.weight": ((cfg.rope_dim // 2,), f"rope_dim={cfg.rope_dim}"),
        "rope_factors_short.weight": ((cfg.rope_dim // 2,), f"rope_dim={cfg.rope_dim}"),
    }
    for name, (shape, why) in expected.items():
        _check_shape(path, tensors, name, shape, why, required=True)
    for name, (shape, why) in optional.items():
        _check_shape(path, tensors, name, shape, why, required=False)
    for i in range(cfg.n_layer):  # stops at the first missing tensor, so a huge n_layer cannot hang
        for suffix, (shape, why) in per_layer.items():
            _check_shape(path, tensors, f"blk.{i}.{suffix}", shape, why, required=True)
    if not cfg.attn_bias and any(name.endswith((".attn_k.bias", ".attn_q.bias", ".attn_v.bias")) for name in tensors):
        raise GGUFError(f"{path}: some layers have attention biases but layer 0 has no "
                        f"'blk.0.attn_q.bias'; biases must be in every layer or none")


def _check_shape(path: str, tensors: dict[str, TensorInfo], name: str, shape: tuple[int, ...],
                 why: str, required: bool) -> None:
    """GGUFError if tensor `name` is missing (when required), not `shape`, or a quantized vector."""
    t = tensors.get(name)
    if t is None:
        if required:
            raise GGUFError(f"{path}: missing required tensor '{name}'")
        return
    if t.shape != shape:
        raise GGUFError(f"{path}: tensor '{name}' has shape {t.shape} but the config ({why}) needs {shape}")
    if len(shape) == 1 and t.qtype not in _FLOAT_DTYPES:
        raise GGUFError(f"{path}: tensor '{name}' is a vector of quant type {t.qtype.name}; "
                        f"norm, bias and rope tensors must be F32, F16 or BF16")


def _check_tokenizer(path: str, cfg: ModelConfig, metadata: dict) -> None:
    """GGUFError if the tokenizer arrays disagree with each other or name ids past the vocabulary."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        return
    if not isinstance(tokens, StringArray):
        raise GGUFError(f"{path}: tokenizer.ggml.tokens should be an array of strings")
    if len(tokens) > cfg.n_vocab:
        raise GGUFError(f"{path}: the tokenizer has {len(tokens)} tokens but the model only {cfg.n_vocab} (n_vocab)")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        arr = metadata.get(key)
        if arr is not None and not (isinstance(arr, np.ndarray) and arr.shape == (len(tokens),)):
            raise GGUFError(f"{path}: {key} should be a numeric array of {len(tokens)} entries, one per token")
    merges = metadata.get("tokenizer.ggml.merges")
    if merges is not None and not isinstance(merges, StringArray):
        raise GGUFError(f"{path}: tokenizer.ggml.merges should be an array of strings")
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
        token_id = _key(path, metadata, key, int, None)
        if token_id is not None and not 0 <= token_id < cfg.n_vocab:
            raise GGUFError(f"{path}: {key} is {token_id}, outside the vocabulary (n_vocab={cfg.n_vocab})")
