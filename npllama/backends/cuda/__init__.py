"""The CUDA backend: `npllama.load(path, device="cuda")`.

Device arrays are CuPy's, and the kernels numba-cuda's (kernels.py). With
NUMBA_ENABLE_CUDASIM=1 in the environment (read when Numba is imported) the same backend runs
in Numba's CUDA simulator on the CPU, with NumPy arrays in place of CuPy's: no GPU and no CuPy
needed, which is how its tests run. Install with `pip install 'npllama[cuda]'`.
"""
from __future__ import annotations

import warnings

import numpy as np

from ...errors import DeviceError

_INSTALL = "install the extra with `pip install 'npllama[cuda]'` (CuPy for CUDA 13 and numba-cuda)"


def simulated() -> bool:
    """Whether Numba's CUDA simulator is on (NUMBA_ENABLE_CUDASIM=1 when Numba was imported)."""
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def array_module():
    """CuPy on a usable CUDA device; NumPy in the simulator; else DeviceError saying what is missing."""
    if simulated():
        return np
    try:
        import numba.cuda  # noqa: F401 - the kernels' compiler
    except ImportError:
        raise DeviceError(f"device='cuda' needs numba-cuda, which is not installed: {_INSTALL}") from None
    try:
        import cupy
    except ImportError:
        raise DeviceError(f"device='cuda' needs CuPy, which is not installed: {_INSTALL}") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CuPy raises its own runtime errors without a driver
        raise DeviceError(f"no CUDA device or driver was found ({type(e).__name__}: {e}); load the model "
                          f"with device='cpu', or set NUMBA_ENABLE_CUDASIM=1 to run the CUDA backend in "
                          f"Numba's simulator") from None
    if count < 1:
        raise DeviceError("no CUDA device was found (the driver reports none); load the model with device='cpu'")
    return cupy


def load(path, **options):
    """A model on the CUDA device (see npllama.load): the same API, logits as NumPy arrays.

    On a GPU it silences numba-cuda's low-occupancy warning ("Grid size N will likely result in
    GPU under-utilization"), for the process: a decode step's kernels are small grids by nature,
    and the warning would otherwise print for each of them."""
    xp = array_module()
    if xp is not np:
        warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization")
    from .model import CudaModel
    return CudaModel(path, xp=xp, **options)
