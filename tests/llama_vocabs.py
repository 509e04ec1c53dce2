"""llama.cpp's tokenizer test vectors, fetched once from PyPI into npllama's cache.

llama.cpp ships, under `models/`, small vocabulary-only GGUF files (`ggml-vocab-<name>.gguf`) with
texts (`.gguf.inp`) and the ids llama.cpp's tokenizer gives them (`.gguf.out`). They travel in the
`llama-cpp-python` sdist under `vendor/llama.cpp/models/`. `vocab_dir()` downloads that sdist once
(`pip download --no-binary`), checks its sha256, and extracts only the `ggml-vocab-*` files into
`<cache>/llama-cpp-vocabs-<version>/`. A file lock serialises concurrent test runs; the directory
appears by an atomic rename, complete or not at all.

Format (as llama.cpp's tests/test-tokenizer-0.cpp reads it): the `.inp` file holds the texts
separated by ``"\\n__ggml_vocab_test__\\n"`` (usually with one after the last text too), the
`.out` file one line of space-separated ids per text. Texts are tokenized without BOS and
without parsing special tokens.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from filelock import FileLock

from npllama.gguf.hub import cache_dir

SDIST = "llama-cpp-python==0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_MEMBER_DIR = "vendor/llama.cpp/models/"
_PREFIX = "ggml-vocab-"
SEPARATOR = "\n__ggml_vocab_test__\n"


class VocabFetchError(RuntimeError):
    """The llama.cpp vocabulary files could not be fetched."""


def vocab_dir() -> Path:
    """The directory holding llama.cpp's `ggml-vocab-*` files, fetched once (VocabFetchError if not)."""
    root = cache_dir()
    dest = root / f"llama-cpp-vocabs-{SDIST.split('==')[1]}"
    if dest.is_dir():
        return dest
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VocabFetchError(f"cannot create the cache directory {root}: {e}") from e
    with FileLock(str(root / (dest.name + ".lock")), timeout=900):
        if dest.is_dir():  # another process fetched it while we waited
            return dest
        with tempfile.TemporaryDirectory(prefix=".vocabs-", dir=root) as tmp:
            sdist = _download(Path(tmp) / "sdist")
            out = Path(tmp) / "models"
            _extract(sdist, out)
            os.replace(out, dest)
    return dest


def _download(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
           "--disable-pip-version-check", "-d", str(into), SDIST]
    print(f"fetching {SDIST} (sdist) from PyPI for llama.cpp's tokenizer test vectors (once)", file=sys.stderr)
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        raise VocabFetchError(f"pip download {SDIST} did not finish in {e.timeout} s") from e
    found = sorted(into.glob("*.tar.gz"))
    if res.returncode != 0 or len(found) != 1:
        tail = (res.stderr or "").strip().splitlines()[-1:] or ["(no output)"]
        raise VocabFetchError(f"could not download {SDIST} with pip: {tail[0]}")
    with open(found[0], "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    if digest != SDIST_SHA256:
        raise VocabFetchError(f"{found[0].name}: sha256 {digest}, expected {SDIST_SHA256}; the download was discarded")
    return found[0]


def _extract(sdist: Path, out: Path) -> None:
    """Extract the regular files `<top>/vendor/llama.cpp/models/ggml-vocab-*` flat into `out`."""
    out.mkdir()
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            top, _, rest = member.name.partition("/")
            if not (member.isfile() and rest.startswith(_MEMBER_DIR)):
                continue
            name = rest[len(_MEMBER_DIR):]
            if "/" in name or not name.startswith(_PREFIX):
                continue
            with tar.extractfile(member) as src, open(out / name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            n += 1
    if n == 0:
        raise VocabFetchError(f"{sdist.name} holds no {_MEMBER_DIR}{_PREFIX}* files")


def vocab_names(directory: Path) -> list[str]:
    """Names (`gpt-2`, `llama-spm`, ...) of the vocabularies that come with test vectors."""
    return sorted(p.name[len(_PREFIX):-len(".gguf.inp")] for p in directory.glob(f"{_PREFIX}*.gguf.inp"))


def read_vectors(directory: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of vocabulary `name`, parsed as llama.cpp's test-tokenizer-0 does."""
    base = directory / f"{_PREFIX}{name}.gguf"
    raw = base.with_name(base.name + ".inp").read_bytes().decode("utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        nxt = raw.find(SEPARATOR, pos)
        if nxt < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:nxt])
        pos = nxt + len(SEPARATOR)
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) != len(texts):
        raise ValueError(f"{base.name}: {len(texts)} texts but {len(lines)} lines of ids")
    return [(text, [int(t) for t in line.split()]) for text, line in zip(texts, lines)]
