"""A model's RoPE tables, as every executor reads them: `ModelConfig.ropes` made into
stacked cos/sin arrays (one table per entry; each layer names its table in
`ModelConfig.layer_rope`), built for the positions in use and grown by doubling up to the
model's context, so a 32k-context model does not pay for 32k positions it never reaches."""
from __future__ import annotations

import threading

import numpy as np

from .nn import RopeTable, check_positions

_MIN_POSITIONS = 1024  # positions the tables are first built for


class Ropes:
    """cos, sin: (n_tables, positions, rope_dim // 2) float32, for positions 0..capacity-1."""

    def __init__(self, cfg, factors: dict[str, np.ndarray]):
        """factors: tensor name -> float32 values, for the tables' frequency factors."""
        self.cfg, self.factors = cfg, factors
        self.n_ctx, self.neox = cfg.n_ctx, cfg.rope_neox
        self.capacity = 0
        self._tables: dict[bool, tuple[np.ndarray, np.ndarray]] = {}  # long factors? -> (cos, sin)
        self._lock = threading.Lock()

    def check_range(self, start: int, end: int) -> None:
        """Raise ContextOverflowError unless positions start..end-1 lie in [0, n_ctx)."""
        check_positions(start, end, self.n_ctx)

    def check(self, positions: np.ndarray) -> None:
        if len(positions):
            self.check_range(int(positions.min()), int(positions.max()) + 1)

    def tables(self, end: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) covering positions 0..end-1, for a forward call whose last position is
        end - 1 (LongRoPE's choice of factors depends on it). Safe to call from several
        threads: tables are built and published under a lock, never resized in place."""
        self.check_range(0, end)
        long = any(r.long_factors and end > r.orig_ctx for r in self.cfg.ropes)
        with self._lock:
            if end > self.capacity:
                cap = max(self.capacity, _MIN_POSITIONS)
                while cap < end:
                    cap *= 2
                self.capacity = min(cap, self.n_ctx)
                self._tables = {}
            tables = self._tables.get(long)
            if tables is None:
                tables = self._tables[long] = self._build(long)
            return tables

    def _build(self, long: bool) -> tuple[np.ndarray, np.ndarray]:
        cfg = self.cfg
        half = cfg.rope_dim // 2
        cos = np.empty((len(cfg.ropes), self.capacity, half), np.float32)
        sin = np.empty_like(cos)
        for i, r in enumerate(cfg.ropes):
            name = r.long_factors if long and r.long_factors else r.factors
            t = RopeTable(self.capacity, cfg.rope_dim, r.base, neox=self.neox, scale=r.linear,
                          freq_factors=self.factors[name] if name else None, mscale=r.mscale)
            cos[i], sin[i] = t.cos, t.sin
        return cos, sin
