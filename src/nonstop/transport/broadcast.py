"""torch.distributed broadcast transport, in fixed-size buckets, over a group that takes replacements.

The trainer (rank 0) and the engines (ranks 1..N) form their own process group, built from a
TCPStore served by the trainer and a ProcessGroupGloo or ProcessGroupNCCL directly, so it is
separate from any training process group and from the default group.

Backend (transport.device_path, device.py). At the rendezvous every engine writes the device its
weights are received on (`device/{rank}`: 'cpu' or the GPU's uuid); the trainer reads them all,
picks the backend (NCCL when asked or, with 'auto', when every member is on a GPU of its own;
gloo otherwise) and writes it under
`backend` before anyone builds the group. Buffers live where the backend needs them: with NCCL
the trainer's flat buffer (its parameters re-homed into it) and every engine's receive buffers
are on their GPUs, so weights go GPU to GPU; with gloo they are host buffers, and an engine whose
weights are on a GPU copies each received version onto it (`copy_into`) instead of re-pointing.
A replacement engine reads the settled backend and fails at attach if it cannot take part (NCCL
on the CPU). NCCL works are waited on by polling `is_completed()` (their `wait` only orders
streams); with NCCL, re-planning after a dead engine has never run (no GPU here).

Rounds. Every send is one round n = 1, 2, ...: the trainer sets the store key `r{n}` to
"{version} {generation}" (the notification), then broadcasts its flat buffer (the sent tensors
live in it, see FlatSender: no staging copy) in slices of `bucket_bytes`, all issued at once so
gloo pipelines them, and waits until every engine acknowledged round n. Each engine runs one
receiver thread that waits for r1, r2, ... in turn, receives into a back buffer and, once every
bucket arrived (and passed its checksum), hands it over as the ready buffer under a lock:
decoding goes on meanwhile. `maybe_update` points the engine's tensors at the ready buffer (no
copy), and the buffer they left becomes the next back buffer; at most three buffers exist
(live, ready, receiving).

Deltas (`transport.delta`, delta.py). The round's value then also names the delta's base version, its
payload's bytes and the CRC32 of the whole version (checksum on; -1 otherwise), or base -1 for the full
version: "{version} {generation} {base} {bytes} {crc}". The payload goes in slices of `bucket_bytes`;
each engine brings its back buffer to the version along the deltas it keeps (or from a copy of its live
or ready buffer) and checks the version's CRC before handing it over. A round that starts a new
generation carries the full version (a new member holds no base), and so does the first.

Generations (the re-plan). A gloo group cannot take a new member, so the group is rebuilt: the
group of generation g is a ProcessGroupGloo over the store prefix `g{g}/`, and all its members
build it together. The first group holds the trainer and the engines that attach at the start
(ranks 1..first_engines). An engine that attaches after the trainer's group is up either replaces
a dead one (same rank) or joins (a rank up to num_engines not yet in the group: an engine on a
node that joined the cluster): it registers (`joins` + 1, `join/{j}` = its rank) and waits for
`welcome/{j}`, the round it starts at. At its next send the trainer welcomes every registered
engine, adds a joining rank to the members, writes them under `members/g{g + 1}`, starts
generation g + 1 with that round, and every member builds the new group before the broadcast
(the survivors see the new generation in `r{n}`). A send that fails (a member died: its socket
closed, or it did not acknowledge within timeout_s) is followed by roll calls (a round whose
key says `roll` instead of a version: every live member answers it) until every member either
answered or has a replacement registered, up to `rejoin_timeout_s`; the send is then made again
in a new round of a new generation, so `publish` returns only once every engine holds the
version, and a new group never waits on a dead member. An engine that registers as a new member
is not taken for a dead member's replacement. If a silent member is not replaced in time it
raises a TransportError naming the ranks and the version. A receiver whose round failed goes on
to the next round (the trainer re-plans); a checksum mismatch stops that engine's updates
(never applied) and is raised from `maybe_update`. Groups left behind by a re-plan are kept
until `close()`: destroying one with a dead peer would wait on its threads mid-run (an NCCL
group is aborted first, groups.py).
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nonstop.config import ConfigError
from nonstop.transport.base import (
    FlatSender,
    TransportError,
    crc32,
)
from nonstop.transport.delta import Delta, DeltaEncoder
from nonstop.transport.device import Backend, pick_backend
from nonstop.transport.groups import (
    REFUSED,
    ROUND_SLICE,
    ProcessGroup,
    RoundAbandoned,
    await_works,
    encode_members,
    first_members,
    make_group,
    make_store,
    registered,
    retire,
    roll_call,
)
from nonstop.types import BroadcastOptions, TransportHandle

STOP = "stop"
STARTED_KEY = "started"  # set once the trainer's first group is up: an engine attaching later is a replacement
BACKEND_KEY = "backend"  # the trainer's choice of gloo or nccl, set before any group is built


def split_buckets(flat: torch.Tensor, handle: TransportHandle, opts: BroadcastOptions) -> list[torch.Tensor]:
    """Fixed-size byte slices of the flat layout, or one slice per parameter (per_tensor)."""
    if opts.per_tensor:
        return [flat[s.offset : s.offset + s.nbytes] for s in handle.layout]
    return slices(flat, opts.bucket_bytes)


def slices(buf: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`buf` in consecutive slices of `size` bytes (a delta's payload travels so, whatever per_tensor says)."""
    return [buf[i : i + size] for i in range(0, buf.numel(), size)]


def round_value(version: int, generation: int, delta: Delta | None) -> str:
    """The store value that announces a round: version, generation, then the delta's base, payload bytes and
    state CRC (-1: none), or base -1 for the full version."""
    if delta is None:
        return f"{version} {generation} -1 -1 -1"
    crc = delta.crc if delta.crc is not None else -1
    return f"{version} {generation} {delta.base} {delta.nbytes} {crc}"


class BroadcastPublisher:
    def __init__(self, handle: TransportHandle, opts: BroadcastOptions) -> None:
        self.handle, self.opts = handle, opts
        self.sender = FlatSender(handle)
        self.store: dist.TCPStore | None = None
        self.pg: ProcessGroup | None = None
        self.round = 0
        self.generation = 0
        self.joins_seen = 0
        self.replans = 0  # groups rebuilt for replacement or joining engines
        self.members = first_members(handle)  # transport ranks in the current group, the trainer's 0 first
        self.fresh_group = False  # the next round starts a new generation (set after a failed round)
        self.retired: list[ProcessGroup] = []
        self.backend: Backend = "gloo"
        self.encoder = DeltaEncoder(handle) if opts.delta else None
        self.sent_bytes = 0  # what the last publish broadcast (a delta's payload, or the full layout)

    def connect(self) -> None:
        self.store = make_store(self.handle, self.opts, rank=0)
        self.backend = self._settle_backend(self.store)
        if self.backend == "nccl":
            self.sender = FlatSender(self.handle, torch.device(self.opts.device))
        self.pg = make_group(self.store, self.handle, 0, self.generation, self.backend, self.members, self.opts.host)
        self.store.add("joins", 0)
        self.store.set(STARTED_KEY, "1")

    def _settle_backend(self, store: dist.TCPStore) -> Backend:
        """Read every engine's device, pick the backend and tell the engines (or tell them the refusal)."""
        keys = [f"device/{r}" for r in self.members[1:]]
        try:
            store.wait(keys, timedelta(seconds=self.handle.connect_timeout_s))
        except Exception as e:  # the store raises DistStoreError on timeout
            missing = [k.split("/")[1] for k in keys if not store.check([k])]
            raise TransportError(
                f"engine rank(s) {', '.join(missing)} did not attach to the broadcast transport "
                f"within {self.handle.connect_timeout_s:g} s: {e}"
            ) from e
        devices = {0: self.opts.member, **{r: store.get(k).decode() for r, k in enumerate(keys, start=1)}}
        try:
            backend = pick_backend(self.opts.device_path, devices)
        except ConfigError as e:
            store.set(BACKEND_KEY, REFUSED + str(e))
            raise
        store.set(BACKEND_KEY, backend)
        return backend

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        if self.pg is None or self.store is None:
            raise TransportError("broadcast transport used before connect()")
        flat = self.sender.flat(model)
        delta = None
        if self.encoder is not None:
            delta = self.encoder.encode(flat, version, crc32(flat) if self.handle.checksum else None)
        packed = delta.pack() if delta is not None else None
        while True:
            try:
                self._send_round(flat, delta, packed, version)
                return
            except TransportError as failure:
                self._await_live_members(failure)
                self.fresh_group = True  # a group a round failed in is not used again

    def _payload(self, flat: torch.Tensor, packed: torch.Tensor | None) -> list[torch.Tensor]:
        """The round's broadcasts: the full layout's buckets or the delta's slices, then their CRCs (checksum)."""
        buckets = (
            split_buckets(flat, self.handle, self.opts) if packed is None else slices(packed, self.opts.bucket_bytes)
        )
        self.sent_bytes = flat.numel() if packed is None else packed.numel()
        if not self.handle.checksum:
            return buckets
        return [*buckets, torch.tensor([crc32(b) for b in buckets], dtype=torch.int64, device=flat.device)]

    def _send_round(self, flat: torch.Tensor, delta: Delta | None, packed: torch.Tensor | None, version: int) -> None:
        assert self.store is not None and self.pg is not None
        if self.fresh_group or self._registered():  # a new group is due: no dead member may be in it
            self._await_live_members(None)
        replan = self._welcome_joins() or self.fresh_group
        self.fresh_group = False
        self.round += 1
        if replan:
            self.generation += 1
            self.store.set(f"members/g{self.generation}", encode_members(self.members))
            delta = packed = None  # a member of the new group may hold no base: the full version goes
        tensors = self._payload(flat, packed)
        self.store.set(f"r{self.round}", round_value(version, self.generation, delta))
        if replan:
            self.retired.append(self.pg)
            retire(self.pg, self.backend)
            try:
                self.pg = make_group(
                    self.store, self.handle, 0, self.generation, self.backend, self.members, self.opts.host
                )
            except Exception as e:  # a member died again before the new group was up
                raise TransportError(
                    f"re-planning the broadcast group (generation {self.generation}) for version "
                    f"{version} failed within {self.handle.connect_timeout_s:g} s: {e}"
                ) from e
            self.replans += 1
        # Issue every bucket before waiting on any: gloo sends them back to back, without a
        # round trip through Python between two buckets.
        works = []
        try:
            works = [self.pg.broadcast(t, 0) for t in tensors]
            await_works(works, self.handle.timeout_s, self._replacement_waiting, poll=self.backend == "nccl")
        except RoundAbandoned as e:
            raise TransportError(f"broadcast of version {version}: an engine was replaced during the send") from e
        except Exception as e:  # gloo raises RuntimeError subclasses on timeout and reset
            done = sum(w.is_completed() for w in works)
            raise TransportError(
                f"broadcast of version {version} (bucket {done + 1}/{len(tensors)}) to engine ranks "
                f"{encode_members(self.members[1:])} failed within {self.handle.timeout_s:g} s: {e}"
            ) from e
        self._await_acks(version)

    def _registered(self) -> list[int]:
        assert self.store is not None
        return registered(self.store, self.joins_seen)

    def _replacement_waiting(self) -> bool:
        """A member's replacement registered: the current group has a dead member. (An engine that
        joins as a new member does not stop a round: the next round welcomes it.)"""
        return any(rank in self.members for rank in self._registered())

    def _welcome_joins(self) -> bool:
        """Give every newly registered engine the next round (a joining rank becomes a member);
        True when there was one."""
        assert self.store is not None
        total = self.store.add("joins", 0)
        for j in range(self.joins_seen + 1, total + 1):
            rank = int(self.store.get(f"join/{j}"))
            if rank not in self.members:
                self.members = sorted([*self.members, rank])
            self.store.set(f"welcome/{j}", str(self.round + 1))
        joined = total > self.joins_seen
        self.joins_seen = total
        return joined

    def _await_live_members(self, failure: TransportError | None) -> None:
        """Before a new group (after a failed round, or to welcome registered engines): return once
        every member is alive or has a registered replacement, else raise. Roll calls tell the
        living from the dead, so a new group never waits on a dead member, and an engine that
        registered as a new member is not taken for the replacement of a dead one."""
        assert self.store is not None
        wait_s = self.opts.rejoin_timeout_s
        deadline = time.monotonic() + wait_s
        while True:
            silent = self._roll_call()
            missing = sorted(set(silent) - set(self._registered()))
            if not missing:
                return
            if time.monotonic() >= deadline:
                why = f"{failure}; " if failure is not None else ""
                raise TransportError(
                    f"{why}engine rank(s) {encode_members(missing)} are gone and no replacement joined "
                    f"within {wait_s:g} s (transport.rejoin_timeout_s)"
                )

    def _roll_call(self) -> list[int]:
        assert self.store is not None
        self.round += 1
        return roll_call(self.store, self.round, self.members)

    def _await_acks(self, version: int) -> None:
        """Every engine confirms it holds the round's version; a silent or dead engine is named."""
        assert self.store is not None
        keys = [f"ack{rank}/r{self.round}" for rank in self.members[1:]]
        deadline = time.monotonic() + self.handle.timeout_s
        while True:
            try:
                self.store.wait(keys, min(ROUND_SLICE, timedelta(seconds=max(deadline - time.monotonic(), 0.001))))
                break
            except Exception as e:  # the store raises DistStoreError on timeout
                missing = [k.split("/")[0].removeprefix("ack") for k in keys if not self.store.check([k])]
                if time.monotonic() < deadline and not self._replacement_waiting():
                    continue
                raise TransportError(
                    f"engine rank(s) {', '.join(missing)} did not confirm version {version} "
                    f"within {self.handle.timeout_s:g} s (dead or stalled): {e}"
                ) from e
        for key in [*keys, f"r{self.round}"]:
            self.store.delete_key(key)

    def close(self) -> None:
        if self.store is not None:
            self.store.set(f"r{self.round + 1}", STOP)
            self.store = None
            self.pg = None
            self.retired.clear()
