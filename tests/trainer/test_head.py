"""The LM head's logprob node (trainer/head.py) against the plain autograd composition."""

import math

import pytest
import torch

from nonstop.trainer.head import head_logprobs, plain_head
from nonstop.trainer.losses import token_logprobs


def composed(hidden, weight, targets, temperature, keep):
    """log_softmax(hidden @ W.T / T) at targets and the entropy, by plain autograd ops."""
    z = (hidden @ weight.t()).float() / temperature
    if keep is not None:
        z = z.masked_fill(~keep, float("-inf"))
    lp = torch.log_softmax(z, -1)
    ent = -(lp.exp() * lp.clamp_min(-1e30)).sum(-1)
    return lp.gather(-1, targets[:, None])[:, 0], ent


def test_two_tokens_by_hand():
    # hidden [1, 0] and [0, 1], W = [[1, 0], [0, 1], [0, 0]]: logits [1, 0, 0] and [0, 1, 0]
    hidden = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], requires_grad=True)
    targets = torch.tensor([0, 2])
    logp, ent = head_logprobs(hidden, weight, targets, with_entropy=True)
    e = math.e
    assert logp.tolist() == pytest.approx([1 - math.log(e + 2), -math.log(e + 2)], abs=1e-6)
    p = [e / (e + 2), 1 / (e + 2), 1 / (e + 2)]
    assert ent.tolist() == pytest.approx([-sum(x * math.log(x) for x in p)] * 2, abs=1e-6)
    logp.sum().backward()
    # d logp_0 / d z_0 = onehot(0) - p = [1 - p0, -p1, -p2]; d z / d hidden_0 = W^T
    assert hidden.grad[0].tolist() == pytest.approx([1 - p[0], -p[1]], abs=1e-6)
    # token 1: logits [0, 1, 0], target 2: d/dz = [-p1', -p0', 1 - p1'] with the same p set
    assert hidden.grad[1].tolist() == pytest.approx([-p[1], -p[0]], abs=1e-6)


@pytest.mark.parametrize(("with_keep", "V"), [(False, 29), (True, 29), (True, 100_003)])
def test_values_and_gradients_match_the_composition(with_keep, V):
    # V = 100,003: 10 rows of float32 logits per cache-sized slice, so 13 tokens take two slices
    torch.manual_seed(0)
    N, H = 13, 8
    hidden = torch.randn(N, H, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, V, (N,))
    keep = torch.rand(N, V) < 0.6 if with_keep else None
    if keep is not None:
        keep[torch.arange(N), targets] = True  # the sampled token is always kept
    g1, g2 = torch.randn(N, dtype=torch.float64), torch.randn(N, dtype=torch.float64)

    want_lp, want_ent = composed(hidden.double(), weight, targets, 0.7, keep)
    want = torch.autograd.grad((want_lp.double() * g1 + want_ent.double() * g2).sum(), (hidden, weight))
    lp, ent = head_logprobs(hidden, weight, targets, 0.7, chunk_tokens=4, keep=keep, with_entropy=True)
    got = torch.autograd.grad((lp.double() * g1 + ent.double() * g2).sum(), (hidden, weight))
    assert torch.allclose(lp.double(), want_lp.double(), atol=1e-5)
    assert torch.allclose(ent.double(), want_ent.double(), atol=1e-5)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5), (a - b).abs().max()  # float32 softmax inside both


def test_frozen_weight_gets_no_gradient_and_token_logprobs_routes_plain_heads():
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 17, bias=False).requires_grad_(False)
    hidden = torch.randn(3, 4, 6, requires_grad=True)
    targets = torch.randint(0, 17, (3, 4))
    assert plain_head(head) is head.weight
    assert plain_head(torch.nn.Linear(6, 17)) is None  # a bias takes the composition
    out = token_logprobs(hidden, head, targets, temperature=1.3, chunk_rows=2)
    want = torch.log_softmax(head(hidden) / 1.3, -1).gather(-1, targets[..., None])[..., 0]
    assert out.shape == (3, 4) and torch.allclose(out, want, atol=1e-6)
    out.sum().backward()
    assert hidden.grad is not None and head.weight.grad is None


def test_bfloat16_autocast_matches_the_composition_under_autocast():
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 300, bias=False)
    hidden = torch.randn(2, 9, 32, requires_grad=True)
    targets = torch.randint(0, 300, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = token_logprobs(hidden, head, targets)
        plain = token_logprobs(hidden, torch.nn.Sequential(head), targets)  # not a plain Linear: composition
    assert fused.dtype == torch.float32
    assert torch.allclose(fused, plain, atol=1e-5)
    g_fused = torch.autograd.grad(fused.sum(), (hidden, head.weight))
    g_plain = torch.autograd.grad(plain.sum(), (hidden, head.weight))
    for a, b in zip(g_fused, g_plain):
        assert a.dtype == torch.float32
        assert torch.allclose(a, b, rtol=2e-2, atol=2e-3), (a - b).abs().max()
