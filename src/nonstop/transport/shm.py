"""Shared-memory transport: one segment allocated once, two slots, version stamps.

Segment layout: a 64-byte header of int64 words (stamps of slots 0 and 1, then their CRC32
when checksums are on), then slot 0 and slot 1, each holding the
whole flat parameter layout. Version v is written into slot v % 2, so the slot holding the
previous version stays intact while the trainer writes (the engine keeps decoding with it and
can still read it). A stamp is -1 while its slot is being written and the version once it is
complete. The engine copies a slot into a private shadow, then re-reads the stamp: if the
trainer started overwriting that slot meanwhile, the copy is discarded, so a half-written
update is never applied.
"""

from __future__ import annotations

import uuid
from multiprocessing import shared_memory

import torch

from nonstop.transport.base import TransportError, bind_flat, crc32, pack, views
from nonstop.types import TransportHandle

HEADER_BYTES = 64
WRITING = -1
EMPTY = -2


def new_segment_name() -> str:
    return f"nonstop_{uuid.uuid4().hex[:16]}"


class _Segment:
    def __init__(self, handle: TransportHandle, create: bool) -> None:
        size = HEADER_BYTES + 2 * handle.total_bytes
        self.shm = shared_memory.SharedMemory(name=handle.options["name"], create=create, size=size)
        raw = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.stamps = raw[:HEADER_BYTES].view(torch.int64)
        total = handle.total_bytes
        self.slots = [raw[HEADER_BYTES + i * total: HEADER_BYTES + (i + 1) * total] for i in range(2)]
        if create:
            self.stamps.fill_(EMPTY)

    def close(self, unlink: bool) -> None:
        """Only the creator unlinks; attachers share the orchestrator's resource tracker, which
        also unlinks the segment if the creator dies without closing it."""
        del self.stamps, self.slots
        self.shm.close()
        if unlink:
            self.shm.unlink()


class ShmSink:
    def __init__(self, handle: TransportHandle) -> None:
        self.handle = handle
        self.segment = _Segment(handle, create=True)
        self.slot_views = [views(slot, handle.layout) for slot in self.segment.slots]

    def connect(self) -> None:
        """Nothing to rendezvous: engines attach by name whenever they start."""

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        slot = version % 2
        self.segment.stamps[slot] = WRITING
        pack(model, self.slot_views[slot])
        if self.handle.options.get("checksum"):
            self.segment.stamps[2 + slot] = crc32(self.segment.slots[slot])
        self.segment.stamps[slot] = version

    def close(self) -> None:
        self.slot_views = []
        self.segment.close(unlink=True)


class ShmSource:
    def __init__(self, handle: TransportHandle, model: torch.nn.Module) -> None:
        self.handle = handle
        self.segment = _Segment(handle, create=False)
        self.flat = bind_flat(model, handle.layout, handle.total_bytes)
        self.shadow = torch.empty_like(self.flat)
        self.applied = -1
        self.torn_reads = 0

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        stamps = self.segment.stamps[:2].tolist()
        slot = 0 if stamps[0] >= stamps[1] else 1
        version = stamps[slot]
        if version <= self.applied:
            return None
        self.shadow.copy_(self.segment.slots[slot])
        if int(self.segment.stamps[slot]) != version:
            self.torn_reads += 1
            return None
        if self.handle.options.get("checksum") and crc32(self.shadow) != int(self.segment.stamps[2 + slot]):
            raise TransportError(f"shared-memory slot {slot} of version {version} failed its checksum; not applied")
        self.flat.copy_(self.shadow)
        self.applied = version
        return version

    def close(self) -> None:
        self.segment.close(unlink=False)
