"""The engine side of the weight-transport tests: targets of spawned processes that attach to a
trainer's transport and report what arrived on the queue passed as their last argument
(conftest.py `ChildProcess`), and `perturbed_model`, weights an update can be told apart by."""

from __future__ import annotations

import time

import torch


def perturbed_model(model_dir, seed: int):
    """The model at `model_dir` with N(0, 1) noise from `seed` added to every weight: weights an
    update can be told apart by."""
    from nonstop.hf import load_model

    model = load_model(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    return model


def receive_weights(handle, model_dir: str, rank: int, want_version: int, out_queue, deadline_s: float = 60.0) -> None:
    """Engine-side process: attach to the transport, wait for `want_version`, send the weights back."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver

    model = load_model(model_dir)
    receiver = open_receiver(handle, model, rank)
    out_queue.put(("attached", None))
    end = time.monotonic() + deadline_s
    seen = []
    while time.monotonic() < end:
        v = receiver.maybe_update(model)
        if v is not None:
            seen.append(v)
            if v >= want_version:
                # numpy pickles by value; a torch tensor would travel as a shared fd that dies with us
                out_queue.put(("weights", (seen, {k: t.numpy().copy() for k, t in model.state_dict().items()})))
                receiver.close()
                return
        time.sleep(0.005)
    out_queue.put(("timeout", seen))


def attach_in_dtype(handle, model_dir: str, dtype: str, rank: int, out_queue):
    """In an engine-side process: one thread, the model in `dtype`, attached to the transport as
    engine `rank`; says ("attached", None) on `out_queue` and returns (model, receiver)."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver

    model = load_model(model_dir, getattr(torch, dtype))
    receiver = open_receiver(handle, model, rank)
    out_queue.put(("attached", None))
    return model, receiver


def receive_weights_in(
    handle, model_dir: str, dtype: str, rank: int, want_version: int, out_queue, deadline_s: float = 60.0
) -> None:
    """Engine-side process holding its model in `dtype` (a bf16 engine): attach, wait for
    `want_version`, send back the weights as float32 (exact for bf16) and their CRC32 in the
    transport's layout."""
    from nonstop.transport.base import receiver_crc32

    model, receiver = attach_in_dtype(handle, model_dir, dtype, rank, out_queue)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = receiver.maybe_update(model)
        if v is not None and v >= want_version:
            state = {k: t.float().numpy().copy() for k, t in model.state_dict().items()}
            out_queue.put(("weights", (v, receiver_crc32(receiver), state)))
            receiver.close()
            return
        time.sleep(0.005)
    out_queue.put(("timeout", None))


def connect_then_hang(handle, model_dir: str, rank: int, out_queue) -> None:
    """Engine-side process that joins the broadcast group and then stops participating."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_receiver

    receiver = open_receiver(handle, load_model(model_dir), rank)
    receiver.close()  # the receiver thread stops: the peer process is alive but silent
    out_queue.put(("attached", None))
    time.sleep(120)
