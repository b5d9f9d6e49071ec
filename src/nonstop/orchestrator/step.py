"""One learner step, shared by every learning loop: take a batch, train it, publish, settle.

Every learning loop goes through here: the shared policy's `learn()` (learn.py) and each own
policy's `learn_policy()` (env.policies; modes/own_policies/mode.py), each with its own trainer and
buffer. A step is
- `take_batch(...)`: the buffer's next batch, or [] as soon as the run is stopped (or out of
  time), sorted by (epoch, prompt index) so that the same groups make the same step whatever
  order the engines finished them in (a resumed run repeats the uninterrupted one);
- `train_step(...)`: trainer.step on the batch, then trainer.publish; every group settled in the
  ledger once, through the buffer ('trained', or 'skipped_step' when the trainer skipped the
  step); then the buffer is told the published version, and only now, once every engine can
  load it, do admission and the max-lag rule count from it. It returns a `Trained`: the batch,
  the trainer's result, the publish, the version the batch was trained against and the times.
  With trainer.publish_overlap the publish returns while its send goes on (`pending`): with
  `overlap`, `train_step` returns then, the max-lag rule counts from the new version at once (the
  next batch trains against it) and `Trained.finishing` tells the buffer the version when the send
  ended (admission counts from there, as without overlap); without `overlap` it waits for the send.
A failing trainer (in a step, a publish, a forward ahead or a checkpoint) ends the run with
RunFailed naming the run folder to resume from and the last checkpoint (`trainer_failure`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

from nonstop.clients import TrainerClient
from nonstop.observe.spans import now
from nonstop.orchestrator.buffer import RolloutBuffer
from nonstop.orchestrator.ledger import SHARED
from nonstop.orchestrator.recovery import RunFailed
from nonstop.orchestrator.run import Run
from nonstop.runtime import ActorCallError, ActorDied
from nonstop.types import Group, PublishResult, StepResult


@dataclass(frozen=True)
class Trained:
    """One finished step. Times are the span log's clock (observe/spans.py `now`)."""

    groups: list[Group]  # the batch, in the order the trainer saw it
    result: StepResult
    published: PublishResult
    trained_on: int  # the policy_version the batch was trained against (its lag counts from it)
    t0: float  # the trainer's step began
    t1: float  # the step ended and the publish began
    t2: float  # the publish ended (with a send left under way: its launch ended)
    finishing: asyncio.Task[PublishResult] | None = None  # the send under way: the buffer is told when it ends


async def take_batch(
    buffer: RolloutBuffer,
    stop: asyncio.Event,
    ahead: Callable[[list[Group]], Awaitable[None]] | None = None,
    ahead_min: int = 1,
    timeout_s: float | None = None,
) -> list[Group]:
    """The buffer's next batch, sorted; [] when `stop` is set or `timeout_s` passed first, or when
    the stream ran out and every group was taken. `ahead`/`ahead_min`: RolloutBuffer.take."""
    groups = await until_stopped(buffer.take(ahead, ahead_min), stop, timeout_s)
    # Arrival order depends on how the engines happened to batch; the trainer sees one order,
    # so the same groups give the same step (a resumed run repeats the uninterrupted one).
    groups.sort(key=lambda g: (g.epoch, g.prompt_index))
    return groups


async def until_stopped(
    take: Coroutine[Any, Any, list[Group]], stop: asyncio.Event, timeout_s: float | None = None
) -> list[Group]:
    """The batch `take` returns, or [] as soon as `stop` is set or `timeout_s` has passed."""
    if stop.is_set():
        take.close()
        return []
    taking = asyncio.create_task(take, name="learn-take")
    stopping = asyncio.create_task(stop.wait(), name="learn-stop-wait")
    try:
        await asyncio.wait({taking, stopping}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (taking, stopping):
            if not t.done():
                t.cancel()
        await asyncio.gather(taking, stopping, return_exceptions=True)
    return taking.result() if taking.done() and not taking.cancelled() else []


async def train_step(
    run: Run,
    trainer: TrainerClient,
    buffer: RolloutBuffer,
    groups: list[Group],
    step: int,
    policy: str = SHARED,
    overlap: bool = False,
) -> Trained:
    """Train `groups` (from take_batch) on `trainer`, publish, settle each group once through
    `buffer`, then `buffer.step_done(published version)`. `step` and `policy` ('' the shared
    policy, else the role with its own) name the step in a failure's message. `overlap`: a send
    the publish left under way is not waited for (`Trained.finishing`, see the module docstring)."""
    t0 = now()
    with trainer_failure(run, step, policy):
        result = await trainer.step(groups)
        t1 = now()
        published = await trainer.publish()
    t2 = now()
    outcome = "skipped_step" if result.metrics["skipped"] else "trained"
    for g in groups:
        buffer.settle(g, outcome)
    trained_on = buffer.policy_version
    if not published.pending:
        await buffer.step_done(published.policy_version)
        return Trained(groups, result, published, trained_on, t0, t1, t2)
    buffer.stepped(published.policy_version)
    finishing = asyncio.create_task(finish_publish(run, trainer, buffer, step, policy), name="learn-publish")
    if not overlap:
        published = await finishing
        return Trained(groups, result, published, trained_on, t0, t1, now())
    return Trained(groups, result, published, trained_on, t0, t1, t2, finishing)


async def finish_publish(
    run: Run, trainer: TrainerClient, buffer: RolloutBuffer, step: int, policy: str = SHARED
) -> PublishResult:
    """Wait for the send under way, then tell the buffer its version: every engine can load it now."""
    with trainer_failure(run, step, policy):
        published = await trainer.published()
    await buffer.step_done(published.policy_version)
    return published


@contextlib.contextmanager
def trainer_failure(run: Run, step: int, policy: str = SHARED) -> Iterator[None]:
    """A failing trainer ends the run with how to resume it: RunFailed naming the trainer (with
    `policy`, that role's own), the step, the run folder and the last checkpoint."""
    try:
        yield
    except (ActorDied, ActorCallError) as e:
        last = run.state.last_checkpoint
        where = f"checkpoint step {last}" if last else "no checkpoint yet"
        who = f"the trainer of policy {policy!r} failed at its step" if policy else "the trainer failed at step"
        raise RunFailed(f"{who} {step}: {e}\nresume with `nonstop train --resume {run.run_dir}` ({where})") from e
