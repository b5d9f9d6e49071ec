"""Engine actor: a TorchEngine in its own process, reached through the actor seam.

The orchestrator calls `connect_transport(handle, rank)` once, then `generate(requests)`
repeatedly. New weights arrive through the transport, never through these calls; the engine
applies them between two forward passes (see engine/core.py).
"""

from __future__ import annotations

import time

import torch

from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model
from nonstop.transport import WeightSource, open_source
from nonstop.types import GenerationRequest, Sample, TransportHandle


class EngineWorker:
    def __init__(self, model_path: str, eos_token_ids: list[int], pad_token_id: int, seed: int = 0,
                 initial_version: int = 0) -> None:
        """`initial_version` is the policy_version of the weights at `model_path` (a checkpoint's on resume)."""
        torch.manual_seed(seed)
        self.engine = TorchEngine(load_model(model_path), eos_token_ids, pad_token_id, policy_version=initial_version)
        self.source: WeightSource | None = None
        self.busy_s = 0.0

    def connect_transport(self, handle: TransportHandle, rank: int = 1) -> None:
        self.source = open_source(handle, self.engine.model, rank)
        self.engine.weights = self.source

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        t0 = time.perf_counter()
        try:
            return self.engine.generate(requests)
        finally:
            self.busy_s += time.perf_counter() - t0

    async def ping(self) -> int:
        """Heartbeat: answered on the actor's loop even while `generate` decodes on its thread."""
        return self.engine.policy_version

    def stats(self) -> dict[str, float | int]:
        return {
            "policy_version": self.engine.policy_version,
            "forward_passes": self.engine.forward_passes,
            "tokens_generated": self.engine.tokens_generated,
            "busy_s": self.busy_s,
        }

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
