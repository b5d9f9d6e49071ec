"""The vLLM engine (engine.kind: vllm) with the real vLLM on CPU: run in .venv-vllm (`make test-vllm`).

Each test starts one vLLM engine actor through the local backend (20-60 s on a busy 2-core
machine) and talks to it the way the pipeline does: EngineActor calls, weights through the shm
transport, behaviour logprobs checked against the trainer's own recomputation.

The mismatch bound: vLLM computes in float32 here (engine.vllm.dtype) with its own kernels
(fused q/k/v and gate/up projections, its CPU attention, its RMSNorm), so its logprobs are
those of the same function computed in a different order: float32 rounding differences of a
few 1e-6 per operation, which reach at most ~1e-4 in a logprob of these small models
(measured: see MAX_ABS_LOG_RATIO). A real error (a wrong weight, the raw instead of the
tempered distribution, a token stamped with the wrong version) moves logprobs by 1e-2 or more.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from nonstop.config import EngineConfig, LocalRuntimeConfig, ShmTransportConfig, TinyModelConfig, TrainerConfig
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.shipped import shipped_dir
from nonstop.models.tiny import save_tiny
from nonstop.runtime import make_backend
from nonstop.runtime.actor_clients import EngineActor
from nonstop.trainer.core import Trainer
from nonstop.transport import open_publisher, plan_transport
from nonstop.types import GenerationRequest, Group, SamplingParams

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

MEAN_ABS_LOG_RATIO = 2e-5  # bounds with ~10x margin over the measured values (module docstring)
MAX_ABS_LOG_RATIO = 5e-4
LONG = TinyModelConfig(
    hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_position_embeddings=160
)  # head size 32: the smallest vLLM's CPU attention takes


def vllm_settings(**engine) -> EngineConfig:
    return EngineConfig(kind="vllm", vllm={"kv_cache_gib": 0.25, "max_num_seqs": 64}, **engine)


async def start(
    run_dir: Path, model_dir: Path, settings: EngineConfig, model: torch.nn.Module, span_path: Path | None = None
):
    """A vLLM engine actor attached to a shm transport whose sending end is this process."""
    backend = make_backend(LocalRuntimeConfig(start_timeout_s=300), run_dir)
    engine = EngineActor(
        await backend.spawn(
            "engine",
            _worker(),
            str(model_dir),
            [2],
            0,
            0,
            settings=settings,
            span_path=None if span_path is None else str(span_path),
        )
    )
    publisher = open_publisher(plan_transport(ShmTransportConfig(), model, 1))
    await asyncio.gather(asyncio.to_thread(publisher.connect), engine.connect_transport(publisher.handle, 1))
    return engine, publisher


def _worker():
    from nonstop.engine.vllm.engine import VllmEngineWorker

    return VllmEngineWorker


def abs_log_ratios(model: torch.nn.Module, groups: list[Group], temperature: float) -> torch.Tensor:
    """|log pi - log mu| per completion token, pi recomputed by the trainer's own code."""
    trainer = Trainer(model, TrainerConfig(), temperature=temperature, pad_token_id=0)
    batch = trainer.batch_of(groups)
    with torch.no_grad():
        recomputed = trainer.logprobs(batch)
    m = batch["mask"]
    return (recomputed[m] - batch["behaviour"][m]).abs()


def as_groups(results) -> list[Group]:
    return [Group(i, "", "", samples) for i, samples in enumerate(results)]


def test_depth0_behaviour_logprobs_match_the_trainer_and_a_published_version_is_loaded(tmp_path):
    """The shipped base, 16 prompts x 8 completions at temperature 0.7: behaviour logprobs vs the
    trainer's; then new weights through shm: the next tokens carry version 1 and match them."""
    model_dir = shipped_dir()
    model = load_model(str(model_dir))
    tok = load_tokenizer(str(model_dir))

    async def go():
        engine, publisher = await start(tmp_path / "run", model_dir, vllm_settings(), model)
        try:
            reqs = [
                GenerationRequest(
                    i,
                    tok(f"{3 * i:02d}+{7 * i % 100:02d}=")["input_ids"],
                    8,
                    SamplingParams(max_new_tokens=4, temperature=0.7),
                )
                for i in range(16)
            ]
            first = await engine.generate(reqs)
            with torch.no_grad():  # a different policy, far from the first
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            publisher.publish(model, 1)
            second = await engine.generate(reqs)
            stats = (await engine.stats())[0]
            return first, second, stats
        finally:
            await engine.stop()
            publisher.close()

    first, second, stats = asyncio.run(go())
    assert all(v == 0 for g in first for s in g for v in s.versions)
    assert all(len(s.completion_ids) == len(s.logprobs) == len(s.versions) >= 1 for g in first for s in g)
    d0 = abs_log_ratios(load_model(str(model_dir)), as_groups(first), 0.7)
    print(f"depth 0: {d0.numel()} tokens, mean |log ratio| {d0.mean():.2e}, max {d0.max():.2e}")
    assert d0.mean() < MEAN_ABS_LOG_RATIO and d0.max() < MAX_ABS_LOG_RATIO, (float(d0.mean()), float(d0.max()))

    assert all(v == 1 for g in second for s in g for v in s.versions), "tokens after the update carry version 1"
    d1 = abs_log_ratios(model, as_groups(second), 0.7)
    print(f"after the update: mean |log ratio| {d1.mean():.2e}, max {d1.max():.2e}")
    assert d1.mean() < MEAN_ABS_LOG_RATIO and d1.max() < MAX_ABS_LOG_RATIO
    stale = abs_log_ratios(load_model(str(model_dir)), as_groups(second), 0.7)
    assert stale.mean() > 100 * MEAN_ABS_LOG_RATIO, "the update changed the policy vLLM samples from"
    assert stats["swaps"] == 1 and stats["policy_version"] == 1, stats


def test_an_update_mid_generation_stamps_later_tokens_and_they_match_the_new_weights(tmp_path):
    """abort_retry (vLLM's pause 'abort' + re-submission of prompt + prefix): a version published
    while 8 long completions decode; tokens before it match the old weights, tokens after it carry
    version 1 and match the new weights (re-prefilled under them)."""
    old_dir = save_tiny(tmp_path / "old", LONG, seed=0)
    new = load_model(str(save_tiny(tmp_path / "new", LONG, seed=1)))
    old = load_model(str(old_dir))

    async def go():
        engine, publisher = await start(tmp_path / "run", old_dir, vllm_settings(update_mode="abort_retry"), old)
        try:
            await engine.generate([GenerationRequest(99, [1, 5], 1, SamplingParams(2))])  # warm up
            req = GenerationRequest(0, [1, 5, 6, 7], 8, SamplingParams(max_new_tokens=150, temperature=1.0))
            task = asyncio.ensure_future(engine.generate([req]))
            while (await engine.stats())[0]["tokens_generated"] < 2 + 8 * 10:  # a few steps in
                await asyncio.sleep(0.01)
            publisher.publish(new, 1)
            return (await task)[0], (await engine.stats())[0]
        finally:
            await engine.stop()
            publisher.close()

    samples, stats = asyncio.run(go())
    assert stats["swaps"] == 1 and stats["aborted_seqs"] >= 1, stats
    straddling = [s for s in samples if 0 in s.versions and 1 in s.versions]
    assert straddling, [s.versions for s in samples]
    for s in samples:
        assert s.versions == sorted(s.versions)  # a version per token, never going back
    old_d = abs_log_ratios(old, [Group(0, "", "", samples)], 1.0)
    new_d = abs_log_ratios(new, [Group(0, "", "", samples)], 1.0)
    versions = torch.tensor([v for s in samples for v in s.versions])
    mine = torch.where(versions == 0, old_d, new_d)  # each token against the weights it names
    print(
        f"mid-generation: {int((versions == 1).sum())} of {len(versions)} tokens at version 1; "
        f"mean |log ratio| {mine.mean():.2e}, max {mine.max():.2e}"
    )
    assert mine.mean() < MEAN_ABS_LOG_RATIO and mine.max() < MAX_ABS_LOG_RATIO
    assert new_d[versions == 0].mean() > 100 * MEAN_ABS_LOG_RATIO  # the versions are not interchangeable


def test_vllm_setup_errors_name_the_fix(tmp_path):
    """Unsupported architecture and impossible memory: one line naming the field, before vLLM loads."""
    from nonstop.config import VllmConfig
    from nonstop.engine.vllm.setup import VllmSetupError, check_architecture, check_memory

    odd = tmp_path / "odd"
    save_tiny(odd, LONG)
    cfg = json.loads((odd / "config.json").read_text())
    (odd / "config.json").write_text(json.dumps({**cfg, "architectures": ["MadeUpForCausalLM"]}))
    with pytest.raises(
        VllmSetupError,
        match=r"architecture \['MadeUpForCausalLM'\] is not supported by vLLM.*"
        r"engine.kind: builtin",
    ):
        check_architecture(str(odd))
    check_architecture(str(shipped_dir()))
    narrow = save_tiny(tmp_path / "narrow", LONG.model_copy(update={"hidden_size": 32}))
    with pytest.raises(VllmSetupError, match=r"head size 16 is not supported by vLLM's CPU attention"):
        check_architecture(str(narrow))
    with pytest.raises(
        VllmSetupError, match=r"engine.vllm.kv_cache_gib: 100000.0 GiB .* lower engine.vllm.kv_cache_gib"
    ):
        check_memory(VllmConfig(kv_cache_gib=100000))
