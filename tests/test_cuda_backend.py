"""The CUDA backend without a GPU: every kernel compiles to PTX for compute capability 9.0
(H100/H200) with explicit signatures and no float64 instruction; `load(device="cuda")` raises
DeviceError where there is no usable device; the CPU engine never imports the backend. Its
kernels and a whole model run in Numba's simulator in tests/cuda (a process of their own)."""
import os
import pathlib
import subprocess
import sys
import types

import pytest

cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is installed by the test extra")
from numba import boolean, float32, int8, int32, int64, uint8  # noqa: E402
from numba.core.types import float16  # noqa: E402

import npllama  # noqa: E402
from npllama.backends.cuda import kernels as K  # noqa: E402

f32_1, f32_2, f32_3 = float32[::1], float32[:, ::1], float32[:, :, ::1]
SIGNATURES = {
    "_matvec_kernel": [(int64, f32_3, q[:, :, ::1], f32_2, f32_1, int64, int64, int64, int64, int64, boolean)
                       for q in (int8, uint8)],
    "_dequantize_kernel": [(int64, f32_3, q[:, :, ::1], f32_2, int64, int64) for q in (int8, uint8)],
    "_rmsnorm_kernel": [(f32_2, f32_1, float32, f32_2, int64)],
    "_head_norms_kernel": [(f32_2, f32_2, f32_1, f32_1, float32, f32_2, f32_2, int64)],
    "_add_rmsnorm_kernel": [(f32_2, f32_2, f32_1, float32, int64)],
    "_rope_store_kernel": [(f32_3, f32_3, f32_3, kv[:, :, :, ::1], int64[::1], int64[::1], f32_2, f32_2, boolean,
                            int64) for kv in (float32, float16)],
    "_glu_kernel": [(f32_1, f32_1, f32_1, int64, int64)],
    "_store_kv_kernel": [(kv[:, :, :, ::1], f32_3, f32_3, int64[::1]) for kv in (float32, float16)],
    "_attention_split_kernel": [(f32_3, kv[:, :, :, :, ::1], int32[:, ::1], int64[::1], int64[::1], int64, float32,
                                 int64, f32_2, f32_2, f32_3) for kv in (float32, float16)],
    "_attention_merge_kernel": [(f32_2, f32_2, f32_3, f32_3, int64)],
}


def test_every_kernel_is_checked():
    kernels = {name for name, obj in vars(K).items() if name.endswith("_kernel")}
    assert kernels == set(SIGNATURES)


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_kernel_compiles_to_ptx_without_float64(name):
    assert K.SHUFFLES and K.LANES == 32  # the warp-shuffle reductions are the ones compiled
    for sig in SIGNATURES[name]:
        ptx, _ = cuda.compile_ptx(getattr(K, name).py_func, sig, cc=(9, 0))
        assert ".target sm_90" in ptx
        body = [line for line in ptx.splitlines() if not line.lstrip().startswith("//")]
        assert not [line for line in body if ".f64" in line], f"{name}{sig}: float64 in the PTX"
        if name in ("_matvec_kernel", "_rmsnorm_kernel", "_head_norms_kernel", "_add_rmsnorm_kernel"):
            assert "shfl.sync.bfly" in ptx  # a GPU reduces across the warp by shuffles


def test_shared_memory_reductions_compile_for_a_gpu():
    """NPLLAMA_CUDA_SHARED_REDUCTIONS=1 (the simulator's form, on a GPU: gpu_check.sh compares
    the two) compiles too, without shuffles or float64."""
    code = ("import sys\nfrom numba import cuda\nfrom npllama.backends.cuda import kernels as K\n"
            "sys.path.insert(0, 'tests')\nfrom test_cuda_backend import SIGNATURES\nassert not K.SHUFFLES\n"
            "for name in ('_matvec_kernel', '_rmsnorm_kernel', '_head_norms_kernel', '_add_rmsnorm_kernel',\n"
            "             '_attention_split_kernel'):\n"
            "    ptx, _ = cuda.compile_ptx(getattr(K, name).py_func, SIGNATURES[name][0], cc=(9, 0))\n"
            "    assert 'shfl' not in ptx and 'bar.sync' in ptx and '.f64' not in ptx, name\n")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "NPLLAMA_CUDA_SHARED_REDUCTIONS": "1"},
                   cwd=pathlib.Path(__file__).parent.parent)


def test_no_device_is_a_clear_error(monkeypatch, tiny_model_path):
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not installed
    with pytest.raises(npllama.DeviceError, match="needs CuPy"):
        npllama.load(tiny_model_path, device="cuda")

    def no_driver():
        raise RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient")

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=no_driver)))
    monkeypatch.setitem(sys.modules, "cupy", fake)  # CuPy imports, but there is no driver
    with pytest.raises(npllama.DeviceError, match="no CUDA device or driver was found"):
        npllama.load(tiny_model_path, device="cuda")
    fake.cuda.runtime.getDeviceCount = lambda: 0
    with pytest.raises(RuntimeError, match="no CUDA device was found"):
        npllama.load(tiny_model_path, device="cuda")
    with pytest.raises(ValueError, match="device must be"):
        npllama.load(tiny_model_path, device="gpu")


def test_cpu_engine_does_not_import_the_backend(tiny_model_path):
    code = ("import sys, npllama; m = npllama.load(sys.argv[1]); m.generate('hi', max_tokens=2); "
            "print(sorted(n for n in sys.modules if n.startswith(('cupy', 'numba.cuda', 'npllama.backends'))))")
    out = subprocess.run([sys.executable, "-c", code, str(tiny_model_path)], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("command", [["run", "hi", "-n", "2"], ["serve", "--port", "0"]])
def test_cli_device_flag_without_a_device(monkeypatch, capsys, tiny_model_path, command):
    from npllama.cli import main
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert main([*command, "--device", "cuda", "-m", str(tiny_model_path)]) == 1
    assert "needs CuPy" in capsys.readouterr().err


def test_the_models_stream_is_entered_by_one_thread_at_a_time():
    """A GPU model's stream (a CuPy stream in _Stream) admits one thread at a time: another
    thread's launches would otherwise join a decode graph's capture."""
    import threading
    import time
    from npllama.backends.cuda.model import _Stream

    class Fake:  # a CuPy stream's context protocol, recording who is inside
        inside, most, log = 0, 0, []

        def __enter__(self):
            Fake.inside += 1
            Fake.most = max(Fake.most, Fake.inside)

        def __exit__(self, *exc):
            Fake.inside -= 1

        def synchronize(self):
            Fake.log.append("sync")

    stream = _Stream(Fake())

    def work():
        with stream:
            with stream:  # re-entered by the same thread (a cache growing inside a pass)
                time.sleep(0.01)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stream.synchronize()
    assert (Fake.most, Fake.inside, Fake.log) == (2, 0, ["sync"])  # two: the one thread, nested
    with pytest.raises(KeyError):
        with stream:
            raise KeyError("x")
    assert stream._lock.acquire(blocking=False)  # released after an error inside
    stream._lock.release()


def test_a_batched_step_that_fails_to_capture_keeps_no_graph():
    """A batched decode step whose capture fails ends the capture and keeps no graph (the pass
    then runs eagerly, CudaModel._batch_step), where a later pass would have launched a broken
    one; a capture that works keeps the graph and its output buffer."""
    from npllama.backends.cuda.model import _BatchStep
    log = []

    class Stream:  # a CuPy stream's capture calls
        def begin_capture(self, mode):
            log.append("begin")

        def end_capture(self):
            log.append("end")
            return "graph"

    def fails(pool, end):
        raise RuntimeError("operation not permitted when stream is capturing")

    st = _BatchStep.__new__(_BatchStep)  # no device buffers: only the capture is exercised
    st.model = types.SimpleNamespace(stream=types.SimpleNamespace(cupy=Stream()),
                                     xp=types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=None)))
    st.graph = st.out = None
    st.run = fails
    with pytest.raises(RuntimeError, match="capturing"):
        st.capture(None, 1)
    assert st.graph is None and log == ["begin", "end"]
    st.run = lambda pool, end: "logits"
    st.capture(None, 1)
    assert (st.graph, st.out, log) == ("graph", "logits", ["begin", "end"] * 2)
