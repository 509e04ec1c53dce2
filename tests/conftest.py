import pytest

from tinygguf import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random llama GGUF (F32 weights), written once per test session."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_q8_path(tmp_path_factory):
    """The same tiny model with Q8_0 matrices."""
    from gguf import GGMLQuantizationType as QT
    return write_tiny_llama(tmp_path_factory.mktemp("tinyq8") / "tiny-q8.gguf", qtype=QT.Q8_0)
