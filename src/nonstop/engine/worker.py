"""Engine actor: a TorchEngine in its own process, reached through the actor seam.

The orchestrator calls `connect_transport(handle, rank)` once, then `generate(requests)` as
often and as concurrently as it likes: `generate` is a coroutine served on the actor's event
loop, and all concurrent calls share one continuous-batching decode loop (engine/aio.py), so
each call returns as soon as its own groups are done. New weights arrive through the
transport, never through these calls; the engine applies them between two forward passes as
`engine.update_mode` says.
`engine.dtype` resolves here, in the engine's process (device.py: auto is bfloat16 where the
device has it); `stats()` reports it (`bf16`), the FLOPs of every forward pass so far (`flops`,
over `busy_s`) and this process's matmul peak in that dtype (`peak_flops_per_s`), probed at
start and again at exponentially spaced times, at `stats()` (observe/flops.py `PeakProbe`).
"""

from __future__ import annotations

import torch

from nonstop.config import EngineConfig
from nonstop.device import place, resolve_device, resolve_dtype
from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.observe.flops import PeakProbe
from nonstop.observe.spans import SpanLog
from nonstop.transport import WeightReceiver, open_receiver
from nonstop.transport.base import layout_dtype, receiver_crc32
from nonstop.transport.device import receive_device
from nonstop.types import GenerationRequest, Sample, TransportHandle


def load_detokenizer(model_path: str):
    """The tokenizer's decode for stop strings, or None when the model folder has no tokenizer."""
    try:
        tok = load_tokenizer(model_path)
    except (OSError, ValueError):
        return None
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


class EngineWorker:
    def __init__(
        self,
        model_path: str,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        initial_version: int = 0,
        settings: EngineConfig | None = None,
        span_path: str | None = None,
    ) -> None:
        """`initial_version` is the policy_version of the weights at `model_path` (a checkpoint's on resume);
        `span_path`: this engine's span file (nonstop.observe.spans), None records nothing."""
        torch.manual_seed(seed)
        cfg = settings or EngineConfig()
        self.device = device = resolve_device(cfg.device, "engine.device")
        self.dtype = resolve_dtype(cfg.dtype, device, "engine.dtype")
        model = place(load_model(model_path, self.dtype), device)
        self.engine = TorchEngine(
            model,
            eos_token_ids,
            pad_token_id,
            policy_version=initial_version,
            settings=settings,
            detokenize=load_detokenizer(model_path),
        )
        self.peak = PeakProbe(self.dtype, device)
        self.spans = SpanLog(span_path)
        self.aio = AsyncEngine(self.engine, self.spans)
        self.receiver: WeightReceiver | None = None

    def connect_transport(self, handle: TransportHandle, rank: int = 1) -> None:
        # a GPU path receives on this engine's GPU; every version arrives in the transport's dtype. LoRA
        # adapters arrive in tensors of their own and are merged into the model's weights: into the
        # live model itself under never_stop (no float32 copy of a bf16 model), else a copy in its dtype
        device = receive_device(handle, self.device) or torch.device("cpu")
        self.engine.receive_weights_on(device, self.dtype if handle.lora is not None else layout_dtype(handle.layout))
        self.receiver = open_receiver(handle, self.engine.weight_model, rank)
        self.engine.weights = self.receiver

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        return await self.aio.generate(requests)

    async def ping(self) -> int:
        """Heartbeat: answered on the actor's loop between two decode steps."""
        return self.engine.policy_version

    async def weights_crc32(self) -> tuple[int, int]:
        """(policy_version, CRC32 of the weights this engine decodes with, in the transport's layout
        order; trainer/worker.py computes the same of the trainer's): taken between two decode steps. An
        idle engine first applies the newest published version, as its next request would."""
        if self.receiver is None:
            raise RuntimeError("weights_crc32: the engine is not attached to a weight transport yet")
        self.engine.scheduler.apply_newest_if_idle()
        while True:  # a version applied while the CRC ran would mix two versions: take it again
            version = self.engine.policy_version
            crc = receiver_crc32(self.receiver)
            if version == self.engine.policy_version:
                return version, crc

    async def stats(self) -> dict[str, float | int]:
        return {
            "policy_version": self.engine.policy_version,
            **self.engine.scheduler.stats,
            "peak_flops_per_s": self.peak.tick(),
            "bf16": int(self.dtype == torch.bfloat16),
        }

    async def sampling_state(self) -> dict[str, bytes]:
        """The state of the generator that requests without a seed draw their sampling noise from
        (torch's default generator of the engine's device; nothing else in this process draws from
        it while it serves), taken between two decode steps, for checkpoints."""
        state = {"cpu": torch.get_rng_state().numpy().tobytes()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device).numpy().tobytes()
        return state

    async def load_sampling_state(self, state: dict[str, bytes]) -> None:
        """Continue the random stream `sampling_state` saved (a resumed run does not replay the
        noise its first steps drew)."""
        torch.set_rng_state(torch.frombuffer(bytearray(state["cpu"]), dtype=torch.uint8))
        if "cuda" in state and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.frombuffer(bytearray(state["cuda"]), dtype=torch.uint8), self.device)

    async def close(self) -> None:
        await self.aio.close()
        self.spans.close()
        if self.receiver is not None:
            self.receiver.close()
