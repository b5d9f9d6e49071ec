"""The CPU pools of the local runtime (`runtime.pin_cpus`): which cores each role's actors may use.

On one CPU machine the engine and the trainer compete for the same cores, so a pipeline's "idle"
time is not idle at all: the other role runs on the core. Pinning each role's actor processes to
its own set of cores makes the pools as separate as GPU pools are, and an idle pool then really
leaves its cores unused. CPU sets are written as Linux cpu lists ('0', '0-3', '0,2,4-5'), a bare
number or a YAML list of numbers.

Rules (checked when the config loads, each error naming its field): a set is not empty, its CPUs
exist on this machine (0 .. os.cpu_count() - 1) and this process may run on them
(os.sched_getaffinity), and no CPU is in two pools. A role left out is not pinned.
"""

from __future__ import annotations

import os

from pydantic import field_validator, model_validator

from nonstop.config.schema import Section as _Section

ROLES = ("engine", "trainer", "scorer")


def parse_cpu_list(text: str) -> frozenset[int]:
    """'0-2,5' -> {0, 1, 2, 5}; ValueError on anything else (empty parts, reversed ranges)."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"'{text}' is not a cpu list such as '0', '0-3' or '0,2,4-5'")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError(f"'{text}': range {part} runs backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def available_cpus() -> frozenset[int]:
    """The CPUs this process may run on (a container or taskset may allow fewer than exist)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: every CPU the OS reports
        return frozenset(range(os.cpu_count() or 1))


class CpuPools(_Section):
    """Disjoint CPU sets per role; each actor process of a role is pinned to its role's set."""

    engine: str | None = None
    """CPUs of the engine actors (a cpu list, e.g. '0'); None: not pinned."""
    trainer: str | None = None
    """CPUs of the trainer rank actors (e.g. '1'); None: not pinned."""
    scorer: str | None = None
    """CPUs of the scoring actors (reward workers, reward models, teachers); None: not pinned."""

    @field_validator(*ROLES, mode="before")
    @classmethod
    def _as_text(cls, v: object) -> object:
        """A bare CPU number ('--set runtime.pin_cpus.engine=0' reads as an int) or a list of them."""
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        if isinstance(v, list) and all(isinstance(c, int) for c in v):
            return ",".join(map(str, v))
        return v

    @model_validator(mode="after")
    def _disjoint_and_present(self) -> "CpuPools":
        sets = self.sets()
        if not sets:
            raise ValueError("name at least one of engine, trainer, scorer (or leave runtime.pin_cpus out)")
        present, allowed = frozenset(range(os.cpu_count() or 1)), available_cpus()
        for role, cpus in sets.items():
            if cpus - present:
                raise ValueError(
                    f"{role}: CPU(s) {sorted(cpus - present)} do not exist (this machine has 0-{max(present)})"
                )
            if not cpus <= allowed:
                raise ValueError(f"{role}: CPU(s) {sorted(cpus - allowed)} are outside this process's affinity")
        roles = list(sets)
        for i, a in enumerate(roles):
            for b in roles[i + 1 :]:
                shared = sets[a] & sets[b]
                if shared:
                    raise ValueError(f"{a} and {b} share CPU(s) {sorted(shared)}: the pools must be disjoint")
        return self

    def sets(self) -> dict[str, frozenset[int]]:
        """The pinned roles and their CPUs (parsed; a malformed list raises ValueError naming the role)."""
        out = {}
        for role in ROLES:
            text = getattr(self, role)
            if text is not None:
                try:
                    cpus = parse_cpu_list(text)
                except ValueError as e:
                    raise ValueError(f"{role}: {e}") from None
                out[role] = cpus
        return out
