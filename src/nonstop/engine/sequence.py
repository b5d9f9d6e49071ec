"""In-flight state of one request (a group of n completions) and of each completion.

A `Seq` owns the growing completion and its per-token metadata: token ids, behaviour logprobs,
policy versions, (when the request truncates) the Keep Sampling Mask and (for a MoE model) the
routes of its input tokens. Invariants: the four lists have equal length; the routes cover the
prompt and every completion token but the pending one; `pending` is the last sampled token, not yet in the KV cache;
`length` is the number of tokens in the cache; `row` is the cache slot (-1 when not in the
batch). A `SeqGroup` finishes when all its sequences have a finish reason; `reset()` clears it
for a restart from the prompt (group_cancel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nonstop.kept import KeptIds, Routes
from nonstop.types import FinishReason, GenerationRequest, Sample


class Seq:
    __slots__ = (
        "group",
        "index",
        "ids",
        "logprobs",
        "versions",
        "kept",
        "routes",
        "pending",
        "length",
        "row",
        "finish",
        "generator",
    )

    def __init__(self, group: "SeqGroup", index: int) -> None:
        self.group, self.index = group, index
        self.row = -1
        self.clear()

    def clear(self) -> None:
        p = self.group.request.params
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.kept = KeptIds(self.group.vocab_size) if p.truncates and p.temperature > 0 else None
        shape = self.group.route_shape
        self.routes = Routes(*shape) if shape is not None else None
        self.pending = -1
        self.length = 0
        self.finish: FinishReason | None = None
        self.generator = torch.Generator().manual_seed(p.seed + self.index) if p.seed is not None else None

    def to_sample(self) -> Sample:
        assert self.finish is not None, "to_sample before the sequence finished"
        return Sample(
            prompt_ids=list(self.group.request.prompt_ids),
            completion_ids=self.ids,
            logprobs=self.logprobs,
            versions=self.versions,
            finish_reason=self.finish,
            sampling_mask=self.kept,
            routes=self.routes,
        )


class SeqGroup:
    def __init__(
        self,
        request: GenerationRequest,
        on_done: Callable[[list[Sample]], None],
        on_fail: Callable[[BaseException], None] | None,
        on_token: Callable[[int, int, float, int], None] | None,
        vocab_size: int,
        route_shape: tuple[int, int, int] | None = None,
    ) -> None:
        """`route_shape`: (moe_layers, top_k, num_experts) of a MoE model, whose routes are recorded."""
        p = request.params
        self.request, self.on_done, self.on_fail, self.on_token = request, on_done, on_fail, on_token
        self.n = request.n
        self.share = len(request.prompt_ids) + p.max_new_tokens  # KV tokens one sequence may need
        self.reserve = request.n * self.share
        self.held = 0  # of `reserve`, what the scheduler still holds for this group's unfinished sequences
        self.settings = (float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p))
        self.stop_ids = frozenset(p.stop_token_ids)
        self.max_new_tokens = p.max_new_tokens
        self.stop_strings = tuple(p.stop)
        self.stop_window = max((len(x) for x in p.stop), default=0) + 1
        self.vocab_size = vocab_size
        self.route_shape = route_shape
        self.seqs = [Seq(self, i) for i in range(request.n)]

    def reset(self) -> None:
        for s in self.seqs:
            s.clear()

    @property
    def all_finished(self) -> bool:
        return all(s.finish is not None for s in self.seqs)

    @property
    def min_version(self) -> int:
        return min((s.versions[0] for s in self.seqs if s.versions), default=10**18)
