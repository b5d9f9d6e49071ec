"""The decode hot path's shortcuts give exactly what the plain forms give."""

import pytest
import torch

from nonstop.config import EngineConfig, TinyModelConfig
from nonstop.engine.blocks import attention_blocks, attention_reads, block_order, reorder_plan
from nonstop.engine.core import TorchEngine
from nonstop.engine.sampling import BLOCK, ONE_LEVEL_MAX_V, RowParams, _two_levels, categorical, row_params, sample
from nonstop.models.tiny import make_tiny_model
from nonstop.types import GenerationRequest, SamplingParams

SETTINGS = [(1.0, 0, 1.0, 0.0), (0.7, 20, 0.9, 0.0), (0.0, 0, 1.0, 0.0), (1.3, 5, 1.0, 0.05)]


def _plain(settings, generators) -> RowParams:
    """Row parameters built column by column, flags from tensor reductions (the reference form)."""
    t = torch.tensor([s[0] for s in settings], dtype=torch.float32)
    return RowParams(
        t,
        torch.tensor([s[1] for s in settings], dtype=torch.long),
        torch.tensor([s[2] for s in settings], dtype=torch.float32),
        torch.tensor([s[3] for s in settings], dtype=torch.float32),
        generators,
        any_sampled=bool((t > 0).any()),
        any_greedy=bool((t == 0).any()),
        any_truncates=any(a > 0 and (b > 0 or c < 1.0 or d > 0.0) for a, b, c, d in settings),
    )


def test_row_params_table_equals_the_columns_built_one_by_one():
    for settings in ([SETTINGS[0]] * 7, [SETTINGS[i % 4] for i in range(11)], [SETTINGS[1], SETTINGS[3]], []):
        gens = [torch.Generator().manual_seed(i) if i % 3 == 0 else None for i in range(len(settings))]
        got, ref = row_params(settings, gens), _plain(settings, gens)
        for name in ("temperature", "top_k", "top_p", "min_p"):
            a, b = getattr(got, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert (got.any_sampled, got.any_greedy, got.any_truncates) == (
            ref.any_sampled,
            ref.any_greedy,
            ref.any_truncates,
        )
        assert got.unit_temperature == all(s[0] == 1.0 for s in settings)
        assert [i for i, _ in got.seeded] == [i for i, g in enumerate(gens) if g is not None]


def test_sample_with_the_table_equals_sample_with_the_plain_columns():
    logits = torch.randn(12, 128, generator=torch.Generator().manual_seed(0)) * 3
    for settings in ([SETTINGS[0]] * 12, [SETTINGS[i % 4] for i in range(12)]):
        outs = []
        for build in (row_params, _plain):
            gens = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(12)]
            torch.manual_seed(7)
            outs.append(sample(logits, build(settings, gens)))
        (t1, l1, k1), (t2, l2, k2) = outs
        assert torch.equal(t1, t2) and torch.equal(l1, l2)
        assert (k1 is None and k2 is None) or torch.equal(k1, k2)


def test_move_copies_several_slots_of_every_layer_either_way():
    model = make_tiny_model(TinyModelConfig()).eval()
    engine = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=24, max_seq_len=32))
    runner = engine.runner
    runner.cache.copy_(torch.randn(runner.cache.shape))
    assert all(k.data_ptr() != v.data_ptr() for k, v in zip(runner.k, runner.v))
    for src, dst in (([20, 21, 23], [2, 5, 7]), (list(range(12, 24)), list(range(12)))):  # slices; one indexed copy
        before = runner.cache.clone()
        runner.move(src, dst, 9)
        for a, b in zip(src, dst):
            assert torch.equal(runner.cache[:, b, :, :9], before[:, a, :, :9])
            assert torch.equal(runner.cache[:, b, :, 9:], before[:, b, :, 9:])  # past `length`: untouched
        untouched = [s for s in range(24) if s not in dst]
        assert torch.equal(runner.cache[:, untouched], before[:, untouched])


def test_a_prompt_packed_beside_decode_rows_gets_the_kv_and_logits_of_its_own_prefill():
    """A prompt prefilled beside decode rows (keys read back from the cache) gets the logits and the
    cached K/V that a prefill of it alone gives."""
    model = make_tiny_model(TinyModelConfig()).eval()
    engine = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=8, max_seq_len=32))
    runner = engine.runner
    runner.cache.copy_(torch.randn(runner.cache.shape))  # stale data past every prompt's end
    runner.prefill(torch.arange(3), [[5, 6, 7, 8], [9, 10], [11, 12, 13]])
    prompts = [[20, 21, 22, 23, 24], [30, 31], [40, 41, 42]]
    mixed = runner.mixed(torch.tensor([1, 2, 3]), torch.tensor([4, 2, 3]), torch.tensor([3, 4, 5]), prompts)
    mixed_k = [k[3:6].clone() for k in runner.k]
    alone = runner.prefill(torch.tensor([3, 4, 5]), prompts)
    torch.testing.assert_close(mixed[3:], alone, rtol=1e-5, atol=1e-5)
    for k_mixed, k in zip(mixed_k, runner.k):
        for j, p in enumerate(prompts):
            torch.testing.assert_close(k_mixed[j, :, : len(p)], k[3 + j, :, : len(p)], rtol=1e-5, atol=1e-5)


def test_a_seeded_batch_generates_the_same_tokens_and_logprobs_twice():
    model = make_tiny_model(TinyModelConfig()).eval()
    engine = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=4, max_seq_len=48))
    reqs = [GenerationRequest(i, [3, 4 + i, 5], 1, SamplingParams(4 + 3 * i, 1.0, seed=i)) for i in range(6)]
    first = engine.generate(reqs)
    again = engine.generate(reqs)
    assert [[s.completion_ids for s in g] for g in first] == [[s.completion_ids for s in g] for g in again]
    assert [[s.logprobs for s in g] for g in first] == [[s.logprobs for s in g] for g in again]


def test_permute_gives_each_slot_its_source_prefix_and_leaves_fixed_slots_alone():
    model = make_tiny_model(TinyModelConfig()).eval()
    engine = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=8, max_seq_len=32))
    runner = engine.runner
    runner.cache.copy_(torch.randn(runner.cache.shape))
    before = runner.cache.clone()
    order = [2, 1, 3, 0, 6, 5, 4]  # a 3-cycle 0<-2<-3<-0, a swap 4<->6, fixed 1 and 5; slot 7 is past the rows
    lengths = [5, 9, 12, 3, 7, 2, 10]
    runner.permute(order, lengths)
    for i, src in enumerate(order):
        n = lengths[src]
        assert torch.equal(runner.cache[:, i, :, :n], before[:, src, :, :n])
    for fixed in (1, 5, 7):
        assert torch.equal(runner.cache[:, fixed], before[:, fixed])


def test_block_order_moves_only_rows_in_the_wrong_block_and_cuts_the_reads():
    keys = [100, 10] * 16  # long and short rows interleaved: every block of 16 reads up to 100
    assert attention_blocks(keys) == [(0, 32, 100)]  # blocks would save nothing: one padded block
    assert attention_reads(keys) == 32 * 100
    order = block_order(keys)
    assert sorted(order) == list(range(32))
    moved = [i for i, r in enumerate(order) if r != i]
    assert len(moved) == 16  # the 8 short rows of block 0 and the 8 long rows of block 1 swap blocks
    assert [keys[r] for r in order] == [100] * 16 + [10] * 16
    assert attention_blocks([keys[r] for r in order]) == [(0, 16, 100), (16, 32, 10)]
    assert attention_reads([keys[r] for r in order]) == 16 * 100 + 16 * 10
    assert block_order([100] * 16 + [10] * 16) == list(range(32))  # in order already: nothing moves
    assert reorder_plan(keys) == order  # halves the reads for a copy of 8 x 100 + 8 x 10 positions
    assert reorder_plan([100] * 16 + [10] * 16) is None
    # one long row among 31 short ones: its block reads 16 x 100 either way, so a move saves nothing
    assert reorder_plan([10] * 20 + [100] + [10] * 11) is None


def test_uneven_lengths_reorder_the_batch_and_greedy_tokens_equal_each_request_alone():
    """Rows of very different lengths in a refilling batch get reordered by length (engine/blocks.py),
    and every request still decodes exactly what it decodes alone."""
    model = make_tiny_model(TinyModelConfig()).eval()
    # long requests admitted after short ones sit in the last rows; as short rows finish, the last
    # rows fill their slots and the long ones scatter over every attention block
    lengths = [10 + (i * 7) % 31 for i in range(32)] + [120] * 16 + [6 + (i * 5) % 25 for i in range(48)]
    reqs = [GenerationRequest(i, [3, 4 + i % 50, 5], 1, SamplingParams(n, 0.0)) for i, n in enumerate(lengths)]
    engine = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=48, max_seq_len=128))
    together = engine.generate(reqs)
    assert engine.scheduler.stats["reorders"] > 0
    alone = TorchEngine(model, [], 0, settings=EngineConfig(max_concurrent_seqs=1, max_seq_len=128))
    for req, got in zip(reqs, together):
        ref = alone.generate([req])[0][0]
        assert got[0].completion_ids == ref.completion_ids
        assert got[0].logprobs == pytest.approx(ref.logprobs, abs=1e-4)


def test_categorical_inverts_the_cumulative_sum_across_blocks_and_skips_zero_probabilities():
    """Hand-placed mass over a vocabulary of 3 blocks and a remainder: each u lands on the token
    whose cumulative share first passes it, whatever block it falls in; zero-mass tokens, the
    padding past V included, are never drawn, even for u just below 1. The same holds for the
    one-level sum that `categorical` takes at this small vocabulary and for the two levels it
    takes above ONE_LEVEL_MAX_V."""
    V = 2 * BLOCK + 5
    assert V <= ONE_LEVEL_MAX_V
    p = torch.zeros(V)
    p[3], p[BLOCK + 7], p[2 * BLOCK + 4] = 1.0, 2.0, 1.0  # cumulative 0.25, 0.75, 1.0
    u = torch.tensor([0.0, 0.2499, 0.25, 0.7, 0.75, 0.9999999, 1 - 2**-53], dtype=torch.float64)
    want = [3, 3, BLOCK + 7, BLOCK + 7, 2 * BLOCK + 4, 2 * BLOCK + 4, 2 * BLOCK + 4]
    assert categorical(p.expand(len(u), V).contiguous(), u).tolist() == want
    assert _two_levels(p.expand(len(u), V).contiguous(), u).tolist() == want
    big = torch.zeros(ONE_LEVEL_MAX_V + 1)  # the same mass in a vocabulary that takes the two levels
    big[:V] = p
    assert categorical(big.expand(len(u), len(big)).contiguous(), u).tolist() == want


def test_categorical_frequencies_follow_the_probabilities_at_a_real_vocabulary():
    torch.manual_seed(1)
    V = 151_936
    p = torch.zeros(V)
    ids = torch.tensor([5, 999, 70_000, 151_935])
    p[ids] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    p += 1e-9  # a long tail of tiny mass, 0.00015 in all
    u = torch.rand(20_000, dtype=torch.float64)
    tokens = categorical(p.expand(20_000, V), u)
    freq = torch.tensor([(tokens == i).float().mean() for i in ids])
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.015), freq
    g = torch.Generator().manual_seed(5)
    a = categorical(p[None].contiguous(), torch.rand(1, dtype=torch.float64, generator=g))
    g = torch.Generator().manual_seed(5)
    assert torch.equal(a, categorical(p[None].contiguous(), torch.rand(1, dtype=torch.float64, generator=g)))


def test_sampling_draws_tokens_in_proportion_to_their_probability_and_never_a_masked_one():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    logits = probs.clamp_min(1e-45).log().expand(20_000, 4).contiguous()
    logits[:, 3] = float("-inf")
    rows = row_params([(1.0, 0, 1.0, 0.0)] * 20_000, [None] * 20_000)
    torch.manual_seed(0)
    tokens, _, _ = sample(logits, rows)
    freq = torch.bincount(tokens, minlength=4).float() / 20_000
    assert float(freq[3]) == 0.0
    assert torch.allclose(freq[:3], probs[:3], atol=0.015), freq
