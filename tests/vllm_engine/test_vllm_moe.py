"""Keep Routing with the vLLM engine: vLLM's routed experts recorded into the samples as the
built-in engine records them, so `trainer.routing_replay: r3` works with `engine.kind: vllm`.
Real vLLM on CPU, in .venv-vllm (`make test-vllm`).

The check that can fail: the trainer's forward with the recorded experts forced on every router
(r3) must reproduce vLLM's behaviour logprobs within the dense bounds of tests/vllm_engine/test_vllm.py. A
route row shifted by one token, rows given to the wrong request, a wrong layer, or routes kept
from before a weight update route tokens through other experts and move logprobs by far more.
"""

from __future__ import annotations

import asyncio
import copy
import json

import numpy as np
import pytest
import torch

from nonstop.config import TinyModelConfig, TinyMoeConfig, TrainerConfig
from nonstop.hf import load_model
from nonstop.kept import Routes
from nonstop.models.tiny import save_tiny
from nonstop.trainer.core import Trainer
from nonstop.types import GenerationRequest, Group, SamplingParams

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from test_vllm import MAX_ABS_LOG_RATIO, MEAN_ABS_LOG_RATIO, start, vllm_settings  # noqa: E402

MOE = TinyModelConfig(
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=160,  # head size 32: vLLM's CPU attention needs >= 32
    moe=TinyMoeConfig(kind="qwen3_moe", num_experts=8, experts_per_token=2, expert_intermediate_size=32),
)


def _routes(r: Routes) -> np.ndarray:
    return np.frombuffer(r.prompt + bytes(r.completion), dtype=np.uint8).reshape(-1, r.num_layers, r.top_k)


def _replayed(model: torch.nn.Module, groups: list[Group], replay: str) -> tuple[torch.Tensor, dict[str, float]]:
    """|log pi - log mu| per completion token with the routes replayed (r3) or free, and the
    routing metrics of that forward."""
    trainer = Trainer(copy.deepcopy(model), TrainerConfig(routing_replay=replay), temperature=1.0, pad_token_id=0)
    batch = trainer.batch_of(groups)
    routes = batch["routes"]
    assert trainer.routing is not None
    trainer.routing.arm(routes.reshape(-1, *routes.shape[2:]))
    with torch.no_grad():
        logp = trainer.logprobs(batch)
    metrics = trainer.routing.disarm()
    m = batch["mask"]
    return (logp[m] - batch["behaviour"][m]).abs(), metrics


def test_vllm_routes_replayed_by_the_trainer_reproduce_its_logprobs_before_and_after_an_update(tmp_path):
    model_dir = save_tiny(tmp_path / "moe", MOE, seed=0)
    model = load_model(str(model_dir))
    spans = tmp_path / "spans" / "engine-0.jsonl"
    requests = [
        GenerationRequest(
            i, [1, 5 + i, 7, 9, 11 + i, 4, 8][: 3 + i % 5], 4, SamplingParams(max_new_tokens=8, temperature=1.0)
        )
        for i in range(8)
    ]

    async def go():
        engine, publisher = await start(tmp_path / "run", model_dir, vllm_settings(), model, span_path=spans)
        try:
            first = await engine.generate(requests)
            with torch.no_grad():  # new router and experts: other routes for the same prompts
                for layer in model.model.layers:
                    layer.mlp.gate.weight.mul_(-3.0)
                    layer.mlp.experts.gate_up_proj.add_(0.5 * torch.randn(layer.mlp.experts.gate_up_proj.shape))
            publisher.publish(model, 1)
            second = await engine.generate(requests)  # the same prompts, under the new weights
            return first, second, (await engine.stats())[0]
        finally:
            await engine.stop()
            publisher.close()

    first, second, stats = asyncio.run(go())
    assert stats["routes_missing"] == 0 and stats["swaps"] == 1, stats
    for out in (first, second):
        for req, samples in zip(requests, out):
            for s in samples:
                assert s.routes is not None and (s.routes.num_layers, s.routes.top_k, s.routes.num_experts) == (2, 2, 8)
                assert s.routes.num_prompt_tokens == len(req.prompt_ids)
                assert s.routes.num_completion_tokens == len(s.completion_ids) - 1
                assert int(_routes(s.routes).max()) < 8
                assert all(
                    len(set(row)) == 2 for row in _routes(s.routes).reshape(-1, 2).tolist()
                )  # k distinct experts
    old_groups = [Group(i, "", "", s) for i, s in enumerate(first)]
    new_groups = [Group(i, "", "", s) for i, s in enumerate(second)]
    assert all(v == 0 for g in old_groups for s in g.samples for v in s.versions)
    assert all(v == 1 for g in new_groups for s in g.samples for v in s.versions)
    # the prompts' routes changed with the router: recorded under the new weights
    before = np.concatenate([_routes(g.samples[0].routes)[: len(r.prompt_ids)] for g, r in zip(old_groups, requests)])
    after = np.concatenate([_routes(g.samples[0].routes)[: len(r.prompt_ids)] for g, r in zip(new_groups, requests)])
    assert (np.sort(before, -1) != np.sort(after, -1)).any()

    old = load_model(str(model_dir))
    for weights, groups, label in ((old, old_groups, "v0"), (model, new_groups, "v1")):
        kept, m_kept = _replayed(weights, groups, "r3")
        free, m_free = _replayed(weights, groups, "none")
        print(
            f"vLLM MoE {label}: r3 mean |log ratio| {kept.mean():.2e} max {kept.max():.2e}; free routing "
            f"mismatch {m_free['routing_free_mismatch_frac']:.4f}, free max |log ratio| {free.max():.2e}"
        )
        assert m_kept["routing_replayed_frac"] == 1.0  # the experts computed with were vLLM's for every routed token
        assert kept.mean() < MEAN_ABS_LOG_RATIO and kept.max() < MAX_ABS_LOG_RATIO, (
            float(kept.mean()),
            float(kept.max()),
        )
        assert m_free["routing_free_mismatch_frac"] < 0.05  # one precision: the free router mostly agrees with vLLM's
        assert m_free["routing_replayed_frac"] == pytest.approx(1 - m_free["routing_free_mismatch_frac"])
    wrong, _ = _replayed(old, new_groups, "r3")  # v1's routes and tokens against v0's weights
    assert wrong.mean() > 100 * MEAN_ABS_LOG_RATIO

    # the span log, as the built-in engine writes it: busy chunks covering every token, one apply
    events = [json.loads(line) for line in spans.read_text().splitlines()]
    assert events[0]["ev"] == "clock"
    busy = [e for e in events if e["ev"] == "busy"]
    assert (
        sum(e["rows"] for e in busy) == stats["tokens_generated"]
        and sum(e["passes"] for e in busy) == stats["forward_passes"]
    )
    assert all(e["t0"] <= e["t1"] and 0 < e["busy_s"] <= e["t1"] - e["t0"] + 1e-6 for e in busy)
    [apply] = [e for e in events if e["ev"] == "apply"]
    assert apply["version"] == 1 and apply["t0"] <= apply["t1"]
    assert max(e["t1"] for e in busy if e["t0"] < apply["t0"]) <= apply["t0"] + 1e-6  # between two steps
