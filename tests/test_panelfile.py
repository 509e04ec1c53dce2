"""A model's panels saved in the model cache and mapped by later models (gguf/panelfile.py):
the same bits as packing, keyed by the file and the layout, and never in the way."""
import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

import npllama
from npllama.gguf import panelfile
from npllama.engine import transformer
from npllama.gguf.reader import GGUFFile
from npllama.kernels.panels import pack_panels
from tinygguf import write_tiny_llama


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A model cache of the test's own, in which any arena is saved (the tiny model's is small)."""
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NPLLAMA_PANEL_CACHE", raising=False)
    monkeypatch.setattr(panelfile, "MIN_BYTES", 0)
    return tmp_path / "cache" / "panels"


def _entries(cache):
    return sorted(p.name for p in cache.iterdir()) if cache.exists() else []


def _model(path, monkeypatch, packs: bool, **options):
    """A model of `path` with its panels made; `packs`: whether it must pack them (else map them)."""
    if not packs:
        monkeypatch.setattr(transformer, "pack_panels", lambda *a, **k: pytest.fail("packed, not mapped"))
    m = npllama.Model(path, **options)
    m.panel_arena
    monkeypatch.setattr(transformer, "pack_panels", pack_panels)
    return m


def test_saved_then_mapped(tmp_path, cache, monkeypatch):
    """The first model packs and saves its panels; the next maps them (page-aligned, writable
    for Numba, though never written): the same panels, the same logits."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1)
    first = _model(path, monkeypatch, packs=True)
    (name,) = _entries(cache)
    assert name.startswith("m.gguf.") and name.endswith(".panels")
    second = _model(path, monkeypatch, packs=False)
    arena = second.panel_arena
    assert arena.ctypes.data % 4096 == 0 and arena.flags.writeable
    np.testing.assert_array_equal(arena, first.panel_arena)
    for w in second.product_weights():
        np.testing.assert_array_equal(second.panels(w), pack_panels(w.data, w.qtype))
    ids = np.array([1, 7, 42, 99])
    np.testing.assert_array_equal(second.forward(ids, 0, second.new_cache()), first.forward(ids, 0, first.new_cache()))


def test_a_changed_file_is_packed_again(tmp_path, cache, monkeypatch):
    """A model file rewritten (another modification time) packs again, and its entry replaces
    the old one (files there that are not entries stay); another file of the same name
    elsewhere has an entry of its own, removed once that file is gone."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1)
    _model(path, monkeypatch, packs=True)
    (old,) = _entries(cache)
    foreign = [cache / "m.gguf.notes.panels", cache / ".someone.tmp"]  # not entries: kept
    stale = cache / f".{old}.4242-0a1b2c3d.tmp"  # a save killed long ago: removed
    for f in foreign + [stale]:
        f.write_text("somebody else's")
        os.utime(f, (1, 1))
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _model(path, monkeypatch, packs=True)
    (new,) = (e for e in _entries(cache) if e not in {f.name for f in foreign})
    assert new != old and all(f.read_text() == "somebody else's" for f in foreign) and not stale.exists()
    for f in foreign:
        f.unlink()
    (tmp_path / "b").mkdir()
    other = write_tiny_llama(tmp_path / "b" / "m.gguf", qtype=QT.Q4_1)
    _model(other, monkeypatch, packs=True)
    assert len(_entries(cache)) == 2
    os.remove(other)  # the next save removes the entry of a file that is gone
    _model(write_tiny_llama(tmp_path / "c.gguf", qtype=QT.Q4_1), monkeypatch, packs=True)
    assert len(_entries(cache)) == 2 and new in _entries(cache)


def test_a_path_that_is_not_utf8(tmp_path, cache, monkeypatch):
    """A model file whose name is not UTF-8 (Linux allows any bytes) is saved and mapped too."""
    path = os.fsdecode(os.path.join(os.fsencode(str(tmp_path)), b"m\xff.gguf"))
    write_tiny_llama(path, qtype=QT.Q4_1)
    first = _model(path, monkeypatch, packs=True)
    assert len(_entries(cache)) == 1
    np.testing.assert_array_equal(_model(path, monkeypatch, packs=False).panel_arena, first.panel_arena)


def test_another_layout_does_not_map_the_entry(tmp_path, cache):
    """An entry answers only the layout (weights, types, shapes) and size it was saved for."""
    path = GGUFFile(write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1))
    layout = [["w", int(QT.Q4_1), 16, 32]]
    panels = np.arange(4096, dtype=np.uint8)
    assert panelfile.save(path, layout, "stamp", panels) is not None
    np.testing.assert_array_equal(panelfile.load(path, layout, "stamp", panels.size), panels)
    assert panelfile.load(path, [["w", int(QT.Q8_0), 16, 32]], "stamp", panels.size) is None
    assert panelfile.load(path, layout, "another stamp", panels.size) is None
    assert panelfile.load(path, layout, "stamp", panels.size - 64) is None


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_damaged_entry_is_packed_again(tmp_path, cache, monkeypatch, damage):
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1)
    want = _model(path, monkeypatch, packs=True).panel_arena.copy()
    (name,) = _entries(cache)
    entry = cache / name
    if damage == "truncated":
        os.truncate(entry, entry.stat().st_size - 1)
    else:
        with open(entry, "r+b") as f:
            f.write(b"X")
    m = _model(path, monkeypatch, packs=True)
    np.testing.assert_array_equal(m.panel_arena, want)
    assert entry.stat().st_size == panelfile.HEADER + want.size  # saved anew


def test_off_small_or_unwritable(tmp_path, cache, monkeypatch):
    """NPLLAMA_PANEL_CACHE=0 neither saves nor maps; arenas under MIN_BYTES are not saved; a
    cache directory that cannot be written leaves the model packing, and working."""
    path = write_tiny_llama(tmp_path / "m.gguf", qtype=QT.Q4_1)
    monkeypatch.setenv("NPLLAMA_PANEL_CACHE", "0")
    _model(path, monkeypatch, packs=True)
    assert _entries(cache) == []
    monkeypatch.delenv("NPLLAMA_PANEL_CACHE")
    monkeypatch.setattr(panelfile, "MIN_BYTES", 1 << 40)
    _model(path, monkeypatch, packs=True)
    assert _entries(cache) == []
    monkeypatch.setattr(panelfile, "MIN_BYTES", 0)
    (tmp_path / "blocker").write_text("a file where a folder of the cache's path would be")
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "blocker" / "cache"))
    m = _model(path, monkeypatch, packs=True)
    assert m.generate([1, 2, 3], max_tokens=2, temperature=0) is not None


@pytest.mark.model
def test_the_default_model_saved_then_mapped(default_model_path, tmp_path, monkeypatch):
    """The default model's 96 MB of panels (over MIN_BYTES) saved by one model, in a cache of
    the test's own, and mapped by the next: the same logits as packed panels, in both modes."""
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("NPLLAMA_PANEL_CACHE", raising=False)
    saver = _model(default_model_path, monkeypatch, packs=True)
    assert saver.panel_arena.nbytes >= panelfile.MIN_BYTES and len(_entries(tmp_path / "cache" / "panels")) == 1
    ids = saver.tokenize("The capital of France is")
    for activations in ("f32", "int8"):
        mapped = _model(default_model_path, monkeypatch, packs=False, activations=activations)
        monkeypatch.setenv("NPLLAMA_PANEL_CACHE", "0")
        packed = _model(default_model_path, monkeypatch, packs=True, activations=activations)
        monkeypatch.delenv("NPLLAMA_PANEL_CACHE")
        np.testing.assert_array_equal(mapped.forward(ids, 0, mapped.new_cache()),
                                      packed.forward(ids, 0, packed.new_cache()))
