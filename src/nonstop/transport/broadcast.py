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

import functools
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from nonstop.config import ConfigError
from nonstop.transport.base import (
    FlatSender,
    TransportError,
    WeightTarget,
    copy_into,
    crc32,
    in_layout_order,
    repoint,
    same_device,
    views,
)
from nonstop.transport.device import Backend, member_device, pick_backend, settle, tensors_device
from nonstop.transport.groups import (
    REFUSED,
    ROLL,
    ROUND_SLICE,
    Group,
    RoundAbandoned,
    address_towards,
    await_works,
    decode_backend,
    decode_members,
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
_STARTED = "started"  # set once the trainer's first group is up: an engine attaching later is a replacement
# How long one store wait for the next round lasts before it is renewed. The trainer's close()
# wakes the waiter at once (it sets the next round to STOP), so this only bounds log noise.
_WAIT_SLICE = timedelta(seconds=30)
_BACKEND = "backend"  # the trainer's choice of gloo or nccl, set before any group is built


def _buckets(flat: torch.Tensor, handle: TransportHandle, opts: BroadcastOptions) -> list[torch.Tensor]:
    """Fixed-size byte slices of the flat layout, or one slice per parameter (per_tensor)."""
    if opts.per_tensor:
        return [flat[s.offset : s.offset + s.nbytes] for s in handle.layout]
    size = opts.bucket_bytes
    return [flat[i : i + size] for i in range(0, flat.numel(), size)]


class BroadcastSink:
    def __init__(self, handle: TransportHandle, opts: BroadcastOptions) -> None:
        self.handle, self.opts = handle, opts
        self.sender = FlatSender(handle)
        self.store: dist.TCPStore | None = None
        self.pg: Group | None = None
        self.round = 0
        self.generation = 0
        self.joins_seen = 0
        self.replans = 0  # groups rebuilt for replacement or joining engines
        self.members = first_members(handle)  # transport ranks in the current group, the trainer's 0 first
        self.fresh_group = False  # the next round starts a new generation (set after a failed round)
        self.retired: list[Group] = []
        self.backend: Backend = "gloo"

    def connect(self) -> None:
        self.store = make_store(self.handle, self.opts, rank=0)
        self.backend = self._settle_backend(self.store)
        if self.backend == "nccl":
            self.sender = FlatSender(self.handle, torch.device(self.opts.device))
        self.pg = make_group(self.store, self.handle, 0, self.generation, self.backend, self.members, self.opts.host)
        self.store.add("joins", 0)
        self.store.set(_STARTED, "1")

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
            store.set(_BACKEND, REFUSED + str(e))
            raise
        store.set(_BACKEND, backend)
        return backend

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        if self.pg is None or self.store is None:
            raise TransportError("broadcast transport used before connect()")
        flat = self.sender.flat(model)
        buckets = _buckets(flat, self.handle, self.opts)
        sums = (
            [torch.tensor([crc32(b) for b in buckets], dtype=torch.int64, device=flat.device)]
            if self.handle.checksum
            else []
        )
        while True:
            try:
                self._send_round(buckets + sums, version)
                return
            except TransportError as failure:
                self._await_live_members(failure)
                self.fresh_group = True  # a group a round failed in is not used again

    def _send_round(self, tensors: list[torch.Tensor], version: int) -> None:
        assert self.store is not None and self.pg is not None
        if self.fresh_group or self._registered():  # a new group is due: no dead member may be in it
            self._await_live_members(None)
        replan = self._welcome_joins() or self.fresh_group
        self.fresh_group = False
        self.round += 1
        if replan:
            self.generation += 1
            self.store.set(f"members/g{self.generation}", encode_members(self.members))
        self.store.set(f"r{self.round}", f"{version} {self.generation}")
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


class _Buffer:
    """One flat receive buffer with its typed views (made once, outside inference_mode)."""

    def __init__(self, handle: TransportHandle, opts: BroadcastOptions, device: torch.device) -> None:
        self.flat = torch.empty(handle.total_bytes, dtype=torch.uint8, device=device)
        self.views = views(self.flat, handle.layout)
        self.buckets = _buckets(self.flat, handle, opts)


class BroadcastSource:
    def __init__(self, handle: TransportHandle, opts: BroadcastOptions, target: WeightTarget, rank: int) -> None:
        self.handle, self.opts, self.target, self.rank = handle, opts, target, rank
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        self.device = tensors_device(self.tensors)
        self.lock = threading.Lock()
        self.spare: list[_Buffer] = []  # guarded by lock, like ready and live
        self.ready: tuple[int, _Buffer] | None = None
        self.live: _Buffer | None = None
        self.applied = -1
        self.error: TransportError | None = None
        self.failed_rounds = 0  # rounds this engine could not receive (the trainer sent them again)
        self.closing = threading.Event()
        self.store = make_store(handle, opts, rank)
        self.bind = address_towards(opts.host)  # where this member's gloo pairs listen
        self.pg: Group | None = None
        self.generation = -1
        self.retired: list[Group] = []
        self.join: int | None = None
        self.copies = 0
        # the group is running (this engine replaces a dead one), or this rank joins it later
        replacement = rank not in first_members(handle) or self.store.check([_STARTED])
        if not replacement:
            self.store.set(f"device/{rank}", member_device(self.device))
        self.backend = self._await_backend()
        # Receive buffers sit where the backend delivers: the GPU for NCCL, the host for gloo.
        self.buffer_device = self.device if self.backend == "nccl" else torch.device("cpu")
        if replacement:
            self.join = self.store.add("joins", 1)
            self.store.set(f"join/{self.join}", str(rank))
        else:
            self.pg, self.generation = make_group(self.store, handle, rank, 0, self.backend, bind=self.bind), 0
        self.thread = threading.Thread(target=self._receive_loop, name=f"weights-rx-{rank}", daemon=True)
        self.thread.start()

    def _await_backend(self) -> Backend:
        try:
            self.store.wait([_BACKEND], timedelta(seconds=self.handle.connect_timeout_s))
        except Exception as e:  # the store raises DistStoreError on timeout
            raise TransportError(
                f"engine rank {self.rank}: the trainer did not settle the broadcast backend within "
                f"{self.handle.connect_timeout_s:g} s: {e}"
            ) from e
        backend = decode_backend(self.store.get(_BACKEND), self.rank)
        if backend == "nccl" and self.device.type != "cuda":
            raise TransportError(
                f"transport.device_path: the broadcast group runs on NCCL, but engine rank {self.rank} "
                f"receives its weights on {self.device}; use transport.device_path 'host'"
            )
        return backend

    def _take_spare(self) -> _Buffer:
        with self.lock:
            return self.spare.pop() if self.spare else _Buffer(self.handle, self.opts, self.buffer_device)

    def _wait(self, key: str, what: str) -> bytes | None:
        """The value of `key` once the trainer set it; None when closing or the store is gone."""
        while not self.closing.is_set():
            try:
                self.store.wait([key], _WAIT_SLICE)
            except Exception as e:  # a timeout of this slice is normal; anything else means the store is gone
                if self.closing.is_set():
                    return None
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                self.error = TransportError(
                    f"engine rank {self.rank}: lost the trainer's store while waiting for {what}: {e}"
                )
                return None
            return self.store.get(key)
        return None

    def _receive_loop(self) -> None:
        first = 1
        if self.join is not None:
            welcome = self._wait(f"welcome/{self.join}", "its place in the group")
            if welcome is None:
                return
            first = int(welcome)
        back = self._take_spare()
        checksum = self.handle.checksum
        sums = torch.zeros(len(back.buckets), dtype=torch.int64, device=self.buffer_device)
        n = first
        while not self.closing.is_set():
            value = self._wait(f"r{n}", f"round {n}")
            if value is None or value == STOP.encode() or self.closing.is_set():
                return
            if value == ROLL.encode():  # the trainer asks who is alive after a failed round
                self.store.set(f"here{self.rank}/r{n}", "1")
                n += 1
                continue
            version, generation = (int(x) for x in value.split())
            try:
                if generation != self.generation:  # the trainer re-planned the group: build our member of it
                    if self.pg is not None:
                        self.retired.append(self.pg)
                        retire(self.pg, self.backend)
                    self.pg = None
                    members = decode_members(self.store.get(f"members/g{generation}"))
                    self.pg = make_group(
                        self.store, self.handle, self.rank, generation, self.backend, members, self.bind
                    )
                    self.generation = generation
                assert self.pg is not None
                works = [self.pg.broadcast(bucket, 0) for bucket in back.buckets + ([sums] if checksum else [])]
                await_works(
                    works,
                    self.handle.timeout_s,
                    functools.partial(self.store.check, [f"r{n + 1}"]),
                    poll=self.backend == "nccl",
                )
            except Exception:  # a peer died in this round: the trainer sends it again in a new group
                self.failed_rounds += 1
                n += 1
                continue
            bad = [i for i, b in enumerate(back.buckets) if checksum and crc32(b) != int(sums[i])]
            if bad:  # never applied; the trainer learns of it through the missing acknowledgement
                self.error = TransportError(
                    f"engine rank {self.rank}: bucket(s) {bad} of version {version} failed their checksum; not applied"
                )
                return
            with self.lock:
                if self.ready is not None:  # superseded before it was applied
                    self.spare.append(self.ready[1])
                self.ready = (version, back)
            self.store.set(f"ack{self.rank}/r{n}", "1")
            back = self._take_spare()
            n += 1

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        if self.error is not None:
            raise self.error
        with self.lock:
            if self.ready is None:
                return None
            version, buf = self.ready
            self.ready = None
            if same_device(self.tensors, buf.views):
                repoint(self.tensors, buf.views)
            else:  # gloo delivered to the host, the engine's weights are on its GPU
                copy_into(self.tensors, buf.views)
                settle(self.device)
                self.copies += 1
            self.target.applied()
            if self.live is not None:
                self.spare.append(self.live)
            self.live, self.applied = buf, version
        return version

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=2.0)  # a daemon thread: a wait in progress must not hold up shutdown
