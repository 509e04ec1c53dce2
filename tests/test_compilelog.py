"""The word on kernels compiling: a first run's minutes of compiling must say what they are
doing, and a run whose compiles are short (or loaded from the cache) must say nothing."""
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
from numba import njit

from npllama.kernels import compilelog


class Terminal(io.StringIO):
    def isatty(self):
        return True


class Broken(io.StringIO):
    def write(self, text):
        raise OSError("the stream is gone")


def mine(func):
    return getattr(func, "__module__", None) == __name__


@pytest.fixture
def report(monkeypatch, tmp_path):
    """A fresh report counting this file's functions, shown at once, its cache in tmp_path."""
    fresh = compilelog._Report()
    monkeypatch.setattr(compilelog, "_report", fresh)
    monkeypatch.setattr(compilelog, "is_ours", mine)
    monkeypatch.setattr(compilelog, "DELAY", 0)
    monkeypatch.setenv("NPLLAMA_KERNEL_CACHE", str(tmp_path))
    yield fresh
    fresh.finish()


def compile_one(x=1):
    """Compile a new function (not cached): one kernel."""
    @njit
    def add_one(x):
        return x + 1
    assert add_one(x) == x + 1


def compile_two():
    """Compile a new function that compiles a new callee inside its own compile: two kernels."""
    @njit
    def inner(x):
        return x * 2

    @njit
    def outer(x):
        return inner(x) + 1
    assert outer(3) == 7


def test_a_plain_stream_gets_a_first_and_a_last_line(report):
    out = io.StringIO()
    compilelog.set_stream(out, always=True)
    before = compilelog.stats()
    compile_one()
    compile_two()
    compilelog.finish()
    kernels, seconds = compilelog.stats()
    assert kernels - before[0] == 3 and seconds > before[1]
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("npllama: compiling kernels for this CPU (once; cached in ")
    assert lines[-1].startswith("npllama: compiled 3 kernels in 0:0")
    assert lines[-1].endswith("; later runs load them)")


def test_a_plain_stream_gets_a_line_with_the_count_every_so_often(report, monkeypatch, tmp_path):
    monkeypatch.setattr(compilelog, "EVERY", 0)
    (tmp_path / compilelog.COUNTS).write_text(json.dumps({"run": 4}))
    out = io.StringIO()
    compilelog.set_stream(out, always=True)
    with compilelog.job("run"):
        compile_one()
    compilelog.finish()
    assert "npllama: compiling kernels: 1/4 so far, 0:0" in out.getvalue()


def test_a_terminal_gets_one_line_redrawn(report, monkeypatch):
    monkeypatch.setattr(compilelog, "TICK", 0.01)
    out = Terminal()
    compilelog.set_stream(out)
    compile_one()
    deadline = time.monotonic() + 10
    while "\n" not in out.getvalue() and time.monotonic() < deadline:  # the thread ends it after IDLE
        time.sleep(0.02)
    text = out.getvalue()
    assert text.startswith("\rnpllama: compiling kernels for this CPU")
    assert "add_one" in text and "1 kernel" in text
    assert text.count("\r") >= 6  # drawn at the start and end of the compile, redrawn by the thread, finished
    assert text.endswith("\n") and text.count("\n") == 1
    assert text.rsplit("\r", 1)[1].startswith("npllama: compiled 1 kernel in 0:0")


def test_not_a_terminal_and_not_forced_draws_nothing(report, caplog):
    out = io.StringIO()
    compilelog.set_stream(out)
    with caplog.at_level(logging.INFO, logger="npllama.compile"):
        compile_one()
        compilelog.finish()
    assert out.getvalue() == ""
    assert any("compiled 1 kernel in" in r.getMessage() for r in caplog.records)


def test_short_compiles_stay_silent(report, monkeypatch, caplog):
    monkeypatch.setattr(compilelog, "DELAY", 60)
    out = Terminal()
    compilelog.set_stream(out, always=True)
    before = compilelog.stats()[0]
    with caplog.at_level(logging.INFO, logger="npllama.compile"):
        compile_one()
        compilelog.finish()
    assert out.getvalue() == "" and caplog.records == []
    assert compilelog.stats()[0] == before + 1


def test_a_job_gives_the_total_it_compiled_last_time(report, tmp_path):
    with compilelog.job("decode") as j:
        compile_two()
    compilelog.finish()
    assert j.count == 2 and j.total is None
    assert json.loads((tmp_path / compilelog.COUNTS).read_text()) == {"decode": 2}
    assert not list(tmp_path.glob(".compile-counts.*"))  # no temporary file left

    out = Terminal()
    compilelog.set_stream(out)
    with compilelog.job("decode") as j:
        compile_one()
    compilelog.finish()
    assert j.total == 2
    assert f"[{'#' * (compilelog.BAR // 2)}{' ' * (compilelog.BAR // 2)}] 1/2" in out.getvalue()
    assert json.loads((tmp_path / compilelog.COUNTS).read_text()) == {"decode": 1}

    out = Terminal()
    compilelog.set_stream(out)
    with compilelog.job("never seen"):
        compile_one()
    compilelog.finish()
    assert "/" not in out.getvalue().split("cached in")[1].split(")")[1]
    assert "1 kernel" in out.getvalue()


def test_an_interrupted_job_or_an_unwritable_cache_records_nothing(report, tmp_path, monkeypatch):
    with pytest.raises(KeyboardInterrupt):
        with compilelog.job("run"):
            compile_one()
            raise KeyboardInterrupt
    assert not (tmp_path / compilelog.COUNTS).exists()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NPLLAMA_KERNEL_CACHE", str(tmp_path / "file" / "kernels"))
    with compilelog.job("run") as j:
        compile_one()
    assert j.count == 1 and j.total is None


def test_nested_jobs(report, tmp_path):
    (tmp_path / compilelog.COUNTS).write_text(json.dumps({"inner": 5, "outer": 7}))
    out = Terminal()
    compilelog.set_stream(out)
    with compilelog.job("outer") as outer:
        with compilelog.job("inner") as inner:
            compile_one()
        with compilelog.job("unknown"):
            compile_one()
    compilelog.finish()
    assert (inner.count, outer.count) == (1, 2)
    assert "] 1/5" in out.getvalue() and "] 2/7" in out.getvalue()  # the innermost known total
    assert json.loads((tmp_path / compilelog.COUNTS).read_text()) == {"inner": 1, "outer": 2, "unknown": 1}


def test_a_compile_counts_for_the_jobs_of_its_thread(report):
    with compilelog.job("main") as main:
        def work():
            with compilelog.job("worker") as worker:
                compile_one()
            assert worker.count == 1
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert main.count == 0
        compile_one()  # a thread without a job of its own counts for all open jobs
    assert main.count == 1


def test_logging(report, caplog):
    with caplog.at_level(logging.DEBUG, logger="npllama.compile"):
        compile_two()
        compilelog.finish()
    records = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "npllama.compile"]
    assert records[0][0] == logging.INFO and records[0][1].startswith("compiling kernels for this CPU")
    debug = [m for level, m in records if level == logging.DEBUG]
    assert len(debug) == 2 and all(m.startswith("compiled test_compilelog.") and m.endswith(" s") for m in debug)
    assert records[-1][0] == logging.INFO and records[-1][1].startswith("compiled 2 kernels in ")


def test_the_listener_never_raises(report, monkeypatch):
    compilelog.set_stream(Broken(), always=True)
    compile_one()
    compile_two()
    compilelog.finish()
    assert compilelog.stats()[0] >= 3

    def bad_predicate(func):
        raise RuntimeError("no")
    monkeypatch.setattr(compilelog, "is_ours", bad_predicate)
    compile_one()
    listener = compilelog._CompileListener()
    listener.on_start(object())
    listener.on_end(None)


def test_a_numba_without_compile_events_warns_once(monkeypatch):
    monkeypatch.setattr(compilelog, "_installed", False)
    monkeypatch.setattr(compilelog, "_register", None)
    with pytest.warns(RuntimeWarning, match="compile events"):
        compilelog.install()
    compilelog.install()  # once


def test_a_process_reports_on_stderr(tmp_path):
    code = ("import sys\n"
            "from numba import njit\n"
            "from npllama.kernels import compilelog\n"
            "compilelog.DELAY = 0\n"
            "compilelog.is_ours = lambda f: f.__module__ == '__main__'\n"
            "compilelog.set_stream(sys.stderr, always=True)\n"
            "f = njit(lambda x: x + 1)\n"
            "assert f(1) == 2\n")
    env = {**os.environ, "NPLLAMA_KERNEL_CACHE": str(tmp_path)}
    err = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         timeout=300).stderr
    lines = err.splitlines()
    assert lines[0] == f"npllama: compiling kernels for this CPU (once; cached in {tmp_path})"
    assert lines[-1].startswith("npllama: compiled 1 kernel in 0:0")
    assert lines[-1].endswith(f" (cached in {tmp_path}; later runs load them)")


def test_a_wait_for_another_process_is_shown_as_its_compile_and_its_kernels_counted(report):
    """A first token waiting for a helper process (engine/precompile.py) is reported as the
    helper's job being compiled, and the kernels the helper compiled join the count."""
    out = Terminal()
    compilelog.set_stream(out, always=True)
    compile_one()
    with compilelog.elsewhere("decode (in a helper process)") as shown:
        deadline = time.monotonic() + 10
        while "decode (in a helper process)" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)  # the thread redraws the line with the wait's name
        shown.kernels = 5
    compilelog.finish()
    assert "decode (in a helper process)" in out.getvalue()
    assert out.getvalue().rstrip().split("\r")[-1].startswith("npllama: compiled 6 kernels in 0:")
