"""Seeds per prompt (rollout.seed_per_prompt): a draw's completions depend on the weights and the
draw only. The end-to-end proof (a resumed run repeats the uninterrupted one token for token) is
tests/faults/test_faults.py; the engine's half (a seeded request samples the same tokens whatever
shares its batch) is tests/engine/test_engine_batching.py."""

from __future__ import annotations

import asyncio

from nonstop.engine.aio import AsyncEngine
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.orchestrator.generate import draw_seed
from nonstop.orchestrator.records import completions_crc32
from nonstop.types import GenerationRequest, Group, Sample, SamplingParams


def test_draw_seeds_are_stable_distinct_and_leave_room_for_the_completion_index():
    seeds = {draw_seed(run, epoch, index) for run in (0, 1) for epoch in range(3) for index in range(500)}
    assert len(seeds) == 2 * 3 * 500
    assert all(0 <= s < 2**56 for s in seeds)  # + completion index stays within torch's seed range
    assert draw_seed(0, 1, 7) == 19869008325450464  # pinned: a run resumed by a later version draws the same seeds


def _group(index: int, completions: list[list[int]]) -> Group:
    samples = [Sample([1], c, [0.0] * len(c), [0] * len(c), "length") for c in completions]
    return Group(index, "p", "a", samples, epoch=0)


def test_completions_digest_changes_with_any_token_and_with_the_prompt():
    base = completions_crc32([_group(3, [[5, 6], [7]]), _group(4, [[1]])])
    assert base == completions_crc32([_group(3, [[5, 6], [7]]), _group(4, [[1]])])
    assert base != completions_crc32([_group(3, [[5, 6], [8]]), _group(4, [[1]])])
    assert base != completions_crc32([_group(3, [[5], [6, 7]]), _group(4, [[1]])])  # same tokens, other split
    assert base != completions_crc32([_group(3, [[5, 6], [7]]), _group(5, [[1]])])


def test_a_draw_seed_gives_the_same_completions_alone_or_among_other_draws(tiny_dir):
    """What the producer relies on: the request of one draw, generated alone or concurrently with
    other draws' requests (so sharing decode passes with them), samples the same tokens."""
    tok = load_tokenizer(str(tiny_dir))
    model = load_model(str(tiny_dir))
    prompt = tok("3+4=")["input_ids"]

    def request(index: int) -> GenerationRequest:
        return GenerationRequest(index, prompt, 4, SamplingParams(6, 1.0, seed=draw_seed(0, 0, index)))

    async def run(indices: list[int]) -> dict[int, list[list[int]]]:
        engine = AsyncEngine(TorchEngine(model, [tok.eos_token_id], tok.pad_token_id))
        try:
            results = await asyncio.gather(*(engine.generate([request(i)]) for i in indices))
        finally:
            await engine.close()
        return {i: [s.completion_ids for s in r[0]] for i, r in zip(indices, results)}

    alone = asyncio.run(run([7]))[7]
    crowded = asyncio.run(run([1, 2, 7, 9]))
    assert crowded[7] == alone
    assert crowded[1] != crowded[2]  # different draws, different noise


def test_an_engines_sampling_state_continues_its_random_stream(tiny_dir):
    """What a checkpoint keeps per engine: restoring the state makes an unseeded request draw
    the noise it would have drawn next, instead of the noise the engine drew at its start."""
    from nonstop.engine.worker import EngineWorker

    tok = load_tokenizer(str(tiny_dir))
    worker = EngineWorker(str(tiny_dir), [tok.eos_token_id], tok.pad_token_id, seed=3)
    request = GenerationRequest(0, tok("3+4=")["input_ids"], 4, SamplingParams(6, 1.0))

    async def run() -> tuple[list, list, list]:
        try:
            await worker.generate([request])
            state = await worker.sampling_state()
            first = await worker.generate([request])
            moved_on = await worker.generate([request])
            await worker.load_sampling_state(state)
            again = await worker.generate([request])
        finally:
            await worker.close()
        return first, moved_on, again

    first, moved_on, again = (r[0] for r in asyncio.run(run()))  # one request each: its samples
    ids = lambda samples: [s.completion_ids for s in samples]  # noqa: E731
    assert ids(again) == ids(first)
    assert ids(moved_on) != ids(first)
