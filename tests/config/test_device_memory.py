"""nonstop.device.retain_freed_memory: freed memory stays in the process (measured in fresh interpreters)."""

import subprocess
import sys

import pytest

PROBE = """
import sys
import torch
from nonstop.device import retain_freed_memory
def rss_mib():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
applied = retain_freed_memory() if sys.argv[1] == "retain" else None
x = torch.ones(64, 2**20)  # 256 MiB, touched
held = rss_mib()
del x
print(applied, held - rss_mib())
"""


def freed_mib(mode: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    applied, dropped = out.stdout.split()
    return applied, float(dropped)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_memory_is_kept_only_when_asked():
    _, dropped_default = freed_mib("default")
    applied, dropped_retained = freed_mib("retain")
    assert dropped_default > 200  # glibc gives a 256 MiB block back to the kernel on free
    assert applied == "True"
    assert dropped_retained < 16  # kept in the heap for the next step's tensors
