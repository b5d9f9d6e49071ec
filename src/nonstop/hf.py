"""The one loading path for models and tokenizers (tiny built-ins and users' real models).

`load_model(path_or_hub_id)` is `AutoModelForCausalLM.from_pretrained` in float32 unless told
otherwise; a local folder written by `save_pretrained` and a hub id go through the same call.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

CausalLM: TypeAlias = "PreTrainedModel | PeftModel"
"""A causal language model as trainers hold it: a transformers model, or a peft model around one."""


def quiet_transformers() -> None:
    """Silence per-load progress bars and advisory warnings in worker output."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def load_model(path: str, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    quiet_transformers()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_tokenizer(path: str):
    quiet_transformers()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def max_positions(path: str | Path) -> int:
    """The longest sequence the model at `path` supports, from its config alone."""
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(path)).max_position_embeddings)
