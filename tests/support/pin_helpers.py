"""Actor classes for tests/runtime/test_pinning.py (spawned processes need importable targets)."""

from __future__ import annotations

import time


class Spinner:
    """An actor that keeps its CPU busy on request."""

    def spin(self, cpu_seconds: float) -> int:
        """Busy-loop until this process has used `cpu_seconds` more CPU time (however long that takes
        on a shared machine)."""
        end, n = time.process_time() + cpu_seconds, 0
        while time.process_time() < end:
            n += 1
        return n
