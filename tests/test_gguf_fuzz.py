"""Property test: GGUFFile on a randomly truncated or byte-flipped GGUF either loads cleanly or
raises GGUFError, quickly; never another exception, a crash or a hang."""
import time

import pytest
from gguf import GGMLQuantizationType as QT
from hypothesis import given, settings, strategies as st

from npllama.errors import GGUFError
from npllama.gguf.reader import GGUFFile
from tinygguf import write_tiny_llama

SECONDS_PER_CASE = 5.0  # generous for a loaded 2-core machine; a clean case takes milliseconds


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(bytes of a small valid Q8_0 model, where its tensor data starts, a scratch file path)."""
    folder = tmp_path_factory.mktemp("fuzz")
    path = write_tiny_llama(folder / "base.gguf", n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=32,
                            qtype=QT.Q8_0)
    return path.read_bytes(), GGUFFile(path).data_offset, folder / "case.gguf"


def _position(data: st.DataObject, size: int, header_end: int) -> int:
    """A byte position, two times in three inside the header, metadata and tensor table."""
    if data.draw(st.integers(0, 2), label="anywhere") == 0:
        return data.draw(st.integers(0, size - 1), label="position")
    return data.draw(st.integers(0, header_end - 1), label="position")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_corrupted_gguf_loads_or_raises_gguf_error(base, data):
    original, header_end, path = base
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(0, 4), label="n_edits")):
        at = _position(data, len(buf), header_end)
        kind = data.draw(st.sampled_from(["bit", "byte", "u64"]), label="kind")
        if kind == "bit":
            buf[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
        elif kind == "byte":
            buf[at] = data.draw(st.integers(0, 255), label="byte")
        else:  # a length or count field turned huge, or anything else
            value = data.draw(st.sampled_from([2**64 - 1, 2**63, 2**32, 2**31 - 1]) | st.integers(0, 2**64 - 1))
            buf[at:at + 8] = value.to_bytes(8, "little")[:len(buf) - at]
    if data.draw(st.booleans(), label="truncate"):
        del buf[_position(data, len(buf), min(header_end, len(buf))):]
    path.unlink(missing_ok=True)  # a fresh inode, never rewriting a file that may still be mapped
    path.write_bytes(bytes(buf))

    start = time.perf_counter()
    try:
        gf = GGUFFile(path)
    except GGUFError as e:
        assert str(path) in str(e)
    else:
        for t in gf.tensors.values():
            assert t.data.nbytes == t.n_bytes
            t.data.reshape(-1)[-1]  # the view's last byte lies inside the mapped file
        assert gf.config.n_layer == 1
    assert time.perf_counter() - start < SECONDS_PER_CASE
