"""Process hygiene for actor processes: a name by role, and death with the orchestrator.

`name_process(role)` makes an actor findable in `ps` and `top`: with the optional
`setproctitle` package (extra `names`) the whole command line reads `nonstop: engine` (one
engine) or `nonstop: engine-0` (several);
without it, on Linux, the kernel's short name (what `top` and `ps -o comm` show, 15 bytes) is
set through prctl. `die_with_parent()` asks Linux to send SIGTERM to this process when the
process that spawned it dies, however it dies (SIGKILL included), so no engine or trainer is
left behind by an orchestrator that was killed. Both are no-ops where unsupported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15


def _prctl(option: int, arg: int | bytes) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, arg, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def short_name(role: str) -> str:
    """The kernel's 15-byte name for `role`: 'nonstop-trainer', or 'ns-engine-0' when longer."""
    name = f"nonstop-{role}"
    return name if len(name) <= 15 else f"ns-{role}"[:15]


def name_process(role: str) -> None:
    try:  # optional: the names extra
        import setproctitle

        setproctitle.setproctitle(f"nonstop: {role}")
    except ImportError:
        pass
    _prctl(PR_SET_NAME, short_name(role).encode())


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when `parent_pid` (the spawner) dies; if it already has, exit now."""
    if _prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request took effect
