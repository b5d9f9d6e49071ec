"""The scoring stage: components scored concurrently, with a cap, timeouts, retries and backpressure.

`ScoringStage(components, cfg)` is the `Scorer` of a run (scoring/base.py). For each group it
runs every component at once; each attempt holds one of `scoring.concurrency` slots, and an
attempt that fails for a retryable reason (a timeout, a dead worker) is tried again up to
`scoring.retries` times. The group is kept only if every component contributed: its samples'
rewards are the sum of the contributions. A sample that every task reward function returned None
for is kept in its group but left out of training (`leave_out`) and counted as `reward_all_none`.
`ready()` holds admission while `scoring.max_pending_groups` groups wait for or are under scoring.

Reward functions run in a `Runner` (scoring/runners.py: on the loop, on threads, in worker
processes, or on threads with the slow ones moved to processes). `FunctionComponent` scores
each sample with task.reward, or the whole group with scoring.group_reward (kind 'group').
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from nonstop.config.scoring import ScoringConfig
from nonstop.scoring.base import Contribution, ScoreComponent
from nonstop.scoring.pool import CallFailed
from nonstop.scoring.rewards import RewardError
from nonstop.scoring.runners import Runner
from nonstop.types import Failure, Group, Outcome, RewardKind, RewardRow, Sample

TRANSIENT = frozenset({"timeout", "worker_died"})


def rows_of(group: Group) -> list[RewardRow]:
    return [
        RewardRow(group.prompt, s.text, group.answer, group.extra, None, s.completion_ids, group.messages)
        for s in group.samples
    ]


def leave_out(samples: list[Sample], indices: list[int]) -> None:
    """Leave samples out of training within their group: no token of theirs carries loss (so no
    gradient, no KL term, and no share of a sequence or token mean), and their reward is the mean
    of the others' (0.0 when none has one), so their advantage is 0 and the group's baseline is
    the others' mean, as TRL leaves a sample every reward function returned None for out of its
    baseline. Group-std normalisation still counts them: the others' advantages are scaled by the
    std over the whole group, in which they sit at the mean."""
    out = set(indices)
    scored = [s.reward for i, s in enumerate(samples) if i not in out]
    base = sum(scored) / len(scored) if scored else 0.0
    for i in out:
        samples[i].reward = base
        samples[i].loss_mask = [False] * len(samples[i].completion_ids)


def _failed(outcomes: list[Outcome]) -> list[Failure]:
    return [o for o in outcomes if isinstance(o, Failure)]


class FunctionComponent:
    """A reward function per sample (task.reward; a TRL reward, or `WeightedRewards`, called on the
    whole group), or one per group (scoring.group_reward), in the stage's runner. A sample the
    function returned None for (not applicable) is reported in `left_out`."""

    retryable = TRANSIENT

    def __init__(
        self,
        name: str,
        spec: str | Callable[..., Any],
        fn: Callable[..., Any],
        runner: Runner,
        timeout_s: float,
        weight: float = 1.0,
        kind: RewardKind = "sample",
    ) -> None:
        self.name, self.spec, self.fn, self.runner = name, spec, fn, runner
        self.timeout_s, self.weight, self.kind = timeout_s, weight, kind

    async def start(self) -> None:
        pass

    async def contribute(self, group: Group) -> Contribution:
        rows = rows_of(group)
        outcomes = await self.runner.run(self.kind, self.spec, self.fn, rows, self.timeout_s)
        bad = _failed(outcomes)
        if bad:
            reasons = Counter(f.reason for f in bad)
            reason, _ = reasons.most_common(1)[0]
            raise CallFailed(reason, f"on prompt {group.prompt!r}: {bad[0].message}", dict(reasons))
        values = outcomes[0] if self.kind == "group" else outcomes
        assert isinstance(values, list)
        left_out = [i for i, v in enumerate(values) if v is None]
        return Contribution(
            rewards=[0.0 if v is None else self.weight * float(v) for v in values],  # type: ignore[arg-type]
            left_out=left_out or None,
        )

    async def close(self) -> None:
        pass


def percentile(xs: list[float], q: float) -> float:
    """The q-quantile (0..1) by the nearest-rank rule; 0.0 for no values."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


class ScoringStage:
    def __init__(
        self,
        components: list[ScoreComponent],
        cfg: ScoringConfig,
        runner: Runner | None = None,
        fail_fast: bool = False,
    ) -> None:
        self.components, self.cfg, self.runner, self.fail_fast = components, cfg, runner, fail_fast
        self.errors: Counter[str] = Counter()
        self.retried: Counter[str] = Counter()
        self.last_error: str | None = None
        self.pending = 0  # groups waiting for or under scoring
        self.pending_peak = 0
        self.latencies: dict[str, list[float]] = {c.name: [] for c in components}
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        if self.runner is not None:
            await self.runner.start()
        await asyncio.gather(*(c.start() for c in self.components))

    async def ready(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.pending < self.cfg.max_pending_groups)

    async def _attempts(self, comp: ScoreComponent, group: Group) -> Contribution | None:
        for attempt in range(self.cfg.retries + 1):
            try:
                async with self._slots:
                    t0 = time.perf_counter()
                    out = await comp.contribute(group)
                self.latencies[comp.name].append(time.perf_counter() - t0)
                return out
            except CallFailed as e:
                if e.reason in comp.retryable and attempt < self.cfg.retries:
                    self.retried[f"{comp.name}_{e.reason}"] += 1
                    continue
                for reason, n in (e.counts or {e.reason: 1}).items():
                    self.errors[f"{comp.name}_{reason}"] += n
                self.last_error = f"{comp.name} failed ({e.reason}): {e}"
                return None
        return None  # unreachable: the last attempt returns or records its failure

    async def score(self, group: Group) -> bool:
        async with self._changed:
            self.pending += 1
            self.pending_peak = max(self.pending_peak, self.pending)
        try:
            parts = await asyncio.gather(*(self._attempts(c, group) for c in self.components))
        finally:
            async with self._changed:
                self.pending -= 1
                self._changed.notify_all()
        if any(p is None for p in parts):
            if self.fail_fast:
                raise RewardError(f"{self.last_error} (task.reward_fail_fast is set)")
            return False
        for i, s in enumerate(group.samples):
            s.reward = 0.0
            for p in parts:
                assert p is not None
                if p.rewards is not None:
                    s.reward += p.rewards[i]
                if p.token_rewards is not None:
                    s.token_rewards = p.token_rewards[i]
                if p.teacher_logprobs is not None:
                    s.teacher_logprobs, s.teacher = p.teacher_logprobs[i], p.teacher
        left_out = sorted({i for p in parts if p is not None and p.left_out for i in p.left_out})
        if left_out:
            self.errors["reward_all_none"] += len(left_out)
            leave_out(group.samples, left_out)
        return True

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "scoring_pending": self.pending,
            "scoring_pending_peak": self.pending_peak,
            "scoring_retries": dict(self.retried),
        }
        for name, xs in self.latencies.items():
            out[f"{name}_latency_p50_s"] = round(percentile(xs, 0.5), 6)
            out[f"{name}_latency_p99_s"] = round(percentile(xs, 0.99), 6)
            xs.clear()
        self.pending_peak = self.pending
        return out

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.components), return_exceptions=True)
        if self.runner is not None:
            await self.runner.close()
