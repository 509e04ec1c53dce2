"""Compiled kernels (Numba): quant formats and their products, norms, RoPE, attention."""
from .cachestamp import install as _install_cache_locators

_install_cache_locators()  # before any kernel module compiles or loads a cached function
