"""How a compute process gets its memory: keep what was freed, instead of faulting it in again.

A training step allocates and frees the same large tensors every time (logits, activations, the
bf16 copies autocast makes of each weight, gradients). glibc's malloc hands any block over
32 MiB (and, by its dynamic threshold, many smaller ones) to the kernel with mmap and gives it
back with munmap on free, so the next step's identical tensor starts as untouched pages and
every 4 KiB page costs a fault. On this project's VMs a fault is expensive: casting the 0.5B
shape's embedding (136 M values) to a new bfloat16 tensor took 0.22 s against 0.11 s into an
existing one, and a bfloat16 trainer step at that shape (8 x 128 tokens, one thread) spent
about a third of its time in page faults (bench/scale.py; docs/precision.md).

Contract of `retain_freed_memory()`:
- on Linux with glibc it sets, for the calling process, M_MMAP_MAX = 0 (every block comes from
  malloc's heap) and M_TRIM_THRESHOLD = the largest size (freed memory is never returned to the
  kernel), and returns True; anywhere else it changes nothing and returns False;
- the process's resident memory then stays at its peak instead of falling between steps. The
  preflight memory plan (config/memory.py) already budgets each actor at its peak, so the
  plan is unchanged; what changes is that the peak is held rather than revisited;
- it applies to blocks allocated after the call: call it before the model is loaded.
The trainer calls it on the CPU (trainer/worker.py); on a GPU the host side is not the hot path.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has both
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt takes an int; glibc stores the trim threshold as size_t, so -1 is the largest size
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, -1))
