"""The learning loop and recovery on a real run: an engine and a trainer actor in their own
processes, built and started as `pipeline.train` does (build_run, begin, start_beside), with the
single-turn producer filling the buffer while `learn()` trains.

- learn(): each step publishes the next policy_version and tells the buffer; every taken group
  is settled once, as 'trained'; every draw is settled or still in flight;
- write_checkpoint then resume: a fresh run restored from the checkpoint has the first run's
  ledger, data cursor (its in-flight prompts first), counters, clock and trainer state, and
  trains on from the next step and version;
- a trainer that dies ends the run with RunFailed naming the resume command and the last
  checkpoint, and the batch it held is settled by nobody (it is generated again on resume);
- run.eval_pauses_generation: at depth 0 the next batch is admitted only once the step's
  evaluation ended (and, without it, before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from nonstop.checkpoint import Checkpoint, latest_valid
from nonstop.config import Config, load_config
from nonstop.orchestrator.build import build_run
from nonstop.orchestrator.learn import learn
from nonstop.orchestrator.pipeline import begin, start_beside
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.records import StepRecord
from nonstop.orchestrator.recovery import RunFailed, write_checkpoint
from nonstop.orchestrator.run import Run
from nonstop.orchestrator.step import train_step
from nonstop.runtime import Supervisor, make_backend
from nonstop.tasks.data import PromptStream, TaskData, load_task
from nonstop.transport import release
from support.rewards import length_reward

PROMPTS_PER_STEP = 4


def config(tiny_dir: Path, out_dir: Path, max_steps: int, *more: str) -> Config:
    return load_config(
        None,
        [
            f"model.path={tiny_dir}",
            "warmup.enabled=false",
            "run.progress=off",
            f"run.out_dir={out_dir}",
            f"run.max_steps={max_steps}",
            "run.max_time_s=null",
            "run.eval_every=100",
            "checkpoint.every_steps=null",  # the tests write their checkpoints themselves
            "task.max_operand=9",
            "task.eval_size=8",
            f"rollout.prompts_per_step={PROMPTS_PER_STEP}",
            "rollout.group_size=3",
            "rollout.max_new_tokens=4",
            "rollout.filter_uniform_reward=false",
            *more,
        ],
    )


@contextlib.asynccontextmanager
async def running(
    cfg: Config, base_model: Path, data: TaskData, run_dir: Path, resume: Checkpoint | None = None
) -> AsyncIterator[Run]:
    """A run built as pipeline.train builds it; its actors stopped and its transport released on exit."""
    backend = make_backend(cfg.runtime, run_dir)
    run = None
    try:
        progress = Progress("off", cfg.run.max_steps)
        run = await build_run(cfg, backend, base_model, data, run_dir, progress, resume, reward=length_reward)
        await begin(run, resume)
        yield run
    finally:
        if run is not None:
            await run.scorer.close()
        await backend.shutdown()
        if run is not None and run.transport is not None:
            release(run.transport)


async def learn_beside_producer(run: Run) -> StepRecord | None:
    """learn() with the producer and the engine heartbeats beside it; both stop when it returns."""
    supervisor = Supervisor()
    start_beside(run, supervisor)
    return await supervisor.run(learn(run))


def draws(stream: PromptStream, n: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(n):
        d = stream.next()
        assert d is not None
        out.append((d.epoch, d.example.index))
    return out


@pytest.fixture(scope="module")
def trained(tiny_dir, tmp_path_factory) -> SimpleNamespace:
    """Two steps of learn(), then (producer stopped) a checkpoint of step 2 and the state it saved."""
    out_dir = tmp_path_factory.mktemp("learn")
    cfg = config(tiny_dir, out_dir, max_steps=2)
    data = load_task(cfg.task)
    run_dir = out_dir / "a"
    run_dir.mkdir()

    async def go() -> SimpleNamespace:
        async with running(cfg, tiny_dir, data, run_dir) as run:
            last = await learn_beside_producer(run)
            run.sink.close()
            await write_checkpoint(run, 2)
            return SimpleNamespace(
                run=run,
                last=last,
                data=data,
                run_dir=run_dir,
                records=[json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
                ledger=run.ledger.state_dict(),
                in_flight=[(d.epoch, d.example.index) for d in run.ledger.pending()],
                stream=run.stream.state_dict(),
                stats=run.stats.counters(),
                drops=dict(run.buffer.drops),
                reward_errors=dict(run.scorer.errors),
                busy_s=dict(run.state.clock.busy_s),
            )

    return asyncio.run(go())


def test_learn_publishes_each_step_and_settles_every_taken_group_once(trained):
    run, recs = trained.run, trained.records
    assert trained.last is not None and trained.last.step == 2 and trained.last.policy_version == 2
    assert [(r["step"], r["policy_version"]) for r in recs] == [(1, 1), (2, 2)]
    # step_done after each publish: the buffer counts admission and lag from the published version
    assert run.buffer.policy_version == 2 and run.buffer.steps_trained == 2
    taken = [tuple(p) for r in recs for p in r["prompts"]]
    assert len(taken) == 2 * PROMPTS_PER_STEP and len(set(taken)) == len(taken)
    for r in recs:  # the trainer sees each batch sorted, whatever order the groups arrived in
        assert r["prompts"] == sorted(r["prompts"])
    ledger = run.ledger
    assert sorted(k for k, o in ledger.outcomes.items() if o == "trained") == sorted(taken)
    assert ledger.duplicated_settlements == 0 and ledger.unknown_settlements == 0 and ledger.duplicated_draws == 0
    # every draw is settled (trained, or dropped by the buffer) or still in flight, never lost
    assert len(ledger.outcomes) + len(ledger.in_flight) == run.stats.prompts
    assert set(ledger.outcomes.values()) <= {"trained", "max_lag"}
    assert run.state.clock.busy_s["training"] > 0


def test_a_run_resumed_from_a_checkpoint_has_its_state_and_trains_on(trained, tiny_dir, tmp_path):
    cfg = config(tiny_dir, tmp_path, max_steps=3)
    ckpt = latest_valid(trained.run_dir / "checkpoints")
    assert ckpt.state["step"] == 2 and ckpt.state["policy_version"] == 2
    base = Path(ckpt.state["base_model"])
    assert base == tiny_dir

    async def go() -> StepRecord | None:
        async with running(cfg, base, trained.data, trained.run_dir, resume=ckpt) as run:
            assert run.ledger.outcomes == {(e, i): o for e, i, o in trained.ledger["outcomes"]}
            assert not run.ledger.in_flight
            assert run.ledger.requeued == trained.ledger["requeued"] + len(trained.in_flight)
            # the data cursor: the prompts in flight at the checkpoint first, then where the first run was
            first = PromptStream(trained.data.train, cfg.run.seed, cfg.run.max_epochs)
            first.load_state_dict(trained.stream)
            resumed = PromptStream(trained.data.train, cfg.run.seed, cfg.run.max_epochs)
            resumed.load_state_dict(run.stream.state_dict())
            n = len(trained.in_flight)
            assert draws(resumed, n + 6) == trained.in_flight + draws(first, 6)
            assert run.stats.counters() == trained.stats and dict(run.buffer.drops) == trained.drops
            assert dict(run.scorer.errors) == trained.reward_errors
            assert run.buffer.policy_version == 2
            assert run.state.first_step == 3 and run.state.last_checkpoint == 2
            assert run.state.base_accuracy == trained.run.state.base_accuracy
            assert run.state.clock.busy_s == trained.busy_s
            assert run.state.clock.wall() >= ckpt.state["clock"]["wall_s"] > 0  # the RL clock goes on
            last = await learn_beside_producer(run)
            run.sink.close()
            return last

    last = asyncio.run(go())
    assert last is not None and last.step == 3 and last.policy_version == 3  # the trainer's version came back


def test_a_dead_trainer_ends_the_run_naming_how_to_resume_and_settles_nothing(trained, tiny_dir, tmp_path):
    cfg = config(tiny_dir, tmp_path, max_steps=3)
    ckpt = latest_valid(trained.run_dir / "checkpoints")

    async def go() -> None:
        async with running(cfg, tiny_dir, trained.data, trained.run_dir, resume=ckpt) as run:
            trained_before = sum(o == "trained" for o in run.ledger.outcomes.values())
            for rank in run.trainer.ranks:  # a real SIGKILL of the trainer's process
                await rank.kill()
            with pytest.raises(RunFailed) as failed:
                await learn_beside_producer(run)
            message = str(failed.value)
            assert "the trainer failed at step 3" in message
            assert f"resume with `nonstop train --resume {trained.run_dir}` (checkpoint step 2)" in message
            # the batch it held stays in flight: nothing more trained, no version published
            assert sum(o == "trained" for o in run.ledger.outcomes.values()) == trained_before
            assert run.buffer.policy_version == 2 and run.buffer.steps_trained == 0
            # an own policy's loop goes through the same step and says whose trainer failed
            with pytest.raises(RunFailed) as failed:
                await train_step(run, run.trainer, run.buffer, [], 1, policy="b")
            message = str(failed.value)
            assert message.startswith("the trainer of policy 'b' failed at its step 1: ")
            assert f"\nresume with `nonstop train --resume {trained.run_dir}` (checkpoint step 2)" in message

    asyncio.run(go())


def test_rl_time_limit_is_what_the_total_budget_leaves():
    """run.max_total_s: RL gets what preparing the run left, less the finish reserve, at most
    run.max_time_s; a resumed run's RL clock continues from where it was."""
    from nonstop.orchestrator.pipeline import FINISH_RESERVE_S, rl_time_limit

    assert rl_time_limit(190.0, None, 50.0, 0.0) == 190.0 and rl_time_limit(None, None, 50.0, 0.0) is None
    assert rl_time_limit(None, 300.0, 100.0, 0.0) == 200.0 - FINISH_RESERVE_S
    assert rl_time_limit(150.0, 300.0, 100.0, 0.0) == 150.0
    assert rl_time_limit(None, 300.0, 100.0, 40.0) == 240.0 - FINISH_RESERVE_S
    assert rl_time_limit(None, 60.0, 100.0, 0.0) == 0.0  # nothing left: one step, then the end
    # the final evaluation is kept back as long as the base evaluation took
    assert rl_time_limit(None, 300.0, 100.0, 0.0, eval_s=30.0) == 170.0 - FINISH_RESERVE_S
    assert rl_time_limit(120.0, 300.0, 100.0, 0.0, eval_s=30.0) == 120.0


@pytest.mark.parametrize("pause", [True, False], ids=["paused", "not_paused"])
def test_a_step_that_evaluates_admits_the_next_batch_after_its_evaluation(tiny_dir, tmp_path, pause):
    sets = ["buffer.depth=0", "run.eval_every=1", f"run.eval_pauses_generation={str(pause).lower()}"]
    cfg = config(tiny_dir, tmp_path, 2, *sets)
    data = load_task(cfg.task)
    run_dir = tmp_path / "r"
    run_dir.mkdir()

    async def go() -> None:
        async with running(cfg, tiny_dir, data, run_dir) as run:
            await learn_beside_producer(run)
            run.spans.close()

    asyncio.run(go())
    spans = [json.loads(line) for line in (run_dir / "spans" / "orchestrator.jsonl").read_text().splitlines()]
    first_eval = next(e for e in spans if e.get("ev") == "eval" and e["step"] == 1)
    admitted = sorted(g["t_admit"] for g in spans if g.get("ev") == "group")
    later = admitted[PROMPTS_PER_STEP:]  # depth 0, every group kept: the first batch is the first 4 admitted
    assert later
    if pause:
        assert min(later) >= first_eval["t1"]
    else:  # admitted when step 1 published, before its evaluation ended
        assert min(later) < first_eval["t1"]
