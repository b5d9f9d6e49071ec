"""Why an actor process died, in words: the kernel's OOM killer is named, with the actor's plan.

Contract:
- `death_reason(name, pid, exitcode, oom_before)` is the message of an actor that ended:
  'exit code N', 'killed by signal N', or, for SIGKILL while the cgroup's `oom_kill` counter
  rose past `oom_before` (config/machine.py; read when the actor was spawned), "was killed by
  the kernel's OOM killer (planned: 1.4 GiB; the cgroup's oom_kill count went 0 -> 1)";
- `remember_plan(planned)` gives the orchestrator's current run's planned bytes per actor name
  (MemoryPlan.planned) to every later message; `remember_plan(None)` forgets it. The local
  backend spawns actors without knowing about runs, and one process runs one run at a time.

The counter is the cgroup's, so another process of the same cgroup killed at the same moment
would be blamed on this actor too; a SIGKILL sent by a person (or by `kill()`, which says so
itself) leaves the counter where it was and reads as a plain signal.
"""

from __future__ import annotations

import signal
from collections.abc import Callable

from nonstop.config.machine import oom_kills

_plan: Callable[[str], int | None] | None = None


def remember_plan(planned: Callable[[str], int | None] | None) -> None:
    global _plan
    _plan = planned


def _planned(name: str) -> str:
    nbytes = _plan(name) if _plan is not None else None
    if nbytes is None:
        return ""
    from nonstop.config.memory import size

    return f"planned: {size(nbytes)}; "


def death_reason(name: str, pid: int | None, exitcode: int | None, oom_before: int | None) -> str:
    """The message of actor `name` (pid `pid`) that ended with `exitcode` (see the module docstring)."""
    if exitcode is not None and exitcode < 0:
        if -exitcode == signal.SIGKILL and oom_before is not None:
            after = oom_kills()
            if after is not None and after > oom_before:
                return (
                    f"actor '{name}' (pid {pid}) was killed by the kernel's OOM killer ({_planned(name)}"
                    f"the cgroup's oom_kill count went {oom_before} -> {after}); see the run's memory_plan.json "
                    "and docs/memory.md for the fields that lower it"
                )
        return f"actor '{name}' (pid {pid}) died (killed by signal {-exitcode})"
    return f"actor '{name}' (pid {pid}) died (exit code {exitcode})"
