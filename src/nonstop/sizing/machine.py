"""What memory this machine gives a run, and how many times its kernel's OOM killer has struck.

Contract:
- `machine_memory()` returns a `MachineMemory`: `total` (the cgroup's limit when one is set,
  else the machine's RAM) and `available` (what a new process can take now: MemAvailable, and
  at most the cgroup's limit minus its usage, counting its reclaimable file cache as free);
  `source` says where the figures came from, for messages;
- `oom_kills()` is the cgroup's count of processes the OOM killer ended (`oom_kill` in
  cgroup v2's memory.events or v1's memory.oom_control), None where neither is readable;
- `parse_counters(text)` reads the `key value` lines both files are made of.

The cgroup is this process's own (from /proc/self/cgroup); inside a container whose cgroup is
mounted at /sys/fs/cgroup itself, the files at that root are the container's. A limit of
2**62 bytes or more (v1 writes 9223372036854771712 for "none"), or "max" (v2), is no limit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

GIB = 1024**3
NO_LIMIT = 2**62
CGROUP_ROOT = Path("/sys/fs/cgroup")


def size(n: float) -> str:
    """Bytes for people: '1.4 MiB', '25.8 GiB'."""
    for unit, scale in (("GiB", GIB), ("MiB", 1024**2)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1024:.1f} KiB"


@dataclass(frozen=True)
class MachineMemory:
    total: int
    """Bytes the run's processes may hold together at most (cgroup limit, else RAM)."""
    available: int
    """Bytes free for new processes now."""
    source: str
    """Where the figures come from, e.g. 'cgroup v2 memory.max' or 'MemAvailable'."""


def parse_counters(text: str) -> dict[str, int]:
    """`key value` lines (memory.events, memory.oom_control, memory.stat, /proc/meminfo without
    its 'kB' unit) as a dict; lines that are not a name and an integer are skipped."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2:
            try:
                out[parts[0]] = int(parts[1])
            except ValueError:
                continue
    return out


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _cgroup_dirs(controller_file: str, v1_controller: str) -> list[Path]:
    """Candidate folders of this process's cgroup holding `controller_file`, innermost first."""
    own = _read(Path("/proc/self/cgroup")) or ""
    rel: list[tuple[Path, str]] = []
    for line in own.splitlines():
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "" and hier == "0":  # cgroup v2
            rel.append((CGROUP_ROOT, path))
        elif v1_controller in controllers.split(","):
            rel.append((CGROUP_ROOT / v1_controller, path))
    dirs: list[Path] = []
    for base, path in rel:
        node = base / path.strip("/")
        while True:  # a namespaced mount shows the cgroup at its root, not at its full path
            if (node / controller_file).is_file() and node not in dirs:
                dirs.append(node)
            if node == base or base not in node.parents:
                break
            node = node.parent
    return dirs


def _limit() -> tuple[int, int, str] | None:
    """(limit, usage net of reclaimable file cache, source) of the tightest cgroup limit set."""
    best: tuple[int, int, str] | None = None
    for d in _cgroup_dirs("memory.max", "memory"):
        raw = (_read(d / "memory.max") or "").strip()
        if raw and raw != "max" and int(raw) < NO_LIMIT:
            usage = int((_read(d / "memory.current") or "0").strip() or 0)
            cache = parse_counters(_read(d / "memory.stat") or "").get("file", 0)
            cand = (int(raw), max(0, usage - cache), f"cgroup v2 {d / 'memory.max'}")
            best = cand if best is None or cand[0] - cand[1] < best[0] - best[1] else best
    for d in _cgroup_dirs("memory.limit_in_bytes", "memory"):
        raw = (_read(d / "memory.limit_in_bytes") or "").strip()
        if raw and int(raw) < NO_LIMIT:
            usage = int((_read(d / "memory.usage_in_bytes") or "0").strip() or 0)
            stat = parse_counters(_read(d / "memory.stat") or "")
            cache = stat.get("total_cache", stat.get("cache", 0))
            cand = (int(raw), max(0, usage - cache), f"cgroup v1 {d / 'memory.limit_in_bytes'}")
            best = cand if best is None or cand[0] - cand[1] < best[0] - best[1] else best
    return best


def machine_memory() -> MachineMemory:
    """The run's memory now (see the module docstring)."""
    info = parse_counters(_read(Path("/proc/meminfo")) or "")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    free = info["MemAvailable"] * 1024 if "MemAvailable" in info else ram
    limit = _limit()
    if limit is None:
        return MachineMemory(ram, free, "MemAvailable")
    cap, used, source = limit
    return MachineMemory(min(cap, ram), min(free, cap - used), source)


def oom_kills() -> int | None:
    """The cgroup's OOM-kill count (innermost cgroup that reports one), None if none is readable."""
    for name in ("memory.events", "memory.oom_control"):
        for d in _cgroup_dirs(name, "memory"):
            counters = parse_counters(_read(d / name) or "")
            if "oom_kill" in counters:
                return counters["oom_kill"]
    return None
