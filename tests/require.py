"""What a test does when something it needs from outside (a model, llama.cpp's vocabularies)
cannot be had: it skips, except under NPLLAMA_REQUIRE_MODEL=1 (as `.ci/run` sets), where it
fails, so that a run cannot pass without testing."""
import os

import pytest


def unavailable(message: str):
    """Skip with `message`, or fail with it under NPLLAMA_REQUIRE_MODEL=1."""
    if os.environ.get("NPLLAMA_REQUIRE_MODEL") == "1":
        pytest.fail(f"{message} (and NPLLAMA_REQUIRE_MODEL=1)", pytrace=False)
    pytest.skip(message)
