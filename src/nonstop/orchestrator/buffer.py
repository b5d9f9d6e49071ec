"""The rollout buffer: bounded, async, group-atomic, with admission by depth and a max-lag rule.

Depth is counted in trainer steps of rollouts generated ahead of the trainer. The producer
asks `admit(k)` before generating k groups; admission holds

    groups_admitted <= (steps_trained + depth + 1) * groups_per_step + groups_refunded

so depth 0 is synchronous (the next batch is generated only after the trainer published the
weights of the previous step: lag 0), depth 1 is a double buffer (lag <= 1), depth K a bounded
queue (lag <= K), and depth None an unbounded stream held back only by `max_queued` (at most
that many groups admitted and not yet trained, so admission still waits and the producer
yields) and the max-lag rule. The depth bounds the lag of groups trained in the order they
were admitted; batches are formed in arrival order, so a slow group overtaken by later ones can
lag more (the capacity planner shows it with long-tailed lengths), and the max-lag rule bounds
it. A group that never reaches the trainer (dropped for lag, a reward fault, or no learning
signal) refunds its admission, so a short batch is topped up instead of starving the trainer.

With `refill=False`, a group dropped for having no learning signal ("uniform_reward") is not
refunded: it keeps its place in its batch as an empty slot, so a step trains on the groups with
signal among its `groups_per_step` prompts (fewer groups, the same generation per step, as a
plain synchronous loop does). A batch whose every slot is empty is not handed to the trainer:
its admission is refunded and the next prompts fill it.

`take(ahead)` returns the next `groups_per_step` groups (slots) whose oldest token is at most `max_lag`
versions behind the trainer; every group dropped on the way is counted by reason in `drops`.
With `episodes=True` (buffer.reject 'episode') only the lagging episodes of such a group are
removed (counted as `max_lag_episode`, by episode); a group left with none is dropped whole.
With `max_lag=None` the buffer rejects nothing (rejection per sample or token is then the
trainer's, which masks and counts). Every drop is also settled in the prompt ledger when one is
given, and recorded in the span log when one is given. Nothing is dropped silently. With a
`record` (the run's shared buffer: RUN_DIR/dropped.jsonl) every drop is also appended there, one
line naming the group and its samples (observe/consumed.py): the buffer's own account of its drops,
which `nonstop verify` reads instead of the ledger.

With `refill_ahead=True` (depth >= 1), admission also anticipates drops: from the share p of
scored groups that were dropped and refunded lately (a moving average, `drop_rate`, capped at
MAX_DROP_RATE), it admits the replacements of the groups still in flight before they are
dropped, with a margin of MARGIN_SD standard deviations of their count (at most a quarter of
a batch):

    groups_admitted <= (steps_trained + depth + 1) * groups_per_step + groups_refunded
                       + (n * p + min(MARGIN_SD * sqrt(n * p * (1 - p)), groups_per_step / 4)) / (1 - p)

where n is the number of that bound's groups not yet delivered. Without it, each replacement
waits for a generate-and-score round trip that the trainer waits for too; with it the batch
usually arrives whole after one (with two standard deviations, about 39 batches in 40 when
drops are independent). A group admitted ahead that turns out not to be needed is trained one step later
(lag up to depth + 1, within max_lag), and the next admission is smaller by it.

With an `ahead` callback, `take` hands it the groups of the batch taken so far whenever the
queue runs dry before the batch is whole (at least `ahead_min` groups not handed over before),
and waits for it before taking more: the trainer runs their forward pass meanwhile
(trainer/ahead.py). Each group is handed over at most once, in the batch's order; which groups
form the batch does not change.

When the prompt stream runs out (`run.max_epochs`), the producer calls `close()`; `take()` then
returns the last, possibly short, batch and after it an empty one.
"""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

from nonstop.config import Config
from nonstop.observe.consumed import append, dropped_line
from nonstop.observe.spans import SpanLog, now
from nonstop.orchestrator.ledger import Settler
from nonstop.types import Group

_EMPTY_SLOT = object()  # a group without learning signal, holding its place in a batch (refill=False)
MAX_DROP_RATE = 0.75  # a task that drops nearly every group does not make admission ahead run away
MARGIN_SD = (
    2.0  # a batch short of groups waits a whole generate-and-score round trip; a surplus group trains a step later
)


def refill_ahead_groups(needed: int, drop_rate: float, groups_per_step: int) -> int:
    """Groups admitted ahead to replace the expected drops among the `needed` groups not yet
    delivered (the module docstring's formula; the capacity planner models admission with it too).
    The expected drops, plus MARGIN_SD standard deviations of their count, at most a quarter of a
    batch: a surplus that stays queued adds its share of a step to every later group's lag."""
    p, n = min(drop_rate, MAX_DROP_RATE), max(0, needed)
    margin = min(MARGIN_SD * math.sqrt(n * p * (1 - p)), groups_per_step / 4)
    return int((n * p + margin) / (1 - p))


class Intake(Protocol):
    """What a producer hands groups to: the buffer, or (env.policies) one buffer per policy."""

    async def admit(self, max_groups: int) -> int: ...

    async def refund(self, n: int) -> None: ...

    async def close(self) -> None: ...

    async def put(self, group: Group) -> None: ...

    async def drop(self, group: Group, reason: str) -> None: ...


def make_buffer(cfg: Config, ledger: Settler, spans: SpanLog, record: Path | None = None) -> "RolloutBuffer":
    """A run's buffer (or one policy's) as the config says; group-level max-lag rejection only
    where buffer.reject is done here ('group', 'episode'), not by the trainer. `record`: the file
    its drops are appended to (None: none)."""
    in_buffer = cfg.buffer.reject in ("group", "episode")
    return RolloutBuffer(
        cfg.rollout.prompts_per_step,
        cfg.buffer.depth,
        cfg.buffer.max_lag if in_buffer else None,
        cfg.buffer.max_queued_groups,
        ledger,
        refill=cfg.rollout.refill,
        spans=spans,
        episodes=cfg.buffer.reject == "episode",
        refill_ahead=cfg.refill_ahead,
        record=record,
    )


class RolloutBuffer:
    def __init__(
        self,
        groups_per_step: int,
        depth: int | None,
        max_lag: int | None,
        max_queued: int,
        ledger: Settler | None = None,
        refill: bool = True,
        spans: SpanLog | None = None,
        episodes: bool = False,
        refill_ahead: bool = False,
        record: Path | None = None,
    ) -> None:
        if refill_ahead and (depth is None or depth < 1):
            raise ValueError(
                f"refill_ahead needs a bounded depth of at least 1, not {depth}: a group admitted "
                "ahead and not needed trains a step later"
            )
        self.groups_per_step = groups_per_step
        self.refill_ahead = refill_ahead
        self.spans = spans if spans is not None else SpanLog(None)
        self.episodes = episodes
        self.record = record
        if record is not None:
            record.touch()  # an empty record says "no drops"; a missing one says nothing (nonstop verify)
        self.ledger = ledger
        self.refill = refill
        self.depth = depth
        self.max_lag = max_lag
        self.queue: asyncio.Queue[Group | object | None] = asyncio.Queue(maxsize=max_queued)  # None: closed
        self.policy_version = 0
        self.steps_trained = 0
        self.admitted = 0
        self.refunded = 0
        self.delivered = 0  # groups (and empty slots) put, less those dropped from the queue since
        self.drop_rate = 0.0  # moving average over scored groups: 1 dropped and refunded, 0 delivered
        self.drops: Counter[str] = Counter()
        self._held: int | None = None  # steps_trained as admission counts it while held (hold_admission)
        self._changed = asyncio.Condition()

    def _limit(self) -> float:
        steps = self.steps_trained if self._held is None else self._held
        if self.depth is None:  # groups admitted and not yet trained stay within max_queued
            return steps * self.groups_per_step + self.queue.maxsize + self.refunded
        bound = (steps + self.depth + 1) * self.groups_per_step
        ahead = (
            refill_ahead_groups(bound - self.delivered, self.drop_rate, self.groups_per_step)
            if self.refill_ahead
            else 0
        )
        return bound + self.refunded + ahead

    def _observe(self, dropped: bool) -> None:
        """A scored group's outcome, in the moving average of the drop rate (about one step's groups)."""
        self.drop_rate += (float(dropped) - self.drop_rate) / self.groups_per_step

    async def admit(self, max_groups: int) -> int:
        """Wait until generation may start; reserve and return how many groups (1..max_groups)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._limit() - self.admitted >= 1)
            k = int(min(max_groups, self._limit() - self.admitted))
            self.admitted += k
            return k

    async def put(self, group: Group) -> None:
        await self.queue.put(group)
        await self._delivered(1)

    async def _delivered(self, n: int) -> None:
        async with self._changed:
            self.delivered += n
            if n > 0:
                self._observe(False)
            self._changed.notify_all()

    async def drop(self, group: Group, reason: str) -> None:
        """Count a group that will not be trained on and refund its admission."""
        self.drops[reason] += 1
        self.spans.emit("drop", id=[group.epoch, group.prompt_index], reason=reason, t=round(now(), 6))
        append(self.record, dropped_line(group, reason))
        if self.ledger is not None:
            self.ledger.settle(group.epoch, group.prompt_index, reason)
        if not self.refill and reason == "uniform_reward":
            await self.queue.put(_EMPTY_SLOT)
            await self._delivered(1)
            return
        if reason != "max_lag":  # found in the queue: counted as delivered, not a drop of scoring
            self._observe(True)
        await self.refund(1)

    def settle(self, group: Group, outcome: str) -> None:
        """Settle a group the trainer took (trained, or its step skipped) in the ledger, when one is given."""
        if self.ledger is not None:
            self.ledger.settle(group.epoch, group.prompt_index, outcome)

    async def refund(self, n: int) -> None:
        """Give back admission for `n` groups that will not be generated or trained."""
        async with self._changed:
            self.refunded += n
            self._changed.notify_all()

    async def close(self) -> None:
        """No more groups will come: the stream ran out. Waits for queue space like `put`."""
        await self.queue.put(None)

    async def take(
        self, ahead: Callable[[list[Group]], Awaitable[None]] | None = None, ahead_min: int = 1
    ) -> list[Group]:
        """The next batch for the trainer at the current policy_version (`ahead`: see the module docstring)."""
        batch: list[Group] = []
        slots = 0
        handed = 0  # batch[:handed] went to `ahead`
        while slots < self.groups_per_step:
            if ahead is not None and self.queue.empty() and len(batch) - handed >= ahead_min:
                part, handed = batch[handed:], len(batch)
                await ahead(part)
                continue
            group = await self.queue.get()
            if group is None:
                self.queue.put_nowait(None)  # stays closed for later takes; the slot just freed
                return batch
            slots += 1
            if group is _EMPTY_SLOT:
                if slots == self.groups_per_step and not batch:  # no signal at all: generate this batch again
                    await self._delivered(-self.groups_per_step)
                    await self.refund(self.groups_per_step)
                    slots = 0
                continue
            assert isinstance(group, Group)
            if self.max_lag is not None and self.policy_version - group.min_version > self.max_lag:
                if not (self.episodes and self._drop_stale_episodes(group)):
                    slots -= 1
                    await self._delivered(-1)
                    await self.drop(group, "max_lag")
                    continue
            batch.append(group)
        return batch

    def _drop_stale_episodes(self, group: Group) -> bool:
        """reject 'episode': remove the episodes whose oldest model token lags past max_lag (all
        their roles' samples), counted in `drops['max_lag_episode']` and in the ledger; False when
        no episode is left (the caller drops the group)."""
        assert self.max_lag is not None
        stale = {
            s.episode
            for s in group.samples
            if s.min_version >= 0 and self.policy_version - s.min_version > self.max_lag
        }
        kept = [s for s in group.samples if s.episode not in stale]
        if not kept:
            return False
        removed = [s for s in group.samples if s.episode in stale]
        part = Group(group.prompt_index, group.prompt, group.answer, removed, epoch=group.epoch)
        append(self.record, dropped_line(part, "max_lag_episode"))
        group.samples = kept
        self.drops["max_lag_episode"] += len(stale)
        if self.ledger is not None:
            self.ledger.drop_episodes(len(stale), "max_lag")
        return True

    def stepped(self, policy_version: int) -> None:
        """The trainer holds `policy_version` while its send is still under way (trainer.publish_overlap):
        the next batch trains against it, so the max-lag rule counts from it at once; admission waits for
        `step_done`, when every engine can load it."""
        self.policy_version = policy_version

    def hold_admission(self) -> None:
        """Admit as if no further step finished until `release_admission` (run.eval_pauses_generation):
        refunds still top up the batches admitted so far; steps_trained and the max-lag rule move on."""
        self._held = self.steps_trained

    async def release_admission(self) -> None:
        async with self._changed:
            self._held = None
            self._changed.notify_all()

    async def step_done(self, policy_version: int) -> None:
        """The trainer finished a step and published `policy_version`."""
        async with self._changed:
            self.steps_trained += 1
            self.policy_version = policy_version
            self._changed.notify_all()

    @property
    def queued(self) -> int:
        return self.queue.qsize()
