import math

import pytest
import torch

from nonstop.trainer.losses import clipped_policy_loss, group_advantages, token_logprobs


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
    assert expected[0, 0].item() == pytest.approx(1.0 / (0.625 ** 0.5), rel=1e-5)


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
    assert seq.item() == pytest.approx((-1.0 + 2.0) / 2)
    assert tok.item() == pytest.approx((-3.0 + 2.0) / 4)


def test_token_logprobs_chunked_equals_direct():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(5, 4, 8)
    targets = torch.randint(0, 11, (5, 4))
    direct = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    chunked = token_logprobs(hidden, head, targets, temperature=0.7, chunk_rows=2)
    assert torch.allclose(direct, chunked, atol=1e-6)
    assert math.isclose(torch.logsumexp(torch.log_softmax(head(hidden[0, 0]), -1), -1).item(), 0.0, abs_tol=1e-5)
