"""Weight transports: how new weights travel from the trainer to the engines.

The seam is one method on each side:
- trainer side `WeightPublisher.publish(model, version)` — blocks until the version is readable by
  every engine (shm: written and stamped; broadcast: every rank received it);
- engine side `WeightReceiver.maybe_update(model) -> int | None` — never waits for the trainer;
  loads the newest complete version, if newer than the one applied, between two forward passes.

`plan_transport` (trainer side) describes the transport in a picklable `TransportHandle`;
`open_publisher(handle)` and `open_receiver(handle, rank)` open the two ends; `release(handle)` (the
orchestrator, at the end of a run) frees what a dead trainer could not (a shm segment).

- base.py       the seam (`WeightPublisher`, `WeightReceiver`), the flat parameter layout and its check,
                what travels and what the engine's end fills, `TransportError`;
- factory.py    `plan_transport` / `open_publisher` / `open_receiver` / `release`: the one place naming every kind;
- shm.py        shared memory: one segment of N + 2 stamped slots, zero-copy apply (`ShmPublisher`, `ShmReceiver`);
- broadcast.py  torch.distributed broadcast in buckets: the protocol and the trainer end (`BroadcastPublisher`);
- broadcast_receiver.py  its engine end (`BroadcastReceiver`): a receiver thread, re-pointed buffers;
- groups.py     the broadcast transport's process groups: build (gloo or NCCL), deadlines, retire;
- files.py      safetensors files and a version marker in a shared folder (`FilesPublisher`, `FilesReceiver`);
- delta.py      weights sent as deltas (transport.delta, files and broadcast): the changed words only;
- notify.py     HTTP long-poll version notification for the files transport (`VersionServer`,
                `VersionWatcher`);
- device.py     device paths: weights GPU to GPU (CUDA IPC for shm, NCCL for broadcast);
- names.py      `PerExpertParameters`: a fused-expert trainer's tensors onto a per-expert engine.
"""

from nonstop.transport.base import TransportError, WeightPublisher, WeightReceiver, check_layout, model_layout
from nonstop.transport.factory import open_publisher, open_receiver, plan_transport, release

__all__ = [
    "TransportError",
    "WeightPublisher",
    "WeightReceiver",
    "check_layout",
    "model_layout",
    "open_publisher",
    "open_receiver",
    "plan_transport",
    "release",
]
