"""The bases shipped with the package, and their provenance.

A shipped base is a folder under nonstop/assets/ written by `nonstop warmup --out DIR`
(`write_base`): model.safetensors, config.json, the tokenizer files and provenance.json (command,
warm-up seed and settings, tiny shape, task, gate and held-out accuracy, sha256 of
model.safetensors, torch and transformers versions, CPU capability). Its weights are the same
bytes on every machine, so the default job starts from the same policy whatever the CPU, and
whatever run.seed: the seed changes data order and sampling only. `verify(folder)` checks the
weights' hash; `mismatches` and `task_base_problems` say why a shipped base does not fit a config.
"""

from __future__ import annotations

import hashlib
import json
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from nonstop.config import Config
from nonstop.engine.core import TorchEngine
from nonstop.models.warmup import greedy_accuracy, save_atomically, warm_up, warmup_seed
from nonstop.tasks.data import TaskData

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHIPPED = {"builtin": "addition-base", "builtin_weak": "addition-weak"}
TASK_BASES = {"long_rollout": "long-base"}
"""Tasks whose base is shipped only, tokenizer and shape included (no warm-up path): model.base
'auto' or 'builtin' takes it, whatever model.tiny says. bench/make_long_base.py rebuilds it."""
PROVENANCE = "provenance.json"
_TASK_FIELDS = ("name", "max_operand", "pad_answer", "split_seed")


def shipped_dir(kind: str = "builtin") -> Path:
    return ASSETS / SHIPPED[kind]


def read_provenance(folder: str | Path) -> dict:
    return json.loads((Path(folder) / PROVENANCE).read_text())


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def verify(folder: str | Path) -> dict:
    """The provenance of a shipped base, after checking that its weights are the recorded bytes."""
    prov = read_provenance(folder)
    got = sha256_file(Path(folder) / "model.safetensors")
    if got != prov["sha256"]:
        raise ValueError(f"{folder}/model.safetensors: sha256 {got} differs from provenance {prov['sha256']}")
    return prov


def mismatches(cfg: Config, prov: dict) -> list[str]:
    """Config fields for which the shipped base (its provenance) was not built; [] if it fits."""
    out = [
        f"model.tiny.{k} is {v} (the shipped base has {prov['tiny'][k]})"
        for k, v in cfg.model.tiny.model_dump().items()
        if prov["tiny"].get(k) != v
    ]
    out += [
        f"task.{k} is {getattr(cfg.task, k)!r} (the shipped base has {prov['task'][k]!r})"
        for k in _TASK_FIELDS
        if prov["task"].get(k) != getattr(cfg.task, k)
    ]
    if cfg.task.eval_size > prov["task"]["eval_size"]:
        out.append(
            f"task.eval_size is {cfg.task.eval_size}: over the shipped base's {prov['task']['eval_size']} "
            "held-out prompts, so some would have been trained on"
        )
    return out


def task_base_problems(cfg: Config, prov: dict) -> list[str]:
    """Why a task's own shipped base cannot serve `cfg` (held-out prompts it trained on); [] if it can."""
    out = []
    if cfg.task.split_seed != prov["task"]["split_seed"]:
        out.append(f"task.split_seed is {cfg.task.split_seed} (the shipped base has {prov['task']['split_seed']})")
    if cfg.task.eval_fraction is not None or cfg.task.eval_size > prov["task"]["eval_size"]:
        out.append(
            f"task.eval_size must be at most the shipped base's {prov['task']['eval_size']} held-out prompts, "
            "without task.eval_fraction"
        )
    return out


def build_provenance(
    cfg: Config, info: dict, heldout_accuracy: float, weights: Path, command: str, threads: int
) -> dict:
    """Everything needed to rebuild a base and to check it is the one recorded."""
    return {
        "command": command,
        "warmup_seed": warmup_seed(cfg),
        "warmup": cfg.warmup.model_dump(exclude={"cache_dir"}),
        "tiny": cfg.model.tiny.model_dump(),
        "task": cfg.task.model_dump(exclude={"reward", "dataset_path"}),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "steps": info["steps"],
        "gate_accuracy": info["gate_accuracy"],
        "gate_size": info["gate_size"],
        "gate_curve": info["gate_curve"],
        "heldout_accuracy": heldout_accuracy,
        "sha256": sha256_file(weights),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "threads": threads,
        "seconds": round(info["seconds"], 1),
        "racers": info.get("racers"),  # a race's racers, the kept one's seed among them (warmup.racers)
    }


def write_base(
    cfg: Config, data: TaskData, out_dir: Path, threads: int, command: str, log: Callable[[str], None]
) -> tuple[float, dict]:
    """`nonstop warmup`: the tiny model warmed up on `data` with `threads`, written to `out_dir` with
    its provenance; (its held-out accuracy, the provenance)."""
    model, tok, info = warm_up(cfg, data, log, threads)
    torch.set_num_threads(threads)
    heldout = greedy_accuracy(
        TorchEngine(model, [tok.eos_token_id], tok.pad_token_id), tok, data.eval, cfg.rollout.max_new_tokens
    )
    save_atomically(out_dir, model, tok, {})
    prov = build_provenance(cfg, info, heldout, out_dir / "model.safetensors", command, threads)
    (out_dir / PROVENANCE).write_text(json.dumps(prov, indent=1) + "\n")
    return heldout, prov
