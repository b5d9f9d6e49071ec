"""One episode's tokens after its prompt, with what the trainer needs per token, grown turn by turn.

A multi-turn episode interleaves tokens the policy sampled with tokens its environment wrote
(tool results, an opponent's move, the next user message). The trainer must see exactly the ids
the engine sampled from, never a re-encoding of the text (a BPE merge across a turn boundary
would change them), and must know which tokens are the policy's. `TokenTrace` keeps them as they
come. Both places that record episodes use it: the built-in environments' episode loop
(orchestrator/episodes.py `Track`) and the agent server's episode recorder (serve/recorder.py).

Invariants: `ids`, `logprobs`, `versions` and `mask` have one entry per completion token; `kept`
is None (no turn restricted sampling) or has one entry too. An environment token has logprob 0,
version `ENV_VERSION` and mask False; a model token has its sample's behaviour logprob and
policy_version and mask True.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nonstop.types import FinishReason, Sample

ENV_VERSION = -1  # the policy_version of environment tokens: no policy produced them


@dataclass
class TokenTrace:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    kept: list[list[int]] | None = None  # per token, the ids sampling could choose (a sampling mask)
    turns: int = 0  # model turns appended

    def prefix(self) -> list[int]:
        """The ids the next turn generates from."""
        return self.prompt_ids + self.ids

    def append_env(self, ids: list[int]) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [ENV_VERSION] * len(ids)
        self.mask += [False] * len(ids)
        if self.kept is not None:
            self.kept += [[t] for t in ids]

    def append_model(self, s: Sample) -> None:
        if s.sampling_mask is not None and self.kept is None:
            self.kept = [[t] for t in self.ids]  # earlier tokens could only be themselves
        self.ids += s.completion_ids
        self.logprobs += s.logprobs
        self.versions += s.versions
        self.mask += [True] * len(s.completion_ids)
        if self.kept is not None:
            mask = s.sampling_mask
            self.kept += [list(m) for m in mask] if mask is not None else [[t] for t in s.completion_ids]
        self.turns += 1

    def sample(self, *, reward: float, text: str, finish_reason: FinishReason = "stop", **extra) -> Sample:
        """The episode as one trainable sample (copies: the trace may go on growing)."""
        return Sample(
            prompt_ids=list(self.prompt_ids),
            completion_ids=list(self.ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            finish_reason=finish_reason,
            loss_mask=list(self.mask),
            sampling_mask=None if self.kept is None else list(self.kept),
            reward=reward,
            text=text,
            **extra,
        )
