"""A transport planned from its config, and its two ends opened: the one place that names every kind.

`plan_transport` (trainer side) describes the transport in a picklable `TransportHandle`;
`open_publisher(handle)` and `open_receiver(handle, model, rank)` open its two ends, each kind's
module chosen by the handle's options; `release(handle)` frees what a dead trainer could not.
The kinds' modules build on base.py's seam, so this module sits above them.
"""

from __future__ import annotations

import tempfile

import torch

from nonstop.config import FilesTransportConfig, LoraConfig, ShmTransportConfig, TransportConfig
from nonstop.transport.base import (
    TransportError,
    WeightPublisher,
    WeightReceiver,
    check_layout,
    engine_target,
    free_port,
    layout_of,
    sent_tensors,
)
from nonstop.transport.broadcast import BroadcastPublisher
from nonstop.transport.broadcast_receiver import BroadcastReceiver
from nonstop.transport.device import member_device, plan_broadcast_path, plan_shm_path, tensors_device
from nonstop.transport.files import FilesPublisher, FilesReceiver
from nonstop.transport.shm import ShmPublisher, ShmReceiver, new_segment_name, release_segment
from nonstop.types import BroadcastOptions, FilesOptions, ShmOptions, TransportHandle, TransportOptions


def plan_transport(
    cfg: TransportConfig,
    model: torch.nn.Module,
    num_engines: int,
    lora: LoraConfig | None = None,
    next_version: int = 1,
    host: str = "127.0.0.1",
    first_engines: int | None = None,
) -> TransportHandle:
    """Describe the transport; with `lora` (an enabled LoraConfig) only the adapters travel.
    `next_version`: the first version the trainer will publish (above 1 after a resume).
    `host`: the trainer's address the engines reach (broadcast's store and group).
    `first_engines`: engine ranks 1..first_engines attach at the start, the others of
    1..num_engines may join later (None: all of them at the start)."""
    lora = lora if lora is not None and lora.enabled else None
    sent = sent_tensors(model, lora)
    wire = None if cfg.dtype == "auto" else getattr(torch, cfg.dtype)  # 'auto' resolves in the orchestrator
    layout, total = layout_of(sent, wire)
    trainer_device = tensors_device(t for _, t in sent)
    options: TransportOptions
    if isinstance(cfg, ShmTransportConfig):
        options = ShmOptions(
            name=new_segment_name(),
            device_path=plan_shm_path(cfg.device_path, trainer_device),
            device=str(trainer_device),
        )
    elif isinstance(cfg, FilesTransportConfig):
        notify_at = (cfg.notify_host, free_port(cfg.notify_host)) if cfg.notify == "http" else None
        options = FilesOptions(
            dir=cfg.dir or tempfile.mkdtemp(prefix="nonstop-weights-"),
            keep=cfg.keep,
            owned=cfg.dir is None,
            notify_at=notify_at,
            delta=cfg.delta,
            full_every=cfg.full_every,
        )  # the publisher removes a folder it made
    else:
        plan_broadcast_path(cfg.device_path, trainer_device)
        options = BroadcastOptions(
            host=host,
            port=free_port(host),
            bucket_bytes=int(cfg.bucket_mb * 2**20),
            per_tensor=cfg.per_tensor,
            rejoin_timeout_s=cfg.rejoin_timeout_s,
            device_path=cfg.device_path,
            device=str(trainer_device),
            member=member_device(trainer_device),
            delta=cfg.delta,
        )
    return TransportHandle(
        layout=layout,
        total_bytes=total,
        options=options,
        num_engines=num_engines,
        first_engines=num_engines if first_engines is None else first_engines,
        timeout_s=cfg.timeout_s,
        connect_timeout_s=cfg.connect_timeout_s,
        checksum=cfg.checksum,
        lora=lora,
        next_version=next_version,
    )


def open_publisher(handle: TransportHandle) -> WeightPublisher:
    """Trainer side: allocate the publisher's buffers; call `connect()` (with the engines) next."""
    opts = handle.options
    if isinstance(opts, ShmOptions):
        return ShmPublisher(handle, opts)
    if isinstance(opts, FilesOptions):
        return FilesPublisher(handle, opts)
    return BroadcastPublisher(handle, opts)


def open_receiver(handle: TransportHandle, model: torch.nn.Module, rank: int = 1) -> WeightReceiver:
    """Engine side; `rank` is this engine's rank in the transport (trainer is 0, engines 1..N).

    With a LoRA handle the engine receives adapters only and merges them into `model`."""
    if not 1 <= rank <= handle.num_engines:
        raise TransportError(
            f"engine rank {rank} outside 1..{handle.num_engines} (the trainer planned for "
            f"{handle.num_engines} engine(s))"
        )
    target = engine_target(model, handle.lora, handle.layout)
    check_layout(handle.layout, target.tensors())
    opts = handle.options
    if isinstance(opts, ShmOptions):
        return ShmReceiver(handle, opts, target, rank)
    if isinstance(opts, FilesOptions):
        return FilesReceiver(handle, opts, target)
    return BroadcastReceiver(handle, opts, target, rank)


def release(handle: TransportHandle) -> bool:
    """Free the transport's system resources if their owner died without freeing them."""
    if handle.kind == "shm":
        return release_segment(handle.options.name)  # type: ignore[union-attr]
    return False
