"""The prefix cache (engine/prefix.py): prompts that share whole blocks with earlier ones prefill
only their tail, completions stay those of an engine without it, and the budget holds."""

from __future__ import annotations

import pytest
import torch

from nonstop.config import EngineConfig, TinyModelConfig
from nonstop.engine.core import TorchEngine
from nonstop.engine.prefix import BLOCK, PrefixCache
from nonstop.engine.runner import KVRunner
from nonstop.hf import load_model, load_tokenizer, stop_token_ids
from nonstop.models.tiny import make_tiny_model
from nonstop.tasks.chat import renderer
from nonstop.types import GenerationRequest, SamplingParams


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return make_tiny_model(TinyModelConfig()).eval()


def _shared_prompts(count: int, system: int = 40) -> list[list[int]]:
    """`count` prompts that begin with the same `system` tokens and end in tails of their own."""
    head = [3 + (7 * i) % 120 for i in range(system)]
    return [head + [5 + i % 100, 6, 7 + i % 3, 9 + (i * 13) % 90][: 2 + i % 3] for i in range(count)]


def _run(model, prompts, params: SamplingParams, n: int, prefix_tokens: int | None, slots: int = 16):
    settings = EngineConfig(max_concurrent_seqs=slots, max_seq_len=160, prefix_cache_tokens=prefix_tokens)
    engine = TorchEngine(model, [], 0, settings=settings)
    out = engine.generate([GenerationRequest(i, p, n, params) for i, p in enumerate(prompts)])
    return [[s.completion_ids for s in g] for g in out], [[s.logprobs for s in g] for g in out], engine


def test_a_prefill_that_starts_after_cached_positions_equals_the_whole_prefill(tiny):
    """Runner level: prompts prefilled as a cached head plus a tail (ragged starts, slots not
    consecutive, and beside decode rows) give the whole prefill's logits and KV."""
    runner = KVRunner(tiny, 8, 64)
    prompts = [list(range(3, 3 + n)) for n in (20, 33, 17)]
    whole = runner.prefill(torch.tensor([0, 1, 2]), prompts)
    whole_kv = runner.cache[:, :3].clone()
    starts = [16, 32, 5]
    runner.prefill(torch.tensor([3, 5, 7]), [p[:a] for p, a in zip(prompts, starts)])
    tails = runner.prefill(torch.tensor([3, 5, 7]), [p[a:] for p, a in zip(prompts, starts)], starts)
    torch.testing.assert_close(tails, whole, rtol=1e-5, atol=1e-5)
    for j, slot in enumerate((3, 5, 7)):
        n = len(prompts[j])
        torch.testing.assert_close(runner.cache[:, slot, :, :n], whole_kv[:, j, :, :n], rtol=1e-5, atol=1e-5)
    # the same tails packed beside two decode rows (slots 0 and 1 decode one token each)
    runner.prefill(torch.tensor([3, 4, 5]), [p[:a] for p, a in zip(prompts, starts)])
    mixed = runner.mixed(
        torch.tensor([1, 2]),
        torch.tensor([20, 33]),
        torch.tensor([3, 4, 5]),
        [p[a:] for p, a in zip(prompts, starts)],
        starts,
    )
    torch.testing.assert_close(mixed[2:], whole, rtol=1e-5, atol=1e-5)


def test_prompts_of_one_pass_share_the_prefix_the_first_computes(tiny):
    """Runner level: the second and third prompts begin like the first; within the same pass they
    compute only their tails, their shared positions copied layer by layer from the first's slot."""
    runner = KVRunner(tiny, 8, 64)
    head = list(range(3, 35))
    prompts = [[*head, 40, 41], [*head, 50], [*head[:16], 60, 61, 62]]
    whole = runner.prefill(torch.tensor([0, 1, 2]), prompts)
    whole_kv = runner.cache[:, :3].clone()
    starts, shares = [0, 32, 16], [(4, 5, 32), (5, 6, 16)]  # the third copies from the second's copy
    for decode in (False, True):
        runner.cache[:, 4:7].zero_()
        tails = [p[a:] for p, a in zip(prompts, starts)]
        if decode:
            out = runner.mixed(
                torch.tensor([1, 2]), torch.tensor([5, 6]), torch.tensor([4, 5, 6]), tails, starts, shares
            )[2:]
        else:
            out = runner.prefill(torch.tensor([4, 5, 6]), tails, starts, shares)
        torch.testing.assert_close(out, whole, rtol=1e-5, atol=1e-5)
        for j in range(3):
            n = len(prompts[j])
            torch.testing.assert_close(runner.cache[:, 4 + j, :, :n], whole_kv[:, j, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "params", [SamplingParams(12, 0.0), SamplingParams(12, 1.0, seed=5), SamplingParams(12, 0.8, top_p=0.9, seed=1)]
)
def test_completions_with_the_cache_equal_those_without(tiny, params):
    """Groups of 4 over prompts sharing 40 tokens, admitted a few at a time: later groups find the
    shared head cached and prefill only their tail; every token and logprob is the same."""
    prompts = _shared_prompts(12)
    off, off_lp, engine_off = _run(tiny, prompts, params, 4, 0)
    on, on_lp, engine_on = _run(tiny, prompts, params, 4, None)
    assert engine_off.scheduler.prefix is None and engine_on.scheduler.prefix is not None
    assert on == off
    assert max(abs(a - b) for g, h in zip(on_lp, off_lp) for s, t in zip(g, h) for a, b in zip(s, t)) < 1e-5
    stats_off, stats_on = engine_off.scheduler.stats, engine_on.scheduler.stats
    assert stats_off["prefix_hit_tokens"] == 0
    # 16 slots: 4 groups a pass; all but the very first reuse the 2 shared blocks (3 of the first
    # pass from the first prompt, within that pass; the 8 later ones from the cache)
    assert stats_on["prefix_hit_tokens"] == 11 * 32
    assert stats_on["prefill_tokens"] + stats_on["prefix_hit_tokens"] == stats_off["prefill_tokens"]


def test_the_budget_bounds_the_cache_and_evicts_least_recently_used_blocks(tiny):
    runner = KVRunner(tiny, 4, 128)
    cache = PrefixCache(runner.cache, 6 * BLOCK)
    prompts = [[10 + i] * (3 * BLOCK + 1) for i in range(4)]  # 3 whole blocks each, nothing shared
    for i, p in enumerate(prompts):
        runner.prefill(torch.tensor([0]), [p])
        cache.store(p, 0)
        assert cache.cached_tokens <= 6 * BLOCK
        if i == 1:  # prompt 0 used again: prompt 1's blocks are now the least recently used
            assert len(cache.match(prompts[0])) == 3
            cache.load(cache.match(prompts[0]), 1)
    assert cache.cached_tokens == 6 * BLOCK and cache.evictions == 6
    assert len(cache.match(prompts[3])) == 3 and len(cache.match(prompts[0])) == 0  # 2 evicted 1, then 3 evicted 0
    assert len(cache.match(prompts[1])) == 0 and len(cache.match(prompts[2])) == 3
    # a loaded prefix is the KV its prompt's prefill wrote
    runner.prefill(torch.tensor([2]), [prompts[3]])
    assert cache.load(cache.match(prompts[3]), 3) == 3 * BLOCK
    torch.testing.assert_close(runner.cache[:, 3, :, : 3 * BLOCK], runner.cache[:, 2, :, : 3 * BLOCK])
    # a prompt longer than the whole budget keeps what fits and never evicts its own blocks
    long = [99] * (8 * BLOCK)
    runner.prefill(torch.tensor([0]), [long])
    assert cache.store(long, 0) == 6 and len(cache.match(long)) == 6
    cache.clear()
    assert cache.cached_tokens == 0 and cache.match(long) == []


def test_the_cache_empties_when_new_weights_go_live(tiny):
    """A prompt admitted after a swap must not read the old weights' KV."""

    class SwapWhenArmed:  # a weight receiver whose next poll after arming reports version 1
        armed = False

        def maybe_update(self, model):
            if not self.armed:
                return None
            self.armed = False
            return 1

    prompts = _shared_prompts(2)
    engine = TorchEngine(tiny, [], 0, settings=EngineConfig(max_concurrent_seqs=4, max_seq_len=160))
    source = engine.weights = SwapWhenArmed()
    engine.generate([GenerationRequest(0, prompts[0], 1, SamplingParams(2, 0.0))])
    assert engine.scheduler.prefix.cached_tokens == 2 * BLOCK
    source.armed = True
    engine.generate([GenerationRequest(1, prompts[1], 1, SamplingParams(2, 0.0))])  # the swap comes first
    assert engine.policy_version == 1 and engine.scheduler.stats["prefix_hit_tokens"] == 0


SYSTEM_PROMPT = (
    "You are a careful arithmetic assistant. Read the question, add the two numbers, and answer with "
    "the sum as digits only: no words, no units, no explanation. If the question is not a sum, say so "
    "in one short sentence."
)


def _chat_prompts(folder, count: int) -> list[list[int]]:
    tokenizer = load_tokenizer(str(folder))
    render = renderer(tokenizer, SYSTEM_PROMPT)
    questions = [f"What is {a} + {b}?" for a, b in zip(range(3, 3 + count), range(40, 40 + 7 * count, 7))]
    return [tokenizer(render([{"role": "user", "content": q}]))["input_ids"] for q in questions]


@pytest.mark.parametrize("params", [SamplingParams(24, 0.0), SamplingParams(24, 1.0, seed=3)])
def test_smollm2_chat_prompts_sharing_a_system_prompt_complete_alike_with_the_cache(smollm2_dir, params):
    """SmolLM2 in float32, chat prompts under one system prompt, 3 groups of 4 at a time: the later
    groups reuse the template head and system prompt, and every completion is token for token
    the one without the cache."""
    folder = smollm2_dir
    model = load_model(str(folder), torch.float32)
    stops = stop_token_ids(load_tokenizer(str(folder)), folder)
    prompts = _chat_prompts(folder, 9)
    requests = [GenerationRequest(i, p, 4, params) for i, p in enumerate(prompts)]
    results = {}
    for tokens in (0, 4096):
        settings = EngineConfig(dtype="float32", max_concurrent_seqs=12, max_seq_len=128, prefix_cache_tokens=tokens)
        engine = TorchEngine(model, stops, 0, settings=settings)
        results[tokens] = ([[s.completion_ids for s in g] for g in engine.generate(requests)], engine.scheduler.stats)
    (off, stats_off), (on, stats_on) = results[0], results[4096]
    assert on == off
    common = next(i for i, t in enumerate(zip(*prompts)) if len(set(t)) > 1)  # tokens every prompt shares
    assert common >= 3 * BLOCK
    assert stats_on["prefix_hit_tokens"] >= 6 * (common // BLOCK) * BLOCK  # the 6 groups admitted later
    assert stats_on["prefill_tokens"] + stats_on["prefix_hit_tokens"] == stats_off["prefill_tokens"]
