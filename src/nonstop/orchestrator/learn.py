"""The learning loop: take a batch from the buffer, train, publish, record, checkpoint.

It runs beside the producer (generate.py), which fills the buffer. Each step settles its
groups in the prompt ledger, and tells the buffer the published version only once `publish()`
returned, i.e. once every engine can load it: admission and the max-lag rule count from there.
While it waits for a batch whose first groups are there (trainer.forward_ahead), the trainer
runs their forward pass (`ahead`); that time counts as the trainer's, not as its wait.
A trainer failure ends the run with RunFailed naming the last checkpoint to resume from. When
`run.state.stop` is set (the first Ctrl-C), the loop ends after the step under way, or at once
if it is waiting for a batch, and writes a checkpoint of the last finished step (when
checkpoints are on): the taken-but-untrained groups are in flight in the ledger, so a resume
generates them again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterator
from typing import Any

from nonstop.observe.spans import now
from nonstop.orchestrator.build import Run
from nonstop.orchestrator.records import StepRecord, completions_crc32
from nonstop.orchestrator.recovery import RunFailed, write_checkpoint
from nonstop.runtime import ActorCallError, ActorDied
from nonstop.types import Group, PublishResult, StepResult


async def learn(run: Run) -> StepRecord | None:
    """Returns the last step's record (None when no step ran)."""
    cfg, state, record, spans = run.cfg, run.state, None, run.spans
    ahead = Ahead(run) if cfg.forward_ahead else None
    for step in range(state.first_step, cfg.run.max_steps + 1):
        t_wait, cpu = now(), time.process_time()
        left_s = None if cfg.run.max_time_s is None else max(0.0, cfg.run.max_time_s - state.clock.wall())
        if ahead is not None:
            ahead.step = step
        take = run.buffer.take(
            ahead if ahead is not None and ahead.able else None, max(1, cfg.rollout.prompts_per_step // AHEAD_PARTS)
        )
        groups = await until_stopped(take, state.stop, timeout_s=left_s)
        if not groups:
            # stopped; or the stream ran out (run.max_epochs) and every group was trained; or the time
            # budget ran out while no batch came (every group dropped, e.g. for uniform rewards)
            break
        # Arrival order depends on how the engines happened to batch; the trainer sees one order,
        # so the same groups give the same step (a resumed run repeats the uninterrupted one).
        groups.sort(key=lambda g: (g.epoch, g.prompt_index))
        t0 = now()
        with trainer_failure(run, step):
            result = await run.trainer.step(groups)
            t1 = now()
            published = await run.trainer.publish()
        t2 = now()
        state.clock.add("training", t2 - t0)
        spans.emit("wait", step=step, t0=round(t_wait, 6), t1=round(t0, 6), cpu=round(cpu, 6))
        spans.emit(
            "train",
            step=step,
            t0=round(t0, 6),
            t1=round(t1, 6),
            queued=run.buffer.queued,
            groups=[[g.epoch, g.prompt_index] for g in groups],
        )
        spans.emit("publish", step=step, version=published.policy_version, t0=round(t1, 6), t1=round(t2, 6))
        outcome = "skipped_step" if result.metrics["skipped"] else "trained"
        for g in groups:
            run.buffer.settle(g, outcome)
        if run.envs is not None:
            run.envs.stats.trained(groups, run.buffer.policy_version)  # lag against the version trained on
        if run.policies is not None:
            run.policies.shared_trained(groups, run.buffer.policy_version, published.policy_version)
        await run.buffer.step_done(published.policy_version)
        out_of_time = cfg.run.max_time_s is not None and state.clock.wall() >= cfg.run.max_time_s
        record = step_record(run, step, groups, result, published)
        if step % cfg.run.eval_every == 0 or step == cfg.run.max_steps or out_of_time:
            t_eval = now()
            record.eval_accuracy = await run.eval()
            spans.emit("eval", step=step, t0=round(t_eval, 6), t1=round(now(), 6), accuracy=record.eval_accuracy)
        run.sink.write(record.to_dict())
        run.progress.update(record)
        if cfg.checkpoint.every_steps is not None and step % cfg.checkpoint.every_steps == 0:
            t_ckpt = now()
            with trainer_failure(run, step):  # the trainer may die while idle: its next call is this one
                await write_checkpoint(run, step)
            spans.emit("checkpoint", step=step, t0=round(t_ckpt, 6), t1=round(now(), 6))
        if out_of_time or state.stop.is_set():
            break
    if state.stop.is_set():
        if record is not None and cfg.checkpoint.every_steps is not None and state.last_checkpoint != record.step:
            with trainer_failure(run, record.step):
                await write_checkpoint(run, record.step)
        return record
    if record is not None and record.eval_accuracy is None:  # the stream ran out between two evaluations
        record.eval_accuracy = await run.eval()
        run.sink.write(record.final_eval())
    if record is not None and cfg.checkpoint.every_steps is not None and state.last_checkpoint != record.step:
        with trainer_failure(run, record.step):
            await write_checkpoint(run, record.step)
    return record


AHEAD_PARTS = 8
"""A forward ahead takes at least 1/AHEAD_PARTS of a batch: each has a fixed cost (a call to the
trainer, the model's layers run once more), so a few groups at a time would cost more than the
wait they fill."""


class Ahead:
    """The buffer's callback for the first groups of step `step`'s batch: their forward pass now
    (trainer/ahead.py), timed as training (the trainer's own time). A trainer that held none of a
    part (a mixture-of-experts model) cannot: `able` turns false and the loop stops calling."""

    def __init__(self, run: Run) -> None:
        self.run, self.step, self.able = run, 0, True

    async def __call__(self, groups: list[Group]) -> None:
        run, t0 = self.run, now()
        with trainer_failure(run, self.step):
            done = await run.trainer.forward_ahead(groups)
        # the trainer's own time, not the call's: a call's answer waits while the loop is busy
        # (a reward on the loop, scoring.pool 'loop'), and the trainer is idle meanwhile
        run.state.clock.add("training", done.forward_s)
        run.spans.emit("ahead", step=self.step, t0=round(t0, 6), t1=round(now(), 6), groups=done.groups)
        self.able = done.groups > 0


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


@contextlib.contextmanager
def trainer_failure(run: Run, step: int) -> Iterator[None]:
    """A failing trainer (in a step, a publish or a checkpoint) ends the run with how to resume it."""
    try:
        yield
    except (ActorDied, ActorCallError) as e:
        last = run.state.last_checkpoint
        where = f"checkpoint step {last}" if last else "no checkpoint yet"
        raise RunFailed(
            f"the trainer failed at step {step}: {e}\nresume with `nonstop train --resume {run.run_dir}` ({where})"
        ) from e


def step_record(run: Run, step: int, groups: list[Group], result: StepResult, published: PublishResult) -> StepRecord:
    clock, stats = run.state.clock, run.stats
    wall, busy = clock.wall(), clock.busy_s
    rewards = [s.reward for g in groups for s in g.samples]
    trainer = {k: v for k, v in result.metrics.items() if k != "samples"}
    trainer.update(publish_s=published.publish_s, publish_bytes=published.publish_bytes)
    return StepRecord(
        step=step,
        policy_version=published.policy_version,
        time_s=round(wall, 3),
        reward_mean=sum(rewards) / max(len(rewards), 1),
        prompts=[[g.epoch, g.prompt_index] for g in groups],
        completions_crc32=completions_crc32(groups),
        trainer=trainer,
        samples_trained=result.metrics["samples"],
        samples_generated=stats.samples,
        samples_per_s=stats.samples / wall if wall > 0 else 0.0,
        generation_busy_s=round(busy["generation"], 3),
        generation_idle_s=round(max(0.0, wall - busy["generation"]), 3),
        training_busy_s=round(busy["training"], 3),
        training_idle_s=round(max(0.0, wall - busy["training"]), 3),
        engine_idle_frac=clock.idle_fraction("generation"),
        trainer_idle_frac=clock.idle_fraction("training"),
        drops=dict(run.buffer.drops),
        reward_errors=dict(run.scorer.errors),
        buffer_queued=run.buffer.queued,
        engine_restarts=sum(len(e.faults.restarts) for e in run.engines),
        prompts_requeued=run.ledger.requeued + sum(e.faults.requeued for e in run.engines),
        engine_versions=list(run.engine.versions),
        scoring=run.scorer.metrics(),
        episodes=run.envs.report() if run.envs is not None else None,
        policies=run.policies.report() if run.policies is not None else None,
    )
