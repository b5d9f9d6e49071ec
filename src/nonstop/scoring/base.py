"""The scoring seams: the `Scorer` stage the orchestrator talks to, and the components it runs.

A `Scorer` turns a generated group into rewards. The producer (orchestrator/generate.py) calls
`await scorer.ready()` before it admits new prompts (backpressure: it returns only while fewer
than `scoring.max_pending_groups` groups wait for scoring) and `await scorer.score(group)` once a
group's completions are done; many groups are scored at once, beside generation and training.
`score` fills every sample's `reward` (and, with process rewards or a teacher, its
`token_rewards` / `teacher_logprobs` / `teacher`) and returns True, or returns False when the
group must be dropped (a component failed after its retries); every failure is counted in
`errors` by component and reason (`reward_raised`, `reward_timeout`, `reward_model_worker_died`,
`judge_unparsed`, ...), and the caller settles the dropped group in the prompt ledger. A sample
that every reward function left None (TRL's "not applicable") is counted there too, as
`reward_all_none`, and left out of training within its kept group (stage.py `leave_out`).

A `ScoreComponent` is one source of signal (reward functions, a group function, a reward model,
a judge, process rewards, a teacher). It returns a `Contribution` for the whole group or raises
`CallFailed(reason)` (scoring/pool.py); the stage adds its retries, its concurrency cap and its
latency and error accounting around every component alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from nonstop.types import Group


@dataclass
class Contribution:
    """What one component adds to each sample of a group (None: nothing of that kind)."""

    rewards: list[float] | None = None
    """Added to each sample's reward, already times the component's weight."""
    token_rewards: list[list[float]] | None = None
    """Per sample, per completion token (process rewards)."""
    teacher_logprobs: list[list[float]] | None = None
    """Per sample, per completion token (distillation)."""
    teacher: str | None = None
    """Identity and version of the teacher."""
    left_out: list[int] | None = None
    """Indices of the samples no reward applies to (every reward function returned None): the stage
    leaves them out of training and counts them (`errors['reward_all_none']`)."""


class ScoreComponent(Protocol):
    name: str
    """Prefix of its error counts and latency metrics ('reward', 'judge', ...)."""
    retryable: frozenset[str]
    """Failure reasons worth another attempt (a timeout, a dead worker), up to scoring.retries."""

    async def start(self) -> None: ...

    async def contribute(self, group: Group) -> Contribution:
        """The group's contribution, or CallFailed naming why not."""
        ...

    async def close(self) -> None: ...


class Scorer(Protocol):
    errors: Counter[str]
    """Failures by component and reason; reported per step and in the summary."""
    last_error: str | None
    """The newest failure, in words, for the message that ends a run without learning signal."""

    async def start(self) -> None:
        """Start the workers and actors the stage needs."""
        ...

    async def ready(self) -> None:
        """Return once the stage can take another group (backpressure on admission)."""
        ...

    async def score(self, group: Group) -> bool:
        """Fill the group's rewards; False: the group must be dropped (counted in `errors`)."""
        ...

    def metrics(self) -> dict[str, Any]:
        """Latency percentiles, queue depth and retries since the last call (metrics.jsonl)."""
        ...

    async def close(self) -> None: ...
