"""One training run, start to end: build it, run the producer beside the learning loop, summarize.

Processes: this orchestrator (asyncio), `runtime.num_engines` engine actors behind a
least-loaded pool, `trainer.ranks` trainer actors in lockstep (dispatch.py), all reached through
typed clients (nonstop.clients). Rollouts flow engines -> orchestrator (generate.py, the
scoring stage) -> buffer (buffer.py) -> trainer ranks (learn.py, step.py) as small messages;
weights flow trainer rank 0 -> every engine through the weight transport only, when the learning
loop publishes. What the run's mode starts (its producer; run.py `RunMode`, chosen in build.py)
runs beside the learning loop (`start_beside`); the supervisor re-raises its failure, and a dead
actor fails every pending call at once, so the run ends with a message instead of a hang. The
mode is opened after the base evaluation, finished after the last step, saves its own final
weights beside RUN_DIR/final, gives its fields to summary.json and is closed however the run ended.

Faults: each engine sits behind a RestartingEngine (heartbeat, restart, its prompts
re-submitted); a trainer failure ends the run with a message naming the last checkpoint,
from which `nonstop train --resume RUN_DIR` continues (see checkpoint.py and recovery.py).

Stopping: once the actors run, the first Ctrl-C (or SIGTERM) asks the learning loop to end
after the step under way and write a checkpoint, then the run ends with RunInterrupted naming
it; a second one stops at once (KeyboardInterrupt). Either way the actors are stopped and the
transports (the run's and its mode's) released.
"""

from __future__ import annotations

import asyncio
import gc
import signal
import time
from collections.abc import Callable
from pathlib import Path

from nonstop.checkpoint import Checkpoint
from nonstop.config import Config
from nonstop.errors import RunInterrupted
from nonstop.observe.clock import Clock
from nonstop.observe.doctor import Context, Doctor, read_records
from nonstop.observe.spans import host_cpus, now
from nonstop.orchestrator.build import build_run
from nonstop.orchestrator.grow import start_joins
from nonstop.orchestrator.learn import learn
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.records import RunSummary, StepRecord
from nonstop.orchestrator.recovery import restore, restore_engines
from nonstop.orchestrator.run import Run
from nonstop.runtime import Supervisor, make_backend
from nonstop.runtime.restart import RestartStats
from nonstop.scoring.rewards import RewardFn
from nonstop.tasks.data import TaskData
from nonstop.transport import release


async def train(
    cfg: Config,
    base_model: Path,
    data: TaskData,
    run_dir: Path,
    progress: Progress,
    resume: Checkpoint | None = None,
    reward: RewardFn | None = None,
    started_s: float | None = None,
) -> RunSummary:
    """Spawn the actors, connect the transport, run the producer beside `learn`, save the result.

    With `resume`, actors start from the checkpoint's weights and state, and the data cursor and
    ledger continue from it (prompts in flight at the checkpoint are generated again first).
    `reward`, when given, is the reward function instead of task.reward. `started_s`: when the
    command started (time.perf_counter()), which run.max_total_s counts from (None: now)."""
    started_s = time.perf_counter() if started_s is None else started_s
    backend, supervisor = make_backend(cfg.runtime, run_dir), Supervisor()
    run: Run | None = None
    restore_signals: Callable[[], None] = _nothing
    try:
        run = await build_run(cfg, backend, base_model, data, run_dir, progress, resume, reward)
        restore_signals = stop_on_signals(run)
        # What set-up left alive (task rows, tokenizer, configs: about 400k objects) leaves the
        # collector's reach: each full collection scanned it all, stopping the event loop and the
        # reward threads for 200-300 ms, about every 2 s of the run. Before the RL clock starts.
        gc.collect()
        gc.freeze()
        await begin(run, resume, started_s)
        await run.mode.open(run)  # after the base evaluation: what it serves sees the policy the run trains
        pools = getattr(backend, "pools", None)  # the local backend's CPU pools (runtime/pinning.py)
        if pools is not None:
            pools.start()
        start_beside(run, supervisor)
        last = await supervisor.run(learn(run))
        if run.state.stop.is_set():
            raise interrupted(run, last)
        await run.mode.finish()
        run.sink.close()
        run.spans.close()
        final_dir = run_dir / "final"
        await run.trainer.save(str(final_dir))
        run.codec.tokenizer.save_pretrained(final_dir)
        await run.mode.save_final(run)
        progress.stop()
        summary = await summarize(run, last, final_dir, resume)
        summary.pools = pools.report() if pools is not None else None
        return summary
    finally:
        gc.unfreeze()  # what set-up left becomes collectable again (a process may run more than one training)
        restore_signals()
        progress.stop()
        await supervisor.close()
        if run is not None:
            await run.mode.close()
            await run.scorer.close()
        await backend.shutdown()
        handles = [run.transport] if run is not None and run.transport is not None else []
        handles += run.mode.transports() if run is not None else []
        if any([release(h) for h in handles]):
            progress.log("[yellow]released the shared-memory weight segment of a trainer that died[/]")


def start_beside(run: Run, supervisor: Supervisor) -> None:
    """What runs beside the shared policy's learning loop, under `supervisor` (its first failure
    ends the run): every engine's heartbeat, the engines that may join (grow.py), and what the
    run's mode starts (its producer, and whatever else it runs beside the loop). Call it after
    `begin` (and the mode's `open`)."""
    for e in run.engines:
        supervisor.spawn(e.heartbeat(), name=f"{e.name}-heartbeat")
    start_joins(run, supervisor)  # engines past runtime.num_engines, as nodes with room join
    run.mode.start(run, supervisor)


def _nothing() -> None:
    """What `train` restores when it had set no signal handler yet."""


def stop_on_signals(run: Run) -> Callable[[], None]:
    """First SIGINT/SIGTERM: set run.state.stop; second: cancel this task, which ends as a
    KeyboardInterrupt. Returns the function that puts the previous handlers back (a no-op where
    the loop cannot take signals: not the main thread)."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal() -> None:
        if not run.state.stop.is_set():
            run.state.stop.set()
            run.progress.log(
                "[yellow]stopping after this step and writing a checkpoint (Ctrl-C again to stop at once)[/]"
            )
        elif task is not None:
            task.cancel("stop at once")

    try:
        for sig in previous:
            loop.add_signal_handler(sig, on_signal)
    except (RuntimeError, ValueError, NotImplementedError):
        return _nothing

    def restore() -> None:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)

    return restore


def interrupted(run: Run, last: StepRecord | None) -> RunInterrupted:
    ckpt = run.state.last_checkpoint
    where = (
        f"checkpoint step {ckpt} written; resume with `nonstop train --resume {run.run_dir}`"
        if ckpt is not None
        else "no checkpoint (checkpoint.every_steps is null, or no step had finished)"
    )
    return RunInterrupted(f"stopped at step {last.step if last else 0} on request; {where}")


FINISH_RESERVE_S = 10.0
"""What run.max_total_s keeps back for the save and the shutdown, besides the final evaluation."""


def rl_time_limit(
    max_time_s: float | None, max_total_s: float | None, elapsed_s: float, wall_s: float, eval_s: float = 0.0
) -> float | None:
    """The RL clock's limit: run.max_time_s, or what run.max_total_s leaves after `elapsed_s` of the
    command, less the final evaluation (`eval_s`: as long as the base evaluation took; a loaded
    model's 60 greedy completions take tens of seconds) and FINISH_RESERVE_S, whichever comes first;
    `wall_s`: the RL clock now (a resumed run's continues)."""
    if max_total_s is None:
        return max_time_s
    left = wall_s + max(max_total_s - elapsed_s - eval_s - FINISH_RESERVE_S, 0.0)
    return left if max_time_s is None else min(max_time_s, left)


async def begin(run: Run, resume: Checkpoint | None, started_s: float | None = None) -> None:
    """Resume the orchestrator's state, or measure the base policy and start the RL clock; set the
    RL clock's limit (run.max_time_s, and what run.max_total_s leaves since `started_s`); start the
    run doctor (on resume, from the records up to the checkpoint)."""
    eval_s = 0.0  # a resumed session has no base evaluation to time: its reserve is FINISH_RESERVE_S
    if resume is not None:
        restore(run, resume)
        await restore_engines(run, resume)
    else:
        t_eval = time.perf_counter()
        run.state.base_accuracy = await run.eval()
        eval_s = time.perf_counter() - t_eval
        how = "" if run.held_out is None or run.held_out.samples == 1 else f" (mean@{run.held_out.samples})"
        n = len(run.data.eval)
        run.progress.log(f"base policy held-out {run.eval_metric}{how}: {run.state.base_accuracy:.1%} on {n} prompts")
        run.state.clock = Clock()
    total, wall = run.cfg.run.max_total_s, run.state.clock.wall()
    elapsed_s = time.perf_counter() - started_s if started_s is not None else 0.0
    run.state.max_rl_s = rl_time_limit(run.cfg.run.max_time_s, total, elapsed_s, wall, eval_s)
    if total is not None and run.state.max_rl_s is not None:
        run.progress.log(f"RL time: {run.state.max_rl_s - wall:.0f} s (what run.max_total_s={total:g} leaves)")
    run.state.doctor = Doctor(run.cfg.doctor, Context.of(run.cfg.model_dump()), run.state.base_accuracy)
    if resume is not None:
        for record in read_records(run.run_dir / "metrics.jsonl", upto_step=run.state.first_step - 1):
            run.state.doctor.observe(record)  # reported in the session that first saw them
    run.spans.emit(
        "rl_start",
        t=round(now(), 6),
        resumed=resume is not None,
        base_accuracy=run.state.base_accuracy,
        **host_cpus(run.cfg),
    )
    run.progress.base_eval = run.state.base_accuracy
    run.progress.metric = run.eval_metric


async def summarize(run: Run, last: StepRecord | None, final_dir: Path, resume: Checkpoint | None) -> RunSummary:
    clock = run.state.clock
    engines = run.engines + run.mode.engines()  # the mode's own engines too
    fields = await run.mode.summary(run)  # the mode's own fields (final scores of its policies too)
    engine_stats = await run.engine.stats()
    weights = None
    if run.cfg.transport.checksum:  # end to end: what each engine decodes with against the trainer's weights
        trainer_crc, engine_crcs = await asyncio.gather(run.trainer.weights_crc32(), run.engine.weights_crc32())
        weights = {"trainer": list(trainer_crc), "engines": [list(d) for d in engine_crcs]}
    return RunSummary(
        eval_metric=run.eval_metric,
        eval_samples=run.held_out.samples if run.held_out is not None else 1,
        eval_reward_failures=run.held_out.failures if run.held_out is not None else 0,
        base_accuracy=run.state.base_accuracy,
        final_accuracy=last.eval_accuracy if last else None,
        steps=last.step if last else 0,
        policy_version=last.policy_version if last else 0,
        rl_wall_s=clock.wall(),
        samples_generated=run.stats.samples,
        samples_per_s=last.samples_per_s if last else 0.0,
        engine_idle_frac=clock.idle_fraction("generation"),
        trainer_idle_frac=clock.idle_fraction("training"),
        drops=dict(run.buffer.drops),
        reward_errors=dict(run.scorer.errors),
        skipped_steps=last.skipped_steps if last else 0,
        engines=engine_stats,
        last_reward_error=run.scorer.last_error,
        final_dir=str(final_dir),
        prompts=run.ledger.report(),
        engine_faults=RestartStats(
            [r for e in engines for r in e.faults.restarts], sum(e.faults.requeued for e in engines)
        ).summary(),
        resumed_from=str(resume.path) if resume is not None else None,
        last_checkpoint=run.state.last_checkpoint,
        run_dir=str(run.run_dir),
        flops=run.state.flops.summary(engine_stats),
        doctor=run.state.doctor.report() if run.state.doctor is not None else None,
        weights_crc32=weights,
        engine_joins=list(run.state.joins),
        **fields,
    )
