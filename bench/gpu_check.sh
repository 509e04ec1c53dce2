#!/usr/bin/env bash
# Everything of the CUDA backend that needs a GPU, in one run of a few minutes (issue 18): the
# `gpu`-marked tests (the default model against the CPU engine when $NPLLAMA_MODEL names it,
# the kernels on realistic shapes against the CPU kernels), with the warp-shuffle reductions and
# again with the shared-memory ones, and bench/bench_gpu.py (tokens/s
# against the CPU engine and HF transformers on the same GPU, one kernel launch's cost).
#
# The GPU machines lent here have CuPy, numba-cuda, torch and transformers but no network and
# no `gguf`: put the wheels of what is missing in .gpu-wheels/ first (here:
#   pip download --no-deps -d .gpu-wheels gguf tokenizers jinja2 filelock threadpoolctl pyyaml pytest pytest-timeout hypothesis
# ) and carry that folder with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    python -m pip install -q --no-index --find-links .gpu-wheels --no-deps .gpu-wheels/*.whl
fi
python -m pip install -q --no-deps --no-build-isolation -e . || export PYTHONPATH="$PWD"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda_gpu.py || echo "gpu tests (warp shuffles): FAILED"
# the same with the simulator's shared-memory reductions: the two forms against the same references
NPLLAMA_CUDA_SHARED_REDUCTIONS=1 python -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda_gpu.py \
    || echo "gpu tests (shared-memory reductions): FAILED"
python bench/bench_gpu.py "$@"
