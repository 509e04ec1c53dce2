"""Re-quantize a GGUF model with gguf.quants: every 2-D weight is dequantized exactly and
quantized again to `qtype`; metadata and 1-D tensors are copied as they are. Used to make the
Q8_0 and F16 variants of the default model for the fidelity tests and their fixtures."""
from __future__ import annotations

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT


def requantize(src, dst, qtype: QT):
    r = gguf.GGUFReader(str(src))
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for t in r.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # numpy order
        if len(shape) == 1:
            w.add_tensor(t.name, np.asarray(t.data, dtype=np.float32).reshape(shape))
            continue
        f32 = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        if qtype == QT.F16:
            w.add_tensor(t.name, f32.astype(np.float16))
        else:
            w.add_tensor(t.name, gguf.quants.quantize(f32, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
