"""Processor sharing: how the engines, trainer ranks and orchestrator of a run on one host slowed
each other down, so calibration can deflate each busy interval to the time it would have taken
with a processor to itself.

`Sharing(actors, cores).work(t0, t1)` is the uncontended work an actor busy over [t0, t1] got
done while n(t) actors shared `cores` processors; `effective_cores` finds the number of
processors that explains the processor time the span log recorded; `host_cores` is how many
the run's actors shared (None on accelerators: no sharing).
"""

from __future__ import annotations

import bisect
import math
from typing import TYPE_CHECKING

from nonstop.device import resolve_device
from nonstop.observe.spans import cpu_count

if TYPE_CHECKING:
    from nonstop.config import Config
    from nonstop.observe.timeline import Timeline

Interval = tuple[float, float]


class Sharing:
    """Processor sharing of `cores` among actors' busy intervals: while n actors are busy each runs
    at min(1, cores / n) of its own speed. `work(t0, t1)` is the uncontended time an actor busy
    over [t0, t1] got done: the integral of min(1, cores / n(t)) dt. `cores` None: no sharing."""

    def __init__(self, actors: list[list[Interval]], cores: float | None) -> None:
        self.cores = cores
        edges: list[tuple[float, int]] = []
        for ivs in actors:
            for a, b in union(ivs):
                edges += [(a, 1), (b, -1)]
        edges.sort()
        self.starts: list[float] = []
        self.speed: list[float] = []  # from starts[i] to starts[i + 1]
        n = 0
        for t, d in edges:
            n += d
            self.starts.append(t)
            self.speed.append(1.0 if cores is None or n <= cores else cores / n)

    def work(self, t0: float, t1: float) -> float:
        if self.cores is None or not self.starts:
            return t1 - t0
        i = max(bisect.bisect_right(self.starts, t0) - 1, 0)
        done, t = 0.0, t0
        while t < t1:
            nxt = self.starts[i + 1] if i + 1 < len(self.starts) else math.inf
            speed = self.speed[i] if self.starts[i] <= t else 1.0
            seg = min(nxt, t1) - t
            done += seg * speed
            t += seg
            i += 1
        return done


def union(ivs: list[Interval]) -> list[Interval]:
    """The union of `ivs` as disjoint intervals in order (empty ones left out)."""
    out: list[Interval] = []
    for a, b in sorted(ivs):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        elif b > a:
            out.append((a, b))
    return out


def effective_cores(busy: list[list[Interval]], items: list[tuple[float, float, float]], host: float) -> float | None:
    """The number of processors c for which processor sharing (`Sharing`) of the actors' busy
    intervals explains how much slower than their processor time `items` (t0, t1, cpu_s) ran:
    sum of work_c(t0, t1) = sum of cpu_s. Less than the host's when something else took a share
    too, more when the actors' busy intervals overstate their demand. None when the items ran
    at full speed (nothing to share)."""
    cpu = sum(c for _, _, c in items)
    wall = sum(t1 - t0 for t0, t1, _ in items)
    if cpu <= 0 or cpu >= wall * (1 - 1e-3):
        return None
    lo, hi = host / 16, host * 16

    def work(cores: float) -> float:  # one Sharing per candidate, not one per item
        sharing = Sharing(busy, cores)
        return sum(sharing.work(t0, t1) for t0, t1, _ in items)

    if work(hi) <= cpu:
        return None
    for _ in range(40):  # work_c grows with c: bisect on a log scale
        mid = math.sqrt(lo * hi)
        if work(mid) < cpu:
            lo = mid
        else:
            hi = mid
    return round(math.sqrt(lo * hi), 3)


def host_cores(tl: Timeline, cfg: Config) -> float | None:
    """Processors the engines and trainer ranks share: `rl_start`'s record, or (a span log
    without it) this machine's, when the run's actors would compute on it. None: accelerators."""
    start = [e for e in tl.events.get("orchestrator", []) if e["ev"] == "rl_start"]
    if start and "cpus" in start[-1]:
        return float(start[-1]["cpus"]) if start[-1]["cpu_actors"] else None
    on_cpu = all(
        resolve_device(spec, name).type == "cpu"
        for spec, name in ((cfg.engine.device, "engine.device"), (cfg.trainer.device, "trainer.device"))
    )
    return float(cpu_count()) if on_cpu and cfg.runtime.backend == "local" else None
