"""Device paths of the weight transports: what moves weights GPU to GPU without a host round trip.

`transport.device_path` (config/kinds.py) picks, per transport kind:
- shm: 'host' (the segment's host slots), 'ipc' (two slots in the trainer's GPU memory, exported
  once with a CUDA IPC handle that every engine maps, shm.py), or 'auto' (GPU slots when the
  trainer is on a GPU and every engine mapped them, else the host slots);
- broadcast: 'host' (host buckets over gloo), 'nccl' (buckets on each member's GPU over NCCL), or
  'auto' (NCCL when every member at the rendezvous is on CUDA, broadcast.py).

This module holds the parts both kinds share and that do not depend on the protocol:
- `plan_shm_path` / `plan_broadcast_path` (trainer side, at plan time): the resolved mode, or a
  ConfigError naming `transport.device_path` when a GPU path is asked for on the CPU;
- `receive_device(handle, engine_device)` (engine side): where the engine's transport target
  should live so that a GPU path can be used (its GPU, float32) or None (the host);
- `member_device(device)` / `pick_backend(asked, members)`: what each member of a broadcast group
  says at the rendezvous ('cpu', or 'cuda/<GPU uuid>') and the backend that follows: NCCL needs
  every member on CUDA and on its own GPU (it refuses two ranks on one GPU);
- `settle(device)`: wait for the work queued on `device`'s current stream (CUDA copies are
  asynchronous: a stamp or a claim release must come after the bytes are there);
- `IpcRecord.export(buffer)` / `.open()`: a GPU buffer's CUDA IPC handle as bytes (torch's
  `reduce_tensor`, whose arguments `rebuild_cuda_tensor` takes back), keyed by the GPU's UUID so
  that an engine with another CUDA_VISIBLE_DEVICES order finds the same physical GPU.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from nonstop.config import ConfigError
from nonstop.types import BroadcastOptions, ShmOptions, TransportHandle

ShmPath = Literal["host", "auto", "ipc"]
Backend = Literal["gloo", "nccl"]


def tensors_device(tensors: Iterable[torch.Tensor]) -> torch.device:
    """The device of the first tensor (a model's or a layout's tensors all live on one)."""
    for t in tensors:
        return t.device
    return torch.device("cpu")


def plan_shm_path(asked: ShmPath, trainer_device: torch.device) -> ShmPath:
    """The shm segment's mode: GPU slots only for a trainer on CUDA."""
    if asked == "ipc" and trainer_device.type != "cuda":
        raise ConfigError(
            f"transport.device_path: 'ipc' maps the trainer's GPU memory, but the trainer's weights "
            f"are on {trainer_device} (trainer.device); use 'host' or 'auto'"
        )
    if asked == "auto" and trainer_device.type != "cuda":
        return "host"
    return asked


def plan_broadcast_path(asked: Literal["auto", "host", "nccl"], trainer_device: torch.device) -> None:
    """Refuse NCCL for a trainer on the CPU at plan time (NCCL carries only CUDA tensors)."""
    if asked == "nccl" and trainer_device.type != "cuda":
        raise ConfigError(
            f"transport.device_path: 'nccl' broadcasts from the trainer's GPU, but the trainer's "
            f"weights are on {trainer_device} (trainer.device); use 'host' or 'auto'"
        )


def wants_device(handle: TransportHandle) -> bool:
    """Whether the handle allows a GPU path (the engine then receives on its GPU if it has one)."""
    options = handle.options
    return isinstance(options, (ShmOptions, BroadcastOptions)) and options.device_path != "host"


def receive_device(handle: TransportHandle, engine_device: torch.device) -> torch.device | None:
    """Where an engine on `engine_device` should keep the tensors its transport fills: its GPU
    when the handle allows a GPU path and it is on one, else None (host float32, as before)."""
    return engine_device if engine_device.type == "cuda" and wants_device(handle) else None


def member_device(device: torch.device) -> str:
    """What a broadcast member says of its device at the rendezvous: 'cpu' or 'cuda/<GPU uuid>'
    (the physical GPU: two processes may number one GPU differently)."""
    return f"cuda/{gpu_uuid(device)}" if device.type == "cuda" else "cpu"


def pick_backend(asked: Literal["auto", "host", "nccl"], members: dict[int, str]) -> Backend:
    """The broadcast group's backend for `members` (rank -> member_device). NCCL takes only members
    on CUDA, one per GPU; 'nccl' asked where that does not hold fails naming the ranks, 'auto' falls
    back to gloo."""

    def who(ranks: list[int]) -> str:
        return ", ".join("the trainer" if r == 0 else f"engine rank {r}" for r in ranks)

    if asked == "host":
        return "gloo"
    off = sorted(r for r, d in members.items() if not d.startswith("cuda/"))
    on_gpu = [d for d in members.values() if d.startswith("cuda/")]
    shared = sorted(r for r, d in members.items() if d.startswith("cuda/") and on_gpu.count(d) > 1)
    if asked == "nccl" and off:
        raise ConfigError(
            f"transport.device_path: 'nccl' needs every member's weights on CUDA, but {who(off)} "
            f"receive(s) on the CPU (engine.device / trainer.device, or the vLLM engine, which "
            f"receives into a host staging model); use 'host' or 'auto'"
        )
    if asked == "nccl" and shared:
        raise ConfigError(
            f"transport.device_path: 'nccl' needs one GPU per member (NCCL refuses two ranks on "
            f"one GPU), but {who(shared)} share one; use 'ipc' with the shm transport, 'host' or 'auto'"
        )
    return "gloo" if off or shared else "nccl"


def settle(device: torch.device) -> None:
    """Block until the work queued on `device`'s current stream is done (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gpu_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def local_index(uuid: str) -> int | None:
    """This process's index of the GPU with `uuid`, None when it is not visible here."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return i
    return None


_DEVICE_ARG = 6  # the storage device index in rebuild_cuda_tensor's arguments (torch/multiprocessing/reductions.py)


@dataclass(frozen=True)
class IpcRecord:
    """A GPU buffer's CUDA IPC handle: the physical GPU's UUID and `rebuild_cuda_tensor`'s arguments.

    The exporting process must keep the buffer alive for as long as any engine maps it."""

    uuid: str
    args: tuple

    @staticmethod
    def export(buffer: torch.Tensor) -> IpcRecord:
        if buffer.device.type != "cuda":
            raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got one on {buffer.device}")
        _rebuild, args = reduce_tensor(buffer)
        return IpcRecord(gpu_uuid(buffer.device), tuple(args))

    def to_bytes(self) -> bytes:
        return pickle.dumps((self.uuid, self.args))

    @staticmethod
    def from_bytes(data: bytes) -> IpcRecord:
        uuid, args = pickle.loads(data)
        return IpcRecord(uuid, tuple(args))

    def open(self) -> torch.Tensor | None:
        """Map the buffer in this process (once: each open maps it again); None when its GPU is
        not visible here (CUDA_VISIBLE_DEVICES, or no CUDA at all)."""
        if not torch.cuda.is_available():
            return None
        index = local_index(self.uuid)
        if index is None:
            return None
        args = list(self.args)
        args[_DEVICE_ARG] = index  # the exporter's index of that GPU may differ from ours
        return rebuild_cuda_tensor(*args)
