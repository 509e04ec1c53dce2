#!/usr/bin/env bash
# Everything of the CUDA backend that needs a GPU, in one run of a few minutes (issue 18):
# random models of SmolLM2-135M's and Gemma 3 270M's shapes written from their specs, the
# `gpu`-marked tests (those models against the CPU engine's logits, graph against eager steps,
# the kernels against gguf and NumPy) with the warp-shuffle reductions and again the kernels
# with the shared-memory ones, then bench/bench_gpu.py on both models (tokens/s with graphs, with
# and without the fused products, and eager, against HF transformers on the same GPU; a batch
# of 64 prompts against the CPU engine's throughput that gpu_prep.py measured; one kernel
# launch's cost).
#
# The GPU machines lent here have CuPy, numba-cuda, torch and transformers but no network, no
# `gguf`, and take at most 64 MiB along. First, here: `python bench/gpu_prep.py`, which writes
# .gpu-carry (the shapes and the CPU engine's reference logits) and .gpu-wheels; carry both.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu-wheels/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python3 -c "import numba, numba.cuda, cupy, numpy; print('numba', numba.__version__, 'cupy', cupy.__version__, 'numpy', numpy.__version__)"
if [ ! -f .gpu-carry/smollm2.pkl ] || [ ! -f .gpu-carry/gemma3.pkl ]; then
    echo "gpu_check.sh: .gpu-carry is missing: run 'python bench/gpu_prep.py' where the models are, and carry it" >&2
    exit 2
fi
for name in smollm2 gemma3; do
    python3 bench/shaped_model.py write .gpu-carry/$name.pkl .gpu-carry/$name.gguf
done
export NPLLAMA_GPU_REF=.gpu-carry
python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda_gpu.py || echo "gpu tests (warp shuffles): FAILED"
# the simulator's shared-memory reductions on the GPU: the same references
NPLLAMA_CUDA_SHARED_REDUCTIONS=1 python3 -m pytest -m gpu -p no:cacheprovider -q tests/test_cuda_gpu.py \
    -k "matvec or attention" || echo "gpu tests (shared-memory reductions): FAILED"
python3 bench/bench_gpu.py --model .gpu-carry/smollm2.gguf --model .gpu-carry/gemma3.gguf "$@"
