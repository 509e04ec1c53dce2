"""Compiled kernels (Numba): quant formats and their products, norms, RoPE, attention."""
