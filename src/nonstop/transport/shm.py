"""Shared-memory transport: one segment allocated once, N + 2 slots, version stamps, zero-copy apply.

Segment: a header of int64 words — per slot its stamp and its CRC32, then per engine rank the
slot it is reading (-1: none) — and then N + 2 slots (N engines), each holding the whole flat
layout. Stamps: EMPTY, WRITING while the trainer writes, else the version the slot holds.

Publish (trainer, one copy): pick a slot that is neither the newest complete one nor claimed
by any engine — with N + 2 slots one always exists — stamp it WRITING, re-check the claims
(an engine may have claimed it at that moment; then try another slot), copy the trainer's
flat buffer into it, write its CRC, stamp it with the version. The trainer never waits for an
engine, not even a dead one.

Apply (engine, no copy): claim the newest complete slot, then re-read its stamp; if the trainer
began to overwrite it meanwhile, release the claim and report nothing new (the next forward
pass gets the newer version). Otherwise verify the CRC when checksums are on, point the
engine's tensors at that slot's bytes, and release the previous slot. A slot an engine reads
from is never written, so a half-written update is never applied and a running forward pass
never sees its weights change.

The claim protocol is Dekker's: each side stores (stamp / claim), then loads the other's
word. `_fence()` (an uncontended lock, whose atomic instruction is a full memory barrier)
sits between the store and the load on both sides, so at least one side sees the other.

GPU slots (`transport.device_path` 'ipc' or 'auto' with the trainer on a GPU, device.py). The
segment then also describes two slots held in one buffer in the trainer's GPU memory: the same
stamps, CRCs and claims cover them, after the host slots. The trainer exports that buffer once
(its CUDA IPC handle, written after the header) and every engine whose weights are on a GPU maps
it once at attach and records in its `mapped` word whether it could. A publish goes to a GPU slot
('ipc'; 'auto' when every engine mapped them) as one GPU-to-GPU copy, settled before the stamp.
An engine applies a slot on another device than its weights by copying (claim, copy, settle,
release): it never points its weights at the trainer's memory (which would vanish with the
trainer) and holds a claim only for the copy. So two GPU slots suffice: if both are claimed or
newest, 'auto' publishes to a host slot instead and 'ipc' waits up to timeout_s for a claim to
clear. The CPU tests run this copying apply on host slots (`apply="copy"`).
"""

from __future__ import annotations

import _posixshmem  # type: ignore[import-not-found]  # CPython's POSIX shm calls, as SharedMemory uses
import threading
import time
import uuid
from multiprocessing import resource_tracker, shared_memory
from typing import Literal

import torch

from nonstop.transport.base import (
    FlatSender,
    TransportError,
    WeightTarget,
    bind_flat,
    copy_into,
    crc32,
    in_layout_order,
    repoint,
    same_device,
    views,
)
from nonstop.transport.device import IpcRecord, settle, tensors_device
from nonstop.types import ShmOptions, TransportHandle

WRITING = -1
EMPTY = -2
NONE = -1
GPU_SLOTS = 2
RECORD_BYTES = 8192  # room for the pickled CUDA IPC handle (a few hundred bytes)
_barrier = threading.Lock()


def _fence() -> None:
    with _barrier:
        pass


def new_segment_name() -> str:
    return f"nonstop_{uuid.uuid4().hex[:16]}"


def release_segment(name: str) -> bool:
    """Unlink segment `name` if it still exists, i.e. its creator (the trainer) died without
    closing it, and drop it from the resource tracker the run's processes share, so no exit path
    leaves shared memory or a 'leaked shared_memory' warning behind. True if it had to."""
    path = "/" + name
    try:
        _posixshmem.shm_unlink(path)
    except FileNotFoundError:
        return False
    resource_tracker.unregister(path, "shared_memory")
    return True


class _Segment:
    def __init__(self, handle: TransportHandle, opts: ShmOptions, create: bool) -> None:
        engines = handle.num_engines
        self.num_host = engines + 2
        self.num_slots = self.num_host + (GPU_SLOTS if opts.device_path != "host" else 0)
        words = 2 * self.num_slots + 2 * engines + 1
        header = (words * 8 + 63) // 64 * 64
        record = RECORD_BYTES if self.num_slots > self.num_host else 0
        total = handle.total_bytes
        self.shm = shared_memory.SharedMemory(
            name=opts.name, create=create, size=header + record + self.num_host * total
        )
        raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        words_view = raw[:header].view(torch.int64)
        self.stamps = words_view[: self.num_slots]
        self.crcs = words_view[self.num_slots : 2 * self.num_slots]
        self.claims = words_view[2 * self.num_slots : 2 * self.num_slots + engines]
        self.mapped = words_view[2 * self.num_slots + engines : 2 * self.num_slots + 2 * engines]
        self.record_len = words_view[2 * self.num_slots + 2 * engines : 2 * self.num_slots + 2 * engines + 1]
        self.record = raw[header : header + record]
        base = header + record
        self.slots: list[torch.Tensor | None] = [
            raw[base + i * total : base + (i + 1) * total] for i in range(self.num_host)
        ]
        self.slots += [None] * (self.num_slots - self.num_host)  # GPU slots, once allocated or mapped
        if create:
            self.stamps.fill_(EMPTY)
            self.claims.fill_(NONE)
            self.mapped.fill_(NONE)
            self.record_len.fill_(0)

    def gpu_slots(self) -> range:
        return range(self.num_host, self.num_slots)

    def attach_gpu(self, buffer: torch.Tensor, total: int) -> None:
        self.slots[self.num_host :] = [buffer[i * total : (i + 1) * total] for i in range(GPU_SLOTS)]

    def write_record(self, data: bytes) -> None:
        if len(data) > self.record.numel():
            raise TransportError(f"CUDA IPC handle of {len(data)} bytes does not fit the segment's {RECORD_BYTES}")
        self.record[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.record_len[0] = len(data)

    def read_record(self) -> bytes:
        return bytes(self.record[: int(self.record_len[0])].numpy())

    def newest(self) -> tuple[int, int]:
        """(slot, version) of the newest complete slot; version EMPTY when there is none."""
        stamps = self.stamps.tolist()
        slot = max(range(len(stamps)), key=lambda i: stamps[i])
        return slot, stamps[slot]

    def close(self, unlink: bool) -> None:
        """Only the creator unlinks; attachers share the orchestrator's resource tracker, which
        also unlinks the segment if the creator dies without closing it."""
        del self.stamps, self.crcs, self.claims, self.mapped, self.record_len, self.record, self.slots
        try:
            self.shm.close()
        except BufferError:  # a tensor still views the mapping; it is unmapped at process exit
            pass
        if unlink:
            self.shm.unlink()


class ShmPublisher:
    def __init__(self, handle: TransportHandle, opts: ShmOptions) -> None:
        self.handle, self.opts = handle, opts
        self.segment = _Segment(handle, opts, create=True)
        device = torch.device(opts.device) if opts.device_path != "host" else None
        self.sender = FlatSender(handle, device)
        self.gpu_buffer: torch.Tensor | None = None  # kept alive while any engine may map it
        if device is not None:
            self.gpu_buffer = torch.empty(GPU_SLOTS * handle.total_bytes, dtype=torch.uint8, device=device)
            self.segment.attach_gpu(self.gpu_buffer, handle.total_bytes)
            self.segment.write_record(IpcRecord.export(self.gpu_buffer).to_bytes())
        self.gpu_publishes = 0
        self.host_publishes = 0
        self.sent_bytes = handle.total_bytes  # every publish copies the whole layout into a slot

    def connect(self) -> None:
        """Nothing to rendezvous: engines attach by name whenever they start. The host slots are
        written once here, so that no publish pays the first touch of its slot's pages: at the
        Qwen2.5-0.5B shape (2 GB a slot) that was 1.5 s of page faults in each of the first N + 2
        publishes, several times the copy itself."""
        seg = self.segment
        with torch.no_grad():
            for i, slot in enumerate(seg.slots[: seg.num_host]):
                if slot is not None and int(seg.stamps[i]) == EMPTY:  # never a slot an engine may read
                    slot.zero_()

    def _free_slot(self, exclude: set[int], candidates: range) -> int | None:
        seg = self.segment
        newest, _ = seg.newest()
        busy = set(seg.claims.tolist()) | {newest} | exclude
        free = [i for i in candidates if i not in busy]
        if not free:
            return None
        stamps = seg.stamps.tolist()
        return min(free, key=lambda i: stamps[i])  # overwrite the oldest

    def _use_gpu(self) -> bool:
        if self.gpu_buffer is None:
            return False
        return self.opts.device_path == "ipc" or all(m == 1 for m in self.segment.mapped.tolist())

    def _pick(self, tried: set[int]) -> int:
        """A slot to write: a GPU slot when the path says so, else (or if both are held, in 'auto') a host slot."""
        seg = self.segment
        if self._use_gpu():
            deadline = time.monotonic() + self.handle.timeout_s
            while True:
                slot = self._free_slot(tried, seg.gpu_slots())
                if slot is not None or self.opts.device_path == "auto":
                    break
                if time.monotonic() >= deadline:
                    holders = [r + 1 for r, c in enumerate(seg.claims.tolist()) if c in seg.gpu_slots()]
                    raise TransportError(
                        f"shared-memory segment {self.opts.name}: both GPU slots stayed claimed by engine rank(s) "
                        f"{holders} for {self.handle.timeout_s:g} s (dead or stalled mid-copy)"
                    )
                time.sleep(0.001)
            if slot is not None:
                return slot
        slot = self._free_slot(tried, range(seg.num_host))
        if slot is None:  # impossible with N + 2 slots unless the header was damaged
            raise TransportError(
                f"shared-memory segment {self.opts.name}: no free slot "
                f"(claims {seg.claims.tolist()}, stamps {seg.stamps.tolist()})"
            )
        return slot

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        seg, tried = self.segment, set[int]()
        while True:
            slot = self._pick(tried)
            previous = int(seg.stamps[slot])
            seg.stamps[slot] = WRITING
            _fence()
            if slot not in seg.claims.tolist():
                break
            seg.stamps[slot] = previous  # an engine claimed it just now: it keeps reading it
            tried.add(slot)
        target = seg.slots[slot]
        assert target is not None  # the publisher allocated its GPU slots
        self.sender.write(model, target)
        settle(target.device)  # the stamp must not come before the bytes
        if self.handle.checksum:
            seg.crcs[slot] = crc32(target)
        if slot in seg.gpu_slots():
            self.gpu_publishes += 1
        else:
            self.host_publishes += 1
        seg.stamps[slot] = version

    def close(self) -> None:
        self.segment.close(unlink=True)
        self.gpu_buffer = None


class ShmReceiver:
    """`apply`: 'repoint' (zero copy, host slots into host tensors), 'copy' (claim, copy, release),
    or None: repoint where the slot lies on the tensors' device, else copy."""

    def __init__(
        self,
        handle: TransportHandle,
        opts: ShmOptions,
        target: WeightTarget,
        rank: int,
        apply: Literal["repoint", "copy"] | None = None,
    ) -> None:
        self.handle, self.target, self.rank, self.apply = handle, target, rank, apply
        self.index = rank - 1  # this engine's claim word
        self.segment = seg = _Segment(handle, opts, create=False)
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        self.device = tensors_device(self.tensors)
        seg.claims[self.index] = NONE  # a replacement engine drops the claim its dead predecessor held
        if seg.num_slots > seg.num_host:
            mapped = self._map_gpu_slots(opts)
            seg.mapped[self.index] = 1 if mapped else 0
        # Views are made once, outside any inference_mode, so they are ordinary tensors.
        self.slot_views = [views(slot, handle.layout) if slot is not None else None for slot in seg.slots]
        self.current = NONE
        self.applied = -1
        self.torn_reads = 0
        self.copies = 0

    def _map_gpu_slots(self, opts: ShmOptions) -> bool:
        """Map the trainer's GPU slots (CUDA IPC) if this engine's weights are on a GPU that sees them."""
        why = None
        if self.device.type != "cuda":
            why = (
                f"this engine receives its weights on {self.device} (engine.device, or the vLLM engine's host staging)"
            )
        else:
            record = IpcRecord.from_bytes(self.segment.read_record())
            buffer = record.open()
            if buffer is None:
                why = f"the trainer's GPU (uuid {record.uuid}) is not visible to this process (CUDA_VISIBLE_DEVICES)"
            else:
                self.segment.attach_gpu(buffer, self.handle.total_bytes)
        if why is not None and opts.device_path == "ipc":
            raise TransportError(
                f"transport.device_path 'ipc': engine rank {self.rank} cannot map the trainer's GPU "
                f"slots: {why}; use transport.device_path 'auto' or 'host'"
            )
        return why is None

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        seg = self.segment
        slot, version = seg.newest()
        if version <= self.applied:
            return None
        slot_views = self.slot_views[slot]
        if slot_views is None:  # a GPU slot this engine could not map: 'auto' publishes to host next
            return None
        seg.claims[self.index] = slot
        _fence()
        if int(seg.stamps[slot]) != version:  # the trainer is overwriting it: wait for the next one
            seg.claims[self.index] = self.current
            self.torn_reads += 1
            return None
        source = seg.slots[slot]
        assert source is not None
        if self.handle.checksum and crc32(source) != int(seg.crcs[slot]):
            seg.claims[self.index] = self.current
            raise TransportError(f"shared-memory slot {slot} of version {version} failed its checksum; not applied")
        copy = self.apply == "copy" or (self.apply is None and not same_device(self.tensors, slot_views))
        if copy:
            copy_into(self.tensors, slot_views)
            settle(self.device)
            settle(source.device)  # the slot may be written again as soon as the claim is gone
            seg.claims[self.index] = self.current
            self.copies += 1
        else:
            repoint(self.tensors, slot_views)
            self.current = slot
        self.target.applied()
        self.applied = version
        return version

    def close(self) -> None:
        """Move the tensors back to private memory (the segment may go away), release the claim."""
        if self.current != NONE:
            bind_flat(self.tensors, self.handle.layout, self.handle.total_bytes)
            self.target.applied()  # targets that view into the tensors (per-expert weights) follow
        self.segment.claims[self.index] = NONE
        self.slot_views = []
        self.segment.close(unlink=False)
