"""torch.distributed broadcast transport, in fixed-size buckets.

The trainer (rank 0) and the engines (ranks 1..N) form their own process group, built from a
TCPStore and a ProcessGroupGloo (NCCL on GPU later) directly, so it is separate from any
training process group and from the default group. Publishing version v: the trainer sets the
store key `v{v}` (the notification), then broadcasts its flat buffer (the sent tensors live in
it, see FlatSender: no staging copy) in slices of `bucket_bytes`, all issued at once so gloo
pipelines them. Each engine runs one receiver thread that waits for the next key, receives
into a back buffer and, once every bucket arrived (and passed its checksum), hands it over as
the ready buffer under a lock: decoding goes on meanwhile. `maybe_update` points the engine's
tensors at the ready buffer (no copy), and the buffer they left becomes the next back buffer;
at most three buffers exist (live, ready, receiving). Every collective has the transport
timeout; a failure is kept and raised from `maybe_update` as a TransportError naming the peer
and the version.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from nonstop.transport.base import FlatSender, TransportError, WeightTarget, crc32, in_layout_order, repoint, views
from nonstop.types import BroadcastOptions, TransportHandle

STOP = "stop"
# How long one store wait for the next version lasts before it is renewed. The trainer's close()
# wakes the waiter at once (it sets the next key to STOP), so this only bounds log noise.
_WAIT_SLICE = timedelta(seconds=30)


class _Group(Protocol):
    """What this transport uses of its gloo backend (torch's stubs leave out Backend's collectives)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...


def _group(handle: TransportHandle, opts: BroadcastOptions, rank: int) -> tuple[dist.TCPStore, _Group]:
    world = 1 + handle.num_engines
    connect = timedelta(seconds=handle.connect_timeout_s)
    store = dist.TCPStore(opts.host, opts.port, world, is_master=rank == 0, timeout=connect)
    pg = dist.ProcessGroupGloo(store, rank, world, connect)
    pg.set_timeout(timedelta(seconds=handle.timeout_s))  # every later collective
    return store, cast(_Group, pg)


def _buckets(flat: torch.Tensor, handle: TransportHandle, opts: BroadcastOptions) -> list[torch.Tensor]:
    """Fixed-size byte slices of the flat layout, or one slice per parameter (per_tensor)."""
    if opts.per_tensor:
        return [flat[s.offset:s.offset + s.nbytes] for s in handle.layout]
    size = opts.bucket_bytes
    return [flat[i:i + size] for i in range(0, flat.numel(), size)]


class BroadcastSink:
    def __init__(self, handle: TransportHandle, opts: BroadcastOptions) -> None:
        self.handle, self.opts = handle, opts
        self.sender = FlatSender(handle)
        self.store: dist.TCPStore | None = None
        self.pg: _Group | None = None
        self.last_version = handle.next_version - 1

    def connect(self) -> None:
        self.store, self.pg = _group(self.handle, self.opts, rank=0)

    @torch.no_grad()
    def publish(self, model: torch.nn.Module, version: int) -> None:
        if self.pg is None or self.store is None:
            raise TransportError("broadcast transport used before connect()")
        buckets = _buckets(self.sender.flat(model), self.handle, self.opts)
        self.store.set(f"v{version}", "1")
        sums = [torch.tensor([crc32(b) for b in buckets], dtype=torch.int64)] if self.handle.checksum else []
        # Issue every bucket before waiting on any: gloo sends them back to back, without a
        # round trip through Python between two buckets.
        works = []
        try:
            works = [self.pg.broadcast(bucket, 0) for bucket in buckets + sums]
            for i, work in enumerate(works):
                work.wait()
        except Exception as e:  # gloo raises RuntimeError subclasses on timeout and reset
            done = sum(w.is_completed() for w in works)
            raise TransportError(
                f"broadcast of version {version} (bucket {done + 1}/{len(buckets)}) to engine ranks "
                f"1..{self.handle.num_engines} failed within {self.handle.timeout_s:g} s: {e}"
            ) from e
        self._await_acks(version)
        self.last_version = version

    def _await_acks(self, version: int) -> None:
        """Every engine confirms it holds `version`; a silent or dead engine is named."""
        assert self.store is not None
        keys = [f"ack{rank}/v{version}" for rank in range(1, 1 + self.handle.num_engines)]
        try:
            self.store.wait(keys, timedelta(seconds=self.handle.timeout_s))
        except Exception as e:  # the store raises DistStoreError on timeout
            missing = [k.split("/")[0].removeprefix("ack") for k in keys if not self.store.check([k])]
            raise TransportError(
                f"engine rank(s) {', '.join(missing)} did not confirm version {version} "
                f"within {self.handle.timeout_s:g} s (dead or stalled): {e}"
            ) from e
        for key in [*keys, f"v{version}"]:
            self.store.delete_key(key)

    def close(self) -> None:
        if self.store is not None:
            self.store.set(f"v{self.last_version + 1}", STOP)
            self.store = None
            self.pg = None


class _Buffer:
    """One flat receive buffer with its typed views (made once, outside inference_mode)."""

    def __init__(self, handle: TransportHandle, opts: BroadcastOptions) -> None:
        self.flat = torch.empty(handle.total_bytes, dtype=torch.uint8)
        self.views = views(self.flat, handle.layout)
        self.buckets = _buckets(self.flat, handle, opts)


class BroadcastSource:
    def __init__(self, handle: TransportHandle, opts: BroadcastOptions, target: WeightTarget, rank: int) -> None:
        self.handle, self.opts, self.target, self.rank = handle, opts, target, rank
        self.tensors = in_layout_order(target.tensors(), handle.layout)
        self.lock = threading.Lock()
        self.spare: list[_Buffer] = []  # guarded by lock, like ready and live
        self.ready: tuple[int, _Buffer] | None = None
        self.live: _Buffer | None = None
        self.applied = -1
        self.error: TransportError | None = None
        self.closing = threading.Event()
        self.store, self.pg = _group(handle, opts, rank)
        self.thread = threading.Thread(target=self._receive_loop, name=f"weights-rx-{rank}", daemon=True)
        self.thread.start()

    def _take_spare(self) -> _Buffer:
        with self.lock:
            return self.spare.pop() if self.spare else _Buffer(self.handle, self.opts)

    def _receive_loop(self) -> None:
        version = self.handle.next_version
        back = self._take_spare()
        checksum = self.handle.checksum
        sums = torch.zeros(len(back.buckets), dtype=torch.int64)
        while not self.closing.is_set():
            try:
                self.store.wait([f"v{version}"], _WAIT_SLICE)
            except Exception as e:  # a timeout of this slice is normal; anything else means the store is gone
                if self.closing.is_set():
                    return
                if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                    continue
                self.error = TransportError(
                    f"engine rank {self.rank}: lost the trainer's store while waiting for version {version}: {e}")
                return
            if self.closing.is_set() or self.store.get(f"v{version}") == STOP.encode():
                return
            try:
                works = [self.pg.broadcast(bucket, 0) for bucket in back.buckets + ([sums] if checksum else [])]
                for work in works:
                    work.wait()
            except Exception as e:
                self.error = TransportError(
                    f"engine rank {self.rank}: receiving version {version} from the trainer failed "
                    f"within {self.handle.timeout_s:g} s: {e}"
                )
                return
            bad = [i for i, b in enumerate(back.buckets) if checksum and crc32(b) != int(sums[i])]
            if bad:  # never applied; the trainer learns of it through the missing acknowledgement
                self.error = TransportError(
                    f"engine rank {self.rank}: bucket(s) {bad} of version {version} failed their checksum; not applied")
                return
            with self.lock:
                if self.ready is not None:  # superseded before it was applied
                    self.spare.append(self.ready[1])
                self.ready = (version, back)
            self.store.set(f"ack{self.rank}/v{version}", "1")
            back = self._take_spare()
            version += 1

    def maybe_update(self, model: torch.nn.Module) -> int | None:
        if self.error is not None:
            raise self.error
        with self.lock:
            if self.ready is None:
                return None
            version, buf = self.ready
            self.ready = None
            repoint(self.tensors, buf.views)
            self.target.applied()
            if self.live is not None:
                self.spare.append(self.live)
            self.live, self.applied = buf, version
        return version

    def close(self) -> None:
        self.closing.set()
        self.thread.join(timeout=2.0)  # a daemon thread: a wait in progress must not hold up shutdown
