"""Why an actor process died, in words: the kernel's OOM killer is named, with the actor's plan.

Contract:
- `death_reason(name, pid, exitcode, oom_before)` is the message of an actor that ended:
  'exit code N', 'killed by signal N', or, for SIGKILL when the kernel's log says it killed
  that pid for memory (`/dev/kmsg`, where readable) or the cgroup's `oom_kill` counter rose past
  `oom_before` (sizing/machine.py; read when the actor was spawned), "was killed by the kernel's
  OOM killer (planned: 1.4 GiB; ...)" with the kernel's line or the counter's change;
- `oom_line(records, pid)` picks the kernel's 'Killed process PID' line out of log records;
- `remember_plan(planned)` gives the orchestrator's current run's planned bytes per actor name
  (MemoryPlan.planned) to every later message; `remember_plan(None)` forgets it. The local
  backend spawns actors without knowing about runs, and one process runs one run at a time.

The kernel's line names the pid, so it is exact; the counter is the cgroup's, so where the log
is not readable another process of the same cgroup killed at the same moment would be blamed on
this actor too. A SIGKILL sent by a person (or by `kill()`, which says so itself) leaves both
unchanged and reads as a plain signal.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterable

from nonstop.sizing.machine import oom_kills, size

_plan: Callable[[str], int | None] | None = None


def remember_plan(planned: Callable[[str], int | None] | None) -> None:
    global _plan
    _plan = planned


def _planned(name: str) -> str:
    nbytes = _plan(name) if _plan is not None else None
    if nbytes is None:
        return ""
    return f"planned: {size(nbytes)}; "


def oom_line(records: Iterable[str], pid: int) -> str | None:
    """The kernel's OOM-kill line for `pid` among log records ('Out of memory: Killed process 4242
    (python) total-vm:..., anon-rss:...' or the memory cgroup's variant), without its prefix."""
    mark = f"Killed process {pid} "
    for record in records:
        head, sep, rest = record.partition(";")  # /dev/kmsg: 'prio,seq,usec,flags;message'
        is_header = sep and head.translate(str.maketrans("", "", ",-+c")).isdigit()
        lines = (rest if is_header else record).splitlines()
        if lines and mark in lines[0]:
            return lines[0].strip()
    return None


def kernel_records(path: str = "/dev/kmsg") -> list[str]:
    """The kernel log's records now (one read each, non-blocking), [] where it is not readable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    out: list[str] = []
    try:
        while len(out) < 100_000:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records were overwritten while reading; go on from the next
                continue
            if not chunk:
                break
            out.append(chunk.decode("utf-8", "replace"))
    finally:
        os.close(fd)
    return out


def death_reason(name: str, pid: int | None, exitcode: int | None, oom_before: int | None) -> str:
    """The message of actor `name` (pid `pid`) that ended with `exitcode` (see the module docstring)."""
    if exitcode is not None and exitcode < 0:
        if -exitcode == signal.SIGKILL:
            line = oom_line(kernel_records(), pid) if pid is not None else None
            after = oom_kills() if oom_before is not None else None
            why = None
            if line is not None:
                why = f"the kernel: {line}"
            elif after is not None and oom_before is not None and after > oom_before:
                why = f"the cgroup's oom_kill count went {oom_before} -> {after}"
            if why is not None:
                return (
                    f"actor '{name}' (pid {pid}) was killed by the kernel's OOM killer ({_planned(name)}{why}); "
                    "see the run's memory_plan.json and docs/memory.md for the fields that lower it"
                )
        return f"actor '{name}' (pid {pid}) died (killed by signal {-exitcode})"
    return f"actor '{name}' (pid {pid}) died (exit code {exitcode})"
