"""The learning loops: the shared policy's `learn()` and each own policy's `learn_policy()`.

Both take a batch from their buffer, train it, publish and settle it through one `train_step`
(step.py), which also tells the buffer the published version only once `publish()` returned,
i.e. once every engine can load it: admission and the max-lag rule count from there. With
trainer.publish_overlap, `learn()` goes on while the send is under way: the next batch is taken
(the max-lag rule counts from the new version at once) and its forward runs; the step's record is
written once the send ended, with `publish_s` the launch's time and `publish_send_s` the send's.
A step that evaluates, checkpoints or stops waits for the send first (engines must hold it). They run
beside the producer (generate.py or episode_flow.py), which fills the buffers. A trainer
failure ends the run with RunFailed naming the run folder and the last checkpoint to resume from.

`learn(run)` is the run's clock: run.max_steps, run.max_time_s (or what run.max_total_s left:
`run.state.max_rl_s`) and Ctrl-C count and stop it. Under run.max_total_s, a step is not started
when one as long as the last would end past that limit.
Each step it records a StepRecord (metrics.jsonl, the trackers, the progress line), evaluates
every run.eval_every steps and writes a checkpoint every checkpoint.every_steps. While it waits
for a batch whose first groups are there (trainer.forward_ahead), the trainer runs their
forward pass (`Ahead`); that time counts as the trainer's, not as its wait. When
`run.state.stop` is set (the first Ctrl-C), the loop ends after the step under way, or at once
if it is waiting for a batch, and writes a checkpoint of the last finished step (when
checkpoints are on): the taken-but-untrained groups are in flight in the ledger, so a resume
generates them again.

`learn_policy(side, run)` (env.policies; policies.py) steps whenever its buffer has a batch,
under the policy's lock (so a checkpoint saves its trainer state and counters at one step), and
writes one record per step to RUN_DIR/policies/<role>/metrics.jsonl; it ends with the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from rich.markup import escape

from nonstop.observe.clock import EVALUATION
from nonstop.observe.spans import now
from nonstop.orchestrator.policies import PolicySide
from nonstop.orchestrator.records import StepRecord, completions_crc32
from nonstop.orchestrator.recovery import write_checkpoint
from nonstop.orchestrator.run import Run
from nonstop.orchestrator.step import Trained, take_batch, train_step, trainer_failure
from nonstop.types import Group, PublishResult, StepResult


async def learn(run: Run) -> StepRecord | None:
    """Returns the last step's record (None when no step ran)."""
    cfg, state, record, spans = run.cfg, run.state, None, run.spans
    max_rl_s = state.max_rl_s if state.max_rl_s is not None else cfg.run.max_time_s  # begin() sets the former
    ahead = Ahead(run) if cfg.forward_ahead else None
    deferred: asyncio.Task[StepRecord] | None = None  # the last step's record, written once its send ended
    for step in range(state.first_step, cfg.run.max_steps + 1):
        t_wait, cpu = now(), time.process_time()
        left_s = None if max_rl_s is None else max(0.0, max_rl_s - state.clock.wall())
        if ahead is not None:
            ahead.step = step
        groups = await take_batch(
            run.buffer,
            state.stop,
            ahead if ahead is not None and ahead.able else None,
            max(1, cfg.rollout.prompts_per_step // AHEAD_PARTS),
            timeout_s=left_s,
        )
        if not groups:
            # stopped; or the stream ran out (run.max_epochs) and every group was trained; or the time
            # budget ran out while no batch came (every group dropped, e.g. for uniform rewards)
            break
        done = await train_step(run, run.trainer, run.buffer, groups, step, overlap=True)
        if deferred is not None:  # the previous step's send ended before this step's optimizer step
            record, deferred = await deferred, None
        state.clock.add("training", done.t2 - done.t0)
        spans.emit("wait", step=step, t0=round(t_wait, 6), t1=round(done.t0, 6), cpu=round(cpu, 6))
        spans.emit(
            "train",
            step=step,
            t0=round(done.t0, 6),
            t1=round(done.t1, 6),
            queued=run.buffer.queued,
            groups=[[g.epoch, g.prompt_index] for g in groups],
        )
        spans.emit(
            "publish", step=step, version=done.published.policy_version, t0=round(done.t1, 6), t1=round(done.t2, 6)
        )
        if run.envs is not None:
            run.envs.stats.trained(groups, done.trained_on)  # lag against the version trained on
        if run.policies is not None:
            run.policies.shared_trained(groups, done.trained_on, done.published.policy_version)
        out_of_time = max_rl_s is not None and state.clock.wall() >= max_rl_s
        if max_rl_s is not None and cfg.run.max_total_s is not None:
            # the whole command must end in time: a step as long as this one would end past the limit
            out_of_time |= state.clock.wall() + (done.t2 - t_wait) > max_rl_s
        eval_due = step % cfg.run.eval_every == 0 or step == cfg.run.max_steps or out_of_time
        checkpoint_due = cfg.checkpoint.every_steps is not None and step % cfg.checkpoint.every_steps == 0
        engines_due = eval_due or state.flops.engines_due(now())  # a round trip to every engine: not every step
        if done.finishing is not None:
            if not (engines_due or checkpoint_due or state.stop.is_set()):
                # the send goes on while the next batch is taken and its forward runs (trainer.publish_overlap)
                deferred = asyncio.create_task(record_when_sent(run, step, groups, done), name="learn-record")
                continue
            done = replace(done, published=await done.finishing)  # engines hold the version: evaluate it
        record = step_record(run, step, groups, done.result, done.published)
        state.flops.trainer_step(done.result.metrics)
        if engines_due:
            record.engine_flops_per_s, record.engine_peak_frac = state.flops.engines(await run.engine.stats())
        if eval_due:
            t_eval = now()
            record.eval_accuracy = await run.eval()
            state.clock.add(EVALUATION, now() - t_eval)
            spans.emit("eval", step=step, t0=round(t_eval, 6), t1=round(now(), 6), accuracy=record.eval_accuracy)
        write_record(run, record)
        if checkpoint_due:
            t_ckpt = now()
            with trainer_failure(run, step):  # the trainer may die while idle: its next call is this one
                await write_checkpoint(run, step)
            spans.emit("checkpoint", step=step, t0=round(t_ckpt, 6), t1=round(now(), 6))
        if out_of_time or state.stop.is_set():
            break
    if deferred is not None:
        record = await deferred
    if state.doctor is not None:  # groups scored after the last step: did the run wait for signal?
        for finding in state.doctor.finish(run.stats.vitals.take()):
            run.progress.log(f"[yellow]{escape(finding.line())}[/]")
    if state.stop.is_set():
        if record is not None and cfg.checkpoint.every_steps is not None and state.last_checkpoint != record.step:
            with trainer_failure(run, record.step):
                await write_checkpoint(run, record.step)
        return record
    if record is not None and record.eval_accuracy is None:  # the stream ran out between two evaluations
        record.eval_accuracy = await run.eval()
        run.sink.write(record.final_eval())
        consult(run, record.final_eval())
    if record is not None and cfg.checkpoint.every_steps is not None and state.last_checkpoint != record.step:
        with trainer_failure(run, record.step):
            await write_checkpoint(run, record.step)
    return record


def write_record(run: Run, record: StepRecord) -> None:
    """One step's record to metrics.jsonl and the trackers, the progress line and the doctor."""
    line = record.to_dict()
    run.sink.write(line)
    run.progress.update(record)
    consult(run, line)


async def record_when_sent(run: Run, step: int, groups: list[Group], done: Trained) -> StepRecord:
    """A step's record once its send ended (trainer.publish_overlap): the publish's own cost and bytes in it."""
    assert done.finishing is not None
    published = await done.finishing
    record = step_record(run, step, groups, done.result, replace(published, publish_s=done.published.publish_s))
    record.trainer["publish_send_s"] = published.publish_s  # the send's own time, beside the next forward
    run.state.flops.trainer_step(done.result.metrics)
    write_record(run, record)
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


def consult(run: Run, line: dict[str, Any]) -> None:
    """Hand a metrics.jsonl line to the run doctor; show each pattern it sees for the first time."""
    if run.state.doctor is not None:
        for finding in run.state.doctor.observe(line):
            run.progress.log(f"[yellow]{escape(finding.line())}[/]")


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
        episodes=run.envs.report() if run.envs is not None else None,
        policies=run.policies.report() if run.policies is not None else None,
        agents=run.agents.report() if run.agents is not None else None,
        **stats.vitals.take(),
    )


async def learn_policy(side: PolicySide, run: Run) -> None:
    """An own policy's learner loop: take its part of the rows, train, publish, settle, record; until the
    run ends (its supervisor cancels the loop) or the stream ran out and its buffer is empty."""
    path = run.run_dir / "policies" / side.role / "metrics.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as records:
        while True:
            groups = await take_batch(side.buffer, run.state.stop)
            if not groups:
                return
            async with side.lock:
                t0 = time.perf_counter()
                done = await train_step(run, side.trainer, side.buffer, groups, side.tally.steps + 1, side.role)
                side.tally.stepped(groups, done.trained_on, done.published.policy_version)
            records.write(json.dumps(policy_record(side, run, done, time.perf_counter() - t0)) + "\n")
            records.flush()


def policy_record(side: PolicySide, run: Run, done: Trained, train_s: float) -> dict[str, Any]:
    """One line of RUN_DIR/policies/<role>/metrics.jsonl: the step, its batch and the trainer's metrics."""
    rewards = [s.reward for g in done.groups for s in g.samples]
    metrics = {k: v for k, v in done.result.metrics.items() if k != "samples"}
    return {
        "policy": side.role,
        "step": side.tally.steps,
        "policy_version": done.published.policy_version,
        "shared_policy_version": run.buffer.policy_version,
        "train_s": round(train_s, 3),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        "prompts": [[g.epoch, g.prompt_index] for g in done.groups],
        "samples_trained": done.result.metrics["samples"],
        "roles": dict(Counter(s.role for g in done.groups for s in g.samples)),
        **metrics,
        "publish_s": done.published.publish_s,
        "publish_bytes": done.published.publish_bytes,
        "drops": dict(side.buffer.drops),
    }
