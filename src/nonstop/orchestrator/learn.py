"""The shared policy's learning loop, `learn()`: the run's clock, one step after another.

Each step takes a batch from the buffer, trains, publishes and settles it through one
`train_step` (step.py), which also tells the buffer the published version only once `publish()`
returned, i.e. once every engine can load it: admission and the max-lag rule count from there.
With trainer.publish_overlap, `learn()` goes on while the send is under way: the next batch is
taken (the max-lag rule counts from the new version at once) and its forward runs; the step's
record is written once the send ended, with `publish_s` the launch's time and `publish_send_s`
the send's. A step that evaluates, checkpoints or stops waits for the send first (engines must
hold it). The loop runs beside what the run's mode started (its producer fills the buffer). A
trainer failure ends the run with RunFailed naming the run folder and the last checkpoint to
resume from.

`learn(run)` is the run's clock: run.max_steps, run.max_time_s (or what run.max_total_s left:
`run.state.max_rl_s`) and Ctrl-C count and stop it. Under run.max_total_s, a step is not started
when one as long as the last would end past that limit (`TimeLimit`). Each step it records a
StepRecord (`step_record`) and tells the run's mode what it trained; what else a step does hangs
off it as observers (step_observers.py): spans and the RL clock, FLOPs, metrics.jsonl, the
trackers and the progress line, the run doctor, evaluation every run.eval_every steps, a
checkpoint every checkpoint.every_steps. With run.eval_pauses_generation a step that evaluates
holds the buffer's admission from its start until its evaluation ended (the next batch is not
generated in evaluation time). While it waits for a batch whose first groups are there
(trainer.forward_ahead), the trainer runs their forward pass (`Ahead`); that time counts as the
trainer's, not as its wait. When `run.state.stop` is set (the first Ctrl-C), the loop ends after
the step under way, or at once if it is waiting for a batch, and writes a checkpoint of the last
finished step (when checkpoints are on): the taken-but-untrained groups are in flight in the
ledger, so a resume generates them again.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

from nonstop.observe.clock import EVALUATION
from nonstop.observe.spans import now
from nonstop.orchestrator.records import StepRecord, completions_crc32
from nonstop.orchestrator.run import Run
from nonstop.orchestrator.step import Trained, take_batch, train_step, trainer_failure
from nonstop.orchestrator.step_observers import NOTHING_DUE, Due, StepObserver, observe_step, step_observers
from nonstop.types import Group, PublishResult, StepResult


async def learn(run: Run) -> StepRecord | None:
    """Returns the last step's record (None when no step ran)."""
    cfg, state, record = run.cfg, run.state, None
    observers, limit = step_observers(run), TimeLimit(run)
    ahead = Ahead(run) if cfg.forward_ahead else None
    deferred: asyncio.Task[StepRecord] | None = None  # the last step's record, written once its send ended
    for step in range(state.first_step, cfg.run.max_steps + 1):
        t_wait, cpu = now(), time.process_time()
        if ahead is not None:
            ahead.step = step
        groups = await take_batch(
            run.buffer,
            state.stop,
            ahead if ahead is not None and ahead.able else None,
            max(1, cfg.rollout.prompts_per_step // AHEAD_PARTS),
            timeout_s=limit.left_s(),
        )
        if not groups:
            # stopped; or the stream ran out (run.max_epochs) and every group was trained; or the time
            # budget ran out while no batch came (every group dropped, e.g. for uniform rewards)
            break
        scheduled_eval = step % cfg.run.eval_every == 0 or step == cfg.run.max_steps
        held = cfg.run.eval_pauses_generation and scheduled_eval
        if held:  # the next batch waits for this step's evaluation (run.eval_pauses_generation)
            run.buffer.hold_admission()
        done = await train_step(run, run.trainer, run.buffer, groups, step, overlap=True)
        if deferred is not None:  # the previous step's send ended before this step's optimizer step
            record, deferred = await deferred, None
        for o in observers:
            o.trained(step, done, t_wait, cpu)
        run.mode.trained(groups, done.trained_on, done.published.policy_version)
        out_of_time = limit.reached(done.t2 - t_wait)
        every = cfg.checkpoint.every_steps
        eval_due = scheduled_eval or out_of_time
        due = Due(eval_due, every is not None and step % every == 0, eval_due or state.flops.engines_due(now()))
        if done.finishing is not None:
            if not (due.engines or due.checkpoint or state.stop.is_set()):
                # the send goes on while the next batch is taken and its forward runs (trainer.publish_overlap)
                deferred = asyncio.create_task(record_when_sent(run, observers, step, done), name="learn-record")
                continue
            done = replace(done, published=await done.finishing)  # engines hold the version: evaluate it
        record = step_record(run, step, groups, done.result, done.published)
        await observe_step(observers, record, done, due)
        if held:
            await run.buffer.release_admission()
        if out_of_time or state.stop.is_set():
            break
    if deferred is not None:
        record = await deferred
    for o in observers:
        await o.at_end(record, state.stop.is_set())
    return record


class TimeLimit:
    """The learning loop's RL time: run.max_time_s, or what run.max_total_s left (`RunState.max_rl_s`)."""

    def __init__(self, run: Run) -> None:
        state, cfg = run.state, run.cfg
        self.clock, self.total = state.clock, cfg.run.max_total_s
        self.max_rl_s = state.max_rl_s if state.max_rl_s is not None else cfg.run.max_time_s  # begin() sets the former

    def left_s(self) -> float | None:
        return None if self.max_rl_s is None else max(0.0, self.max_rl_s - self.clock.wall())

    def reached(self, step_s: float) -> bool:
        """Out of time after a step of `step_s` seconds (its wait included). Under run.max_total_s
        the whole command must end in time: a step as long as this one would end past the limit."""
        if self.max_rl_s is None:
            return False
        wall = self.clock.wall()
        return wall >= self.max_rl_s or (self.total is not None and wall + step_s > self.max_rl_s)


async def record_when_sent(run: Run, observers: list[StepObserver], step: int, done: Trained) -> StepRecord:
    """A step's record once its send ended (trainer.publish_overlap): the publish's own cost and bytes in it."""
    assert done.finishing is not None
    published = await done.finishing
    record = step_record(run, step, done.groups, done.result, replace(published, publish_s=done.published.publish_s))
    record.trainer["publish_send_s"] = published.publish_s  # the send's own time, beside the next forward
    await observe_step(observers, record, done, NOTHING_DUE)
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


def step_record(run: Run, step: int, groups: list[Group], result: StepResult, published: PublishResult) -> StepRecord:
    clock, stats = run.state.clock, run.stats
    wall, busy = clock.wall(), clock.busy_s
    rewards = [s.reward for g in groups for s in g.samples]
    trainer = {k: v for k, v in result.metrics.items() if k != "samples"}
    trainer.update(publish_s=published.publish_s, publish_bytes=published.publish_bytes)
    if published.full_bytes:  # below 1 where the transport sent a delta (transport.delta)
        trainer["publish_bytes_frac"] = published.publish_bytes / published.full_bytes
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
        generation_idle_s=round(max(0.0, wall - busy.get(EVALUATION, 0.0) - busy["generation"]), 3),
        training_busy_s=round(busy["training"], 3),
        training_idle_s=round(max(0.0, wall - busy.get(EVALUATION, 0.0) - busy["training"]), 3),
        engine_idle_frac=clock.idle_fraction("generation"),
        trainer_idle_frac=clock.idle_fraction("training"),
        drops=dict(run.buffer.drops),
        reward_errors=dict(run.scorer.errors),
        buffer_queued=run.buffer.queued,
        engine_restarts=sum(len(e.faults.restarts) for e in run.engines),
        prompts_requeued=run.ledger.requeued + sum(e.faults.requeued for e in run.engines),
        engine_versions=list(run.engine.versions),
        scoring=run.scorer.metrics(),
        **run.mode.report(),
        **stats.vitals.take(),
    )
