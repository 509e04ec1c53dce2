"""Model files that passed a check, remembered in the model cache so that a later process
opening the same unchanged file does not check it again.

Opening a model checks its vocabulary whole (text/tokenizer.py, `check_metadata`): every
token unique, every merge two tokens whose concatenation is a token. For a 49k-token
vocabulary that is ~0.05 s of every start, for a file that has not changed since it last
passed. One JSON file (``checks.json`` in ``$NPLLAMA_CACHE``, else ``~/.cache/npllama``) maps
a check and a model file's path to the key of its last pass: the identity of the file as it
was opened (device, inode, size, modification time) and the check's version (its source's
hash). A pass is believed only under the same key; any change to the file or the check checks
again.

The record keeps the latest `KEEP` passes, and is written whole under a temporary name and
renamed into place. One that cannot be read or written only means checking again; a file of
that name that is not a record is left as it is.
"""
from __future__ import annotations

import json

from .hub import cache_dir, write_whole

KEEP = 256


def _path():
    return cache_dir() / "checks.json"


def _key(file, version: str) -> tuple[str, list]:
    """(the real path of GGUFFile `file`, the key of a pass of a check of `version` on it)."""
    real, *stat = file.identity
    return real, [*stat, version]


def _read() -> dict | None:
    """The passes recorded; {} where there is no record, None where the file there is not
    one (unreadable, or not a JSON object: it is then left as it is, and no pass recorded)."""
    try:
        with open(_path(), encoding="utf-8") as f:
            passes = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        return None
    return passes if isinstance(passes, dict) else None


def passed(check: str, version: str, file) -> bool:
    """Whether the model file that GGUFFile `file` opened passed `check` of `version` (the file
    as it was opened: a file that changed since is another)."""
    real, key = _key(file, version)
    return (_read() or {}).get(f"{check} {real}") == key


def record(check: str, version: str, file) -> None:
    """Remember that the model file that GGUFFile `file` opened passed `check` of `version`."""
    real, key = _key(file, version)
    passes = _read()
    if passes is None:
        return
    passes.pop(f"{check} {real}", None)
    passes[f"{check} {real}"] = key  # the latest last: the oldest go first
    write_whole(_path(), json.dumps(dict(list(passes.items())[-KEEP:])).encode())
