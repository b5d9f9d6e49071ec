"""Busy/idle accounting per side (generation, training) over a run's wall clock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Clock:
    """Wall time and busy seconds of each side since `start`; idle = wall - busy."""

    start: float = field(default_factory=time.perf_counter)
    busy_s: dict[str, float] = field(default_factory=lambda: {"generation": 0.0, "training": 0.0})

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def add(self, side: str, seconds: float) -> None:
        self.busy_s[side] += seconds

    def idle_fraction(self, side: str) -> float:
        wall = self.wall()
        return max(0.0, 1.0 - self.busy_s[side] / wall) if wall > 0 else 0.0
