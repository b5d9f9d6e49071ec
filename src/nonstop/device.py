"""Where a model runs: `device: auto | cpu | cuda | cuda:i` and its dtype, resolved in the actor.

Contract:
- `resolve_device(spec, field)` turns a config value into a torch.device inside the process that
  will use it (so under Ray, `auto` and `cuda` mean the GPU Ray gave this actor): `auto` is
  `cuda` when torch sees a GPU, else `cpu`; asking for a GPU that is not there raises
  DeviceError naming the field;
- `resolve_dtype(spec, device, field)`: `auto` is bfloat16 where `bf16_supported(device)`, else
  float32; None (a field left unset and not resolved by the run, e.g. in tests or `nonstop
  serve`) keeps the older rule: bfloat16 on a GPU, float32 on the CPU;
- `bf16_supported(device)`: on a GPU torch.cuda.is_bf16_supported(); on the CPU the native bf16
  dot-product instructions (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo, or torch's AMX
  capability): without them torch emulates bf16 matmuls and they are slower than float32. The
  machines of this project's kind differ (some have AVX2 only), so this is asked at run time,
  inside the actor that computes, never assumed;
- `amx_supported(device)`: a CPU with AMX tiles (`amx_bf16`, or torch's AMX capability). Only
  there is torch's bf16 attention kernel faster than float32 attention: the engine's runner picks
  its attention by it (engine/runner.py);
- `attention(q, k, v, **kw)` is torch's scaled-dot-product attention computed in float32 on the
  CPU whenever it would otherwise run in half precision: half-precision inputs, or any inputs
  under CPU autocast (which lists this op for bfloat16 and casts float32 inputs down).
  torch's CPU kernel for bfloat16 with a mask ran 4.5x slower than float32 on a decode step
  (2.16 against 0.48 ms with the casts, 16 rows at the Qwen2.5-0.5B shape), and its backward
  2.5x slower in the trainer (41 against 16 ms per layer at 8 x 127 completion tokens); float32
  also keeps the scores out of bfloat16 rounding, as GPU flash attention does. The result comes
  back in the dtype the plain call would give (autocast's under autocast, else the input's);
- `retain_freed_memory()` keeps a CPU process's freed memory in it: glibc's malloc hands every
  block over 32 MiB to the kernel with mmap and returns it on free, so each training step's
  identical tensors (logits, autocast's weight casts, gradients) started as untouched pages,
  and on this project's VMs every 4 KiB page faulted in costs: casting the 0.5B shape's
  embedding to a new bf16 tensor took 0.22 s against 0.11 s into an existing one, and a bf16
  trainer step at that shape went from 26-30 s to 14-18 s with it (docs/precision.md). On Linux
  with glibc it sets M_MMAP_MAX = 0 (every block from malloc's heap) and M_TRIM_THRESHOLD = the
  largest size (nothing returned to the kernel) and returns True; elsewhere it changes nothing
  and returns False. The process's RSS then stays at its peak (docs/memory.md). It applies to
  blocks allocated after the call: the trainer calls it on the CPU before loading the weights;
- `on(device)` is the context in which a role computes: torch's factory functions
  (`torch.zeros`, `torch.tensor`, `torch.arange`, ...) create on that device, so the engine's and
  the trainer's code stays device-agnostic; on the CPU it changes nothing.

How weights travel between GPUs is the transport's `device_path` (transport/device.py): through
host memory (the trainer copies its GPU weights into the transport's host buffer; a GPU engine
receives into a host staging copy and copies it to the device at the swap, engine/updates.py),
or GPU to GPU (CUDA IPC for shm, NCCL for broadcast; never run on a GPU).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import shutil
import sys
from collections.abc import Iterator
from typing import TypeVar

import torch
import torch.nn.functional as F

from nonstop.config import ConfigError

DEVICE_PATTERN = r"^(auto|cpu|cuda(:\d+)?)$"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


M = TypeVar("M", bound=torch.nn.Module)


class DeviceError(ConfigError):
    """A device this process does not have; the message names the field."""


def resolve_device(spec: str, field: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"{field}: '{spec}' but torch sees no CUDA device here (torch {torch.__version__}); "
                f"use '{field.rsplit('.', 1)[0]}.device: cpu' or 'auto', or install a CUDA build of torch"
            )
        if (device.index or 0) >= torch.cuda.device_count():
            raise DeviceError(f"{field}: '{spec}' but only {torch.cuda.device_count()} CUDA device(s) are visible")
    return device


CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""/proc/cpuinfo flags of native bf16 dot products (AVX512-BF16 on Zen 4 / Cooper Lake, AMX on Sapphire Rapids)."""


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first CPU's feature flags; empty where the file is missing (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def bf16_supported(device: torch.device) -> bool:
    """Whether `device` computes bf16 natively (see the module docstring)."""
    if device.type == "cuda":
        # no GPU here: resolve_device refused already, this branch only names what a GPU would have
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()
    if device.type != "cpu":
        return False
    if "AMX" in torch.backends.cpu.get_cpu_capability():
        return True
    return any(flag in cpu_flags() for flag in CPU_BF16_FLAGS)


def amx_supported(device: torch.device) -> bool:
    """Whether `device` is a CPU with AMX tiles for bf16 (`amx_bf16`, or torch's AMX capability): there
    torch's bf16 attention kernel is the fast one; with AVX512-BF16 alone it is the slow one (see
    engine/runner.py)."""
    if device.type != "cpu":
        return False
    return "AMX" in torch.backends.cpu.get_cpu_capability() or "amx_bf16" in cpu_flags()


def resolve_dtype(spec: str | None, device: torch.device, field: str) -> torch.dtype:
    if spec is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if spec == "auto":
        return torch.bfloat16 if bf16_supported(device) else torch.float32
    if spec not in DTYPES:
        raise DeviceError(f"{field}: unknown dtype '{spec}' (auto, {', '.join(DTYPES)})")
    return DTYPES[spec]


def dtype_name(dtype: torch.dtype) -> str:
    """'float32', 'bfloat16' or 'float16': the config's spelling, for records."""
    return str(dtype).removeprefix("torch.")


def place(model: M, device: torch.device) -> M:
    """Move a module's parameters and buffers to `device` in place; returns the same module."""
    torch.nn.Module.to(model, device)
    return model


@contextlib.contextmanager
def on(device: torch.device) -> Iterator[None]:
    """Compute on `device`: factory functions without an explicit device create there."""
    if device.type == "cpu":
        yield
        return
    with torch.device(device):
        yield


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention, through float32 on the CPU where it would run in half precision."""
    if q.device.type == "cpu":
        autocast = torch.is_autocast_enabled("cpu")
        if autocast or any(t.dtype in (torch.bfloat16, torch.float16) for t in (q, k, v)):
            out_dtype = torch.get_autocast_dtype("cpu") if autocast else q.dtype
            with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back down
                return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw).to(out_dtype)
    return F.scaled_dot_product_attention(q, k, v, **kw)


def compile_blocker() -> str | None:
    """Why torch.compile cannot run here (None when it can): inductor's CPU code needs a C++ compiler."""
    compiler = os.environ.get("CXX") or "c++"
    if shutil.which(compiler) is None and shutil.which("g++") is None:
        return f"no C++ compiler ({compiler} or g++) on PATH for torch.compile's CPU code"
    return None


M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def retain_freed_memory() -> bool:
    """Keep this process's freed memory in it (see the module docstring); True where applied."""
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
