"""Transport protocol, parameter layout and the factory that picks an implementation.

Layout: the parameters of `model.named_parameters()` (tied weights appear once) laid out
back to back in one byte buffer, each at an offset aligned to 64 bytes. Both ends derive the
layout from their own model; `check_layout` compares names, shapes and dtypes once at
attach time and fails with a message naming the first mismatches.
"""

from __future__ import annotations

import socket
import zlib
from typing import Protocol

import torch

from nonstop.config import TransportConfig
from nonstop.types import TensorSpec, TransportHandle

ALIGN = 64


class TransportError(RuntimeError):
    """A weight transfer failed or timed out; the message names the peer and the version."""


class WeightSink(Protocol):
    def connect(self) -> None:
        """Rendezvous with the engines (may block until they attach)."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> None: ...

    def close(self) -> None: ...


class WeightSource(Protocol):
    def maybe_update(self, model: torch.nn.Module) -> int | None: ...

    def close(self) -> None: ...


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def model_layout(model: torch.nn.Module) -> tuple[list[TensorSpec], int]:
    specs, offset = [], 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        specs.append(TensorSpec(name, tuple(p.shape), dtype_name(p.dtype), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return specs, offset


def check_layout(expected: list[TensorSpec], model: torch.nn.Module) -> None:
    """Fail clearly if `model` does not have exactly the parameters the trainer sends."""
    ours = {s.name: s for s in model_layout(model)[0]}
    theirs = {s.name: s for s in expected}
    problems = [f"missing on engine: {n}" for n in theirs.keys() - ours.keys()]
    problems += [f"not sent by trainer: {n}" for n in ours.keys() - theirs.keys()]
    for name in theirs.keys() & ours.keys():
        a, b = theirs[name], ours[name]
        if (a.shape, a.dtype) != (b.shape, b.dtype):
            problems.append(f"{name}: trainer {a.dtype}{list(a.shape)} vs engine {b.dtype}{list(b.shape)}")
    if problems:
        shown = "; ".join(sorted(problems)[:5])
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise TransportError(f"trainer and engine parameters differ: {shown}{more}")


def views(flat: torch.Tensor, layout: list[TensorSpec]) -> list[torch.Tensor]:
    """Typed, shaped views into a uint8 buffer, one per TensorSpec."""
    return [
        flat[s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)
        for s in layout
    ]


@torch.no_grad()
def pack(model: torch.nn.Module, dst_views: list[torch.Tensor]) -> None:
    """Copy the model's parameters into the typed views of a flat buffer, in layout order."""
    for dst, (_, p) in zip(dst_views, model.named_parameters()):
        dst.copy_(p.detach())


def bind_flat(model: torch.nn.Module, layout: list[TensorSpec], total_bytes: int) -> torch.Tensor:
    """Re-home the model's parameters into one flat buffer so a weight update is one copy."""
    flat = torch.empty(total_bytes, dtype=torch.uint8)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for spec, view in zip(layout, views(flat, layout)):
            view.copy_(params[spec.name])
            params[spec.name].data = view
    return flat


def crc32(buf: torch.Tensor) -> int:
    """CRC32 of a contiguous uint8 tensor's bytes."""
    return zlib.crc32(memoryview(buf.numpy()))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def plan_transport(cfg: TransportConfig, model: torch.nn.Module, num_engines: int, host: str = "127.0.0.1") -> TransportHandle:
    """`host`: the trainer's address the engines reach (broadcast's store and group)."""
    layout, total = model_layout(model)
    options: dict = {"timeout_s": cfg.timeout_s, "connect_timeout_s": cfg.connect_timeout_s,
                     "num_engines": num_engines, "checksum": cfg.checksum, "per_tensor": cfg.per_tensor}
    if cfg.kind == "shm":
        from nonstop.transport.shm import new_segment_name

        options["name"] = new_segment_name()
    elif cfg.kind == "files":
        import tempfile

        options["dir"] = cfg.files_dir or tempfile.mkdtemp(prefix="nonstop-weights-")
        options["owned"] = cfg.files_dir is None  # the sink removes a folder it created
        options["keep"] = cfg.files_keep
    else:
        options.update(host=host, port=free_port(host), bucket_bytes=int(cfg.bucket_mb * 2**20))
    return TransportHandle(kind=cfg.kind, layout=layout, total_bytes=total, options=options)


def open_sink(handle: TransportHandle) -> WeightSink:
    """Trainer side: allocate the sink's buffers; call `connect()` (with the engines) next."""
    if handle.kind == "shm":
        from nonstop.transport.shm import ShmSink

        return ShmSink(handle)
    if handle.kind == "files":
        from nonstop.transport.files import FilesSink

        return FilesSink(handle)
    from nonstop.transport.broadcast import BroadcastSink

    return BroadcastSink(handle)


def open_source(handle: TransportHandle, model: torch.nn.Module, rank: int = 1) -> WeightSource:
    """Engine side; `rank` is this engine's rank in the transport (trainer is 0)."""
    check_layout(handle.layout, model)
    if handle.kind == "shm":
        from nonstop.transport.shm import ShmSource

        return ShmSource(handle, model)
    if handle.kind == "files":
        from nonstop.transport.files import FilesSource

        return FilesSource(handle, model)
    from nonstop.transport.broadcast import BroadcastSource

    return BroadcastSource(handle, model, rank)
