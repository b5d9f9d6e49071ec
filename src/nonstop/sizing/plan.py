"""The memory plan's data: `Item`s (bytes, how they are made, the field that changes them) per
`Proc` (a process kind and how many run), and the `MemoryPlan` over all of them with its limit.
`MemoryPlan.check()` refuses a plan over its limit with a ConfigError naming the field of its
largest item; `table()` is the start-up lines, `to_dict()` the run folder's memory_plan.json.
sizing/memory.py makes the plan from a config and a model shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.config import ConfigError
from nonstop.sizing.machine import size


@dataclass(frozen=True)
class Item:
    name: str
    bytes: int
    detail: str
    """How the figure is made, e.g. '256 seqs x 4096 tokens x 24 layers x 2 (K and V) x ...'."""
    field: str
    """The config field that changes it most directly, named first in a refusal."""
    change: str
    """What lowers it, e.g. 'lower engine.max_concurrent_seqs or engine.max_seq_len'."""
    on_host: bool = True


@dataclass
class Proc:
    name: str
    """The process kind, as actors are named: 'engine', 'trainer', 'orchestrator', 'shm segment'."""
    count: int
    items: list[Item] = field(default_factory=list)

    def add(self, name: str, nbytes: float, detail: str, fld: str, change: str, on_host: bool = True) -> None:
        if nbytes > 0:
            self.items.append(Item(name, int(nbytes), detail, fld, change, on_host))

    @property
    def host_bytes(self) -> int:
        return sum(i.bytes for i in self.items if i.on_host)


@dataclass
class MemoryPlan:
    procs: list[Proc]
    limit: int
    """Bytes the run may hold (run.memory_limit_gib, else the machine's available memory)."""
    limit_source: str
    notes: tuple[str, ...] = ()
    """The defaults resolved for this run (sizing/defaults.py)."""

    @property
    def total(self) -> int:
        return sum(p.host_bytes * p.count for p in self.procs)

    def planned(self, actor: str) -> int | None:
        """Host bytes planned for the actor named `actor` ('engine-0', 'trainer', 'nim-engine-1')."""
        head, _, tail = actor.rpartition("-")
        base = head if tail.isdigit() else actor
        for p in self.procs:
            if p.name in (actor, base):
                return p.host_bytes
        return None

    def check(self) -> None:
        """ConfigError naming the field to change, with the figures, if the plan does not fit."""
        if self.total <= self.limit:
            return
        proc, item = max(
            ((p, i) for p in self.procs for i in p.items if i.on_host), key=lambda pi: pi[1].bytes * pi[0].count
        )
        per = f"{size(item.bytes)} per {proc.name} x {proc.count}" if proc.count > 1 else size(item.bytes)
        raise ConfigError(
            f"{item.field}: the run's memory plan needs {size(self.total)} but {size(self.limit)} is available "
            f"({self.limit_source}); the largest part is the {proc.name}'s {item.name}, {per} ({item.detail}); "
            f"{item.change}. Plan: "
            + "; ".join(f"{p.name} x{p.count} {size(p.host_bytes)}" for p in self.procs)
            + " (docs/memory.md; run.memory_limit_gib overrides what is available)"
        )

    def table(self) -> list[str]:
        """The plan as a few lines for the start-up output."""
        lines = [f"memory plan: {size(self.total)} of {size(self.limit)} available ({self.limit_source})"]
        for p in self.procs:
            parts = ", ".join(f"{i.name} {size(i.bytes)}{'' if i.on_host else ' (GPU)'}" for i in p.items)
            lines.append(f"  {p.name:<14} x{p.count}  {size(p.host_bytes):>10}  {parts}")
        return lines

    def to_dict(self) -> dict:
        return {
            "total_bytes": self.total,
            "limit_bytes": self.limit,
            "limit_source": self.limit_source,
            "fits": self.total <= self.limit,
            "resolved": list(self.notes),
            "processes": [
                {
                    "process": p.name,
                    "count": p.count,
                    "host_bytes_each": p.host_bytes,
                    "items": [
                        {"name": i.name, "bytes": i.bytes, "detail": i.detail, "field": i.field, "on_host": i.on_host}
                        for i in p.items
                    ],
                }
                for p in self.procs
            ],
        }
