"""The base policy a run starts from: `choose_base(cfg)` is the one place that chooses it.

`choose_base(cfg)` resolves `model.base`:
- model.path set               -> 'path' (the user's model; model.base must stay 'auto');
- an environment run           -> 'env': the environment's warm-up (models/env_warmup.py), for the
                                  built-ins and reasoning-gym, and for a verifiers taskset or a
                                  textarena game that has a weak player unless model.base is 'init';
- 'auto', warmup.enabled false -> 'init' (freshly initialised tiny model);
- 'auto', otherwise            -> 'builtin' when the tiny shape and the task match the shipped
                                  base, else 'warmup';
- 'builtin', 'builtin_weak', 'warmup', 'init' -> that, where 'builtin*' with a shape or task
  the shipped base was not built for is a ConfigError naming the fields that differ.
A task with a shipped base of its own (long_rollout) starts from it. `prepare_base_model` returns
the chosen base's folder, building (and caching) it when needed. The shipped bases and their
provenance are models/shipped.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from nonstop.config import Config, ConfigError
from nonstop.config.preflight import resolve_model_path
from nonstop.envs.registry import demo_of
from nonstop.models.env_warmup import env_base
from nonstop.models.shipped import (
    ASSETS,
    SHIPPED,
    TASK_BASES,
    mismatches,
    read_provenance,
    shipped_dir,
    task_base_problems,
    verify,
)
from nonstop.models.warmup import cached_base
from nonstop.tasks.data import TaskData


def from_environment(cfg: Config) -> bool:
    """Whether an environment run starts from its environment's warm-up: always for the built-ins
    and reasoning-gym; for a verifiers taskset or a textarena game only if it has a weak player
    to imitate and model.base is not 'init' (else the task's base, as a run without env)."""
    if cfg.env is None or cfg.model.path is not None:
        return False
    if not cfg.env.name.startswith(("verifiers/", "textarena/")):
        return True
    return cfg.model.base != "init" and demo_of(cfg.env) is not None


def choose_base(cfg: Config) -> str:
    """'path', 'env', 'builtin', 'builtin_weak', 'warmup' or 'init' (see the module docstring)."""
    kind = cfg.model.base
    if cfg.model.path is not None:
        if kind != "auto":
            raise ConfigError(f"model.base: '{kind}' applies to the tiny model only, but model.path is set")
        return "path"
    if from_environment(cfg):
        return "env"
    if cfg.task.name in TASK_BASES:
        if kind not in ("auto", "builtin"):
            raise ConfigError(
                f"model.base: task '{cfg.task.name}' starts from its shipped base (model.base auto or builtin), "
                f"not '{kind}'; bench/make_long_base.py rebuilds that base"
            )
        problems = task_base_problems(cfg, read_provenance(ASSETS / TASK_BASES[cfg.task.name]))
        if problems:
            raise ConfigError(f"task '{cfg.task.name}': its shipped base does not fit: " + "; ".join(problems))
        return "builtin"
    if kind == "auto":
        if cfg.warmup.enabled is False:
            return "init"
        return "builtin" if not mismatches(cfg, read_provenance(shipped_dir())) else "warmup"
    if kind in SHIPPED:
        problems = mismatches(cfg, read_provenance(shipped_dir(kind)))
        if problems:
            raise ConfigError(
                f"model.base: the shipped base '{kind}' was built for another shape or task: "
                + "; ".join(problems)
                + ". Use model.base=warmup (or auto) for this one"
            )
    return kind


def builds_warmup_base(cfg: Config) -> bool:
    """Whether a run starts from a base the supervised warm-up builds on its task; its RL learning
    rate follows (sizing/defaults.py WARMUP_BASE_LR). Never an environment run, whichever base it starts from."""
    return cfg.env is None and choose_base(cfg) == "warmup"


def prepare_base_model(cfg: Config, data: TaskData, log: Callable[[str], None] = print) -> Path:
    """Return the folder of the base policy, building (and caching) it when needed."""
    kind = choose_base(cfg)
    if kind == "path":
        return resolve_model_path(cfg.model.path)  # type: ignore[arg-type]
    if kind == "env":
        return env_base(cfg, log)
    if kind in SHIPPED:
        folder = ASSETS / TASK_BASES[cfg.task.name] if cfg.task.name in TASK_BASES else shipped_dir(kind)
        prov = verify(folder)
        log(
            f"base policy: shipped '{kind}' ({prov['heldout_accuracy']:.1%} held-out when built; sha256 "
            f"{prov['sha256'][:12]}); model.base=warmup builds one on this machine instead"
        )
        return folder
    return cached_base(cfg, data, warmup=kind == "warmup", log=log)
