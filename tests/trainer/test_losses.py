import math

import pytest
import torch

from nonstop.trainer import logprobs
from nonstop.trainer.logprobs import target_logprobs, token_logprobs
from nonstop.trainer.losses import (
    clipped_policy_loss,
    group_advantages,
    gspo_loss,
    kl_penalty,
    masked_mean,
)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    adv = group_advantages(rewards, "std")
    # group 0: mean 0.5, population std 0.5 -> +-1; group 1: all equal -> 0
    assert torch.allclose(adv, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]), atol=1e-5)
    assert torch.allclose(group_advantages(torch.tensor([[3.0, 1.0]]), "group_mean"), torch.tensor([[1.0, -1.0]]))
    # batch: centre per group, divide by the std of all centred rewards: values +-1, +-0 -> std 0.5*sqrt(2)... computed:
    centred = torch.tensor([[1.0, -1.0], [0.5, -0.5]])
    expected = centred / centred.std(unbiased=False)
    assert torch.allclose(group_advantages(torch.tensor([[3.0, 1.0], [1.0, 0.0]]), "batch"), expected, atol=1e-5)
    assert expected[0, 0].item() == pytest.approx(1.0 / (0.625**0.5), rel=1e-5)


def test_on_policy_loss_is_minus_mean_advantage():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = clipped_policy_loss(logp, logp.detach(), adv, mask, clip_eps=0.2)
    # ratio 1 everywhere: per-token loss = -A; sequence norm: mean(-2, +1) = -0.5
    assert loss.item() == pytest.approx(-0.5)
    assert stats["ratio_mean"].item() == 1.0 and stats["clip_frac"].item() == 0.0
    loss.backward()
    # d/dlogp of -ratio*A at ratio 1 is -A, divided by the sample's token count and by B
    assert torch.allclose(logp.grad, torch.tensor([[-0.5, -0.5], [0.5, 0.0]]))


def test_clipping_hand_computed():
    behaviour = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1]]))  # ratios 1.5, 0.5, 1.1
    mask = torch.ones(1, 3, dtype=torch.bool)
    # A = +1: min(r, clip(r, 0.8, 1.2)) = 1.2, 0.5, 1.1 -> loss = -(2.8)/3
    loss, stats = clipped_policy_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-2.8 / 3, rel=1e-6)
    assert stats["clip_frac"].item() == pytest.approx(1 / 3)
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(0.5)
    # A = -1: min(-r, -clip(r)) = -1.5, -0.8, -1.1 -> loss = 3.4/3
    loss, stats = clipped_policy_loss(logp, behaviour, torch.tensor([-1.0]), mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(3.4 / 3, rel=1e-6)
    # clip-higher: upper bound 1 + 0.6 lets 1.5 through
    loss, _ = clipped_policy_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_eps=0.2, clip_eps_high=0.6)
    assert loss.item() == pytest.approx(-3.1 / 3, rel=1e-6)


def test_token_vs_sequence_normalisation():
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    adv = torch.tensor([1.0, -2.0])
    seq, _ = clipped_policy_loss(logp, logp, adv, mask, norm="sequence")
    tok, _ = clipped_policy_loss(logp, logp, adv, mask, norm="token")
    const, _ = clipped_policy_loss(logp, logp, adv, mask, norm="constant", max_new_tokens=4)
    assert seq.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert tok.item() == pytest.approx((-3.0 + 2.0) / 4)
    assert const.item() == pytest.approx((-3.0 + 2.0) / (2 * 4))  # B x max_new_tokens, not B x T


def test_token_logprobs_chunked_equals_direct():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(5, 4, 8)
    targets = torch.randint(0, 11, (5, 4))
    direct = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    chunked = token_logprobs(hidden, head, targets, temperature=0.7, chunk_rows=2)
    assert torch.allclose(direct, chunked, atol=1e-6)
    assert math.isclose(torch.logsumexp(torch.log_softmax(head(hidden[0, 0]), -1), -1).item(), 0.0, abs_tol=1e-5)


def test_target_logprobs_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]: logprob of token 1 is ln(3/4); d/d logits = onehot - p = [-1/4, 1/4]
    logits = torch.tensor([[0.0, math.log(3.0)]], requires_grad=True)
    lp = target_logprobs(logits, torch.tensor([1]))
    assert lp.item() == pytest.approx(math.log(0.75), abs=1e-6)
    lp.sum().backward()
    assert torch.allclose(logits.grad, torch.tensor([[-0.25, 0.25]]), atol=1e-6)
    # temperature 2 over [0, 2 ln 3] is the same distribution; the gradient is halved
    hot = torch.tensor([[0.0, 2 * math.log(3.0)]], requires_grad=True)
    target_logprobs(hot, torch.tensor([0]), temperature=2.0).sum().backward()
    assert torch.allclose(hot.grad, torch.tensor([[0.75, -0.75]]) / 2, atol=1e-6)
    # a kept-token mask renormalises: with token 0 dropped, token 1 has all the mass
    kept = target_logprobs(logits.detach(), torch.tensor([1]), keep=torch.tensor([[False, True]]))
    assert kept.item() == pytest.approx(0.0, abs=1e-6)
    # and a token outside the kept ones has probability 0, as log_softmax over the masked logits says
    dropped = target_logprobs(logits.detach(), torch.tensor([0]), keep=torch.tensor([[False, True]]))
    assert dropped.item() == float("-inf")


def test_target_logprobs_gradient_across_chunks(monkeypatch):
    """float64 gradcheck with rows split over several chunks, a temperature and a keep mask."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 14)  # 2 rows of 7 per chunk: 5 rows -> 3 chunks
    torch.manual_seed(0)
    logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([0, 3, 6, 2, 5])
    keep = torch.rand(5, 7) > 0.3
    keep[torch.arange(5), targets] = True
    assert torch.autograd.gradcheck(lambda x: target_logprobs(x, targets, 0.7, keep), (logits,))
    plain = torch.log_softmax((logits / 0.7).masked_fill(~keep, float("-inf")), -1).gather(-1, targets[:, None])
    assert torch.allclose(target_logprobs(logits, targets, 0.7, keep), plain.squeeze(-1))


def test_target_logprobs_bf16_matches_float32_log_softmax():
    """bf16 logits (the autocast head's output): float32 arithmetic, the gradient back in bf16, as
    log_softmax(logits.float()) gives, and the logits themselves untouched."""
    torch.manual_seed(0)
    x = torch.randn(6, 3, 300).bfloat16()
    t = torch.randint(0, 300, (6, 3))
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    plain = torch.log_softmax(a.float(), -1).gather(-1, t[..., None]).squeeze(-1)
    fused = target_logprobs(b, t)
    assert fused.dtype == torch.float32 and torch.allclose(plain, fused, atol=1e-5)
    g = torch.randn(6, 3)
    (plain * g).sum().backward()
    (fused * g).sum().backward()
    assert b.grad.dtype == torch.bfloat16 and torch.allclose(a.grad.float(), b.grad.float(), atol=1e-2, rtol=1e-2)
    assert b.equal(x)


def test_group_std_population_or_unbiased():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]])
    # group 0: mean 0.5, squared deviations 4 x 0.25 = 1; population std sqrt(1/4) = 0.5 -> +-1,
    # unbiased std sqrt(1/3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025 (= sqrt(3)/2); group 1: all 0
    pop = group_advantages(rewards, "group_std", "population")
    unb = group_advantages(rewards, "group_std", "unbiased")
    assert torch.allclose(pop, torch.tensor([[1.0, -1.0, -1.0, 1.0], [0.0] * 4]), atol=1e-5)
    h = 3**0.5 / 2
    assert torch.allclose(unb, torch.tensor([[h, -h, -h, h], [0.0] * 4]), atol=1e-5)
    assert group_advantages(rewards, "group_std").equal(pop)  # the default stays the population std
    # a group of one has no unbiased std (n - 1 = 0): its advantage is 0, not nan
    assert group_advantages(torch.tensor([[1.0]]), "group_std", "unbiased").tolist() == [[0.0]]
    # the option concerns the group std only: group_mean and batch do not change
    for mode in ("group_mean", "batch"):
        assert group_advantages(rewards, mode, "unbiased").equal(group_advantages(rewards, mode, "population"))


def test_dr_grpo_constant_norm_is_padding_invariant():
    """The same two samples, once padded to T = 2 and once to T = 5: same loss, same gradient."""
    adv = torch.tensor([2.0, -1.0])
    narrow = torch.tensor([[-1.0, -2.0], [-0.5, 0.0]])
    mask2 = torch.tensor([[True, True], [True, False]])
    wide = torch.cat([narrow, torch.zeros(2, 3)], dim=1)  # (2, 5)
    mask5 = torch.cat([mask2, torch.zeros(2, 3, dtype=torch.bool)], dim=1)
    losses, grads = [], []
    for logp, mask in ((narrow, mask2), (wide, mask5)):
        logp = logp.clone().requires_grad_(True)
        loss, _ = clipped_policy_loss(logp, logp.detach(), adv, mask, norm="constant", max_new_tokens=4)
        loss.backward()
        losses.append(loss.item())
        grads.append(logp.grad[:, :2])
    # ratio 1: per token -A = -2, -2 | +1; sum -3 over B x max_new_tokens = 2 x 4 -> -0.375
    # (B x T_max would give -3/4 padded to 2 and -3/10 padded to 5)
    assert losses == [pytest.approx(-0.375), pytest.approx(-0.375)]
    # d/dlogp of -ratio A at ratio 1 is -A, over 8: -0.25 on sample 0's tokens, +0.125 on sample 1's
    assert torch.allclose(grads[0], torch.tensor([[-0.25, -0.25], [0.125, 0.0]]))
    assert torch.equal(grads[0], grads[1])
    with pytest.raises(ValueError, match="max_new_tokens"):
        masked_mean(narrow, mask2, "constant")


def test_sequence_norm_leaves_samples_without_loss_tokens_out():
    logp = torch.zeros(3, 2)
    mask = torch.tensor([[True, True], [False, False], [True, False]])  # sample 1: no loss token
    adv = torch.tensor([2.0, 5.0, -1.0])
    # per sample -A over its tokens: -2, (none), +1 -> mean over the 2 samples with tokens = -0.5
    seq, _ = clipped_policy_loss(logp, logp, adv, mask, norm="sequence")
    assert seq.item() == pytest.approx(-0.5)
    # the same without the empty row: the same loss
    keep = torch.tensor([0, 2])
    alone, _ = clipped_policy_loss(logp[keep], logp[keep], adv[keep], mask[keep], norm="sequence")
    assert alone.item() == pytest.approx(-0.5)
    # gspo follows the same rule: ratio 1 per sequence, -A over the samples with tokens
    gspo, _ = gspo_loss(logp, logp, adv, mask)
    assert gspo.item() == pytest.approx(-0.5)
    # a batch with no loss token at all reduces to 0 (and is finite)
    empty, _ = clipped_policy_loss(logp, logp, adv, torch.zeros(3, 2, dtype=torch.bool), norm="sequence")
    assert empty.item() == 0.0


def test_dual_clip_caps_negative_advantages():
    behaviour = torch.zeros(1, 3)
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = torch.log(torch.tensor([[1.5, 4.0, 0.5]])).requires_grad_(True)  # ratios 1.5, 4, 0.5
    # A = -1, clip 0.2: per token max(r, clip(r, 0.8, 1.2)) = 1.5, 4.0, 0.8 (sum 6.3);
    # dual clip c = 3 caps the 4.0 at 3 -> 1.5, 3.0, 0.8 -> loss 5.3 / 3
    plain, stats = clipped_policy_loss(logp, behaviour, torch.tensor([-1.0]), mask)
    assert plain.item() == pytest.approx(6.3 / 3, rel=1e-6) and stats["dual_clip_frac"].item() == 0.0
    loss, stats = clipped_policy_loss(logp, behaviour, torch.tensor([-1.0]), mask, clip_ratio_c=3.0)
    assert loss.item() == pytest.approx(5.3 / 3, rel=1e-6)
    assert stats["dual_clip_frac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dlogp of r |A| / 3 = r / 3: 0.5 on the first token, 0 on the capped one (the cap is a
    # constant), 0 on the third (clipped at 0.8, the clip's bound is a constant too)
    assert torch.allclose(logp.grad, torch.tensor([[0.5, 0.0, 0.0]]), atol=1e-6)
    # the cap comes before the importance weights: w = 1, 0.5, 1 -> 1.5, 1.5, 0.8
    weighted, _ = clipped_policy_loss(
        logp, behaviour, torch.tensor([-1.0]), mask, clip_ratio_c=3.0, weights=torch.tensor([[1.0, 0.5, 1.0]])
    )
    assert weighted.item() == pytest.approx(3.8 / 3, rel=1e-6)
    # A = +1 is never capped: min(r, clip(r)) = 1.2, 1.2, 0.5 -> -2.9 / 3 with or without c
    pos, stats = clipped_policy_loss(logp, behaviour, torch.tensor([1.0]), mask, clip_ratio_c=3.0)
    assert pos.item() == pytest.approx(-2.9 / 3, rel=1e-6) and stats["dual_clip_frac"].item() == 0.0
    # GSPO: log ratios ln 4, ln 4 -> s = 4; A = -2: max(4, 1.2) x 2 = 8, capped at 3 x 2 = 6
    g_logp = torch.log(torch.tensor([[4.0, 4.0]]))
    g, g_stats = gspo_loss(
        g_logp,
        torch.zeros(1, 2),
        torch.tensor([-2.0]),
        torch.ones(1, 2, dtype=torch.bool),
        clip_eps=0.2,
        clip_eps_high=0.2,
        clip_ratio_c=3.0,
    )
    assert g.item() == pytest.approx(6.0, rel=1e-6) and g_stats["dual_clip_frac"].item() == 1.0


def test_kl_clamp_bounds_the_k3_value_and_gradient():
    ref = torch.zeros(1, 4)
    logp = torch.tensor([[-30.0, -1.0, 0.0, 2.0]], requires_grad=True)  # d = log pi - log ref
    # unclamped k3 = exp(-d) + d - 1; its gradient 1 - exp(-d) is -(e^30 - 1) ~ -1.07e13 at d = -30
    kl_penalty(logp, ref).sum().backward()
    assert logp.grad[0, 0].item() == pytest.approx(1 - math.exp(30), rel=1e-5)
    logp.grad = None
    k = kl_penalty(logp, ref, "k3", clamp=5.0)
    # d clamped to [-5, 5]: -30 -> -5: e^5 - 5 - 1 = 142.413159; -1: e - 2 = 0.718282; 0: 0;
    # 2: e^-2 + 1 = 1.135335
    assert torch.allclose(k, torch.tensor([[math.exp(5) - 6, math.e - 2, 0.0, math.exp(-2) + 1]]), rtol=1e-6)
    k.sum().backward()
    # beyond the bound no gradient; inside, 1 - exp(-d): 1 - e = -1.718282, 0, 1 - e^-2 = 0.864665
    assert torch.allclose(logp.grad, torch.tensor([[0.0, 1 - math.e, 0.0, 1 - math.exp(-2)]]), rtol=1e-6)
    # far beyond float32's exp range the unclamped estimate is inf; clamped it stays finite
    far = torch.tensor([[-100.0]])
    assert math.isinf(kl_penalty(far, torch.zeros(1, 1)).item())
    assert kl_penalty(far, torch.zeros(1, 1), "k3", clamp=5.0).item() == pytest.approx(math.exp(5) - 6, rel=1e-6)
    # the clamp acts on the log-ratio for every estimator: k1 = clamp(d), k2 = clamp(d)^2 / 2
    assert kl_penalty(far, torch.zeros(1, 1), "k1", clamp=5.0).item() == -5.0
    assert kl_penalty(far, torch.zeros(1, 1), "k2", clamp=5.0).item() == 12.5


def test_head_logprobs_recompute_matches_the_plain_head_and_log_softmax(monkeypatch):
    """The fused head + log-prob (logits recomputed chunk by chunk in the backward) against
    log_softmax(head(hidden)) in float64: values, d hidden, d weight and d bias agree, with chunks
    that cut the rows unevenly, a temperature and a keep mask; gradcheck on hidden and weight."""
    monkeypatch.setattr(logprobs, "CHUNK_ELEMENTS", 14)  # the softmax's own row blocks split too
    torch.manual_seed(0)
    B, T, H, V = 3, 4, 5, 7
    head = torch.nn.Linear(H, V, bias=True).double()
    hidden = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (B, T))
    keep = torch.rand(B, T, V) > 0.3
    keep.scatter_(-1, targets[..., None], True)
    g = torch.randn(B, T, dtype=torch.float64)
    plain = torch.log_softmax((head(hidden) / 0.7).masked_fill(~keep, float("-inf")), -1)
    plain = plain.gather(-1, targets[..., None]).squeeze(-1)
    want = torch.autograd.grad((plain * g).sum(), (hidden, head.weight, head.bias))
    fused = token_logprobs(hidden, head, targets, temperature=0.7, chunk_rows=1, keep=keep)  # 4 positions a chunk
    got = torch.autograd.grad((fused * g).sum(), (hidden, head.weight, head.bias))
    assert torch.allclose(fused, plain, atol=1e-12)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-12)
    weight = head.weight.detach().clone().requires_grad_(True)

    def fn(h, w):
        return logprobs._HeadLogprob.apply(
            h.reshape(-1, H), w, None, targets.reshape(-1), keep.reshape(-1, V), 1 / 0.7, 5, torch.float64
        )

    assert torch.autograd.gradcheck(fn, (hidden, weight))


def test_head_logprobs_keep_one_chunk_of_logits_for_backward():
    """What autograd keeps for the backward of the fused path: hidden, the weight and one float per
    position, not the (N, V) logits."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 1000, bias=False)
    hidden = torch.randn(4, 8, 16, requires_grad=True)
    targets = torch.randint(0, 1000, (4, 8))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        token_logprobs(hidden, head, targets, chunk_rows=1)
    assert max(t.numel() for t in saved) == 1000 * 16  # the weight; the 32 x 1000 logits are not kept
