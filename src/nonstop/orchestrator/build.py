"""Building a run: spawn the actors, connect the weight transport, wire the stages together.

`build_run(...)` returns a `Run` (run.py): the fixed wiring of one training run (config, data,
the engine pool and the trainer rank group as typed clients, buffer, scorer, prompt stream and
ledger, metrics sink, the run's mode) and its small mutable `RunState`, which resume
(recovery.py) and the learning loop (learn.py) update.

`build_mode(...)` is the one place that chooses the run's mode (run.py `RunMode`,
orchestrator/modes/) from the config: groups from the task, episodes from an environment (with
env.policies, roles on policies of their own), or agents over the API around either; nothing
after it names a mode.

Wiring: `runtime.num_engines` engine actors, each behind a RestartingEngine whose replacement
starts from the same weights and attaches to the same transport, behind one least-loaded
EnginePool; `trainer.ranks` trainer actors in one RankGroup (actors.py starts them). Trainer
rank 0 is transport rank 0; engine i is rank i + 1. With `runtime.max_engines`, `Run.join(i)`
starts engine i >= num_engines the same way, for grow.py to add to the pool once it runs. With
env.policies, each role with its own policy gets its own actors, transport and buffer
(modes/own_policies/policy_build.py), all settling through one ledger split into parts. Before
any actor starts, prompts too long for the model are skipped (`screen`) and the scoring stage is built, so a bad
reward name fails first.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from nonstop.checkpoint import Checkpoint
from nonstop.clients import EngineClient
from nonstop.config import Config
from nonstop.hf import load_tokenizer, max_positions
from nonstop.observe.consumed import DROPPED
from nonstop.observe.spans import SpanLog
from nonstop.observe.tracking import open_sinks
from nonstop.orchestrator.actors import connect_transport, engine_restarter, span_file, spawn_engine, spawn_trainers
from nonstop.orchestrator.buffer import RolloutBuffer, make_buffer
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.generate import RolloutStats
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.api_agents.mode import AgentsMode
from nonstop.orchestrator.modes.environment.episode_flow import EnvRun
from nonstop.orchestrator.modes.environment.mode import EnvMode
from nonstop.orchestrator.modes.own_policies.mode import OwnPoliciesMode
from nonstop.orchestrator.modes.own_policies.policies import Policies
from nonstop.orchestrator.modes.own_policies.policy_build import SideContext, build_policies
from nonstop.orchestrator.modes.single_turn import TaskMode
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.run import Run, RunMode, RunState
from nonstop.runtime import ActorBackend
from nonstop.runtime.restart import RestartingEngine
from nonstop.scoring.compose import build_scorer
from nonstop.scoring.rewards import RewardFn, resolve_reward
from nonstop.tasks.codec import Codec, HeldOut
from nonstop.tasks.data import PromptStream, TaskData, screen_prompts


def screen(cfg: Config, data: TaskData, codec: Codec, model_weights: Path, progress: Progress) -> None:
    """Skip prompts too long for the model's context with room for the completion (in an environment
    run: for one turn within env.max_episode_tokens, which counts the prompt too). Chat rows were
    rendered through the template before (orchestrator/fit.py)."""
    positions = max_positions(model_weights)
    if cfg.env is not None:
        room = min(positions, cfg.env.max_episode_tokens) - cfg.env.turn_max_tokens
    else:
        room = positions - cfg.rollout.max_new_tokens
    limit = cfg.task.max_prompt_tokens or room
    long_prompts = screen_prompts(data, codec.encode, limit, cfg.task.on_bad_row)
    for problem in long_prompts[:10]:
        progress.log(f"[yellow]dataset:[/] {problem}; skipped")
    if len(long_prompts) > 10:
        progress.log(f"dataset: {len(long_prompts)} over-long prompts skipped in all")


async def build_run(
    cfg: Config,
    backend: ActorBackend,
    base_model: Path,
    data: TaskData,
    run_dir: Path,
    progress: Progress,
    resume: Checkpoint | None = None,
    reward: RewardFn | None = None,
) -> Run:
    """Spawn and connect the actors and wire the stages. With `resume`, actors start from the
    checkpoint's weights and trainer state (the orchestrator's state comes back in recovery.py).
    `reward` (a Python callable, from nonstop.api) replaces task.reward; it runs in this process
    and is never pickled unless scoring.pool sends it to worker processes ('process', or 'auto'
    for a slow module-level function). The scoring stage's actors (scoring/compose.py) start
    beside the engines and trainers; pool 'auto' starts its workers later, if a function needs them."""
    weights = resume.model_dir if resume is not None else base_model
    lora = cfg.model.lora.enabled  # LoRA: engines always hold the base; adapters come by transport
    model_weights = base_model if lora else weights
    version0 = resume.state["policy_version"] if resume is not None else 0
    codec = Codec(load_tokenizer(str(weights)))
    tok = codec.tokenizer
    screen(cfg, data, codec, model_weights, progress)
    scorer = build_scorer(cfg, backend, codec.decode, reward, progress.log, str(weights))  # bad names fail here
    num_engines = cfg.runtime.num_engines
    progress.log(
        f"starting {num_engines} engine and {cfg.trainer.ranks} trainer actor(s) ({cfg.runtime.backend} backend) ..."
    )
    first_engines, trainer, _ = await asyncio.gather(
        asyncio.gather(
            *(spawn_engine(backend, cfg, model_weights, tok, i, version0, run_dir) for i in range(num_engines))
        ),
        spawn_trainers(
            backend,
            cfg,
            model_weights,
            tok,
            str(base_model) if resume is not None else None,
            adapter_path=str(weights) if resume is not None and lora else None,
            run_dir=run_dir,
        ),
        scorer.start(),
    )
    if resume is not None:
        await trainer.load_checkpoint(str(resume.path))
    handle = await connect_transport(cfg, trainer, list(first_engines), backend.host)

    def restarting(i: int, engine: EngineClient) -> RestartingEngine:
        return RestartingEngine(
            engine.name,
            engine_restarter(backend, cfg, model_weights, tok, i, version0, handle, trainer, run_dir),
            cfg.engine_restarts,
            cfg.runtime.heartbeat_interval_s,
            cfg.runtime.heartbeat_timeout_s,
            log=progress.log,
            engine=engine,
        )

    async def join(i: int) -> RestartingEngine:
        """Engine i past runtime.num_engines: placed when there is room, attached, holding the current weights."""
        start = engine_restarter(backend, cfg, model_weights, tok, i, version0, handle, trainer, run_dir)
        return restarting(i, await start())

    engines = [restarting(i, e) for i, e in enumerate(first_engines)]
    own = sorted(cfg.env.policies) if cfg.env is not None else []
    ledger = Ledger(("", *own) if own else ())  # with own policies a row settles once each settled its part
    spans = SpanLog(span_file(cfg, run_dir, "orchestrator"))
    buffer = make_buffer(cfg, ledger.part("") if own else ledger, spans, None if own else run_dir / DROPPED)
    mode = await build_mode(cfg, backend, base_model, weights, tok, buffer, ledger, run_dir, spans, progress, resume)
    return Run(
        cfg,
        data,
        codec,
        EnginePool(list(engines)),
        engines,
        trainer,
        buffer,
        scorer,
        RolloutStats(),
        PromptStream(data.train, cfg.run.seed, cfg.run.max_epochs),
        ledger,
        open_sinks(cfg, run_dir),
        progress,
        run_dir,
        base_model,
        RunState(),
        mode,
        spans,
        handle,
        join=join if cfg.max_engines > num_engines else None,
        held_out=held_out(cfg, reward),
    )


async def build_mode(
    cfg: Config,
    backend: ActorBackend,
    base_model: Path,
    weights: Path,
    tok: Any,
    buffer: RolloutBuffer,
    ledger: Ledger,
    run_dir: Path,
    spans: SpanLog,
    progress: Progress,
    resume: Checkpoint | None = None,
) -> RunMode:
    """The run's mode, chosen from the config: the task's groups (no `env`), an environment's
    episodes (`env`; with env.policies each named role's own policy started here, its actors
    beside the run's), and with agents.enabled the agents' groups around either. `weights`: what
    the run's engines start from (its tokenizer, `tok`, renders a verifiers taskset's prompts)."""
    mode: RunMode
    if cfg.env is None:
        mode = TaskMode()
    elif cfg.env.policies:
        ctx = SideContext(cfg, backend, base_model, tok, ledger, run_dir, spans, progress, resume)
        sides = await build_policies(ctx)
        policies = Policies(buffer, sides, cfg.rollout.filter_uniform_reward, ledger)
        mode = OwnPoliciesMode(EnvRun.build(cfg.env, weights), policies)
    else:
        mode = EnvMode(EnvRun.build(cfg.env, weights))
    return AgentsMode(mode) if cfg.agents.enabled else mode


def held_out(cfg: Config, reward: RewardFn | None) -> HeldOut:
    """Held-out scoring by task.eval_reward, else the run's own reward (the Python callable from nonstop.api,
    else task.reward)."""
    t = cfg.task
    temperature = t.eval_temperature
    if temperature is None:
        temperature = 0.0 if t.eval_samples == 1 else cfg.rollout.temperature
    if t.eval_reward is not None:
        return HeldOut(resolve_reward(t.eval_reward, "task.eval_reward"), t.eval_reward, t.eval_samples, temperature)
    fn = reward if reward is not None else resolve_reward(t.reward)
    return HeldOut(fn, t.reward, t.eval_samples, temperature)
