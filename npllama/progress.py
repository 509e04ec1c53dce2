"""A minimal progress bar on stderr, so long work (a model fetch, perplexity, batches) shows
that it is moving. It draws only when stderr is a terminal or when forced."""
from __future__ import annotations

import sys
import time


class Progress:
    """`with Progress(total, "fetch", unit="MB", scale=1e-6) as p: p.update(n)`."""

    def __init__(self, total: float, desc: str, *, unit: str = "", scale: float = 1.0,
                 enabled: bool | None = None, stream=None):
        self.total, self.desc, self.unit, self.scale = total, desc, unit, scale
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.done = 0.0
        self._last = 0.0

    def update(self, n: float) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = self.done / self.total if self.total else 1.0
            bar = "#" * int(30 * frac)
            self.stream.write(f"\r{self.desc} [{bar:<30}] {100 * frac:5.1f}% "
                              f"{self.done * self.scale:.1f}/{self.total * self.scale:.1f} {self.unit}")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
