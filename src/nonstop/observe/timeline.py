"""A run's timeline: the span log and metrics.jsonl of a run folder, read into plain numbers.

`Timeline.load(run_dir)` reads `spans/*.jsonl` (nonstop.observe.spans; every time in seconds since the
run's RL start) and `metrics.jsonl`, and exposes what the run report draws and what the
capacity planner calibrates on:

- `lanes`: per actor (engine-0.., trainer-0.., orchestrator) the busy intervals by kind
  (`busy`/`apply` for engines, `step`/`publish` for trainer ranks, `wait`/`eval`/`checkpoint`
  for the orchestrator), each (t0, t1);
- `groups`: every group's life (admitted, generation start and end, delivered, completion
  lengths, versions); `drops`: reason per dropped group; `trained`: which step trained a group;
- `binned(...)`: samples/s generated and busy fractions of the engines and the trainer per
  time bin (the "over time" curves);
- `idle_fraction(...)`: 1 - (union of a lane's busy intervals) / the window, per lane kind.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.observe.spans import read_spans

Interval = tuple[float, float]


def union_length(intervals: list[Interval], lo: float = float("-inf"), hi: float = float("inf")) -> float:
    """Total length of the union of `intervals`, clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


@dataclass
class GroupLife:
    id: tuple[int, int]
    t_admit: float
    t_gen0: float
    t_gen1: float
    t_done: float
    lens: list[int]
    versions: tuple[int, int] | None


@dataclass
class Timeline:
    run_dir: Path
    lanes: dict[str, dict[str, list[Interval]]]
    events: dict[str, list[dict[str, Any]]]  # raw span events per actor, times relative to RL start
    groups: list[GroupLife]
    drops: Counter[str]
    trained: dict[tuple[int, int], int]  # group id -> step that trained it
    steps: list[dict[str, Any]] = field(default_factory=list)  # metrics.jsonl records (no final_eval lines)
    final_evals: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, run_dir: Path | str) -> "Timeline":
        run_dir = Path(run_dir)
        events = read_spans(run_dir)
        lanes: dict[str, dict[str, list[Interval]]] = {}
        for actor, evs in events.items():
            lane: dict[str, list[Interval]] = {}
            for e in evs:
                if "t0" in e and "t1" in e and e["ev"] != "group":
                    lane.setdefault(e["ev"], []).append((e["t0"], e["t1"]))
            lanes[actor] = lane
        orch = events.get("orchestrator", [])
        groups = [
            GroupLife(
                (e["id"][0], e["id"][1]),
                e["t_admit"],
                e["t_gen0"],
                e["t_gen1"],
                e["t_done"],
                e["lens"],
                (e["v"][0], e["v"][1]) if e["v"] else None,
            )
            for e in orch
            if e["ev"] == "group"
        ]
        drops = Counter(e["reason"] for e in orch if e["ev"] == "drop")
        trained = {(g[0], g[1]): e["step"] for e in orch if e["ev"] == "train" for g in e["groups"]}
        steps: list[dict[str, Any]] = []
        finals: list[dict[str, Any]] = []
        metrics = run_dir / "metrics.jsonl"
        if metrics.exists():
            for line in metrics.read_text().splitlines():
                if line.strip():
                    r = json.loads(line)
                    (finals if r.get("final_eval") else steps).append(r)
        return cls(run_dir, lanes, events, groups, drops, trained, steps, finals)

    def actors(self, role: str) -> list[str]:
        """Actor names of one role ('engine' or 'trainer'), in rank order."""
        names = [a for a in self.lanes if a.split("-")[0] == role]
        return sorted(names, key=lambda a: int(a.rsplit("-", 1)[1]) if "-" in a else 0)

    @property
    def end(self) -> float:
        """Last trainer publish (or last event) in seconds since RL start: the window's end."""
        pubs = [t1 for a in self.actors("trainer") for _, t1 in self.lanes[a].get("publish", [])]
        if pubs:
            return max(pubs)
        ends = [t1 for lane in self.lanes.values() for ivs in lane.values() for _, t1 in ivs]
        return max(ends, default=0.0)

    def busy(self, actor: str, kinds: tuple[str, ...]) -> list[Interval]:
        lane = self.lanes.get(actor, {})
        return [iv for k in kinds for iv in lane.get(k, [])]

    def engine_busy(self, actor: str) -> list[Interval]:
        return self.busy(actor, ("busy", "apply"))

    def trainer_busy(self, actor: str) -> list[Interval]:
        return self.busy(actor, ("ahead", "step", "publish"))

    def idle_fraction(self, role: str, lo: float = 0.0, hi: float | None = None) -> float:
        """Mean idle fraction of the actors of `role` over [lo, hi] (default: RL start to `end`)."""
        hi = self.end if hi is None else hi
        actors = self.actors(role)
        if not actors or hi <= lo:
            return 0.0
        get = self.engine_busy if role == "engine" else self.trainer_busy
        return 1.0 - sum(union_length(get(a), lo, hi) for a in actors) / (len(actors) * (hi - lo))

    def samples_per_s(self, lo: float = 0.0, hi: float | None = None) -> float:
        """Samples generated (groups whose generation ended in [lo, hi]) per second."""
        hi = self.end if hi is None else hi
        n = sum(len(g.lens) for g in self.groups if lo <= g.t_gen1 <= hi)
        return n / (hi - lo) if hi > lo else 0.0

    def binned(self, bins: int = 40) -> dict[str, list[float]]:
        """Per time bin: bin centre, samples/s generated, engine and trainer busy fractions."""
        end = self.end
        width = end / bins if end > 0 else 1.0
        out: dict[str, list[float]] = {"t": [], "samples_per_s": [], "engine_busy": [], "trainer_busy": []}
        for i in range(bins):
            lo, hi = i * width, (i + 1) * width
            out["t"].append((lo + hi) / 2)
            out["samples_per_s"].append(self.samples_per_s(lo, hi))
            out["engine_busy"].append(1.0 - self.idle_fraction("engine", lo, hi))
            out["trainer_busy"].append(1.0 - self.idle_fraction("trainer", lo, hi))
        return out

    def lag_hist(self) -> dict[int, int]:
        """Trained tokens by lag, summed over the steps of metrics.jsonl."""
        hist: Counter[int] = Counter()
        for r in self.steps:
            for k, v in r.get("lag_hist", {}).items():
                hist[int(k)] += v
        return dict(sorted(hist.items()))
