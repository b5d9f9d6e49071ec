"""Busy/idle accounting per side (generation, training) over a run's wall clock (`Clock`), and the
busy time of a side that runs overlapping work (`BusyClock`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

EVALUATION = "evaluation"


@dataclass
class Clock:
    """Wall time and busy seconds of each side since `start`, and the seconds held-out evaluations
    took (`busy_s['evaluation']`). A side's idle fraction is over the wall time outside
    evaluations: the learning loop holds for one, so both sides wait through its long tail, and
    that wait belongs to measuring the run, not to the pipeline (the RL wall time still counts it)."""

    start: float = field(default_factory=time.perf_counter)
    busy_s: dict[str, float] = field(default_factory=lambda: {"generation": 0.0, "training": 0.0, EVALUATION: 0.0})

    def wall(self) -> float:
        return time.perf_counter() - self.start

    def add(self, side: str, seconds: float) -> None:
        self.busy_s[side] = self.busy_s.get(side, 0.0) + seconds  # a resumed older checkpoint may lack one

    def idle_fraction(self, side: str) -> float:
        wall = self.wall() - self.busy_s.get(EVALUATION, 0.0)
        return max(0.0, 1.0 - self.busy_s[side] / wall) if wall > 0 else 0.0


class BusyClock:
    """A side that runs overlapping pieces of work (groups in flight in the engines) is busy
    while at least one runs: `enter()`/`leave()` around each piece, and the time from the first
    enter to the last leave goes to `side` of `clock`."""

    def __init__(self, clock: Clock, side: str = "generation") -> None:
        self.clock, self.side, self.in_flight, self.since = clock, side, 0, 0.0

    def enter(self) -> None:
        if self.in_flight == 0:
            self.since = time.perf_counter()
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.clock.add(self.side, time.perf_counter() - self.since)
