"""Micro-batches (trainer.micro_batch_tokens): one optimizer step over micro-batches is the step over
the whole batch, and the step reports the same statistics; activation checkpointing changes no
gradient.

Tolerance: float32 throughout; the micro-batches sum the loss in another order, so gradients differ
by float rounding. The gradients the optimizer step takes must agree within 1e-7 (max abs; the
largest are about 0.02), and after one AdamW step at lr 1e-3 the weights within 1e-6 (max abs),
leaving out the elements whose gradient is below 1e-7: AdamW's first step moves a weight by
lr x g / (|g| + 1e-8), so there rounding alone moves it by up to lr x 0.1 (the k_proj bias, whose
gradient is zero but for rounding: softmax ignores a constant added to every key's score). The
reported statistics agree within 1e-5 relative.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from nonstop.config import DistillConfig, TinyModelConfig, TrainerConfig
from nonstop.models.tiny import make_tiny_model
from nonstop.trainer.core import Trainer, checkpoint_layers
from nonstop.trainer.micro import forward_tokens, part_groups, split
from nonstop.types import Group, Sample

SHAPE = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
WEIGHT_TOL = 1e-6
GRAD_TOL = 1e-7
STAT_TOL = 1e-5


def make_groups(seed: int, G: int = 5, n: int = 4, teacher: bool = False) -> list[Group]:
    """G groups of n samples: prompts of 2..7 tokens, completions of 1..12 tokens with off-policy
    behaviour logprobs (so the ratios, clipping and corrections have work), mixed rewards."""
    rng = random.Random(seed)
    groups = []
    for g in range(G):
        prompt = [1] + [rng.randrange(3, 128) for _ in range(rng.randint(1, 6))]
        samples = []
        for j in range(n):
            c = [rng.randrange(3, 128) for _ in range(rng.randint(1, 12))]
            lp = [-3.0 - rng.random() for _ in c]
            s = Sample(prompt, c, lp, [0] * len(c), "stop" if j else "length", reward=float(rng.random() > 0.5))
            if teacher:
                s.teacher_logprobs = [-2.0 - rng.random() for _ in c]
            samples.append(s)
        groups.append(Group(g, "", "", samples))
    return groups


def trainers(cfg: TrainerConfig, budget: int, layout: str, **kw) -> tuple[Trainer, Trainer]:
    """The same model twice: one trainer runs whole batches, the other micro-batches of `budget` tokens."""
    model = make_tiny_model(SHAPE, seed=3)
    whole = Trainer(copy.deepcopy(model), cfg.model_copy(update={"packed": layout == "packed"}), 0.9, 0, **kw)
    micro_cfg = cfg.model_copy(update={"packed": layout == "packed", "micro_batch_tokens": budget})
    micro = Trainer(model, micro_cfg, 0.9, 0, **kw)
    if layout == "plain":  # the model's own forward, prompt + completion per row
        whole.shared_prompts = micro.shared_prompts = False
    for t in (whole, micro):
        record_grads(t)
    return whole, micro


def record_grads(trainer: Trainer) -> None:
    """Keep the gradients each optimizer step of `trainer` takes, in `trainer.stepped`."""
    trainer.stepped = []  # type: ignore[attr-defined]
    trainer.optimizer.register_step_pre_hook(
        lambda *_: trainer.stepped.append([p.grad.clone() for p in trainer.model.parameters()])  # type: ignore[attr-defined]
    )


def max_weight_diff(a: Trainer, b: Trainer) -> float:
    """Max abs difference of the weights (see the module docstring for what is left out), after
    checking that every optimizer step took the same gradients."""
    assert len(a.stepped) == len(b.stepped) > 0
    for ga, gb in zip(a.stepped, b.stepped):
        assert max(float((x - y).abs().max()) for x, y in zip(ga, gb)) < GRAD_TOL
    noise = [g.abs() < GRAD_TOL for g in a.stepped[0]]
    with torch.no_grad():
        return max(
            float(((p - q).abs().masked_fill(n, 0.0)).max())
            for p, q, n in zip(a.model.parameters(), b.model.parameters(), noise)
        )


def assert_same_stats(whole: dict, micro: dict) -> None:
    assert micro["micro_batches"] > 1 and "micro_batches" not in whole
    for key, value in whole.items():
        if isinstance(value, float) and key not in ("update_s",):
            assert micro[key] == pytest.approx(value, rel=STAT_TOL, abs=1e-7), key
        elif key not in ("update_s",):
            assert micro[key] == value, key


def test_split_keeps_groups_whole_and_cuts_only_a_group_over_the_budget():
    groups = make_groups(0, G=4, n=4)
    for layout in ("shared", "packed", "packed-prefix", "plain"):
        cost = [forward_tokens([g], layout) for g in groups]
        budget = max(cost[0], cost[1])  # the first two fit alone, not together (cost > 0)
        parts = split(groups, budget, layout)
        assert [(i, lo, hi) for p in parts for i, lo, hi in p if (lo, hi) != (0, 4)] == [
            (i, lo, hi) for p in parts for i, lo, hi in p if cost[i] > budget
        ]
        rows = [(i, s) for p in parts for i, lo, hi in p for s in range(lo, hi)]
        assert rows == [(i, s) for i in range(4) for s in range(4)]  # every sample once, in order
        for p in parts:
            assert forward_tokens(part_groups(groups, p), layout) <= budget or sum(hi - lo for _, lo, hi in p) == 1
    one = make_groups(1, G=1, n=4)
    assert split(one, 1, "shared") == [[(0, s, s + 1)] for s in range(4)]  # a lone sample over the budget: its own


@pytest.mark.parametrize(
    "loss,layout",
    [("grpo", "shared"), ("dapo", "packed"), ("dr_grpo", "plain"), ("gspo", "shared"), ("grpo", "plain")],
)
def test_a_step_over_micro_batches_equals_the_step_over_the_whole_batch(loss, layout):
    """One AdamW step: the weights after it and every statistic the step reports, for the token
    ('dapo'), sequence ('grpo'), constant ('dr_grpo') normalisations and GSPO, on each forward."""
    cfg = TrainerConfig(loss=loss, lr=1e-3, correction="tis", is_cap=1.5)
    whole, micro = trainers(cfg, budget=40, layout=layout, max_new_tokens=12)
    groups = make_groups(1)
    a, b = whole.step(groups), micro.step(groups)
    assert b["micro_batches"] >= 3
    assert max_weight_diff(whole, micro) < WEIGHT_TOL
    assert_same_stats(a, b)


def test_more_updates_a_reference_an_entropy_bonus_and_a_teacher_over_micro_batches():
    """updates_per_batch 2, a KL reference, an entropy bonus and standardised distillation advantages
    (which need the whole batch's proximal logprobs before the first backward)."""
    cfg = TrainerConfig(loss="grpo", lr=1e-3, updates_per_batch=2, kl_coef=0.1, kl_clamp=5.0, entropy_coef=0.01)
    distill = DistillConfig(teacher="x", coef=0.5, normalize=True)
    whole, micro = trainers(cfg, budget=40, layout="shared", distill=distill)
    groups = make_groups(2, teacher=True)
    for _ in range(2):
        a, b = whole.step(groups), micro.step(groups)
        assert max_weight_diff(whole, micro) < 2 * WEIGHT_TOL
        assert_same_stats(a, b)
    assert {"kl_ref", "entropy", "teacher_kl", "last_update_loss"} <= b.keys()


def test_forward_ahead_holds_at_most_one_micro_batch_and_the_step_is_unchanged():
    cfg = TrainerConfig(loss="dapo", lr=1e-3)
    whole, micro = trainers(cfg, budget=60, layout="shared")
    groups = make_groups(3, G=6)
    assert forward_tokens(groups[:1], "shared") <= 60 < forward_tokens(groups, "shared")
    held = micro.forward_ahead(groups[:4])
    assert 1 <= held < 4 and forward_tokens(groups[:held], "shared") <= 60
    assert micro.forward_ahead(groups[held:5]) == held  # full: nothing more is held
    whole.forward_ahead(groups[:4])
    a, b = whole.step(groups), micro.step(groups)
    assert b["ahead_groups"] == held and a["ahead_groups"] == 4
    assert max_weight_diff(whole, micro) < WEIGHT_TOL
    a.pop("ahead_groups"), b.pop("ahead_groups")
    assert_same_stats(a, b)


def test_a_batch_within_the_budget_runs_as_one_forward():
    cfg = TrainerConfig(lr=1e-3)
    whole, micro = trainers(cfg, budget=10_000, layout="shared")
    groups = make_groups(4)
    a, b = whole.step(groups), micro.step(groups)
    assert "micro_batches" not in b and max_weight_diff(whole, micro) == 0.0
    assert a["loss"] == b["loss"]


@pytest.mark.parametrize("layout", ["shared", "packed", "plain"])
def test_activation_checkpointing_changes_no_gradient(layout):
    model = make_tiny_model(SHAPE, seed=5)
    cfg = TrainerConfig(packed=layout == "packed")
    plain = Trainer(copy.deepcopy(model), cfg, 0.9, 0)
    ckpt = Trainer(model, cfg.model_copy(update={"activation_checkpointing": True}), 0.9, 0)
    if layout == "plain":
        plain.shared_prompts = ckpt.shared_prompts = False
        checkpoint_layers(ckpt.model)  # what the Trainer does for a model without the shared-prompt forward
    batch = plain.batch_of(make_groups(6))
    grads = []
    for t in (plain, ckpt):
        logp = t.logprobs(batch)
        t.model.zero_grad(set_to_none=True)
        logp[batch["mask"]].sum().backward()
        grads.append([p.grad.clone() for p in t.model.parameters()])
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))
