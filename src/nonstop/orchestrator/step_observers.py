"""What hangs off the shared policy's learning loop (learn.py), one observer of a step each.

Each step, `learn()` tells its observers, in the order `step_observers` lists them:
- `trained(step, done, t_wait, cpu)` once the batch is trained and its publish launched;
- `measure(record, done, due)` to fill the step's record before it is written;
- `after_step(record, due)` once the record is complete;
and `at_end(record, stopped)` once, when the loop ended (`stopped`: on request, Ctrl-C).
`Due` says what this step owes: an evaluation (run.eval_every, the last step, out of time), a
checkpoint (checkpoint.every_steps) and a round trip to every engine for its FLOP counts. A
step whose record waits for its send (trainer.publish_overlap) owes none of these, by the
loop's rule: its record is measured and written with `NOTHING_DUE` once the send ended.

- `Timing`: the step's training time on the RL clock, its wait/train/publish spans;
- `Flops`: achieved FLOP/s of the trainer each step, of the engines when due (observe/flops.py);
- `Records`: the record to metrics.jsonl and the trackers, and the progress line;
- `Doctoring`: each record to the run doctor, each new finding shown; at the end, what the groups
  scored after the last step say (observe/doctor.py);
- `Evaluation`: the held-out score when due, timed as evaluation, with its span; at the end of a
  run not stopped, the last record's score if it has none (the stream ran out between two);
- `Checkpoints`: a checkpoint when due, with its span; at the end, one of the last step if the
  last checkpoint is older (when checkpoints are on).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rich.markup import escape

from nonstop.observe.clock import EVALUATION
from nonstop.observe.spans import now
from nonstop.orchestrator.records import StepRecord
from nonstop.orchestrator.recovery import write_checkpoint
from nonstop.orchestrator.run import Run
from nonstop.orchestrator.step import Trained, trainer_failure


@dataclass(frozen=True)
class Due:
    """What a step owes besides its record."""

    eval: bool = False
    checkpoint: bool = False
    engines: bool = False  # a round trip to every engine for its FLOP counts: not every step


NOTHING_DUE = Due()


class StepObserver(Protocol):
    """One concern of the learning loop's steps (module docstring); each hook does nothing unless overridden."""

    def trained(self, step: int, done: Trained, t_wait: float, cpu: float) -> None:
        """Step `step`'s batch was trained and its publish launched; the loop waited for the batch
        from `t_wait` (span clock; `cpu`: process time then)."""
        return None  # a hook does nothing unless its observer overrides it

    async def measure(self, record: StepRecord, done: Trained, due: Due) -> None:
        """Fill `record` before it is written."""
        return None  # a hook does nothing unless its observer overrides it

    async def after_step(self, record: StepRecord, due: Due) -> None:
        """`record` is complete."""
        return None  # a hook does nothing unless its observer overrides it

    async def at_end(self, record: StepRecord | None, stopped: bool) -> None:
        """The loop ended; `record`: the last step's (None when no step ran)."""
        return None  # a hook does nothing unless its observer overrides it


class Timing(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    def trained(self, step: int, done: Trained, t_wait: float, cpu: float) -> None:
        run, spans = self.run, self.run.spans
        run.state.clock.add("training", done.t2 - done.t0)
        spans.emit("wait", step=step, t0=round(t_wait, 6), t1=round(done.t0, 6), cpu=round(cpu, 6))
        spans.emit(
            "train",
            step=step,
            t0=round(done.t0, 6),
            t1=round(done.t1, 6),
            queued=run.buffer.queued,
            groups=[[g.epoch, g.prompt_index] for g in done.groups],
        )
        spans.emit(
            "publish", step=step, version=done.published.policy_version, t0=round(done.t1, 6), t1=round(done.t2, 6)
        )


class Flops(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    async def measure(self, record: StepRecord, done: Trained, due: Due) -> None:
        flops = self.run.state.flops
        flops.trainer_step(done.result.metrics)
        if due.engines:
            record.engine_flops_per_s, record.engine_peak_frac = flops.engines(await self.run.engine.stats())


class Records(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    async def after_step(self, record: StepRecord, due: Due) -> None:
        self.run.sink.write(record.to_dict())
        self.run.progress.update(record)


def consult(run: Run, line: dict[str, Any]) -> None:
    """Hand a metrics.jsonl line to the run doctor; show each pattern it sees for the first time."""
    if run.state.doctor is not None:
        for finding in run.state.doctor.observe(line):
            run.progress.log(f"[yellow]{escape(finding.line())}[/]")


class Doctoring(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    async def after_step(self, record: StepRecord, due: Due) -> None:
        consult(self.run, record.to_dict())

    async def at_end(self, record: StepRecord | None, stopped: bool) -> None:
        run = self.run
        if run.state.doctor is not None:  # groups scored after the last step: did the run wait for signal?
            for finding in run.state.doctor.finish(run.stats.vitals.take()):
                run.progress.log(f"[yellow]{escape(finding.line())}[/]")


class Evaluation(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    async def measure(self, record: StepRecord, done: Trained, due: Due) -> None:
        if due.eval:
            run, t_eval = self.run, now()
            record.eval_accuracy = await run.eval()
            run.state.clock.add(EVALUATION, now() - t_eval)
            run.spans.emit(
                "eval", step=record.step, t0=round(t_eval, 6), t1=round(now(), 6), accuracy=record.eval_accuracy
            )

    async def at_end(self, record: StepRecord | None, stopped: bool) -> None:
        if not stopped and record is not None and record.eval_accuracy is None:  # the stream ran out in between
            record.eval_accuracy = await self.run.eval()
            self.run.sink.write(record.final_eval())
            consult(self.run, record.final_eval())


class Checkpoints(StepObserver):
    def __init__(self, run: Run) -> None:
        self.run = run

    async def after_step(self, record: StepRecord, due: Due) -> None:
        if due.checkpoint:
            t_ckpt = now()
            await self.write(record.step)
            self.run.spans.emit("checkpoint", step=record.step, t0=round(t_ckpt, 6), t1=round(now(), 6))

    async def at_end(self, record: StepRecord | None, stopped: bool) -> None:
        every = self.run.cfg.checkpoint.every_steps
        if record is not None and every is not None and self.run.state.last_checkpoint != record.step:
            await self.write(record.step)

    async def write(self, step: int) -> None:
        with trainer_failure(self.run, step):  # the trainer may die while idle: its next call is this one
            await write_checkpoint(self.run, step)


def step_observers(run: Run) -> list[StepObserver]:
    """The learning loop's observers, in the order each hook is called (the module docstring)."""
    return [Timing(run), Flops(run), Records(run), Doctoring(run), Evaluation(run), Checkpoints(run)]


async def observe_step(observers: list[StepObserver], record: StepRecord, done: Trained, due: Due) -> None:
    """A step's record measured, then written and acted on."""
    for o in observers:
        await o.measure(record, done, due)
    for o in observers:
        await o.after_step(record, due)
