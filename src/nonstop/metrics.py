"""Run metrics: a JSONL sink (one object per step) and busy/idle accounting per side."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


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
