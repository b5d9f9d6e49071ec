"""Several engines behind the least-loaded pool, several trainer ranks in lockstep, through the
typed clients: real actors, a real broadcast transport group (trainer rank 0 + engines 1..2)."""

from __future__ import annotations

import asyncio

import torch
from transformers import AutoModelForCausalLM

from nonstop.config import Config
from nonstop.hf import load_tokenizer
from nonstop.orchestrator.actors import connect_transport, spawn_engine, spawn_trainers
from nonstop.orchestrator.dispatch import EnginePool, place
from nonstop.runtime import make_backend
from nonstop.types import GenerationRequest, Group, SamplingParams


def _requests(tok, count: int, n: int, first: int = 0) -> list[GenerationRequest]:
    return [
        GenerationRequest(first + i, tok(f"{first + i}+{i}=")["input_ids"], n, SamplingParams(4, 1.0))
        for i in range(count)
    ]


def test_two_engines_two_fsdp2_ranks_each_prompt_once_and_every_engine_gets_each_version(tiny_dir, tmp_path):
    tok = load_tokenizer(str(tiny_dir))
    cfg = Config.model_validate(
        {
            "model": {"path": str(tiny_dir)},
            "rollout": {"prompts_per_step": 4, "group_size": 3},
            "runtime": {"num_engines": 2},
            "transport": {"kind": "broadcast", "timeout_s": 60},
            "trainer": {"ranks": 2, "data_parallel": "fsdp2", "lr": 1e-2},
            "checkpoint": {"every_steps": None},
        }
    )

    async def go():
        backend = make_backend(cfg.runtime)
        try:
            engines, ranks = await asyncio.gather(
                asyncio.gather(*(spawn_engine(backend, cfg, tiny_dir, tok, i) for i in range(2))),
                spawn_trainers(backend, cfg, tiny_dir, tok),
            )
            await connect_transport(cfg, ranks, list(engines), backend.host)
            pool = EnginePool(list(engines))
            assert [e.name for e in pool.engines] == ["engine-0", "engine-1"]
            assert [r.name for r in ranks.ranks] == ["trainer-0", "trainer-1"]

            # one large call and two concurrent small ones: every request answered once, in order
            reqs = _requests(tok, 10, 3)
            extra_a, extra_b = _requests(tok, 1, 3, first=100), _requests(tok, 1, 3, first=200)
            big, a, b = await asyncio.gather(pool.generate(reqs), pool.generate(extra_a), pool.generate(extra_b))
            for req, samples in zip(reqs + extra_a + extra_b, big + a + b):
                assert len(samples) == req.n and all(s.prompt_ids == req.prompt_ids for s in samples)
            assert pool.served[0] > 0 and pool.served[1] > 0 and sum(pool.served) == 36
            assert pool.in_flight == [0, 0]
            stats = await pool.stats()
            tokens = sum(len(s.completion_ids) for samples in big + a + b for s in samples)
            assert sum(st["tokens_generated"] for st in stats) == tokens  # nothing generated twice

            for version in (1, 2):
                groups = []
                for i, samples in enumerate(big[:4]):
                    for j, s in enumerate(samples):
                        s.reward = float(j == i % 3)
                    groups.append(Group(i, "p", "a", samples))
                result = await ranks.step(groups)
                assert result.policy_version == version and result.metrics["samples"] == 12
                published = await ranks.publish()  # both FSDP2 ranks gather; rank 0 sends
                assert published.policy_version == version and published.publish_bytes > 0
                # the next samples of both engines carry the published version
                after = await pool.generate(_requests(tok, 4, 2, first=300))
                assert {v for samples in after for s in samples for v in s.versions} == {version}
                assert pool.versions == [version, version]
                assert [st["policy_version"] for st in await pool.stats()] == [version, version]
                assert await pool.ping() == version

            # the gathered FSDP2 save is the model the engines sample from
            await ranks.save(str(tmp_path / "final"))
            saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
            for samples in after:
                s = samples[0]
                ids = torch.tensor([s.prompt_ids + s.completion_ids])
                with torch.no_grad():
                    logp = torch.log_softmax(saved(ids).logits[0].float(), -1)  # (L, V)
                P = len(s.prompt_ids)
                ours = logp[P - 1 : P - 1 + len(s.completion_ids)].gather(-1, torch.tensor(s.completion_ids)[:, None])
                assert torch.allclose(ours.squeeze(-1), torch.tensor(s.logprobs), atol=1e-4)
        finally:
            await backend.shutdown()

    asyncio.run(go())


def test_least_loaded_placement_counts_samples_in_flight(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    in_flight = [0, 0, 0]
    assert place(in_flight, _requests(tok, 1, 8)) == [[0], [], []]
    assert place(in_flight, _requests(tok, 4, 2)) == [[], [0, 2], [1, 3]]
    assert in_flight == [8, 4, 4]
    assert place(in_flight, _requests(tok, 1, 2)) == [[], [0], []]


def test_an_engine_that_is_down_gets_no_new_request_while_another_is_up(tiny_dir):
    """Engine 1 is being replaced (its calls wait for the replacement): the others take the work,
    however few samples it holds; with every engine down, placement falls back to all of them."""
    tok = load_tokenizer(str(tiny_dir))
    in_flight = [8, 0, 4]
    assert place(in_flight, _requests(tok, 3, 2), up=[True, False, True]) == [[2], [], [0, 1]]
    assert in_flight == [10, 0, 8]
    assert place(in_flight, _requests(tok, 1, 2), up=[False, False, False]) == [[], [0], []]
