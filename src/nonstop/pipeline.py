"""The top-level asynchronous loop.

Processes: this orchestrator (asyncio), `runtime.num_engines` engine actors behind a
least-loaded pool, `trainer.ranks` trainer actors in lockstep (dispatch.py). Rollouts flow
engines -> orchestrator (scoring) -> buffer -> trainer ranks as small messages; weights flow
trainer rank 0 -> every engine through the weight transport only. The producer task runs beside the
learning loop below; the supervisor re-raises its failure, and a dead actor fails every
pending call at once, so the run ends with a message instead of a hang.

Faults: each engine sits behind a RestartingActor (heartbeat, restart, its prompts
re-submitted); a trainer failure ends the run with a message naming the last checkpoint,
from which `nonstop train --resume RUN_DIR` continues (see checkpoint.py and recovery.py).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Awaitable, Callable
from typing import Any

from nonstop.buffer import RolloutBuffer
from nonstop.checkpoint import Checkpoint
from nonstop.config import Config
from nonstop.dispatch import EnginePool, RankGroup
from nonstop.engine.worker import EngineWorker
from nonstop.ledger import Ledger
from nonstop.metrics import Clock, JsonlSink
from nonstop.progress import Progress
from nonstop.recovery import RunFailed, restore, write_checkpoint
from nonstop.rollout import Codec, RolloutStats, evaluate, produce
from nonstop.runtime import ActorBackend, ActorCallError, ActorDied, ActorHandle, Supervisor, make_backend
from nonstop.runtime.restart import RestartingActor, RestartStats
from nonstop.scorer import FunctionScorer, resolve_reward
from nonstop.tasks.data import PromptStream, TaskData, screen_prompts
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import TransportHandle


@dataclass
class Run:
    cfg: Config
    data: TaskData
    codec: Codec
    engine: EnginePool  # of RestartingActor
    trainer: RankGroup
    buffer: RolloutBuffer
    scorer: FunctionScorer
    clock: Clock
    stats: RolloutStats
    sink: JsonlSink
    progress: Progress
    stream: PromptStream
    ledger: Ledger
    run_dir: Path
    base_model: Path
    base_accuracy: float = 0.0
    first_step: int = 1
    last_checkpoint: int | None = None

    async def eval(self) -> float:
        return await evaluate(self.engine, self.data.eval, self.codec, self.cfg.rollout.max_new_tokens)


async def learn(run: Run) -> dict[str, Any]:
    """The learning loop: take a batch, train, publish, record, checkpoint. Returns the last record."""
    cfg, record = run.cfg, {}
    for step in range(run.first_step, cfg.run.max_steps + 1):
        groups = await run.buffer.take()
        if not groups:
            break  # the stream ran out (run.max_epochs) and every group was trained
        t0 = time.perf_counter()
        try:
            result = await run.trainer.call("step", groups)
        except (ActorDied, ActorCallError) as e:
            where = f"checkpoint step {run.last_checkpoint}" if run.last_checkpoint else "no checkpoint yet"
            raise RunFailed(f"the trainer failed at step {step}: {e}\nresume with `nonstop train --resume "
                            f"{run.run_dir}` ({where})") from e
        run.clock.add("training", time.perf_counter() - t0)
        outcome = "skipped_step" if result.metrics["skipped"] else "trained"
        for g in groups:
            run.ledger.settle(g.epoch, g.prompt_index, outcome)
        await run.buffer.step_done(result.policy_version)
        out_of_time = cfg.run.max_time_s is not None and run.clock.wall() >= cfg.run.max_time_s
        record = step_record(run, step, result.policy_version, groups, result.metrics)
        if step % cfg.run.eval_every == 0 or step == cfg.run.max_steps or out_of_time:
            record["eval_accuracy"] = await run.eval()
        run.sink.write(record)
        run.progress.update(record)
        if cfg.checkpoint.every_steps is not None and step % cfg.checkpoint.every_steps == 0:
            await write_checkpoint(run, step)
        if out_of_time:
            break
    if record and "eval_accuracy" not in record:  # the stream ran out between two evaluations
        record["eval_accuracy"] = await run.eval()
        run.sink.write({"step": record["step"], "policy_version": record["policy_version"],
                        "eval_accuracy": record["eval_accuracy"], "final_eval": True})
    if record and cfg.checkpoint.every_steps is not None and run.last_checkpoint != record["step"]:
        await write_checkpoint(run, record["step"])
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
        "prompts": [[g.epoch, g.prompt_index] for g in groups],
        **{k: v for k, v in metrics.items() if k != "samples"},
        "samples_trained": metrics["samples"], "samples_generated": run.stats.samples,
        "samples_per_s": run.stats.samples / wall if wall > 0 else 0.0,
        "generation_busy_s": round(busy["generation"], 3), "generation_idle_s": round(max(0.0, wall - busy["generation"]), 3),
        "training_busy_s": round(busy["training"], 3), "training_idle_s": round(max(0.0, wall - busy["training"]), 3),
        "engine_idle_frac": run.clock.idle_fraction("generation"), "trainer_idle_frac": run.clock.idle_fraction("training"),
        "drops": dict(run.buffer.drops), "reward_errors": dict(run.scorer.errors), "buffer_queued": run.buffer.queued,
        "engine_restarts": sum(len(e.stats.restarts) for e in run.engine.engines),
        "prompts_requeued": run.ledger.requeued + sum(e.stats.requeued for e in run.engine.engines),
        "engine_versions": list(run.engine.versions),
    }


def _names(role: str, count: int) -> list[str]:
    return [role] if count == 1 else [f"{role}-{i}" for i in range(count)]


def reachable_host(cfg: Config) -> str | None:
    """Where trainer rank 0 serves its group and the transport: loopback on one machine; on a
    running Ray cluster None, i.e. its node's IP, so actors on other machines reach it."""
    return None if cfg.runtime.backend == "ray" and cfg.runtime.ray_address is not None else "127.0.0.1"


async def spawn_engine(backend: ActorBackend, cfg: Config, weights: Path, tok: Any, i: int, version0: int = 0) -> ActorHandle:
    return await backend.spawn(_names("engine", cfg.runtime.num_engines)[i], EngineWorker, str(weights),
                               [tok.eos_token_id], tok.pad_token_id, cfg.run.seed + i, initial_version=version0,
                               settings=engine_settings(cfg))


async def spawn_trainers(backend: ActorBackend, cfg: Config, weights: Path, tok: Any,
                         reference_path: str | None = None, adapter_path: str | None = None) -> RankGroup:
    """The trainer rank actors; with several, they form their process group before returning."""
    ranks = await asyncio.gather(*(
        backend.spawn(n, TrainerWorker, str(weights), cfg.trainer, cfg.rollout.temperature, tok.pad_token_id,
                      cfg.run.seed, cfg.buffer.max_lag, cfg.buffer.reject, reference_path=reference_path,
                      total_steps=cfg.run.max_steps, lora=cfg.model.lora, adapter_path=adapter_path)
        for n in _names("trainer", cfg.trainer.ranks)))
    group = RankGroup(list(ranks))
    if len(ranks) > 1:
        addr, port = await group.lead.call("rendezvous", reachable_host(cfg))
        await asyncio.gather(*(t.call("join_group", addr, port, r, len(ranks), cfg.transport.connect_timeout_s)
                               for r, t in enumerate(ranks)))
    return group


async def connect_transport(cfg: Config, trainers: RankGroup, engines: list[ActorHandle]) -> TransportHandle:
    """Trainer rank 0 is transport rank 0; engine i is rank i + 1."""
    handle = await trainers.lead.call("plan_transport", cfg.transport, len(engines), reachable_host(cfg))
    await asyncio.gather(trainers.lead.call("connect_transport"),
                         *(e.call("connect_transport", handle, i + 1) for i, e in enumerate(engines)))
    return handle


async def train(cfg: Config, base_model: Path, data: TaskData, run_dir: Path, progress: Progress,
                resume: Checkpoint | None = None) -> dict[str, Any]:
    """Spawn the actors, connect the transport, run the producer beside `learn`, save the result.

    With `resume`, actors start from the checkpoint's weights and state, and the data cursor and
    ledger continue from it (prompts in flight at the checkpoint are generated again first)."""
    from nonstop.hf import load_tokenizer, max_positions

    weights = resume.model_dir if resume is not None else base_model
    lora = cfg.model.lora.enabled  # LoRA: engines always hold the base; adapters come by transport
    model_weights = base_model if lora else weights
    version0 = resume.state["policy_version"] if resume is not None else 0
    codec = Codec(load_tokenizer(str(weights)))
    tok = codec.tokenizer
    limit = cfg.task.max_prompt_tokens or max_positions(model_weights) - cfg.rollout.max_new_tokens
    long_prompts = screen_prompts(data, codec.encode, limit, cfg.task.on_bad_row)
    for problem in long_prompts[:10]:
        progress.log(f"[yellow]dataset:[/] {problem}; skipped")
    if len(long_prompts) > 10:
        progress.log(f"dataset: {len(long_prompts)} over-long prompts skipped in all")
    backend, supervisor = make_backend(cfg.runtime, run_dir), Supervisor()
    num_engines = cfg.runtime.num_engines

    try:
        progress.log(f"starting {num_engines} engine and {cfg.trainer.ranks} trainer actor(s) "
                     f"({cfg.runtime.backend} backend) ...")
        first_engines, trainer = await asyncio.gather(
            asyncio.gather(*(spawn_engine(backend, cfg, model_weights, tok, i, version0) for i in range(num_engines))),
            spawn_trainers(backend, cfg, model_weights, tok, str(base_model) if resume is not None else None,
                           adapter_path=str(weights) if resume is not None and lora else None),
        )
        if resume is not None:
            await trainer.call("load_checkpoint", str(resume.path))
        handle = await connect_transport(cfg, trainer, list(first_engines))

        def restarter(i: int) -> Callable[[], Awaitable[ActorHandle]]:
            async def restart_engine() -> ActorHandle:
                # A fresh engine starts from `weights` and applies the newest published version at its
                # first forward pass; a broadcast group cannot take a new member.
                if handle.kind == "broadcast":
                    raise ActorDied("the engine cannot be restarted with transport.kind 'broadcast' (use 'shm' or "
                                    f"'files'); resume with `nonstop train --resume {run_dir}`")
                actor = await spawn_engine(backend, cfg, model_weights, tok, i, version0)
                await actor.call("connect_transport", handle, i + 1)
                return actor
            return restart_engine

        engine = EnginePool([
            RestartingActor(a.name, restarter(i), cfg.runtime.max_engine_restarts,
                            cfg.runtime.heartbeat_interval_s, cfg.runtime.heartbeat_timeout_s,
                            count_items=lambda m, args: len(args[0]) if m == "generate" else 0,  # prompts
                            log=progress.log, actor=a)
            for i, a in enumerate(first_engines)])
        ledger = Ledger()
        buffer = RolloutBuffer(cfg.rollout.prompts_per_step, cfg.buffer.depth,
                               cfg.buffer.max_lag if cfg.buffer.reject == "group" else None, cfg.buffer.max_queued_groups,
                               ledger, refill=cfg.rollout.refill)
        run = Run(cfg, data, codec, engine, trainer, buffer,
                  FunctionScorer(resolve_reward(cfg.task.reward), cfg.task.reward_fail_fast), Clock(),
                  RolloutStats(), JsonlSink(run_dir / "metrics.jsonl"), progress,
                  PromptStream(data.train, cfg.run.seed, cfg.run.max_epochs), ledger, run_dir, base_model)
        if resume is not None:
            restore(run, resume)
        else:
            run.base_accuracy = await run.eval()
            progress.log(f"base policy held-out accuracy: {run.base_accuracy:.1%} on {len(data.eval)} prompts")
            run.clock = Clock()
        progress.base_eval = run.base_accuracy
        for e in engine.engines:
            supervisor.spawn(e.heartbeat(), name=f"{e.name}-heartbeat")
        supervisor.spawn(produce(engine, buffer, run.stream, run.scorer, codec, cfg.rollout, run.clock, run.stats,
                                 cfg.task.max_consecutive_reward_failures, ledger), name="producer")
        last = await supervisor.run(learn(run))
        run.sink.close()
        final_dir = run_dir / "final"
        await trainer.call("save", str(final_dir))
        tok.save_pretrained(final_dir)
        progress.stop()
        return {
            "base_accuracy": run.base_accuracy, "final_accuracy": last.get("eval_accuracy"),
            "steps": last.get("step", 0), "policy_version": last.get("policy_version", 0),
            "rl_wall_s": run.clock.wall(), "samples_generated": run.stats.samples,
            "samples_per_s": last.get("samples_per_s", 0.0),
            "engine_idle_frac": run.clock.idle_fraction("generation"),
            "trainer_idle_frac": run.clock.idle_fraction("training"),
            "drops": dict(buffer.drops), "reward_errors": dict(run.scorer.errors),
            "skipped_steps": last.get("skipped_steps", 0),
            "engines": await engine.call("stats"),
            "last_reward_error": run.scorer.last_error, "final_dir": str(final_dir),
            "prompts": ledger.report(),
            "engine_faults": RestartStats([r for e in engine.engines for r in e.stats.restarts],
                                          sum(e.stats.requeued for e in engine.engines)).summary(),
            "resumed_from": str(resume.path) if resume is not None else None,
            "last_checkpoint": run.last_checkpoint,
        }
    finally:
        progress.stop()
        await supervisor.close()
        await backend.shutdown()
