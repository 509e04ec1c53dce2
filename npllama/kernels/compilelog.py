"""A word on what npllama is doing while it compiles its kernels.

A machine that has never run npllama compiles its kernels before the first reply: one to four
minutes in which nothing else happens, and a process that prints nothing meanwhile looks hung.
Numba announces each function it compiles (its "numba:compile" events, a start and an end,
nested where a kernel compiles the npllama functions it calls inside its own compile); the
listener here counts npllama's, each once, when it ends. Loading a kernel from the cache
raises no event, so later runs stay silent, and so do short compiles: the report starts only
once compiling has gone on for longer than DELAY, and ends once no npllama compile has run for
IDLE seconds. Meanwhile a daemon thread redraws it every TICK seconds, so that its clock moves
while one large kernel compiles for a minute (LLVM's work runs through ctypes, which lets go
of the GIL). On a terminal the report is one line redrawn in place: a bar where the total is
known, the function being compiled, the time so far; elsewhere (a log file, a service's
journal) plain lines, one every EVERY seconds at most; and a last line with the count and time.

The total comes from `job`: work that names itself (`with compilelog.job("decode"): ...`) is
shown against the number of kernels the same name compiled the last time it compiled any,
which `cache_root()/compile-counts.json` keeps.

By default the report is drawn on sys.stderr only where that is a terminal: a library must not
write to the stderr of a program that did not ask. The CLI and the server ask for it on stderr
always (`set_stream(sys.stderr, always=True)`). Logger "npllama.compile" gets INFO records at
the start and the end of every report and a DEBUG record for each kernel, whatever is drawn.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import tempfile
import threading
import time
import warnings

try:
    from numba.core.event import Listener as _Listener
    from numba.core.event import register as _register
except ImportError:  # a Numba without compile events: `install` warns and does nothing
    _Listener, _register = object, None

from .cachestamp import cache_root

DELAY = 1.0  # seconds of compiling before the report starts
IDLE = 2.0  # seconds without an npllama compile that end it (a run loads a few files between its groups of kernels)
TICK = 0.25  # seconds between redraws
EVERY = 10.0  # seconds between plain lines, where the stream is not a terminal
BAR = 20  # the bar's width in characters
COUNTS = "compile-counts.json"  # in cache_root(): {job label: kernels it compiled}

log = logging.getLogger("npllama.compile")


def is_ours(func) -> bool:
    """Whether `func`, the Python function of a dispatcher being compiled, is npllama's (the
    predicate the listener asks; tests replace it to count functions of their own)."""
    return (getattr(func, "__module__", None) or "").startswith("npllama.")


def _name(func) -> str:
    """`func` as the report shows it: module and qualified name, without 'npllama.'."""
    name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
    return name.removeprefix("npllama.")


def _mmss(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60}:{s % 60:02d}"


def _kernels(n: int) -> str:
    return f"{n} kernel" if n == 1 else f"{n} kernels"


def _where() -> str:
    """cache_root(), with ~ for the home directory (the report's lines are read, not parsed)."""
    path, home = str(cache_root()), os.path.expanduser("~")
    if home not in ("", "~", os.sep) and (path == home or path.startswith(home + os.sep)):
        return "~" + path[len(home):]
    return path


def _counts() -> dict[str, int]:
    """compile-counts.json, or {} where it is missing or unreadable."""
    try:
        with open(cache_root() / COUNTS, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}


_counts_lock = threading.Lock()  # one read-modify-write of compile-counts.json at a time


def _record(label: str, count: int) -> None:
    """Set `label`'s count in compile-counts.json, replacing the file whole (a reader in another
    process sees the old file or the new one). A directory that cannot be written is left be:
    the next run shows no total, nothing worse."""
    with _counts_lock:
        counts = _counts()
        counts[label] = count
        root = cache_root()
        try:
            root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=root, prefix=".compile-counts.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(counts, f, indent=1, sort_keys=True)
                os.replace(tmp, root / COUNTS)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError:
            pass


class _Job:
    """A piece of work that names itself to the report (see `job`)."""

    def __init__(self, label: str):
        self.label, self.count, self.total = label, 0, None

    def __enter__(self):
        self.total = _counts().get(self.label)
        self.thread = threading.get_ident()
        self._report = _report
        with self._report.lock:
            self._report.jobs.append(self)
        return self

    def __exit__(self, kind, value, traceback):
        with self._report.lock:
            self._report.jobs.remove(self)
        if self.count and kind is None:  # an interrupted job's count is not its total
            _record(self.label, self.count)
        return False


class _Elsewhere:
    """See `elsewhere`."""

    def __init__(self, name: str):
        self.name, self.kernels = name, 0

    def __enter__(self):
        _report.waiting(self, self.name)
        return self

    def __exit__(self, *exc):
        _report.waited(self, self.kernels)
        return False


def elsewhere(name: str) -> _Elsewhere:
    """`with elsewhere(name) as w:` around a wait for kernels that another process compiles
    for this one (a helper process beside the first prompt): shown as `name` being compiled
    while the wait lasts, and the `w.kernels` it compiled, set by the caller, counted."""
    return _Elsewhere(name)


def job(label: str) -> _Job:
    """`with job(label):` around work that may compile kernels: the report shows the kernels
    compiled so far against the count the same label compiled the last time it compiled any
    (an unknown label: no total), and this count is kept for next time. Jobs nest (the
    innermost with a known total gives it) and run in any thread: a compile counts for the
    open jobs of the thread that compiles it, or for all open jobs where that thread has
    none (work handed to a pool of threads). `.count` is the kernels compiled so far."""
    return _Job(label)


class _Report:
    """The listener's state, behind one lock: the listener runs in whichever thread compiles
    (one at a time, under Numba's compiler lock), the redraws in a thread of their own, and
    jobs open and close in any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.stream, self.always = None, False  # see set_stream
        self.running: list = []  # npllama's compiles under way, outermost first:
        # (dispatcher, name, start, how many overloads it had)
        self.jobs: list[_Job] = []  # open jobs, oldest first
        self.compiler = None  # the thread that compiles or compiled last
        self.kernels, self.seconds = 0, 0.0  # stats()
        self.episode = 0  # bumped at each end, so that a report's thread knows its report ended
        self.since = None  # when the current run of compiles began; None between runs
        self.count = self.last = self.shown = self.said = self.width = 0
        self.out = self.tty = self.where = None

    # the listener's side
    def started(self, dispatcher) -> None:
        func = getattr(dispatcher, "py_func", None)
        if func is not None and is_ours(func):
            self._run(dispatcher, _name(func), len(getattr(dispatcher, "overloads", ())))

    def waiting(self, token, name: str) -> None:
        """A compile in another process that this one waits for (`elsewhere`), shown as
        running until `waited`."""
        self._run(token, name, 0)

    def _run(self, key, name: str, overloads: int) -> None:
        """A compile under way (`key`: its dispatcher, or a wait's token), the report's thread
        started with the first of a run of them."""
        now = time.monotonic()
        with self.lock:
            if self.since is None:
                self.since, self.last, self.count, self.shown = now, now, 0, False
                threading.Thread(target=self._watch, args=(self.episode,), name="npllama-compilelog",
                                 daemon=True).start()
            self.running.append((key, name, now, overloads))
            self.compiler = threading.get_ident()
            self._update(now)

    def waited(self, token, kernels: int) -> None:
        now = time.monotonic()
        with self.lock:
            self.running = [r for r in self.running if r[0] is not token]
            if not self.running:
                self.last = now
            self.count += kernels
            for j in self._jobs_of(threading.get_ident()):
                j.count += kernels
            self._update(now)

    def ended(self, dispatcher) -> None:
        now = time.monotonic()
        with self.lock:
            for i in range(len(self.running) - 1, -1, -1):
                if self.running[i][0] is dispatcher:
                    break
            else:
                return  # not ours, or begun before the listener was installed
            _, name, start, before = self.running.pop(i)
            if not self.running:
                self.seconds += now - start
                self.last = now
            # a compile that succeeded has added its overload (Numba's Event.is_failed cannot
            # tell: in 0.68 it is False for every event)
            if not hasattr(dispatcher, "overloads") or len(dispatcher.overloads) > before:
                self.kernels += 1
                self.count += 1
                for j in self._jobs_of(threading.get_ident()):
                    j.count += 1
                log.debug("compiled %s in %.2f s", name, now - start)
            self._update(now)

    # the report's side
    def _jobs_of(self, thread) -> list[_Job]:
        return [j for j in self.jobs if j.thread == thread] or self.jobs

    def _update(self, now: float) -> None:
        """Redraw a report under way (its count or its function changed), or start one."""
        if self.shown:
            self._draw(now)
        else:
            self._show_if_due(now)

    def _show_if_due(self, now: float) -> None:
        """Start the report where compiling has gone on for DELAY."""
        if self.shown or now - self.since < DELAY:
            return
        self.shown, self.said, self.width = True, now, 0
        self.where = _where()
        self._open()
        log.info("compiling kernels for this CPU (once; cached in %s): %s in %.1f s so far",
                 self.where, _kernels(self.count), now - self.since)
        if self.tty:
            self._draw(now)
        else:
            self._write(f"npllama: compiling kernels for this CPU (once; cached in {self.where})\n")

    def _open(self) -> None:
        """Take the stream that set_stream chose, or none (logging only)."""
        out = self.stream if self.stream is not None else sys.stderr
        try:
            self.tty = bool(out.isatty())
        except Exception:
            self.tty = False
        self.out = out if out is not None and (self.tty or self.always) else None
        self.width = 0

    def _progress(self) -> tuple[int, int | None]:
        """(kernels compiled, of how many): the innermost open job with a known total, else
        this run of compiles with none (also where a job has gone past its total)."""
        for j in reversed(self._jobs_of(self.compiler)):
            if j.total and j.count <= j.total:
                return j.count, j.total
        return self.count, None

    def _line(self, now: float) -> str:
        done, total = self._progress()
        if total:
            fill = BAR * done // total
            progress = f"[{'#' * fill}{' ' * (BAR - fill)}] {done}/{total}"
        else:
            progress = _kernels(done)
        name = self.running[-1][1] if self.running else ""
        head = f"npllama: compiling kernels for this CPU (once; cached in {self.where})"
        line = "  ".join(p for p in (head, progress, name, _mmss(now - self.since)) if p)
        try:  # a line longer than the terminal wraps, and '\r' then redraws only its end
            columns = os.get_terminal_size(self.out.fileno()).columns
        except Exception:
            return line
        if len(line) >= columns and name:
            line = "  ".join((head, progress, _mmss(now - self.since)))
        return line[:max(columns - 1, 1)]

    def _draw(self, now: float) -> None:
        if self.out is None:
            return
        if self.tty:
            line = self._line(now)
            self._write("\r" + line.ljust(self.width))
            self.width = len(line)
        elif now - self.said >= EVERY:
            self.said = now
            done, total = self._progress()
            count = f"{done}/{total}" if total else _kernels(done)
            self._write(f"npllama: compiling kernels: {count} so far, {_mmss(now - self.since)}\n")

    def _write(self, text: str) -> None:
        """Write to the report's stream; one that fails is written to no more."""
        if self.out is None:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except Exception:
            self.out = None

    def _end(self) -> None:
        if self.shown:
            took = self.last - self.since
            log.info("compiled %s in %.1f s (cached in %s)", _kernels(self.count), took, self.where)
            final = (f"npllama: compiled {_kernels(self.count)} in {_mmss(took)} "
                     f"(cached in {self.where}; later runs load them)")
            self._write(("\r" + final.ljust(self.width) if self.tty else final) + "\n")
        self.since, self.out, self.shown = None, None, False
        self.episode += 1

    def _watch(self, episode: int) -> None:
        """The report's thread: redraws every TICK until compiling has stopped for IDLE."""
        while True:
            time.sleep(TICK)
            try:
                with self.lock:
                    if self.episode != episode:
                        return
                    now = time.monotonic()
                    if not self.running and now - self.last >= IDLE:
                        self._end()
                        return
                    if self.running:
                        self._show_if_due(now)
                    if self.shown:
                        self._draw(now)
            except Exception:
                pass

    def finish(self) -> None:
        with self.lock:
            if self.since is not None and not self.running:
                self._end()


_report = _Report()


class _CompileListener(_Listener):
    """Numba's "numba:compile" events, handed to the report. It never raises: an error here
    would fail the compile it reports."""

    def on_start(self, event):
        try:
            _report.started(event.data["dispatcher"])
        except Exception:
            pass

    def on_end(self, event):
        try:
            _report.ended(event.data["dispatcher"])
        except Exception:
            pass


def set_stream(stream=None, always: bool = False) -> None:
    """Where the report is drawn: `stream` (None: sys.stderr as it is when a report starts),
    where it is a terminal, or whatever it is with `always` (the CLI and the server:
    their stderr is the user's, or a service's journal). A report under way goes on there."""
    with _report.lock:
        _report.stream, _report.always = stream, always
        if _report.shown:  # a report under way goes on there
            _report._open()


def stats() -> tuple[int, float]:
    """(kernels compiled in this process, seconds spent compiling them): the compiles of
    npllama's functions, nested ones counted once each and their time once."""
    with _report.lock:
        return _report.kernels, _report.seconds


def finish() -> None:
    """End a report now rather than IDLE seconds after the last compile (its last line and
    INFO record), unless a compile is running. Called at exit, where the report's daemon
    thread would otherwise die before the last line."""
    _report.finish()


_installed = False


def install() -> None:
    """Listen to Numba's compile events (once). A Numba without them gets a warning and no
    report: npllama runs as it would otherwise."""
    global _installed
    if _installed:
        return
    _installed = True
    if _register is None:
        warnings.warn("this Numba has no compile events (numba.core.event): npllama's first compile "
                      "of its kernels (minutes) will not be reported", RuntimeWarning, stacklevel=2)
        return
    try:
        _register("numba:compile", _CompileListener())
    except Exception as e:
        warnings.warn(f"npllama cannot listen to Numba's compile events ({e!r}): its first compile "
                      "of its kernels (minutes) will not be reported", RuntimeWarning, stacklevel=2)
        return
    atexit.register(finish)
