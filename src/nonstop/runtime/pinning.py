"""Pools of CPUs for the local backend: pin each role's actors to its cores, measure each pool.

`role_of(actor name)` says which pool an actor belongs to, from the names the orchestrator gives
its actors: 'engine', 'engine-1', 'alice-engine' are engines; 'trainer', 'trainer-0',
'alice-trainer-1' trainer ranks; 'reward-worker-2', 'reward-model', 'teacher' scorers. Any other
actor is in no pool and runs where the orchestrator runs.

`pin(cpus)` runs first thing in a spawned actor (runtime/local.py), before torch starts any
thread, so every thread of the actor inherits the set (Linux affinity is per thread and is
inherited at creation).

`PoolMeter` measures what each pool's processes did with their cores: CPU seconds (user + system,
all threads, from /proc/<pid>/stat) over a window that `start()` opens (the RL clock's start).
busy_frac = CPU seconds / (wall seconds x CPUs in the pool) and idle_frac = 1 - busy_frac: with
pinned, disjoint pools these are the pools' own busy and idle, as separate GPU pools would show.
Without pinning a pool has no CPUs of its own and its figure is CPU seconds over wall seconds
(how many cores it kept busy on average), with no idle fraction.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from nonstop.config.cpus import ROLES

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def role_of(name: str) -> str | None:
    """The pool of the actor named `name` ('engine', 'trainer', 'scorer'), or None."""
    parts = name.split("-")
    if "engine" in parts:
        return "engine"
    if "trainer" in parts:
        return "trainer"
    if name.startswith(("reward-", "teacher")):
        return "scorer"
    return None


def pin(cpus: frozenset[int] | None) -> None:
    """Restrict this process (and the threads it starts from now on) to `cpus`; None: leave as is."""
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process `pid` (all its threads), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after 'pid (comm) ': field 3 is fields[0]
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime: fields 14 and 15


@dataclass
class _Proc:
    pid: int
    base: float = 0.0  # CPU seconds at the window's start (0 for a process started after it)
    last: float = 0.0  # the last reading, kept once the process is gone


@dataclass
class PoolMeter:
    """CPU seconds per pool over a window (see the module docstring)."""

    sets: dict[str, frozenset[int]]
    procs: dict[str, list[_Proc]] = field(default_factory=dict)
    t0: float | None = None

    def add(self, role: str | None, pid: int) -> None:
        if role is not None:
            self.procs.setdefault(role, []).append(_Proc(pid))

    def _read(self, p: _Proc) -> float:
        now = cpu_seconds(p.pid)
        if now is not None:
            p.last = now
        return p.last

    def start(self) -> None:
        """Open the window now: CPU time spent so far (start-up, model loading) does not count."""
        self.t0 = time.monotonic()
        for procs in self.procs.values():
            for p in procs:
                p.base = self._read(p)

    def report(self) -> dict[str, dict]:
        """Per pool: cpus (None unpinned), actors, cpu_s, wall_s, busy_frac and idle_frac (None unpinned)."""
        if self.t0 is None:
            return {}
        wall = max(time.monotonic() - self.t0, 1e-9)
        out = {}
        for role in ROLES:
            procs = self.procs.get(role, [])
            if not procs:
                continue
            used = sum(max(0.0, self._read(p) - p.base) for p in procs)
            cpus = self.sets.get(role)
            busy = used / (wall * len(cpus)) if cpus else used / wall
            out[role] = {
                "cpus": sorted(cpus) if cpus else None,
                "actors": len(procs),
                "cpu_s": round(used, 2),
                "wall_s": round(wall, 2),
                "busy_frac": round(min(busy, 1.0) if cpus else busy, 4),
                "idle_frac": round(max(0.0, 1.0 - busy), 4) if cpus else None,
            }
        return out
