"""Shared fixtures: real tiny models saved on the fly, one thread per test process."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".nonstop_cache" / "inductor"))
torch.set_num_threads(1)

from nonstop.config import TinyModelConfig  # noqa: E402
from nonstop.hf import quiet_transformers  # noqa: E402
from nonstop.tasks.tiny import save_tiny  # noqa: E402

quiet_transformers()
sys.path.insert(0, str(Path(__file__).resolve().parent))  # helper modules (rewards for tests)

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A small random Qwen2 model and char tokenizer written with save_pretrained."""
    return save_tiny(tmp_path_factory.mktemp("tiny"), SMALL, seed=0)
