"""npllama: CPU-first LLM inference on NumPy and Numba, reading GGUF models.

    import npllama
    model = npllama.load()                      # SmolLM2-135M-Instruct Q4_1 unless told otherwise
    print(model.chat([{"role": "user", "content": "Hi!"}], max_tokens=64))
"""
from .batch import beam_search, forward_batch
from .scheduler import Scheduler, complete_many, generate_many
from .errors import (BadRowError, ChatTemplateError, ContextOverflowError, GGUFError, MemoryLimitError,
                     ModelFetchError, PositionError)
from .generate import Completion, Token
from .gguf_file import GGUFFile, ModelConfig
from .hub import pull
from .kvcache import KVCache
from .kvpool import KVPool, PoolExhaustedError, PoolSeq
from .model import Model, load
from .predictor import BatchPredictor
from .quants import dequantize, matmul
from .sampling import SamplingParams, make_sampler
from .session import Session

__all__ = [
    "BadRowError", "BatchPredictor", "ChatTemplateError", "Completion", "ContextOverflowError", "GGUFError",
    "GGUFFile", "KVCache", "KVPool", "MemoryLimitError", "Model", "ModelConfig", "ModelFetchError",
    "PoolExhaustedError", "PoolSeq", "PositionError", "SamplingParams", "Scheduler", "Session", "Token",
    "beam_search", "complete_many", "dequantize", "forward_batch", "generate_many", "load", "make_sampler",
    "matmul", "pull",
]
__version__ = "0.1.0"
