"""A model's weight panels kept on disk, so that a later process maps them rather than packing them.

The products read a model's weights as panels (kernels/panels.py), packed from the file's rows
into one array at the first forward pass: for SmolLM2-135M Q4_1, 96 MB in ~0.04 s, of which
~0.015 s is the OS handing out and zeroing fresh pages. That array is saved once in the
model cache (``panels/`` under ``$NPLLAMA_CACHE``, else ``~/.cache/npllama``) and later
processes map it: its pages come from the OS's page cache, neither packed nor zeroed, and
processes that run the same model (a server's workers, a pipeline's) share them.

An entry is named by the model file's name and a hash of its path, and keyed (in its header)
by the identity of the file as opened (`GGUFFile.identity`: device, inode, size,
modification time), the panels' layout (each
weight's name, type and shape) and the compiled kernels' source stamp (kernels/cachestamp.py,
which changes with the packing code). Any mismatch, or a file of the wrong size, and the
panels are packed again and saved anew; saving a model's entry removes its older ones. The
file is written whole (and synced) under a temporary name and renamed into place, so a
process never maps a part-written entry (the save adds ~0.05-0.09 s to a model's first run).
The mapping is private (copy-on-write): the kernels see a writable array and never write it.

Arenas under `MIN_BYTES` are not saved (they pack in a few ms). ``NPLLAMA_PANEL_CACHE=0``
turns saving and loading off. A cache directory that cannot be written only means packing
again next time. A save also removes the entries of model files that no longer exist (models
made in a temporary directory, say).
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import time
from pathlib import Path

import numpy as np

from .hub import cache_dir, write_whole

MIN_BYTES = 32 << 20
HEADER = 4096  # the panels start a page into the file (on a cache line, as the kernels want them)
_MAGIC = b"npllama panels 1\n"
_TEMPORARY = re.compile(r"\..+\.panels\.\d+-[0-9a-f]+\.tmp")  # a save's file before its rename (`hub._unique`)


def enabled() -> bool:
    return os.environ.get("NPLLAMA_PANEL_CACHE", "1") != "0"


def directory() -> Path:
    return cache_dir() / "panels"


def _entry(file, layout: list, stamp: str) -> tuple[Path, str, bytes]:
    """(the entry's path, the start of the names of the model's entries, its header: the key
    and the model file's path) for the model file that GGUFFile `file` opened."""
    real = file.identity[0]
    key = hashlib.sha256(json.dumps([*file.identity, layout, stamp]).encode()).hexdigest()
    model = f"{os.path.basename(real)}.{hashlib.sha256(os.fsencode(real)).hexdigest()[:12]}."
    header = b"".join((_MAGIC, key.encode(), b"\n", os.fsencode(real), b"\n"))
    if len(header) > HEADER:
        raise OSError(f"a model path of {len(real)} bytes does not fit an entry's header")
    return directory() / f"{model}{key[:16]}.panels", model, header


def _model_of(entry: Path) -> bytes | None:
    """The model file path an entry's header names (None where it names none)."""
    with open(entry, "rb") as f:
        lines = f.read(HEADER).split(b"\n")
    return lines[2] if len(lines) > 2 and lines[0] + b"\n" == _MAGIC else None


def load(file, layout: list, stamp: str, nbytes: int) -> np.ndarray | None:
    """The saved panels (`nbytes` uint8, mapped) of the model file that GGUFFile `file`
    opened, with `layout`, or None when there are none that match."""
    if nbytes < MIN_BYTES or not enabled():
        return None
    try:
        path, _, header = _entry(file, layout, stamp)
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size != HEADER + nbytes or f.read(len(header)) != header:
                return None
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError:
        return None
    return np.frombuffer(mm, np.uint8, count=nbytes, offset=HEADER)


def save(file, layout: list, stamp: str, panels: np.ndarray) -> Path | None:
    """Save `panels` (uint8) for the model file that GGUFFile `file` opened, with `layout`,
    and remove the model's older entries; the entry's path, or None where it was not saved."""
    if panels.nbytes < MIN_BYTES or not enabled():
        return None
    try:
        path, model, header = _entry(file, layout, stamp)
    except OSError:
        return None
    if not write_whole(path, header.ljust(HEADER, b"\0"), memoryview(np.ascontiguousarray(panels).reshape(-1)),
                       sync=True):
        return None
    for old in path.parent.iterdir():  # the model's other entries, those of files since removed,
        try:                             # and saves killed an hour ago
            if old.name.endswith(".panels") and old != path:
                named = _model_of(old)  # None: not an entry (no file of another's is removed)
                if named is not None and (old.name.startswith(model) or not os.path.exists(named)):
                    old.unlink()
            elif _TEMPORARY.fullmatch(old.name) and time.time() - old.stat().st_mtime > 3600:
                old.unlink()
        except OSError:
            pass
    return path
