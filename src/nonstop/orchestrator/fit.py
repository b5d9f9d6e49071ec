"""Fitting a run to the machine before any actor starts: need -> resolved defaults -> memory plan.

`fit_run(cfg, data, model_dir)` is what `run_training` calls once it has the task's rows and
before it makes the run folder (and again on resume, where defaults resolve afresh from the
run's config.yaml):

1. chat rows rendered through the model's chat template (tasks/chat.py), so that every later
   step measures and encodes the text the model will see;
2. the longest prompt the run admits: every train and held-out prompt tokenised with the
   policy's tokenizer, those over the screening limit left out (task.max_prompt_tokens, else
   the model's positions minus the completion's tokens: the rule build.screen applies);
3. the need-dependent defaults resolved (sizing/defaults.py): for a loaded model of >= 50 M
   parameters rollout.max_new_tokens and run.eval_every where unset; engine.max_seq_len,
   engine.max_concurrent_seqs, engine.vllm.max_model_len, trainer.lr;
4. the memory plan (sizing/memory.py) of that resolved config. Where it is over its limit and
   trainer.micro_batch_tokens was resolved, not set, the budget is lowered to what the rest of the
   plan leaves (`micro_batch_within`) and the plan made again;
5. the plan checked: a run that cannot fit
   raises ConfigError naming the field to change. With engine.kind vllm, a KV reserve smaller
   than one sequence of max_model_len is refused too (vLLM's own error comes only after it
   loaded the model).

Nothing here loads weights: the shape comes from config.json, the tokenizer from the model
folder (the built-in character tokenizer for the tiny model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nonstop.config import Config, ConfigError
from nonstop.config.preflight import resolve_model_path
from nonstop.hf import load_tokenizer
from nonstop.models.base_policy import builds_warmup_base
from nonstop.models.tiny import make_char_tokenizer, tiny_config
from nonstop.sizing.defaults import (
    ACTIVATION_FRACTION,
    Sized,
    forward_tokens,
    loaded_model_defaults,
    size_run,
    vllm_dtype,
)
from nonstop.sizing.machine import GIB, MachineMemory, machine_memory, size
from nonstop.sizing.memory import VLLM_BYTES, MemoryPlan, plan_memory
from nonstop.sizing.shape import ModelShape
from nonstop.tasks.chat import render_chat

if TYPE_CHECKING:
    from nonstop.tasks.data import TaskData


@dataclass(frozen=True)
class Fitted:
    cfg: Config
    """The run's config with its need-dependent defaults resolved: what every actor gets."""
    plan: MemoryPlan
    shape: ModelShape


def longest_prompt(cfg: Config, data: TaskData, encode, max_positions: int) -> int:
    """Tokens of the longest prompt the run admits (see step 1 of the module docstring)."""
    new_tokens = cfg.env.max_episode_tokens if cfg.env is not None else cfg.rollout.max_new_tokens
    limit = cfg.task.max_prompt_tokens or max_positions - new_tokens
    prompts = sorted({ex.prompt for split in (data.train, data.eval) for ex in split})
    lengths = [len(ids) for ids in encode(prompts)] if prompts else [1]
    admitted = [n for n in lengths if n <= limit]
    return max(admitted) if admitted else limit


def micro_batch_within(sized: Sized, shape: ModelShape, plan: MemoryPlan) -> Sized | None:
    """`sized` with its resolved trainer.micro_batch_tokens lowered until `plan` fits its limit, or None
    when even one sequence's micro-batch would not (the plan's refusal then names what to change).

    The resolved budget gives one micro-batch's activations a fixed fraction of the machine's memory
    (sizing/defaults.py), whatever the rest of the plan holds; a 0.5B model's weights, gradients,
    AdamW states, engine and weight slots leave less than that on a 23 GiB machine. Each token
    removed frees its activations and their share of the trainer's headroom."""
    t = sized.cfg.trainer
    budget = t.micro_batch_tokens
    if budget is None:
        return None
    per_token = shape.activation_bytes_per_token(t.activation_checkpointing) * (1 + sized.cfg.run.memory_headroom)
    lower = budget - math.ceil((plan.total - plan.limit) / per_token)
    if lower < sized.seq_len:  # a sample is never cut: one sequence is the least a micro-batch holds
        return None
    was = next(n for n in sized.notes if n.startswith("trainer.micro_batch_tokens:"))
    whole = forward_tokens(sized.cfg, shape, sized.seq_len)[0]
    note = (
        f"trainer.micro_batch_tokens: {lower} (the {budget} whose activations fit "
        f"{ACTIVATION_FRACTION:g} of the machine's memory left the plan {size(plan.total - plan.limit)} over "
        f"{size(plan.limit)}: micro-batches of what the rest of the plan leaves; {math.ceil(whole / lower)} "
        f"micro-batches of the batch's {whole:,} tokens at most)"
    )
    trainer = t.model_copy(update={"micro_batch_tokens": lower})
    notes = tuple(note if n == was else n for n in sized.notes)
    return replace(sized, cfg=sized.cfg.model_copy(update={"trainer": trainer}), notes=notes)


def _tokenizer(model_dir: Path | None) -> Any:
    """The policy's tokenizer: the model folder's, or the built-in tiny model's."""
    return load_tokenizer(str(model_dir)) if model_dir is not None else make_char_tokenizer()


def shape_of(cfg: Config, model_dir: Path | None) -> ModelShape:
    """The shape of the run's policy: `model_dir`'s config.json (the resolved model.path), or the
    built-in tiny model's when model.path is None."""
    if model_dir is not None:
        return ModelShape.from_folder(model_dir)
    return ModelShape.from_config(tiny_config(cfg.model.tiny).to_dict())


def check_vllm_kv(cfg: Config, shape: ModelShape, machine_total: int) -> None:
    """ConfigError when vLLM's KV reserve cannot hold one sequence of max_model_len tokens."""
    v = cfg.engine.vllm
    if cfg.engine.kind != "vllm" or v.max_model_len is None:
        return
    nbytes = VLLM_BYTES.get(vllm_dtype(v.dtype, shape), 4)
    weights = shape.params * nbytes
    reserve = v.kv_cache_gib * GIB if v.kv_cache_gib is not None else v.memory_fraction * machine_total - weights
    need = v.max_model_len * shape.kv_bytes_per_token(nbytes)
    if need > reserve:
        whence = (
            f"engine.vllm.kv_cache_gib {v.kv_cache_gib:g}"
            if v.kv_cache_gib is not None
            else f"memory_fraction {v.memory_fraction:g} x {size(machine_total)} - weights {size(weights)}"
        )
        raise ConfigError(
            f"engine.vllm.max_model_len: one sequence of {v.max_model_len} tokens needs {size(need)} of KV cache "
            f"({shape.kv_formula(nbytes)} per token) but vLLM would keep {size(max(0, reserve))} for it ({whence}); "
            "lower engine.vllm.max_model_len, or raise engine.vllm.memory_fraction or engine.vllm.kv_cache_gib"
        )


def fit_run(cfg: Config, data: TaskData, model_dir: Path | None = None, machine: MachineMemory | None = None) -> Fitted:
    """The resolved config and its checked memory plan (see the module docstring).
    `model_dir`: the resolved model.path folder (None: resolved here; the tiny model has none)."""
    if model_dir is None and cfg.model.path is not None:
        model_dir = resolve_model_path(cfg.model.path)
    machine = machine or machine_memory()
    shape = shape_of(cfg, model_dir)
    cfg, loaded_notes = loaded_model_defaults(cfg, shape.params)
    tok = _tokenizer(model_dir)
    t = cfg.task
    if cfg.env is None:  # chat rows become prompt text before any prompt is measured or encoded
        render_chat(data, tok, t.system_prompt, t.chat_strings, t.on_bad_row)
    encode = lambda texts: tok(texts)["input_ids"]  # noqa: E731
    longest = 0 if cfg.env is not None else longest_prompt(cfg, data, encode, shape.max_positions)
    sized = size_run(cfg, shape, longest, machine.total, warmed_up=builds_warmup_base(cfg))

    def folder_of(path: str, field: str) -> Path:
        return resolve_model_path(path, field=field) if not Path(path).is_dir() else Path(path)

    plan = plan_memory(sized.cfg, shape, machine, loaded_notes + sized.notes, folder_of, sized.seq_len)
    if plan.total > plan.limit and cfg.trainer.micro_batch_tokens is None and sized.cfg.trainer.ranks == 1:
        smaller = micro_batch_within(sized, shape, plan)
        if smaller is not None:
            sized = smaller
            plan = plan_memory(sized.cfg, shape, machine, loaded_notes + sized.notes, folder_of, sized.seq_len)
    check_vllm_kv(sized.cfg, shape, machine.total)
    plan.check()
    return Fitted(sized.cfg, plan, shape)
