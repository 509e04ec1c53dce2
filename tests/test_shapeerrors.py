"""Numba's slice-assignment shape error on the CPU, without its message's formatting compiled
(kernels/shapeerrors.py)."""
import subprocess
import sys

import numpy as np
import pytest
from numba import njit
from numba.core import event

from npllama.kernels import shapeerrors


class _Compiled(event.Listener):
    """The modules of the functions Numba compiles while it listens."""

    def __init__(self):
        self.modules = []

    def on_start(self, ev):
        self.modules.append(getattr(getattr(ev.data["dispatcher"], "py_func", None), "__module__", ""))

    def on_end(self, ev):
        pass


def test_a_slice_of_another_shape_raises_the_plain_message_and_compiles_no_string_code():
    @njit
    def assign(a, b):
        a[1:3, :] = b

    listener = _Compiled()
    with event.install_listener("numba:compile", listener):
        with pytest.raises(ValueError, match="cannot assign slice from input of different size"):
            assign(np.zeros((5, 2)), np.ones((4, 2)))
    assert shapeerrors.INSTALLED  # at the first compile's refresh, or at import where arrayobj was imported
    assert not [m for m in listener.modules if m.startswith("numba.cpython.unicode")], listener.modules
    a = np.zeros((5, 2))
    assign(a, np.ones((2, 2)))  # shapes that agree still assign
    assert a[1:3].sum() == 4 and a.sum() == 4


def test_a_numba_whose_overload_differs_keeps_its_own_with_one_warning(monkeypatch):
    from numba.np import arrayobj
    monkeypatch.setattr(shapeerrors, "INSTALLED", False)
    monkeypatch.setattr(shapeerrors, "_REFUSED", [])
    monkeypatch.setattr(arrayobj, "ol_raise_with_shape_context_cpu", lambda *a: None)
    with pytest.warns(RuntimeWarning, match="slice-shape errors otherwise"):
        assert shapeerrors.replace() is False


def test_a_process_that_only_loads_kernels_imports_no_arrayobj():
    """The replacement waits for a compile's refresh: importing npllama imports no arrayobj."""
    code = "import sys, npllama.kernels; print('numba.np.arrayobj' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]
