"""Compiled kernels (Numba): quant formats and their products, norms, RoPE, attention."""
from .arraytype import install as _install_array_typing
from .cacheload import install as _install_lazy_loads
from .cachestamp import install as _install_cache_locators
from .codepages import install as _install_code_page_release
from .compilelog import install as _install_compile_report
from .linking import install as _install_own_copies
from .linking import install_out_of_line as _install_out_of_line_calls
from .shapeerrors import install as _install_plain_shape_errors

_install_own_copies()  # a kernel's bits never depend on what was loaded before it
_install_cache_locators()  # before any kernel module compiles or loads a cached function
if _install_lazy_loads():  # cached kernels load without Numba's registries; their bitcode parsed only if linked
    _install_out_of_line_calls()  # the fused kernels' workers compiled once, called by symbol
_install_code_page_release()  # LLVM's code leaves the resident set after each load
_install_array_typing()  # a plain array's first typing imports no numpy.ma
_install_plain_shape_errors()  # a slice's shape error compiles no string formatting
_install_compile_report()  # a first run's minutes of compiling say what they are doing
