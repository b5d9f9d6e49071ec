import math

import pytest
import torch

from nonstop.trainer.correction import CORRECTIONS, is_weights
from nonstop.trainer.losses import clipped_policy_loss, gspo_loss, kl_penalty, masked_mean

ALL = torch.ones(1, 3, dtype=torch.bool)


def _w(rates, kind, mask=ALL, **kw):
    behaviour = torch.zeros(1, len(rates))
    prox = torch.log(torch.tensor([rates]))
    return is_weights(prox, behaviour, mask, kind, **kw)


def test_token_truncate_hand_computed():
    w, stats = _w([0.5, 3.0, 1.5], "tis", cap=2.0)
    assert torch.allclose(w, torch.tensor([[0.5, 2.0, 1.5]]))
    assert stats["is_truncated_frac"].item() == pytest.approx(1 / 3)


def test_token_mask_hand_computed():
    w, stats = _w([0.4, 3.0, 1.5], "mis", lo=0.5, hi=2.0)
    assert torch.allclose(w, torch.tensor([[0.0, 0.0, 1.5]]))
    assert stats["is_masked_frac"].item() == pytest.approx(2 / 3)


def test_sequence_and_geometric_variants_hand_computed():
    rates = [2.0, 0.5, 3.0]  # product 3, geometric mean 3 ** (1/3)
    assert torch.allclose(_w(rates, "seq_tis", cap=2.0)[0], torch.full((1, 3), 2.0))
    assert torch.allclose(_w(rates, "seq_tis", cap=5.0)[0], torch.full((1, 3), 3.0), atol=1e-5)
    assert torch.allclose(_w(rates, "seq_mis", lo=0.5, hi=2.0)[0], torch.zeros(1, 3))
    g = 3.0 ** (1 / 3)
    assert torch.allclose(_w(rates, "geo_tis", cap=2.0)[0], torch.full((1, 3), g), atol=1e-5)
    assert torch.allclose(_w(rates, "geo_mis", lo=0.5, hi=2.0)[0], torch.full((1, 3), g), atol=1e-5)
    # masked tokens do not enter the product: drop the 3.0 -> product 1
    mask = torch.tensor([[True, True, False]])
    assert torch.allclose(_w(rates, "seq_tis", mask=mask, cap=2.0)[0], torch.ones(1, 3), atol=1e-6)


def test_decoupled_weight_is_the_rate_and_carries_no_gradient():
    prox = torch.log(torch.tensor([[0.5, 3.0, 1.5]])).requires_grad_()
    w, _ = is_weights(prox, torch.zeros(1, 3), ALL, "decoupled")
    assert torch.allclose(w, torch.tensor([[0.5, 3.0, 1.5]]))
    assert not w.requires_grad


@pytest.mark.parametrize("kind", CORRECTIONS)
def test_on_policy_every_correction_reduces_to_the_uncorrected_loss(kind):
    torch.manual_seed(0)
    logp = torch.randn(4, 5).requires_grad_()
    behaviour = logp.detach().clone()  # depth 0: the engine sampled from these very weights
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    mask = torch.rand(4, 5) > 0.2
    ref_loss, _ = clipped_policy_loss(logp, behaviour, adv, mask)
    (ref_grad,) = torch.autograd.grad(ref_loss, logp)
    w, _ = is_weights(logp.detach(), behaviour, mask, kind)
    old = behaviour if kind == "none" else logp.detach()
    loss, stats = clipped_policy_loss(logp, old, adv, mask, weights=w)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.allclose(w[mask], torch.ones_like(w[mask]))
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-6)
    assert torch.allclose(grad, ref_grad, atol=1e-6)
    assert stats["ratio_max"].item() == pytest.approx(1.0)


def test_gspo_hand_computed():
    old = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.2, 1.2], [0.9, 1.0]]))  # s = 1.2 ; sqrt(0.9)
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[True, True], [True, True]])
    loss, stats = gspo_loss(logp, old, adv, mask, clip_eps=0.1, clip_eps_high=0.1)
    s2 = math.sqrt(0.9)
    # sample 1: -min(1.2, 1.1) = -1.1; sample 2: -min(-s2, -clip(s2, 0.9, 1.1)) = s2
    assert loss.item() == pytest.approx((-1.1 + s2) / 2, rel=1e-5)
    assert stats["clip_frac"].item() == pytest.approx(0.5)


def test_kl_estimators_hand_computed():
    logp, ref = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    d = math.log(2.0)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_masked_mean_constant_normalisation():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    # sum 10 over B x max_new_tokens = 2 x 5, whatever the padded width T = 3
    assert masked_mean(x, mask, "constant", max_new_tokens=5).item() == pytest.approx(10 / 10)
    assert masked_mean(x, mask, "token").item() == pytest.approx(10 / 4)
    assert masked_mean(x, mask, "sequence").item() == pytest.approx((2 + 4) / 2)
