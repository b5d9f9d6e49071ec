"""An engine built directly (no run to size it) keeps its KV cache within engine.kv_cache_fraction.

A real model's 8,192 positions times 256 slots, or times slots set by hand, is a cache larger
than the machine: bench/engine.py --model reached 23 GB and the machine thrashed (issue 52)."""

from __future__ import annotations

import psutil
import pytest
import torch

from nonstop.config import EngineConfig, TinyModelConfig
from nonstop.engine.core import TorchEngine, kv_bytes_per_token
from nonstop.hf import load_model
from nonstop.models.tiny import make_tiny_model
from nonstop.sizing.machine import machine_memory
from nonstop.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def long_tiny():
    """The tiny model with a real model's 8,192 positions."""
    return make_tiny_model(TinyModelConfig(max_position_embeddings=8192)).eval()


def _kv_bytes(engine: TorchEngine) -> int:
    return engine.runner.cache.numel() * engine.runner.cache.element_size()


def test_slots_set_by_hand_get_the_positions_the_budget_gives_them(long_tiny):
    settings = EngineConfig(max_concurrent_seqs=64, kv_cache_fraction=0.001)
    engine = TorchEngine(long_tiny, [], 0, settings=settings)
    budget = 0.001 * machine_memory().total
    per_token = kv_bytes_per_token(long_tiny.config, torch.float32)
    assert engine.runner.num_slots == 64
    assert engine.runner.max_seq_len == min(4096, int(budget // (64 * per_token)))
    assert _kv_bytes(engine) <= budget


def test_unset_limits_fit_the_budget(long_tiny):
    engine = TorchEngine(long_tiny, [], 0, settings=EngineConfig(kv_cache_fraction=0.001))
    assert engine.runner.max_seq_len == 4096
    assert _kv_bytes(engine) <= 0.001 * machine_memory().total or engine.runner.num_slots == 1


def test_a_cache_larger_than_the_machine_is_refused_naming_both_fields(long_tiny):
    settings = EngineConfig(max_concurrent_seqs=10**6, max_seq_len=8192)
    with pytest.raises(ValueError, match=r"engine.max_concurrent_seqs 1000000 x engine.max_seq_len 8192 tokens"):
        TorchEngine(long_tiny, [], 0, settings=settings)


def test_smollm2_built_with_default_settings_fits_the_budget_and_commits_what_it_uses(smollm2_dir):
    """The case of the issue: SmolLM2 (8,192 positions) with the engine's defaults, and with 64 slots.
    The cache's pages are committed as they are written, so building the engine costs little memory."""
    model = load_model(str(smollm2_dir), torch.float32)
    budget = EngineConfig().kv_cache_fraction * machine_memory().total
    process = psutil.Process()
    for settings in (EngineConfig(), EngineConfig(max_concurrent_seqs=64)):
        before = process.memory_info().rss
        engine = TorchEngine(model, [2], 0, settings=settings)
        assert _kv_bytes(engine) <= budget, settings
        assert process.memory_info().rss - before < 0.05 * _kv_bytes(engine)
        out = engine.generate([GenerationRequest(0, [1, 2, 3, 4, 5], 2, SamplingParams(4, 0.0))])
        assert [len(s.completion_ids) for s in out[0]] == [4, 4]
        del engine
