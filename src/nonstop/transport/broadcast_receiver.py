"""The engine end of the broadcast transport (transport/broadcast.py states the protocol):
`BroadcastReceiver` attaches to the trainer's store (first member, replacement or joining rank),
builds each generation's group with the others, and receives every round on its own thread into
a back buffer while the engine decodes; `maybe_update` then re-points the engine's tensors at
the newest complete buffer, no copy (or copies it onto the engine's GPU after a gloo round).

At most three `_Buffer`s exist: live, ready and receiving. With `transport.delta` each knows the
version it holds, and a `Chain` keeps the deltas that bring an older one forward.
"""

from __future__ import annotations

import functools
import threading
from datetime import timedelta

import torch

from nonstop.transport.base import (
    TransportError,
    WeightTarget,
    copy_into,
    crc32,
    in_layout_order,
    repoint,
    same_device,
)
from nonstop.transport.broadcast import BACKEND_KEY, STARTED_KEY, STOP, slices, split_buckets
from nonstop.transport.delta import Chain, Delta, Held
from nonstop.transport.device import Backend, member_device, settle, tensors_device
from nonstop.transport.groups import (
    ROLL,
    ProcessGroup,
    address_towards,
    await_works,
    decode_backend,
    decode_members,
    first_members,
    make_group,
    make_store,
    retire,
)
from nonstop.types import BroadcastOptions, TransportHandle

# How long one store wait for the next round lasts before it is renewed. The trainer's close()
# wakes the waiter at once (it sets the next round to STOP), so this only bounds log noise.
_WAIT_SLICE = timedelta(seconds=30)


class _Buffer(Held):
    """One flat receive buffer with its typed views and buckets (made once, outside inference_mode)."""

    def __init__(self, handle: TransportHandle, opts: BroadcastOptions, device: torch.device) -> None:
        super().__init__(handle, device)
        self.buckets = split_buckets(self.flat, handle, opts)


class BroadcastReceiver:
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
        self.pg: ProcessGroup | None = None
        self.generation = -1
        self.retired: list[ProcessGroup] = []
        self.join: int | None = None
        self.copies = 0
        self.chain = Chain(handle)
        # the group is running (this engine replaces a dead one), or this rank joins it later
        replacement = rank not in first_members(handle) or self.store.check([STARTED_KEY])
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
            self.store.wait([BACKEND_KEY], timedelta(seconds=self.handle.connect_timeout_s))
        except Exception as e:  # the store raises DistStoreError on timeout
            raise TransportError(
                f"engine rank {self.rank}: the trainer did not settle the broadcast backend within "
                f"{self.handle.connect_timeout_s:g} s: {e}"
            ) from e
        backend = decode_backend(self.store.get(BACKEND_KEY), self.rank)
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
            version, generation, base, nbytes, crc = (int(x) for x in value.split())
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.buffer_device) if base >= 0 else None
            parts = back.buckets if payload is None else slices(payload, self.opts.bucket_bytes)
            if len(parts) != sums.numel():
                sums = torch.zeros(len(parts), dtype=torch.int64, device=self.buffer_device)
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
                works = [self.pg.broadcast(part, 0) for part in parts + ([sums] if checksum else [])]
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
            bad = [i for i, b in enumerate(parts) if checksum and crc32(b) != int(sums[i])]
            if bad:  # never applied; the trainer learns of it through the missing acknowledgement
                self.error = TransportError(
                    f"engine rank {self.rank}: bucket(s) {bad} of version {version} failed their checksum; not applied"
                )
                return
            try:
                self._complete(back, version, payload, base, crc)
            except TransportError as e:  # never applied, as a checksum failure
                self.error = TransportError(f"engine rank {self.rank}: {e}")
                return
            with self.lock:
                if self.ready is not None:  # superseded before it was applied
                    self.spare.append(self.ready[1])
                self.ready = (version, back)
                self.chain.prune([back, *self.spare, *([self.live] if self.live is not None else [])])
            self.store.set(f"ack{self.rank}/r{n}", "1")
            back = self._take_spare()
            n += 1

    def _complete(self, back: _Buffer, version: int, payload: torch.Tensor | None, base: int, crc: int) -> None:
        """`back` holds `version` once this returns: as received (the full version), or brought along the
        delta in `payload` from what this engine holds (the live and ready buffers are only read)."""
        if payload is None:
            back.version = version
            return
        self.chain.add(Delta.unpack(payload, version, base, self.chain.word, crc if crc >= 0 else None))
        with self.lock:
            others = [b for b in (self.ready[1] if self.ready is not None else None, self.live) if b is not None]
        self.chain.bring(back, version, others)

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
