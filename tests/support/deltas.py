"""Helpers of the weight-delta tests (tests/transport/test_delta.py): small optimizer-like updates,
and an engine-side process that reports the CRC32 of every version it applies."""

from __future__ import annotations

import time

import torch

from support.weights import attach_in_dtype


def nudge(model: torch.nn.Module, step: float, seed: int) -> None:
    """Move every weight by +-`step` (an Adam-like update of about the learning rate), so that only
    some of their bfloat16 casts change; a few weights set to -0.0 and 0.0 in turn (bits that differ
    while the values compare equal)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randint(0, 2, p.shape, generator=g).to(p.dtype) * 2 * step - step)
        first = next(model.parameters()).view(-1)
        first[:3] = -0.0 if seed % 2 else 0.0


def cast_crc(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """The CRC32 of the model's parameters cast to the wire dtype, in layout order."""
    from nonstop.transport.base import weights_crc32

    return weights_crc32(p.detach().to(dtype) for _, p in model.named_parameters())


def report_versions(handle, model_dir: str, dtype: str, rank: int, last: int, out_queue, deadline_s: float = 90.0):
    """Engine-side process: apply every version as it comes and report (version, CRC32 of what it holds)
    until `last`."""
    from nonstop.transport.base import receiver_crc32

    model, receiver = attach_in_dtype(handle, model_dir, dtype, rank, out_queue)
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = receiver.maybe_update(model)
        if v is not None:
            out_queue.put(("version", (v, receiver_crc32(receiver))))
            if v >= last:
                receiver.close()
                return
        time.sleep(0.002)
    out_queue.put(("timeout", None))
