"""npllama: CPU-first LLM inference on NumPy and Numba, reading GGUF models.

    import npllama
    model = npllama.load()                      # SmolLM2-135M-Instruct Q4_1 unless told otherwise
    print(model.chat([{"role": "user", "content": "Hi!"}], max_tokens=64))
"""
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

__all__ = [
    "BadRowError", "BatchPredictor", "ChatTemplateError", "Completion", "ContextOverflowError", "DeviceError",
    "GGUFError",
    "GGUFFile", "KVCache", "KVPool", "MemoryLimitError", "Model", "ModelConfig", "ModelFetchError",
    "PoolExhaustedError", "PoolSeq", "PositionError", "SamplingParams", "Scheduler", "Session", "Token",
    "beam_search", "complete_many", "dequantize", "forward_batch", "generate_many", "load", "make_sampler",
    "matmul", "pull",
]
__version__ = "0.1.0"
