"""The exceptions npllama raises on purpose. Each is a ValueError, so callers that catch
bad input generically keep working, and each message says what was wrong and what to do;
`show` puts a caller's value into such a message."""
import reprlib


def show(value) -> str:
    """A short repr of a value for an error message, that never fails and stays short however
    deep, cyclic or huge the value (a message must not grow with a hostile input)."""
    try:
        return reprlib.repr(value)
    except Exception:  # noqa: BLE001 - e.g. an int too long to print
        return f"<{type(value).__name__}>"


class GGUFError(ValueError):
    """A GGUF file is malformed, truncated, or uses something npllama does not support."""


class PositionError(ValueError):
    """An explicit position disagrees with the KV cache length."""


class ContextOverflowError(ValueError):
    """A position lies past the context the model (or the session) was built for."""


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or verified."""


class DeviceError(RuntimeError):
    """device="cuda" was asked for where there is no usable CUDA device, driver or CuPy; the
    message says which, and what to install or use instead."""


class ChatTemplateError(ValueError):
    """A chat template failed, or went past one of the bounds on what a template may build
    (output size, string and list sizes, time); the message names the template and the bound."""


class MemoryLimitError(ValueError):
    """An allocation (a context's KV cache, a KV pool) would not fit in the memory available; it
    was refused before it was tried, with the bytes needed and available."""


class BadRowError(ValueError):
    """A row of a batch given to `BatchPredictor` cannot be processed (an empty or non-string
    prompt, one past the context...). The message names the row (its position in the batch,
    and its index label for a DataFrame) and what was wrong; `row` is that position."""

    def __init__(self, message: str, row: int | None = None):
        super().__init__(message)
        self.row = row

    def __reduce__(self):  # pickles with its row (Dask and Ray send errors back to the driver)
        return type(self), (self.args[0], self.row)
