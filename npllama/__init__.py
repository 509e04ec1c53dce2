"""npllama: CPU-first LLM inference on NumPy and Numba, reading GGUF models.

    import npllama
    model = npllama.load()                      # SmolLM2-135M-Instruct Q4_1 unless told otherwise
    print(model.chat([{"role": "user", "content": "Hi!"}], max_tokens=64))
"""
import importlib
from typing import TYPE_CHECKING

from . import targets

targets.apply()  # $NPLLAMA_TARGET: compile for a portable CPU target, set before Numba reads its settings

# The public names and the modules that define them. Each module is imported when one of its
# names is first used (PEP 562), so `import npllama` is cheap and a command imports only what it
# runs.
_EXPORTS = {
    ".cache.kvcache": ("KVCache",),
    ".cache.kvpool": ("KVPool", "PoolExhaustedError", "PoolSeq"),
    ".engine.batch": ("forward_batch",),
    ".engine.session": ("Session",),
    ".errors": ("BadRowError", "ChatTemplateError", "ContextOverflowError", "DeviceError", "GGUFError",
                "MemoryLimitError", "ModelFetchError", "PositionError"),
    ".generation.beam": ("beam_search",),
    ".generation.generate": ("Completion", "Token"),
    ".generation.sampling": ("SamplingParams", "make_sampler"),
    ".generation.scheduler": ("Scheduler", "complete_many", "generate_many"),
    ".gguf.hub": ("pull",),
    ".gguf.reader": ("GGUFFile", "ModelConfig"),
    ".kernels.quants": ("dequantize", "matmul"),
    ".model": ("Model", "load"),
    ".predictor": ("BatchPredictor",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)
__version__ = "0.1.0"


if TYPE_CHECKING:  # what type checkers and editors read: the same names, imported at once
    from .cache.kvcache import KVCache
    from .cache.kvpool import KVPool, PoolExhaustedError, PoolSeq
    from .engine.batch import forward_batch
    from .engine.session import Session
    from .errors import (BadRowError, ChatTemplateError, ContextOverflowError, DeviceError, GGUFError,
                         MemoryLimitError, ModelFetchError, PositionError)
    from .generation.beam import beam_search
    from .generation.generate import Completion, Token
    from .generation.sampling import SamplingParams, make_sampler
    from .generation.scheduler import Scheduler, complete_many, generate_many
    from .gguf.hub import pull
    from .gguf.reader import GGUFFile, ModelConfig
    from .kernels.quants import dequantize, matmul
    from .model import Model, load
    from .predictor import BatchPredictor


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # found directly from now on
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
