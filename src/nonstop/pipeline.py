"""The top-level asynchronous loop.

Processes: this orchestrator (asyncio), `runtime.num_engines` engine actors behind a
least-loaded pool, `trainer.ranks` trainer actors in lockstep (dispatch.py). Rollouts flow
engines -> orchestrator (scoring) -> buffer -> trainer ranks as small messages; weights flow
trainer rank 0 -> every engine through the weight transport only. The producer task runs beside the
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
from nonstop.dispatch import EnginePool, RankGroup
from nonstop.engine.worker import EngineWorker
from nonstop.metrics import Clock, JsonlSink
from nonstop.progress import Progress
from nonstop.rollout import Codec, RolloutStats, evaluate, produce
from nonstop.runtime import ActorBackend, Supervisor, make_backend
from nonstop.scorer import FunctionScorer, resolve_reward
from nonstop.tasks.data import PromptStream, TaskData
from nonstop.trainer.worker import TrainerWorker


@dataclass
class Run:
    cfg: Config
    data: TaskData
    codec: Codec
    engine: EnginePool
    trainer: RankGroup
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
        "engine_versions": list(run.engine.versions),
    }


def _names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


async def start_actors(backend: ActorBackend, cfg: Config, base_model: Path, tok: Any) -> tuple[EnginePool, RankGroup]:
    """Spawn the engines and the trainer ranks, form the ranks' group, connect the transport
    (trainer rank 0 is transport rank 0, engine i is rank i + 1)."""
    rt = cfg.runtime
    spawns = [backend.spawn(n, EngineWorker, str(base_model), [tok.eos_token_id], tok.pad_token_id, cfg.run.seed + i)
              for i, n in enumerate(_names("engine", rt.num_engines))]
    spawns += [backend.spawn(n, TrainerWorker, str(base_model), cfg.trainer, cfg.rollout.temperature,
                             tok.pad_token_id, cfg.run.seed, cfg.buffer.max_lag, cfg.buffer.reject)
               for n in _names("trainer", cfg.trainer.ranks)]
    actors = await asyncio.gather(*spawns)
    engines, trainers = EnginePool(actors[:rt.num_engines]), RankGroup(actors[rt.num_engines:])
    # Actors on other machines reach rank 0 / the transport at its node's address; else loopback.
    host = None if rt.backend == "ray" and rt.ray_address is not None else "127.0.0.1"
    if len(trainers.ranks) > 1:
        addr, port = await trainers.lead.call("rendezvous", host)
        await asyncio.gather(*(t.call("join_group", addr, port, r, len(trainers.ranks), cfg.transport.connect_timeout_s)
                               for r, t in enumerate(trainers.ranks)))
    handle = await trainers.lead.call("plan_transport", cfg.transport, rt.num_engines, host)
    await asyncio.gather(trainers.lead.call("connect_transport"),
                         *(e.call("connect_transport", handle, i + 1) for i, e in enumerate(engines.engines)))
    return engines, trainers


async def train(cfg: Config, base_model: Path, data: TaskData, run_dir: Path, progress: Progress) -> dict[str, Any]:
    """Spawn the actors, connect the transport, run the producer beside `learn`, save the result."""
    from nonstop.hf import load_tokenizer

    codec = Codec(load_tokenizer(str(base_model)))
    tok = codec.tokenizer
    backend, supervisor = make_backend(cfg.runtime, run_dir), Supervisor()
    try:
        progress.log(f"starting {cfg.runtime.num_engines} engine and {cfg.trainer.ranks} trainer actor(s) "
                     f"({cfg.runtime.backend} backend) ...")
        engine, trainer = await start_actors(backend, cfg, base_model, tok)
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
            "engines": await engine.call("stats"),
            "last_reward_error": run.scorer.last_error, "final_dir": str(final_dir),
        }
    finally:
        progress.stop()
        await supervisor.close()
        await backend.shutdown()
