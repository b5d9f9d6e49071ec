"""The learning loop: take a batch from the buffer, train, publish, record, checkpoint.

It runs beside the producer (generate.py), which fills the buffer. Each step settles its
groups in the prompt ledger, and tells the buffer the published version only once `publish()`
returned, i.e. once every engine can load it: admission and the max-lag rule count from there.
A trainer failure ends the run with RunFailed naming the last checkpoint to resume from.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from nonstop.orchestrator.build import Run
from nonstop.orchestrator.records import StepRecord
from nonstop.orchestrator.recovery import RunFailed, write_checkpoint
from nonstop.runtime import ActorCallError, ActorDied
from nonstop.types import Group, PublishResult, StepResult


async def learn(run: Run) -> StepRecord | None:
    """Returns the last step's record (None when no step ran)."""
    cfg, state, record = run.cfg, run.state, None
    for step in range(state.first_step, cfg.run.max_steps + 1):
        groups = await run.buffer.take()
        if not groups:
            break  # the stream ran out (run.max_epochs) and every group was trained
        t0 = time.perf_counter()
        with trainer_failure(run, step):
            result = await run.trainer.step(groups)
            published = await run.trainer.publish()
        state.clock.add("training", time.perf_counter() - t0)
        outcome = "skipped_step" if result.metrics["skipped"] else "trained"
        for g in groups:
            run.ledger.settle(g.epoch, g.prompt_index, outcome)
        if run.envs is not None:
            run.envs.stats.trained(groups, run.buffer.policy_version)  # lag against the version trained on
        await run.buffer.step_done(published.policy_version)
        out_of_time = cfg.run.max_time_s is not None and state.clock.wall() >= cfg.run.max_time_s
        record = step_record(run, step, groups, result, published)
        if step % cfg.run.eval_every == 0 or step == cfg.run.max_steps or out_of_time:
            record.eval_accuracy = await run.eval()
        run.sink.write(record.to_dict())
        run.progress.update(record)
        if cfg.checkpoint.every_steps is not None and step % cfg.checkpoint.every_steps == 0:
            with trainer_failure(run, step):  # the trainer may die while idle: its next call is this one
                await write_checkpoint(run, step)
        if out_of_time:
            break
    if record is not None and record.eval_accuracy is None:  # the stream ran out between two evaluations
        record.eval_accuracy = await run.eval()
        run.sink.write(record.final_eval())
    if record is not None and cfg.checkpoint.every_steps is not None and state.last_checkpoint != record.step:
        with trainer_failure(run, record.step):
            await write_checkpoint(run, record.step)
    return record


@contextlib.contextmanager
def trainer_failure(run: Run, step: int) -> Iterator[None]:
    """A failing trainer (in a step, a publish or a checkpoint) ends the run with how to resume it."""
    try:
        yield
    except (ActorDied, ActorCallError) as e:
        last = run.state.last_checkpoint
        where = f"checkpoint step {last}" if last else "no checkpoint yet"
        raise RunFailed(f"the trainer failed at step {step}: {e}\nresume with `nonstop train --resume "
                        f"{run.run_dir}` ({where})") from e


def step_record(run: Run, step: int, groups: list[Group], result: StepResult, published: PublishResult) -> StepRecord:
    clock, stats = run.state.clock, run.stats
    wall, busy = clock.wall(), clock.busy_s
    rewards = [s.reward for g in groups for s in g.samples]
    trainer = {k: v for k, v in result.metrics.items() if k != "samples"}
    trainer.update(publish_s=published.publish_s, publish_bytes=published.publish_bytes)
    return StepRecord(
        step=step, policy_version=published.policy_version, time_s=round(wall, 3),
        reward_mean=sum(rewards) / max(len(rewards), 1), prompts=[[g.epoch, g.prompt_index] for g in groups],
        trainer=trainer, samples_trained=result.metrics["samples"], samples_generated=stats.samples,
        samples_per_s=stats.samples / wall if wall > 0 else 0.0,
        generation_busy_s=round(busy["generation"], 3), generation_idle_s=round(max(0.0, wall - busy["generation"]), 3),
        training_busy_s=round(busy["training"], 3), training_idle_s=round(max(0.0, wall - busy["training"]), 3),
        engine_idle_frac=clock.idle_fraction("generation"), trainer_idle_frac=clock.idle_fraction("training"),
        drops=dict(run.buffer.drops), reward_errors=dict(run.scorer.errors), buffer_queued=run.buffer.queued,
        engine_restarts=sum(len(e.faults.restarts) for e in run.engines),
        prompts_requeued=run.ledger.requeued + sum(e.faults.requeued for e in run.engines),
        engine_versions=list(run.engine.versions),
        episodes=run.envs.report() if run.envs is not None else None,
    )
