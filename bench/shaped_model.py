"""A random GGUF with the shape of a real one: the same metadata (tokenizer included), tensor
names, shapes and quant types, with random blocks (sane float16 scales) in place of the weights.

For speed measurements where the real file cannot travel: a GPU machine here has no network,
and what is carried there is limited to 64 MiB (bench/gpu_check.sh). The speed of a pass does
not depend on the weights' values; its logits mean nothing.

    python bench/shaped_model.py spec REAL.gguf SPEC.pkl   # here: the shape, a few MiB
    python bench/shaped_model.py write SPEC.pkl OUT.gguf   # there: the random model
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tinygguf import random_blocks  # noqa: E402

_SKIP = ("GGUF.", "general.alignment")  # the writer's own fields


def spec(path) -> dict:
    """The metadata (key, value, type, subtype) and tensors (name, shape, type) of a GGUF."""
    r = gguf.GGUFReader(path)
    fields = []
    for f in r.fields.values():
        if f.name.startswith(_SKIP):
            continue
        sub = f.types[1] if f.types[0] == VT.ARRAY else None
        fields.append((f.name, f.contents(), f.types[0], sub))
    tensors = [(t.name, [int(n) for n in t.shape], QT(t.tensor_type)) for t in r.tensors]
    return {"arch": r.fields["general.architecture"].contents(), "fields": fields, "tensors": tensors}


def write(s: dict, out, seed: int = 0):
    """The random model of spec `s` at `out`."""
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(out), s["arch"])
    for name, value, vtype, sub in s["fields"]:
        if name != "general.architecture":
            w.add_key_value(name, value, vtype, sub)
    for name, shape, qtype in s["tensors"]:
        rows, cols = int(np.prod(shape[1:])), shape[0]  # gguf lists the fastest axis first
        if qtype == QT.F32:
            a = (1.0 + 0.1 * rng.standard_normal(rows * cols)) if rows == 1 else 0.02 * rng.standard_normal(rows * cols)
            w.add_tensor(name, a.astype(np.float32).reshape(shape[::-1]))
        elif qtype == QT.F16:
            w.add_tensor(name, (0.02 * rng.standard_normal(rows * cols)).astype(np.float16).reshape(shape[::-1]))
        else:
            block_elems = gguf.GGML_QUANT_SIZES[qtype][0]
            raw = random_blocks(qtype, rows * cols // block_elems, rng).reshape(rows, -1)
            w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main(argv):
    if len(argv) != 3 or argv[0] not in ("spec", "write"):
        sys.exit(__doc__)
    if argv[0] == "spec":
        with open(argv[2], "wb") as f:
            pickle.dump(spec(argv[1]), f)
    else:
        with open(argv[1], "rb") as f:
            write(pickle.load(f), argv[2])


if __name__ == "__main__":
    main(sys.argv[1:])
