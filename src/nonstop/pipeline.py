"""The top-level asynchronous loop.

Processes: this orchestrator (asyncio), one engine actor, one trainer actor. Rollouts flow
engine -> orchestrator (scoring) -> buffer -> trainer as small messages; weights flow
trainer -> engine through the weight transport only. The producer task runs beside the
learning loop below; the supervisor re-raises its failure, and a dead actor fails every
pending call at once, so the run ends with a message instead of a hang.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nonstop.buffer import RolloutBuffer
from nonstop.config import Config
from nonstop.engine.worker import EngineWorker
from nonstop.metrics import Clock, JsonlSink
from nonstop.progress import Progress
from nonstop.rollout import Codec, RolloutStats, evaluate, produce
from nonstop.runtime import ActorHandle, Supervisor, make_backend
from nonstop.scorer import FunctionScorer, resolve_reward
from nonstop.tasks.data import PromptStream, TaskData
from nonstop.trainer.worker import TrainerWorker


@dataclass
class Run:
    cfg: Config
    data: TaskData
    codec: Codec
    engine: ActorHandle
    trainer: ActorHandle
    buffer: RolloutBuffer
    scorer: FunctionScorer
    clock: Clock
    stats: RolloutStats
    sink: JsonlSink
    progress: Progress

    async def eval(self) -> float:
        return await evaluate(self.engine, self.data.eval, self.codec, self.cfg.rollout.max_new_tokens)


async def learn(run: Run) -> dict[str, Any]:
    """The learning loop: take a batch, train, publish, record. Returns the last record."""
    cfg, record = run.cfg, {}
    for step in range(1, cfg.run.max_steps + 1):
        groups = await run.buffer.take()
        t0 = time.perf_counter()
        result = await run.trainer.call("step", groups)
        run.clock.add("training", time.perf_counter() - t0)
        await run.buffer.step_done(result.policy_version)
        out_of_time = cfg.run.max_time_s is not None and run.clock.wall() >= cfg.run.max_time_s
        record = step_record(run, step, result.policy_version, groups, result.metrics)
        if step % cfg.run.eval_every == 0 or step == cfg.run.max_steps or out_of_time:
            record["eval_accuracy"] = await run.eval()
        run.sink.write(record)
        run.progress.update(record)
        if out_of_time:
            break
    return record


def engine_settings(cfg: Config):
    """The engine section with group_cancel's lag bound defaulting to the buffer's."""
    if cfg.engine.max_lag is not None:
        return cfg.engine
    return cfg.engine.model_copy(update={"max_lag": cfg.buffer.max_lag})


def step_record(run: Run, step: int, version: int, groups: list, metrics: dict[str, Any]) -> dict[str, Any]:
    wall = run.clock.wall()
    rewards = [s.reward for g in groups for s in g.samples]
    busy = run.clock.busy_s
    return {
        "step": step, "policy_version": version, "time_s": round(wall, 3),
        "reward_mean": sum(rewards) / max(len(rewards), 1),
        **{k: v for k, v in metrics.items() if k != "samples"},
        "samples_trained": metrics["samples"], "samples_generated": run.stats.samples,
        "samples_per_s": run.stats.samples / wall if wall > 0 else 0.0,
        "generation_busy_s": round(busy["generation"], 3), "generation_idle_s": round(max(0.0, wall - busy["generation"]), 3),
        "training_busy_s": round(busy["training"], 3), "training_idle_s": round(max(0.0, wall - busy["training"]), 3),
        "engine_idle_frac": run.clock.idle_fraction("generation"), "trainer_idle_frac": run.clock.idle_fraction("training"),
        "drops": dict(run.buffer.drops), "reward_errors": dict(run.scorer.errors), "buffer_queued": run.buffer.queued,
    }


async def train(cfg: Config, base_model: Path, data: TaskData, run_dir: Path, progress: Progress) -> dict[str, Any]:
    """Spawn the actors, connect the transport, run the producer beside `learn`, save the result."""
    from nonstop.hf import load_tokenizer

    codec = Codec(load_tokenizer(str(base_model)))
    tok = codec.tokenizer
    backend, supervisor = make_backend(cfg.runtime), Supervisor()
    try:
        progress.log("starting engine and trainer processes ...")
        engine, trainer = await asyncio.gather(
            backend.spawn("engine", EngineWorker, str(base_model), [tok.eos_token_id], tok.pad_token_id, cfg.run.seed,
                          engine_settings(cfg)),
            backend.spawn("trainer", TrainerWorker, str(base_model), cfg.trainer, cfg.rollout.temperature,
                          tok.pad_token_id, cfg.run.seed, cfg.buffer.max_lag, cfg.buffer.reject),
        )
        handle = await trainer.call("plan_transport", cfg.transport, 1)
        await asyncio.gather(trainer.call("connect_transport"), engine.call("connect_transport", handle, 1))
        buffer = RolloutBuffer(cfg.rollout.prompts_per_step, cfg.buffer.depth,
                               cfg.buffer.max_lag if cfg.buffer.reject == "group" else None, cfg.buffer.max_queued_groups)
        run = Run(cfg, data, codec, engine, trainer, buffer, FunctionScorer(resolve_reward(cfg.task.reward)), Clock(),
                  RolloutStats(), JsonlSink(run_dir / "metrics.jsonl"), progress)
        base_accuracy = await run.eval()
        progress.base_eval = base_accuracy
        progress.log(f"base policy held-out accuracy: {base_accuracy:.1%} on {len(data.eval)} prompts")
        run.clock = Clock()
        stream = PromptStream(data.train, cfg.run.seed)
        supervisor.spawn(produce(engine, buffer, stream, run.scorer, codec, cfg.rollout, run.clock, run.stats,
                                 cfg.task.max_consecutive_reward_failures), name="producer")
        last = await supervisor.run(learn(run))
        run.sink.close()
        final_dir = run_dir / "final"
        await trainer.call("save", str(final_dir))
        tok.save_pretrained(final_dir)
        progress.stop()
        return {
            "base_accuracy": base_accuracy, "final_accuracy": last.get("eval_accuracy"),
            "steps": last.get("step", 0), "policy_version": last.get("policy_version", 0),
            "rl_wall_s": run.clock.wall(), "samples_generated": run.stats.samples,
            "samples_per_s": last.get("samples_per_s", 0.0),
            "engine_idle_frac": run.clock.idle_fraction("generation"),
            "trainer_idle_frac": run.clock.idle_fraction("training"),
            "drops": dict(buffer.drops), "reward_errors": dict(run.scorer.errors),
            "skipped_steps": last.get("skipped_steps", 0),
            "last_reward_error": run.scorer.last_error, "final_dir": str(final_dir),
        }
    finally:
        progress.stop()
        await supervisor.close()
        await backend.shutdown()
