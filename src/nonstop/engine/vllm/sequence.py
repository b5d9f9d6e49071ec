"""In-flight state of the vLLM engine's requests: `VllmSeqGroup`, one request of n completions with the
future its caller awaits, and `VllmSeq`, one completion with what vLLM returned of it so far.

The vLLM counterpart of engine/sequence.py: each completion is its own vLLM request, so a
`VllmSeq` carries a version per token (the policy_version live when vLLM returned it), and its
`VllmSeqGroup` resolves its future once the last of its n completions has finished.
engine/vllm/engine.py's `VllmEngineWorker` is their only user.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nonstop.kept import Routes
from nonstop.types import FinishReason, GenerationRequest, Sample


@dataclass(eq=False)  # identity: a completion is found in the queue by itself
class VllmSeq:
    """One completion in flight: what vLLM returned so far, with a version per token."""

    group: VllmSeqGroup
    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason = "length"
    routes: Routes | None = None


@dataclass(eq=False)
class VllmSeqGroup:
    request: GenerationRequest
    future: asyncio.Future
    samples: list[Sample | None]
    queue: asyncio.Queue | None = None  # a TokenEvent per token (streaming)

    def finished(self, seq: VllmSeq) -> None:
        self.samples[seq.index] = Sample(
            list(self.request.prompt_ids), seq.ids, seq.logprobs, seq.versions, seq.finish, routes=seq.routes
        )
        if all(s is not None for s in self.samples) and not self.future.done():
            self.future.set_result(list(self.samples))
