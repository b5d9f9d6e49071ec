"""TRL's `GRPOConfig` as a nonstop `Config`: `from_trl(args)`, and what has no equivalent.

`trl_mapping(args)` reads a `trl.GRPOConfig` (an `AsyncGRPOConfig`, or any object with their field
names) and returns a `TrlMapping`: the nonstop setting of every field that has an equivalent
(`settings`, dotted keys, as `--set` takes them), the fields set away from TRL's default that have
none (`unmapped`, each with why), where an equivalent is not exact (`notes`), and the reward
weights, which `nonstop.train(reward_weights=...)` takes. A value nonstop cannot express (a loss
TRL has and nonstop lacks, fp16, a fractional epoch count, a batch that is not whole groups) is a
ConfigError naming the field. `from_trl(args, config=None, model=None)` applies the settings on
top of `config` (a Config, a YAML path, or the defaults), warns once (`TrlMappingWarning`) with
the unmapped fields, and returns the Config. docs/from_trl.md has the table.

Which fields were set is read from the values, against the defaults the config class declares:
TRL's own post-init rewrites a few (`report_to`, `debug`, `bf16`, ...), and those are compared as
the rewritten value, or mapped whatever their value.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nonstop.config.loading import load_config
from nonstop.config.root import Config, ConfigError
from nonstop.config.trl_fields import MAPPED, NO_EQUIVALENT, TRAINER_ONLY

_REWRITTEN: dict[str, Any] = {"report_to": [], "debug": [], "pad_to_multiple_of": None}
"""Defaults TRL's post-init writes in place of the declared ones (compared as written)."""
_DERIVED = frozenset(
    {"disable_tqdm", "accelerator_config", "dataloader_pin_memory", "logging_dir", "local_rank", "do_eval"}
)
"""Fields the post-init fills from others or from the machine: never the user's setting."""

LOSSES = {"grpo": "grpo", "dr_grpo": "dr_grpo", "dapo": "dapo"}
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")
CORRECTIONS = {
    "token_truncate": "tis",
    "token_mask": "mis",
    "sequence_truncate": "seq_tis",
    "sequence_mask": "seq_mis",
}


REQUIRED = (
    "num_generations",
    "max_completion_length",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "weight_decay",
    "max_grad_norm",
    "max_steps",
    "num_train_epochs",
    "temperature",
    "top_p",
    "top_k",
    "seed",
)
"""The fields every GRPOConfig has, which trl_mapping reads without a default."""


class TrlMappingWarning(UserWarning):
    """A GRPOConfig field set away from its default has no nonstop equivalent."""


@dataclass
class TrlMapping:
    settings: dict[str, Any] = field(default_factory=dict)
    """nonstop settings by dotted key ('trainer.lr'), as `--set` and `load_config` take them."""
    unmapped: dict[str, str] = field(default_factory=dict)
    """Fields set away from their default that nonstop has no equivalent for, and why."""
    notes: list[str] = field(default_factory=list)
    """Where a mapped value means something slightly different in nonstop."""
    reward_weights: list[float] | None = None
    """GRPOConfig.reward_weights, for nonstop.train(reward_weights=...)."""

    def overrides(self) -> list[str]:
        """The settings as 'key=value' strings (values in YAML flow syntax)."""
        return [f"{k}={json.dumps(v)}" for k, v in self.settings.items()]


def _plain(value: Any) -> Any:
    return getattr(value, "value", value)  # transformers' str enums (SchedulerType, SaveStrategy, ...)


def _defaults(args: Any) -> dict[str, Any]:
    if not dataclasses.is_dataclass(args):
        return {}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return {**out, **{k: v for k, v in _REWRITTEN.items() if k in out}}


def _set_fields(args: Any) -> dict[str, Any]:
    """The fields whose value differs from the class's default (TRL's rewritten ones as written)."""
    names = [f.name for f in dataclasses.fields(args)] if dataclasses.is_dataclass(args) else list(vars(args))
    defaults = _defaults(args)
    return {
        n: _plain(getattr(args, n))
        for n in names
        if n not in _DERIVED and (n not in defaults or _plain(getattr(args, n)) != _plain(defaults[n]))
    }


def _steps(value: float | None, max_steps: int) -> int | None:
    """A Trainer interval in steps: a value under 1 is a fraction of max_steps (None without them)."""
    if not value:
        return None
    if value >= 1:
        return int(value)
    return max(1, math.ceil(value * max_steps)) if max_steps > 0 else None


def _refuse(name: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"GRPOConfig.{name}={value!r}: {why}")


def _loss(args: Any, world: int, s: dict[str, Any]) -> None:
    loss_type = getattr(args, "loss_type", "dapo")
    level = getattr(args, "importance_sampling_level", "token")
    if level == "sequence":
        if loss_type != "grpo":
            raise _refuse(
                "importance_sampling_level",
                level,
                f"with loss_type {loss_type!r} nonstop has no equivalent; GSPO is "
                "importance_sampling_level='sequence' with loss_type='grpo' (trainer.loss gspo)",
            )
        s["trainer.loss"] = "gspo"
        return
    if level != "token":
        raise _refuse("importance_sampling_level", level, "expected 'token' or 'sequence'")
    if loss_type == "bnpo":
        if args.gradient_accumulation_steps * world != 1:
            raise _refuse(
                "loss_type",
                loss_type,
                "bnpo normalises by the tokens of each accumulated micro-batch; nonstop normalises a "
                "step by all its tokens (dapo), which is bnpo only with gradient_accumulation_steps 1 "
                "on one process",
            )
        loss_type = "dapo"
    if loss_type not in LOSSES:
        raise _refuse(
            "loss_type", loss_type, "nonstop has no such loss (it has grpo, dr_grpo, dapo, bnpo as dapo, GSPO)"
        )
    s["trainer.loss"] = LOSSES[loss_type]


def _batch(args: Any, world: int, s: dict[str, Any], unmapped: dict[str, str]) -> None:
    g = int(args.num_generations)
    per_step = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * world
    if per_step % g:
        raise _refuse(
            "per_device_train_batch_size",
            args.per_device_train_batch_size,
            f"x gradient_accumulation_steps {args.gradient_accumulation_steps} x {world} process(es) = "
            f"{per_step} completions a step, not whole groups of num_generations {g}",
        )
    s["rollout.group_size"], s["rollout.prompts_per_step"] = g, per_step // g
    spg = getattr(args, "steps_per_generation", None)
    if spg is not None and spg != args.gradient_accumulation_steps:
        unmapped["steps_per_generation"] = (
            f"{spg} accumulation steps per generation batch: a batch that spans several optimizer steps; "
            "nonstop generates each step's groups (buffer.depth: how many steps ahead)"
        )


def _schedule(args: Any, s: dict[str, Any], notes: list[str], unmapped: dict[str, str]) -> None:
    kind = _plain(getattr(args, "lr_scheduler_type", "linear"))
    if kind in ("constant", "constant_with_warmup", "linear"):
        s["trainer.lr_schedule"] = "constant"
        if kind == "linear":
            notes.append("lr_scheduler_type 'linear' (TRL's default) decays to 0; nonstop keeps lr constant")
    elif kind == "cosine":
        s["trainer.lr_schedule"] = "cosine"
        notes.append("lr_scheduler_type 'cosine': nonstop's cosine ends at 10% of lr, not 0")
    else:
        unmapped["lr_scheduler_type"] = f"{kind!r}: nonstop has constant and cosine (trainer.lr_schedule)"
    warm = float(getattr(args, "warmup_steps", 0) or 0)
    if 0 < warm < 1:
        if args.max_steps <= 0:
            raise _refuse("warmup_steps", warm, "a fraction of the steps needs max_steps > 0")
        warm = math.ceil(warm * args.max_steps)
    if warm:
        s["trainer.lr_warmup_steps"] = int(warm)


def _length(args: Any, s: dict[str, Any]) -> None:
    if args.max_completion_length is None:
        raise _refuse("max_completion_length", None, "nonstop needs a completion budget (rollout.max_new_tokens)")
    s["rollout.max_new_tokens"] = int(args.max_completion_length)
    if args.max_steps is not None and args.max_steps > 0:
        s["run.max_steps"] = int(args.max_steps)
    else:
        epochs = float(args.num_train_epochs)
        if epochs != int(epochs) or epochs < 1:
            raise _refuse("num_train_epochs", epochs, "nonstop counts whole epochs (run.max_epochs), or set max_steps")
        s["run.max_epochs"] = int(epochs)


def _correction(args: Any, s: dict[str, Any], unmapped: dict[str, str]) -> None:
    if not getattr(args, "use_vllm", False) or not getattr(args, "vllm_importance_sampling_correction", False):
        return
    mode = args.vllm_importance_sampling_mode
    if mode not in CORRECTIONS:
        raise _refuse("vllm_importance_sampling_mode", mode, f"expected one of {sorted(CORRECTIONS)}")
    s["trainer.correction"] = CORRECTIONS[mode]
    hi, lo = args.vllm_importance_sampling_clip_max, args.vllm_importance_sampling_clip_min
    if mode.endswith("truncate"):
        s["trainer.is_cap"] = float(hi)
        if lo is not None:
            unmapped["vllm_importance_sampling_clip_min"] = "nonstop's truncation caps from above only"
    else:
        s["trainer.is_hi"] = float(hi)
        s["trainer.is_lo"] = float(lo) if lo is not None else 1e-30  # TRL: no lower bound; nonstop's must be > 0


def _run_settings(args: Any, set_now: dict[str, Any], s: dict[str, Any], unmapped: dict[str, str]) -> None:
    if getattr(args, "fp16", False):
        raise _refuse("fp16", True, "nonstop trains in float32 or bfloat16 (bf16=True)")
    if getattr(args, "bf16", None) is not None:
        s["trainer.precision"] = "bfloat16" if args.bf16 else "float32"
    if getattr(args, "use_cpu", False):
        s["trainer.device"] = s["engine.device"] = "cpu"
    checkpointing = getattr(args, "activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(args, "gradient_checkpointing", None)
    if checkpointing is not None:
        s["trainer.activation_checkpointing"] = bool(checkpointing)
    if getattr(args, "output_dir", None):
        s["run.out_dir"] = str(args.output_dir)
    if getattr(args, "run_name", None):
        s["run.name"] = str(args.run_name)
    save = _plain(getattr(args, "save_strategy", "steps"))
    if save == "no":
        s["checkpoint.every_steps"] = None
    elif save == "steps" and _steps(args.save_steps, args.max_steps):
        s["checkpoint.every_steps"] = _steps(args.save_steps, args.max_steps)
    elif "save_strategy" in set_now:
        unmapped["save_strategy"] = f"{save!r}: nonstop checkpoints every checkpoint.every_steps steps"
    if getattr(args, "save_total_limit", None):
        s["checkpoint.keep"] = int(args.save_total_limit)
    if _plain(getattr(args, "eval_strategy", "no")) == "steps" and _steps(args.eval_steps, args.max_steps):
        s["run.eval_every"] = _steps(args.eval_steps, args.max_steps)
    trackers = getattr(args, "report_to", None) or []
    trackers = [trackers] if isinstance(trackers, str) else list(trackers)
    kept = [t for t in trackers if t in TRACKERS]
    if kept:
        s["tracking"] = kept
    if len(kept) < len([t for t in trackers if t not in ("none", "all")]):
        unmapped["report_to"] = f"{trackers}: nonstop reports to {', '.join(TRACKERS)} only"


def trl_mapping(args: Any) -> TrlMapping:
    """The nonstop settings of a GRPOConfig, what has no equivalent, and where they differ."""
    missing = [f for f in REQUIRED if not hasattr(args, f)]
    if missing:
        raise ConfigError(f"from_trl: expected a trl.GRPOConfig; {type(args).__name__} has no {', '.join(missing)}")
    m = TrlMapping()
    s, notes = m.settings, m.notes
    world = int(getattr(args, "world_size", 1) or 1)
    set_now = _set_fields(args)
    optional = {k: getattr(args, k) for k in ("beta", "epsilon", "max_staleness", "delta") if hasattr(args, k)}
    _batch(args, world, s, m.unmapped)
    _length(args, s)
    s["rollout.temperature"] = float(args.temperature)
    s["rollout.top_p"] = float(args.top_p)
    s["rollout.top_k"] = int(args.top_k or 0)
    s["rollout.min_p"] = float(getattr(args, "min_p", None) or 0.0)
    s["rollout.filter_uniform_reward"] = False  # TRL trains every group, even one whose rewards are all equal
    s["run.max_time_s"] = None  # TRL has no time limit; nonstop's default stops at 190 s
    s["trainer.lr"] = float(args.learning_rate)
    s["trainer.weight_decay"] = float(args.weight_decay)
    s["trainer.max_grad_norm"] = float(args.max_grad_norm)
    s["run.seed"] = int(args.seed)
    if "beta" in optional:
        s["trainer.kl_coef"], s["trainer.kl_estimator"] = float(optional["beta"]), "k3"
    if "epsilon" in optional:
        high = getattr(args, "epsilon_high", None)
        s["trainer.clip_eps"] = float(optional["epsilon"])
        s["trainer.clip_eps_high"] = float(high if high is not None else optional["epsilon"])
    if optional.get("delta") is not None:
        s["trainer.clip_ratio_c"] = float(optional["delta"])
    if hasattr(args, "loss_type"):
        _loss(args, world, s)
    if hasattr(args, "scale_rewards"):
        scale = {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards)
        advantage = {"group": "group_std", "none": "group_mean", "batch": "batch"}.get(scale)
        if advantage is None:
            raise _refuse("scale_rewards", args.scale_rewards, "expected 'group', 'batch' or 'none'")
        s["trainer.advantage"], s["trainer.group_std"] = advantage, "unbiased"
        if scale == "batch":
            notes.append(
                "scale_rewards 'batch': TRL divides by the std of the batch's rewards, nonstop by the std of "
                "the rewards less their group means"
            )
    aggregation = getattr(args, "multi_objective_aggregation", "sum_then_normalize")
    if aggregation != "sum_then_normalize":
        raise _refuse("multi_objective_aggregation", aggregation, "nonstop sums the weighted rewards, then normalises")
    if hasattr(args, "mask_truncated_completions"):
        s["trainer.overlong_filter"] = bool(args.mask_truncated_completions)
    if hasattr(args, "num_iterations"):
        s["trainer.updates_per_batch"] = int(args.num_iterations)
    if getattr(args, "entropy_coef", 0.0):
        s["trainer.entropy_coef"] = float(args.entropy_coef)
    if optional.get("max_staleness") is not None:
        s["buffer.max_lag"] = int(optional["max_staleness"])
    if getattr(args, "max_prompt_length", None):
        s["task.max_prompt_tokens"] = int(args.max_prompt_length)
    if getattr(args, "num_generations_eval", None):
        s["task.eval_samples"] = int(args.num_generations_eval)
        s["task.eval_temperature"] = float(args.temperature)
    if getattr(args, "use_vllm", False):
        s["engine.kind"] = "vllm"
        s["engine.vllm.memory_fraction"] = float(args.vllm_gpu_memory_utilization)
        if getattr(args, "vllm_max_model_length", None):
            s["engine.vllm.max_model_len"] = int(args.vllm_max_model_length)
    _correction(args, s, m.unmapped)
    _schedule(args, s, notes, m.unmapped)
    _run_settings(args, set_now, s, m.unmapped)
    optim = set_now.get("optim")
    if optim is not None and optim not in ("adamw_torch", "adamw_torch_fused"):
        m.unmapped["optim"] = f"{optim!r}: nonstop trains with torch's AdamW"
    weights = getattr(args, "reward_weights", None)
    m.reward_weights = [float(w) for w in weights] if weights is not None else None
    for name, value in set_now.items():
        if name not in MAPPED and name not in m.unmapped:
            m.unmapped[name] = f"{value!r}: " + NO_EQUIVALENT.get(name, TRAINER_ONLY)
    return m


def from_trl(
    args: Any, config: Config | str | Path | None = None, model: str | os.PathLike[str] | None = None
) -> Config:
    """A nonstop Config with `args`' settings (a GRPOConfig) on top of `config` (a Config, a YAML
    path, or the defaults) and `model` as model.path (GRPOTrainer's `model` argument). Warns once
    (TrlMappingWarning) with the fields set away from their default that nonstop has no equivalent
    for; a value it cannot express is a ConfigError naming the field. Pass
    `args.reward_weights` to nonstop.train(reward_weights=...)."""
    mapping = trl_mapping(args)
    overrides = mapping.overrides()
    if model is not None:
        overrides.append(f"model.path={json.dumps(os.fspath(model))}")
    if mapping.unmapped:
        lines = "\n".join(f"  {k}: {why}" for k, why in sorted(mapping.unmapped.items()))
        warnings.warn(
            f"GRPOConfig fields with no nonstop equivalent (ignored):\n{lines}", TrlMappingWarning, stacklevel=2
        )
    return load_config(config, overrides)
