"""Building the roles' own policies (env.policies): their configs, the checks, their actors.

- `policy_config(cfg, own, k, role)`: the run's config as policy k's actors see it (its learning
  rate, LoRA or not, its engine count, its own seeds, its own files-transport folder);
- `check_roles(cfg, roles)`: every named role exists, and one is left to the shared policy
  (launch.py calls it before the run folder is made);
- `build_policies(ctx)`: each own policy's engines, trainer, transport and buffer, started from
  `env.policies.<role>.path` (checked to share the run's tokenizer) or the run's base policy,
  or with `resume` from its folder and version in the checkpoint; a checkpoint that lacks a
  policy the config names, or holds one it does not, ends the run with RunFailed. `ctx`, a
  `SideContext`, holds what every policy's actors are built from (the run's config, backend,
  base weights, tokenizer, ledger, folder, span log, progress and checkpoint).
What an own policy is and how it is trained: policies.py and mode.py.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nonstop.checkpoint import Checkpoint
from nonstop.config import Config, ConfigError, FilesTransportConfig, PolicyConfig
from nonstop.config.preflight import resolve_model_path
from nonstop.hf import load_tokenizer
from nonstop.observe.spans import SpanLog
from nonstop.orchestrator.actors import connect_transport, engine_restarter, spawn_engine, spawn_trainers
from nonstop.orchestrator.buffer import make_buffer
from nonstop.orchestrator.dispatch import EnginePool
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.own_policies.policies import PolicySide
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.recovery import RunFailed
from nonstop.runtime import ActorBackend
from nonstop.runtime.restart import RestartingEngine


def policy_config(cfg: Config, own: PolicyConfig, k: int, role: str) -> Config:
    """The run's config as policy k (role `role`) sees it: its learning rate, LoRA or not, its engine
    count, its own seeds; with a files transport in a folder the user named, its own subfolder
    `<transport.dir>/policy-<role>` (two trainers in one folder would wipe each other's versions)."""
    update = {
        "trainer": cfg.trainer.model_copy(update={"lr": own.lr if own.lr is not None else cfg.trainer.lr}),
        "model": cfg.model.model_copy(
            update={"lora": cfg.model.lora.model_copy(update={"enabled": own.trains_lora(cfg.model.lora.enabled)})}
        ),
        "runtime": cfg.runtime.model_copy(update={"num_engines": own.num_engines}),
        "run": cfg.run.model_copy(update={"seed": cfg.run.seed + 1000 * (k + 1)}),
    }
    if isinstance(cfg.transport, FilesTransportConfig) and cfg.transport.dir is not None:
        update["transport"] = cfg.transport.model_copy(update={"dir": str(Path(cfg.transport.dir) / f"policy-{role}")})
    return cfg.model_copy(update=update)


def check_roles(cfg: Config, roles: tuple[str, ...]) -> None:
    """ConfigError naming env.policies.<role> for a role the environment lacks, or when no role is left
    to the shared policy (its loop is the one run.max_steps counts)."""
    assert cfg.env is not None
    for role in cfg.env.policies:
        if role not in roles:
            raise ConfigError(
                f"env.policies.{role}: environment {cfg.env.name!r} has no role {role!r}; its roles: {', '.join(roles)}"
            )
    if set(roles) <= set(cfg.env.policies):
        raise ConfigError(
            f"env.policies: every role of {cfg.env.name!r} has its own policy; leave at least one "
            "role to the shared policy (run.max_steps counts its steps)"
        )


def check_tokenizer(role: str, path: Path, tok: Any) -> None:
    """A policy's model must read and write the run's token ids (episodes are shared token sequences)."""
    if load_tokenizer(str(path)).get_vocab() != tok.get_vocab():
        raise ConfigError(
            f"env.policies.{role}.path: {path} has another tokenizer than the run's base policy; "
            "every policy of an episode must share one tokenizer"
        )


def _saved(resume: Checkpoint, role: str) -> tuple[Path, int]:
    """Where a checkpoint keeps policy `role` (its trainer's folder) and the version it had."""
    saved = (resume.state.get("policies") or {}).get("own", {})
    if role not in saved:
        raise RunFailed(
            f"env.policies.{role}: the checkpoint {resume.path} holds no policy {role!r} "
            f"(it has: {', '.join(saved) or 'none'}); resume with the run's own env.policies"
        )
    return resume.path / "policies" / role, int(saved[role]["policy_version"])


@dataclass(frozen=True)
class SideContext:
    """What each own policy's actors are built from: shared by every role of one run."""

    cfg: Config
    backend: ActorBackend
    base_model: Path
    tok: Any
    ledger: Ledger
    run_dir: Path
    spans: SpanLog
    progress: Progress
    resume: Checkpoint | None = None


async def build_side(ctx: SideContext, k: int, role: str) -> PolicySide:
    """Policy k (role `role`): its engines behind restarters, its trainer, transport and buffer part."""
    cfg, backend, tok, run_dir, progress, resume = ctx.cfg, ctx.backend, ctx.tok, ctx.run_dir, ctx.progress, ctx.resume
    own = cfg.env.policies[role] if cfg.env is not None else PolicyConfig()
    start = ctx.base_model
    if own.path is not None:
        start = resolve_model_path(own.path, field=f"env.policies.{role}.path")
        check_tokenizer(role, start, tok)
    weights, version0, folder = start, 0, None
    if resume is not None:
        folder, version0 = _saved(resume, role)
        weights = folder / "model"  # with LoRA: the adapters, on top of `start`
    lora = own.trains_lora(cfg.model.lora.enabled)
    model_weights = start if lora else weights  # LoRA: engines and trainer hold the start weights
    pcfg = policy_config(cfg, own, k, role)
    progress.log(
        f"policy {role!r}: {own.num_engines} engine and {cfg.trainer.ranks} trainer actor(s) from {weights}"
        + (" (LoRA adapters)" if lora else "")
    )
    first, trainer = await asyncio.gather(
        asyncio.gather(
            *(
                spawn_engine(backend, pcfg, model_weights, tok, i, version0, run_dir, f"{role}-engine")
                for i in range(own.num_engines)
            )
        ),
        spawn_trainers(
            backend,
            pcfg,
            model_weights,
            tok,
            str(start) if resume is not None else None,
            adapter_path=str(weights) if folder is not None and lora else None,
            run_dir=run_dir,
            prefix=f"{role}-trainer",
        ),
    )
    if folder is not None:
        await trainer.load_checkpoint(str(folder))
    handle = await connect_transport(pcfg, trainer, list(first), backend.host)
    engines = [
        RestartingEngine(
            e.name,
            engine_restarter(
                backend, pcfg, model_weights, tok, i, version0, handle, trainer, run_dir, f"{role}-engine"
            ),
            cfg.engine_restarts,
            cfg.runtime.heartbeat_interval_s,
            cfg.runtime.heartbeat_timeout_s,
            log=progress.log,
            engine=e,
        )
        for i, e in enumerate(first)
    ]
    buffer = make_buffer(cfg, ctx.ledger.part(role), ctx.spans)
    return PolicySide(role, EnginePool(list(engines)), engines, trainer, handle, buffer)


async def build_policies(ctx: SideContext) -> dict[str, PolicySide]:
    """Spawn and connect every own policy of cfg.env.policies (the roles were checked in check_roles);
    with `resume`, each from its weights and trainer state in the checkpoint."""
    cfg, resume = ctx.cfg, ctx.resume
    assert cfg.env is not None
    if resume is not None:
        extra = set((resume.state.get("policies") or {}).get("own", {})) - set(cfg.env.policies)
        if extra:
            raise RunFailed(
                f"env.policies: the checkpoint {resume.path} has own policies {sorted(extra)} this config "
                "does not name; resume with the run's own env.policies"
            )
    sides = await asyncio.gather(*(build_side(ctx, k, role) for k, role in enumerate(sorted(cfg.env.policies))))
    return {s.role: s for s in sides}
