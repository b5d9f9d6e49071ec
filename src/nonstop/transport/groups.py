"""The broadcast transport's process groups: building one (gloo or NCCL) over the trainer's
store, waiting on its works within a deadline, retiring one that a failed round left behind, and
the roll call that tells which members are alive before a new one is built.

A group is built directly from a `ProcessGroupGloo` / `ProcessGroupNCCL` over a `PrefixStore`
(one prefix per generation, broadcast.py), never through `init_process_group`, so it is
separate from any training group and from the default group. Its members are transport ranks
(the trainer's 0 first); a member's rank in the group is its place in that list, so a group can
take engines that join after the start. Each gloo member listens on an address given to it (the
trainer: its store's host; an engine: its own address on the route to that host), never on
whatever the machine's host name resolves to.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol, cast

import torch
import torch.distributed as dist

from nonstop.transport.base import TransportError
from nonstop.transport.device import Backend
from nonstop.types import BroadcastOptions, TransportHandle

# Waits inside a round (on the broadcast, on the acknowledgements) are made in slices of this
# length, so a round that a peer's death broke is given up as soon as the membership changed
# (a replacement registered; the trainer started the next round) instead of at timeout_s.
ROUND_SLICE = timedelta(seconds=1)
REFUSED = "refused: "  # prefix of a backend value that carries the trainer's refusal instead


class RoundAbandoned(TransportError):
    """The membership changed while this round was under way: it is sent again in a new group."""


def timed_out(e: Exception) -> bool:
    text = str(e).lower()
    return "timeout" in text or "timed out" in text


def await_works(works: list[dist.Work], timeout_s: float, abandon: Callable[[], bool], poll: bool = False) -> None:
    """Wait for every work within `timeout_s` in all; raise RoundAbandoned once `abandon()` is true.

    `poll` (NCCL): watch `is_completed()`, since an NCCL work's `wait` only makes the current stream wait."""
    deadline = time.monotonic() + timeout_s
    if poll:
        last_check = time.monotonic()
        for work in works:
            while not work.is_completed():
                now = time.monotonic()
                if now >= deadline:
                    raise TransportError(f"NCCL broadcast did not complete within {timeout_s:g} s")
                if now - last_check >= ROUND_SLICE.total_seconds():
                    last_check = now
                    if abandon():
                        raise RoundAbandoned()
                time.sleep(0.0005)
        return
    for work in works:
        while True:
            try:
                work.wait(ROUND_SLICE)
                break
            except RuntimeError as e:
                if not timed_out(e) or time.monotonic() >= deadline:
                    raise
                if abandon():
                    raise RoundAbandoned() from e


class ProcessGroup(Protocol):
    """What this transport uses of its backend (torch's stubs leave out Backend's collectives)."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> dist.Work: ...


def retire(pg: ProcessGroup, backend: Backend) -> None:
    """An NCCL group left behind by a failed round may hold a collective that never ends: abort it
    (gloo groups are kept until close: destroying one with a dead peer waits on its threads)."""
    if backend == "nccl":
        abort = getattr(pg, "abort", None)
        if abort is not None:
            try:
                abort()
            except Exception:  # best effort: the new group does not depend on it
                pass


def first_members(handle: TransportHandle) -> list[int]:
    """The transport ranks of the first group: the trainer and the engines that attach at the start."""
    first = handle.num_engines if handle.first_engines is None else handle.first_engines
    return list(range(1 + first))


def make_store(handle: TransportHandle, opts: BroadcastOptions, rank: int) -> dist.TCPStore:
    """The trainer's store (rank 0 serves it and waits for the first engines), or a client of it."""
    connect = timedelta(seconds=handle.connect_timeout_s)
    return dist.TCPStore(opts.host, opts.port, len(first_members(handle)), is_master=rank == 0, timeout=connect)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (the kernel picks it; connecting a UDP
    socket sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def make_group(
    store: dist.TCPStore,
    handle: TransportHandle,
    rank: int,
    generation: int,
    backend: Backend = "gloo",
    members: list[int] | None = None,
    bind: str = "127.0.0.1",
) -> ProcessGroup:
    """Transport rank `rank`'s member of the group of `generation`, whose members are the
    transport ranks `members` (None: the first group's); gloo blocks until every member built it
    and listens on `bind`; NCCL connects at the first collective."""
    members = first_members(handle) if members is None else members
    world, group_rank = len(members), members.index(rank)
    prefixed = dist.PrefixStore(f"g{generation}/", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()  # absent from CPU builds of torch
        options._timeout = timedelta(seconds=handle.timeout_s)
        return cast(ProcessGroup, dist.ProcessGroupNCCL(prefixed, group_rank, world, options))
    gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # absent from torch's stubs
    gloo._timeout = timedelta(seconds=handle.connect_timeout_s)
    gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=bind)]
    pg = dist.ProcessGroupGloo(prefixed, group_rank, world, gloo)
    pg.set_timeout(timedelta(seconds=handle.timeout_s))  # every later collective
    return cast(ProcessGroup, pg)


ROLL = "roll"  # a round's key holding a roll call instead of a version: every live member answers
# How long a roll call waits for the members that are alive: a live member may first have to give
# up the failed round, which it notices within one ROUND_SLICE.
ROLL_WINDOW = 3 * ROUND_SLICE


def roll_call(store: dist.TCPStore, round_no: int, members: list[int]) -> list[int]:
    """Round `round_no` as a roll call: the engine ranks of `members` (the trainer's 0 first) that
    do not answer `here{rank}/r{round_no}` within ROLL_WINDOW. The round's own key stays: a
    member that was slow still reads it on its way to the next."""
    store.set(f"r{round_no}", ROLL)
    keys = {rank: f"here{rank}/r{round_no}" for rank in members[1:]}
    try:
        store.wait(list(keys.values()), ROLL_WINDOW)
    except Exception:  # the store raises DistStoreError on timeout: someone is silent
        pass
    silent = [rank for rank, key in keys.items() if not store.check([key])]
    for key in keys.values():
        store.delete_key(key)
    return silent


def registered(store: dist.TCPStore, seen: int) -> list[int]:
    """The ranks of the engines registered (`join/{j}`) after the first `seen`, in order."""
    total = store.add("joins", 0)
    return [int(store.get(f"join/{j}")) for j in range(seen + 1, total + 1)]


def encode_members(members: list[int]) -> str:
    return ",".join(map(str, members))


def decode_members(value: bytes) -> list[int]:
    return [int(r) for r in value.decode().split(",")]


def decode_backend(value: bytes, rank: int) -> Backend:
    text = value.decode()
    if text.startswith(REFUSED):
        raise TransportError(f"engine rank {rank}: the trainer refused the broadcast group: {text[len(REFUSED) :]}")
    if text not in ("gloo", "nccl"):
        raise TransportError(f"engine rank {rank}: unknown broadcast backend {text!r} in the trainer's store")
    return cast(Backend, text)
