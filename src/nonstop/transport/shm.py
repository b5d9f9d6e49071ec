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
"""

from __future__ import annotations

import threading
import uuid
from multiprocessing import shared_memory

import torch

from nonstop.transport.base import (
    FlatSender,
    TransportError,
    WeightTarget,
    bind_flat,
    crc32,
    in_layout_order,
    repoint,
    views,
)
from nonstop.types import ShmOptions, TransportHandle

WRITING = -1
EMPTY = -2
NONE = -1
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
    from multiprocessing import resource_tracker

    import _posixshmem  # type: ignore[import-not-found]  # CPython's POSIX shm calls, as SharedMemory uses

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
        self.num_slots = engines + 2
        words = 2 * self.num_slots + engines
        header = (words * 8 + 63) // 64 * 64
        total = handle.total_bytes
        self.shm = shared_memory.SharedMemory(
            name=opts.name, create=create, size=header + self.num_slots * total)
        raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        words_view = raw[:header].view(torch.int64)
        self.stamps = words_view[:self.num_slots]
        self.crcs = words_view[self.num_slots:2 * self.num_slots]
        self.claims = words_view[2 * self.num_slots:2 * self.num_slots + engines]
        self.slots = [raw[header + i * total: header + (i + 1) * total] for i in range(self.num_slots)]
        if create:
            self.stamps.fill_(EMPTY)
            self.claims.fill_(NONE)

    def newest(self) -> tuple[int, int]:
        """(slot, version) of the newest complete slot; version EMPTY when there is none."""
        stamps = self.stamps.tolist()
        slot = max(range(len(stamps)), key=lambda i: stamps[i])
        return slot, stamps[slot]

    def close(self, unlink: bool) -> None:
        """Only the creator unlinks; attachers share the orchestrator's resource tracker, which
        also unlinks the segment if the creator dies without closing it."""
        del self.stamps, self.crcs, self.claims, self.slots
        try:
            self.shm.close()
        except BufferError:  # a tensor still views the mapping; it is unmapped at process exit
            pass
        if unlink:
            self.shm.unlink()


class ShmSink:
    def __init__(self, handle: TransportHandle, opts: ShmOptions) -> None:
        self.handle, self.opts = handle, opts
        self.segment = _Segment(handle, opts, create=True)
        self.sender = FlatSender(handle)

    def connect(self) -> None:
        """Nothing to rendezvous: engines attach by name whenever they start."""

    def _free_slot(self, exclude: set[int]) -> int:
        seg = self.segment
        newest, _ = seg.newest()
        busy = set(seg.claims.tolist()) | {newest} | exclude
        free = [i for i in range(seg.num_slots) if i not in busy]
        if not free:  # impossible with N + 2 slots unless the header was damaged
            raise TransportError(f"shared-memory segment {self.opts.name}: no free slot "
                                 f"(claims {seg.claims.tolist()}, stamps {seg.stamps.tolist()})")
        stamps = seg.stamps.tolist()
        return min(free, key=lambda i: stamps[i])  # overwrite the oldest

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        seg, tried = self.segment, set[int]()
        while True:
            slot = self._free_slot(tried)
            previous = int(seg.stamps[slot])
            seg.stamps[slot] = WRITING
            _fence()
            if slot not in seg.claims.tolist():
                break
            seg.stamps[slot] = previous  # an engine claimed it just now: it keeps reading it
            tried.add(slot)
        seg.slots[slot].copy_(self.sender.flat(model))
        if self.handle.checksum:
            seg.crcs[slot] = crc32(seg.slots[slot])
        seg.stamps[slot] = version

    def close(self) -> None:
        self.segment.close(unlink=True)


class ShmSource:
    def __init__(self, handle: TransportHandle, opts: ShmOptions, target: WeightTarget, rank: int) -> None:
        self.handle, self.target = handle, target
        self.index = rank - 1  # this engine's claim word
        self.segment = _Segment(handle, opts, create=False)
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        # Views are made once, outside any inference_mode, so they are ordinary tensors.
        self.slot_views = [views(slot, handle.layout) for slot in self.segment.slots]
        self.current = NONE
        self.applied = -1
        self.torn_reads = 0

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        seg = self.segment
        slot, version = seg.newest()
        if version <= self.applied:
            return None
        seg.claims[self.index] = slot
        _fence()
        if int(seg.stamps[slot]) != version:  # the trainer is overwriting it: wait for the next one
            seg.claims[self.index] = self.current
            self.torn_reads += 1
            return None
        if self.handle.checksum and crc32(seg.slots[slot]) != int(seg.crcs[slot]):
            seg.claims[self.index] = self.current
            raise TransportError(f"shared-memory slot {slot} of version {version} failed its checksum; not applied")
        repoint(self.tensors, self.slot_views[slot])
        self.target.applied()
        self.current, self.applied = slot, version
        return version

    def close(self) -> None:
        """Move the tensors back to private memory (the segment may go away), release the claim."""
        if self.current != NONE:
            bind_flat(self.tensors, self.handle.layout, self.handle.total_bytes)
            self.target.applied()  # targets that view into the tensors (per-expert weights) follow
        self.segment.claims[self.index] = NONE
        self.slot_views = []
        self.segment.close(unlink=False)
