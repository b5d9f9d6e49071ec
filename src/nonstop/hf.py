"""The one loading path for models and tokenizers (tiny built-ins and users' real models).

`load_model(path_or_hub_id)` is `AutoModelForCausalLM.from_pretrained` in float32 unless told
otherwise; a local folder written by `save_pretrained` and a hub id go through the same call.
`stop_token_ids(tokenizer, folder)` are the ids an engine stops at: the tokenizer's EOS, the
generation config's EOS ids (an instruct model often lists several) and the special token the chat
template writes right after an assistant message's content (`<|im_end|>` for ChatML templates,
`<|eot_id|>` for Llama 3), found by rendering a probe exchange.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel
from transformers.utils import logging as hf_logging

if TYPE_CHECKING:
    from peft import PeftModel

CausalLM: TypeAlias = "PreTrainedModel | PeftModel"
"""A causal language model as trainers hold it: a transformers model, or a peft model around one."""


def quiet_transformers() -> None:
    """Silence per-load progress bars and advisory warnings in worker output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    quiet_transformers()
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_tokenizer(path: str):
    quiet_transformers()
    return AutoTokenizer.from_pretrained(path)


def max_positions(path: str | Path) -> int:
    """The longest sequence the model at `path` supports, from its config alone."""
    return int(AutoConfig.from_pretrained(str(path)).max_position_embeddings)


PROBE = "Z7q"
"""A short assistant answer whose end marks where a chat template closes the turn."""


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def turn_end_ids(tokenizer: Any) -> list[int]:
    """The special token ids the chat template writes right after an assistant message's content
    ([] without a template, or when nothing special follows it)."""
    if not has_template(tokenizer):
        return []
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": PROBE}], tokenize=True
        )
    except Exception:  # a template that needs more than a plain user/assistant exchange
        return []
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    probe = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if getattr(t, "special", False)}
    for start in range(len(ids) - len(probe), -1, -1):
        if list(ids[start : start + len(probe)]) == probe:
            after = ids[start + len(probe) :]
            return [after[0]] if after and after[0] in special else []
    return []


def generation_eos_ids(path: str | Path) -> list[int]:
    """The EOS ids of the folder's generation_config.json ([] when it has none)."""
    try:
        eos = GenerationConfig.from_pretrained(str(path)).eos_token_id
    except (OSError, ValueError):  # no generation_config.json: the tokenizer's EOS is all there is
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [] if eos is None else [int(eos)]


def stop_token_ids(tokenizer: Any, path: str | Path | None = None) -> list[int]:
    """Every id that ends a completion for this model: EOS, the generation config's EOS ids and the
    chat template's end of turn, in that order, without repeats."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += generation_eos_ids(path) if path is not None else []
    ids += turn_end_ids(tokenizer)
    return list(dict.fromkeys(ids))
