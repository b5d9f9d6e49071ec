"""Transport protocol, parameter layout and the factory that picks an implementation.

Layout: the sent tensors — `model.named_parameters()` (tied weights appear once), or only the
LoRA adapters of a LoRA run — laid out back to back in one byte buffer, each at an offset
aligned to 64 bytes. The trainer's tensors are re-homed into such a buffer at the first
publish (FlatSender), so publishing reads one contiguous block. The engine end fills a
`WeightTarget`: its parameters, the LoRA adapters it merges (nonstop.lora), or fused experts
its per-expert model views (names.py); `check_layout` compares names, shapes and dtypes once
at attach time and fails with a message naming the first mismatches. Transports apply a
version by pointing the target's tensors at a complete buffer (`repoint`), not by copying, where
the buffer lies on the target's device; across devices (a GPU path, transport/device.py) they
copy into the target (`copy_into`).
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Iterable
from typing import Protocol

import torch

from nonstop.config import LoraConfig
from nonstop.errors import NonstopError
from nonstop.lora import MergedAdapters, adapter_tensors
from nonstop.transport.names import PerExpertParameters, needs_expert_mapping
from nonstop.types import TensorSpec, TransportHandle

ALIGN = 64


class TransportError(NonstopError, RuntimeError):
    """A weight transfer failed or timed out; the message names the peer and the version."""


class WeightPublisher(Protocol):
    sent_bytes: int
    """What the last publish moved: a delta's bytes (transport.delta) or the full layout's."""

    def connect(self) -> None:
        """Rendezvous with the engines (may block until they attach)."""
        ...

    def publish(self, model: torch.nn.Module, version: int) -> None: ...

    def close(self) -> None: ...


class WeightReceiver(Protocol):
    """Engine-side end of a weight transport."""

    handle: TransportHandle
    target: "WeightTarget"

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        """If a newer complete version is available, make `model` hold it and return it.

        Never blocks on the trainer; returns None when there is nothing new."""
        ...

    def close(self) -> None: ...


class WeightTarget(Protocol):
    """Engine side: the tensors a transport fills, and what follows each complete update."""

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs; a transport may copy into them or replace their `.data`."""
        ...

    def applied(self) -> None:
        """Called once the tensors hold a complete new version (LoRA: merge the adapters)."""
        ...


class ModelParameters:
    """Full-weight sync: the target is every parameter of the model (tied weights once)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.named: list[tuple[str, torch.Tensor]] = list(model.named_parameters())

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return self.named

    def applied(self) -> None:
        pass


def sent_tensors(model: torch.nn.Module, lora: LoraConfig | None) -> list[tuple[str, torch.Tensor]]:
    """Trainer side: what travels — the adapters of a LoRA run, otherwise every parameter."""
    if lora is not None:
        return adapter_tensors(model)
    return list(model.named_parameters())


def engine_target(model: torch.nn.Module, lora: LoraConfig | None, layout: list[TensorSpec]) -> WeightTarget:
    """What the engine's end fills: LoRA adapters to merge, fused experts its model holds per
    expert (see names.py), or its parameters as they are."""
    if lora is not None:
        return MergedAdapters(model, lora, layout_dtype(layout))
    if needs_expert_mapping(layout, model):
        try:
            return PerExpertParameters(model, layout)
        except ValueError as e:
            raise TransportError(f"trainer and engine parameters differ: {e}") from e
    return ModelParameters(model)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(named: list[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> tuple[list[TensorSpec], int]:
    """The layout of `named`, each tensor travelling in `dtype` (None: its own)."""
    specs, offset = [], 0
    for name, p in named:
        wire = dtype or p.dtype
        nbytes = p.numel() * wire.itemsize
        specs.append(TensorSpec(name, tuple(p.shape), dtype_name(wire), offset, nbytes))
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return specs, offset


def model_layout(model: torch.nn.Module) -> tuple[list[TensorSpec], int]:
    return layout_of(list(model.named_parameters()))


def check_layout(expected: list[TensorSpec], target: torch.nn.Module | list[tuple[str, torch.Tensor]]) -> None:
    """Fail clearly if the engine's tensors are not exactly the ones the trainer sends."""
    named: list[tuple[str, torch.Tensor]] = (
        list(target.named_parameters()) if isinstance(target, torch.nn.Module) else target
    )
    ours = {s.name: s for s in layout_of(named)[0]}
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


def layout_dtype(layout: list[TensorSpec]) -> torch.dtype:
    """The one dtype every tensor of `layout` travels in (float32 for an empty or mixed layout): what an
    engine receives into."""
    names = {s.dtype for s in layout}
    return getattr(torch, names.pop()) if len(names) == 1 else torch.float32


def in_layout_order(named: list[tuple[str, torch.Tensor]], layout: list[TensorSpec]) -> list[torch.Tensor]:
    by_name = dict(named)
    return [by_name[s.name] for s in layout]


def views(flat: torch.Tensor, layout: list[TensorSpec]) -> list[torch.Tensor]:
    """Typed, shaped views into a uint8 buffer, one per TensorSpec."""
    return [flat[s.offset : s.offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape) for s in layout]


def bind_flat(
    tensors: list[torch.Tensor], layout: list[TensorSpec], total_bytes: int, device: torch.device | None = None
) -> torch.Tensor:
    """Re-home `tensors` (in layout order) into one new flat buffer on `device` (default: the
    host); returns the buffer."""
    flat = torch.empty(total_bytes, dtype=torch.uint8, device=device or "cpu")
    with torch.no_grad():
        for t, view in zip(tensors, views(flat, layout)):
            view.copy_(t)
            t.data = view
    return flat


def repoint(tensors: list[torch.Tensor], new_views: list[torch.Tensor]) -> None:
    """Zero-copy apply: each tensor's storage becomes its view of another buffer. The tensor
    objects stay the same, so modules, tied weights and optimizers keep their references."""
    for t, v in zip(tensors, new_views):
        t.data = v


def copy_into(tensors: list[torch.Tensor], new_views: list[torch.Tensor]) -> None:
    """Copying apply: the engine keeps its own tensors and copies a version into them (a GPU path:
    the engine must not point its weights at memory the trainer owns, and its tensors may sit on
    another device than the version). Asynchronous on a GPU: `device.settle` before reusing the source."""
    with torch.no_grad():
        if same_device(tensors, new_views):
            torch._foreach_copy_(tensors, new_views)
        else:
            for t, v in zip(tensors, new_views):
                t.copy_(v, non_blocking=True)


def same_device(tensors: list[torch.Tensor], new_views: list[torch.Tensor]) -> bool:
    """Zero-copy apply is possible only where the version already lies on the tensors' device."""
    return bool(tensors) and tensors[0].device == new_views[0].device


class FlatSender:
    """Trainer side: the sent tensors, re-homed once into one flat buffer in layout order, so a
    publish reads one contiguous block (one copy, or none: broadcast sends slices of it).

    The buffer lives on `device` (the host by default; the trainer's GPU for a GPU path). The
    tensor list is looked up once per model object; each publish only checks that every tensor
    still lives at its place in the buffer, and binds again if anything re-homed one. Tensors on
    another device than the buffer (a GPU trainer on a host path) or in another dtype than the
    layout's (float32 weights sent as bfloat16) are not re-homed: each publish copies (casts) them
    into the buffer, or straight into the transport's own (`write`)."""

    def __init__(self, handle: TransportHandle, device: torch.device | None = None) -> None:
        self.handle = handle
        self.device = device or torch.device("cpu")
        self.lora = handle.lora
        self.buffer: torch.Tensor | None = None
        self.model: torch.nn.Module | None = None
        self.tensors: list[torch.Tensor] = []
        self.expected_ptrs: list[int] = []
        self.copied = False

    def _look_up(self, model: torch.nn.Module) -> None:
        if model is not self.model:
            self.model = model
            self.tensors = in_layout_order(sent_tensors(model, self.lora), self.handle.layout)
            self.buffer = None
        self.copied = any(
            t.device != self.device or dtype_name(t.dtype) != s.dtype for t, s in zip(self.tensors, self.handle.layout)
        )

    @torch.no_grad()
    def _copy_into(self, dest: torch.Tensor) -> None:
        for t, view in zip(self.tensors, views(dest, self.handle.layout)):
            view.copy_(t)

    def write(self, model: torch.nn.Module, dest: torch.Tensor) -> None:
        """Fill `dest` (uint8, total_bytes, on the buffer's device) with the sent tensors in the layout:
        one block copy, or one copy (and cast) per tensor where they are not re-homed."""
        self._look_up(model)
        if self.copied:
            self._copy_into(dest)
        else:
            dest.copy_(self._bound())

    def flat(self, model: torch.nn.Module) -> torch.Tensor:
        self._look_up(model)
        if self.copied:  # elsewhere than the buffer or another dtype: copied at each publish
            if self.buffer is None:
                self.buffer = torch.empty(self.handle.total_bytes, dtype=torch.uint8, device=self.device)
            self._copy_into(self.buffer)
            return self.buffer
        return self._bound()

    def _bound(self) -> torch.Tensor:
        """The buffer the sent tensors live in, bound again if anything re-homed one."""
        if self.buffer is None or [t.data_ptr() for t in self.tensors] != self.expected_ptrs:
            self.buffer = bind_flat(self.tensors, self.handle.layout, self.handle.total_bytes, self.device)
            self.expected_ptrs = [t.data_ptr() for t in self.tensors]
        return self.buffer


def crc32(buf: torch.Tensor) -> int:
    """CRC32 of a contiguous uint8 tensor's bytes (a GPU tensor's are copied to the host first)."""
    return zlib.crc32(buf.cpu().numpy().data)


def weights_crc32(tensors: Iterable[torch.Tensor]) -> int:
    """CRC32 over the bytes of `tensors`, one after another (in a transport layout's order): the
    trainer's sent tensors and an engine's target give the same value exactly when the engine holds
    the trainer's weights bit for bit."""
    crc = 0
    for t in tensors:
        flat = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        crc = zlib.crc32(flat.numpy().data, crc)
    return crc


def receiver_crc32(receiver: WeightReceiver) -> int:
    """weights_crc32 of what an engine's end of the transport holds, in the trainer's layout order."""
    return weights_crc32(in_layout_order(receiver.target.tensors(), receiver.handle.layout))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
