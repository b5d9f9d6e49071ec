"""The padding-free forward (trainer.packed) computes what the padded shared-prompt forward computes."""

from __future__ import annotations

import random

import pytest
import torch

from nonstop.config import TinyModelConfig, TrainerConfig
from nonstop.models.tiny import make_tiny_model
from nonstop.trainer.core import Trainer
from nonstop.trainer.micro import forward_tokens
from nonstop.trainer.packed import length_buckets, packed_hidden
from nonstop.types import Group, Sample, shared_prefix_len

GQA = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
MHA = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=48)


def heavy_tailed_groups(
    seed: int, G: int, n: int, shared: bool = True, longest: int = 90, head: int = 0
) -> list[Group]:
    """Groups whose completion lengths follow a power law (4 .. longest tokens, and one of 1 token),
    prompts of 2..9 tokens after `head` tokens every prompt begins with (a system prompt's)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 128) for _ in range(head)]

    def prompt() -> list[int]:
        return [1, *system] + [rng.randrange(3, 128) for _ in range(rng.randint(1, 8))]

    groups = []
    for g in range(G):
        p = prompt()
        samples = []
        for j in range(n):
            length = 1 if g == j == 0 else min(longest, int(4 / max(rng.random(), 1e-3) ** 0.9))
            c = [rng.randrange(3, 128) for _ in range(length)]
            lp = [-rng.random() for _ in c]
            samples.append(Sample(p if shared else prompt(), c, lp, [0] * len(c), "stop", reward=float(j % 2)))
        groups.append(Group(g, "", "", samples))
    return groups


def forward(trainer: Trainer, groups: list[Group], packed: bool, with_entropy: bool = False):
    trainer.cfg = trainer.cfg.model_copy(update={"packed": packed})
    batch = trainer.batch_of(groups)
    out = trainer.logprobs(batch, with_entropy=with_entropy)
    logp, ent = out if with_entropy else (out, None)
    trainer.model.zero_grad(set_to_none=True)
    (logp[batch["mask"]].sum() + (ent[batch["mask"]].sum() if ent is not None else 0)).backward()
    grads = [p.grad.clone() for p in trainer.model.parameters()]
    return batch, logp.detach(), None if ent is None else ent.detach(), grads


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Within 1e-5 of the tensor's largest entry: the two forwards sum in different orders."""
    return float((a - b).abs().max()) <= 1e-5 * (1.0 + float(b.abs().max()))


def test_buckets_bound_padding_and_cover_every_nonempty_row():
    lengths = [900, 85, 3, 0, 120, 85, 64, 7, 300, 1]
    buckets = length_buckets(lengths, waste=0.25)
    assert sorted(i for b in buckets for i in b) == [i for i, n in enumerate(lengths) if n > 0]
    for b in buckets:
        assert max(lengths[i] for i in b) * len(b) <= 1.25 * sum(lengths[i] for i in b)
    assert length_buckets([5] * 8) == [list(range(8))]  # equal lengths: one bucket


@pytest.mark.parametrize("tiny", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize(
    "shape", [(4, 8, True, 0), (3, 2, False, 0), (4, 4, True, 12)], ids=["groups", "distinct-prompts", "system-prompt"]
)
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny, shape):
    G, n, shared, head = shape
    trainer = Trainer(make_tiny_model(tiny, seed=1), TrainerConfig(), temperature=0.9, pad_token_id=0)
    groups = heavy_tailed_groups(0, G, n, shared, head=head)
    lengths = [len(s.completion_ids) for g in groups for s in g.samples]
    assert max(lengths) >= 4 * sorted(lengths)[len(lengths) // 2] and min(lengths) == 1  # heavy tail, 1-token rows
    b_pad, lp_pad, ent_pad, g_pad = forward(trainer, groups, packed=False, with_entropy=True)
    b_pk, lp_pk, ent_pk, g_pk = forward(trainer, groups, packed=True, with_entropy=True)
    m = b_pad["mask"]
    assert torch.allclose(lp_pk[m], lp_pad[m], atol=1e-5) and torch.allclose(ent_pk[m], ent_pad[m], atol=1e-5)
    assert (lp_pk[~m] == 0).all()  # padding is 0, never a value
    for a, b in zip(g_pk, g_pad):
        assert close(a, b)


def test_packed_step_trains_like_the_padded_step():
    """A whole trainer step (loss, clip, AdamW) on the packed forward lands on the padded step's
    weights. AdamW's first step moves each weight by about lr x sign(gradient), so a gradient entry
    near zero may move differently by rounding: the bar is 1% of lr per weight."""
    groups = heavy_tailed_groups(3, 4, 4)
    results = []
    for packed in (False, True):
        trainer = Trainer(
            make_tiny_model(GQA, seed=2), TrainerConfig(packed=packed, lr=1e-2), temperature=1.0, pad_token_id=0
        )
        stats = trainer.step(groups)
        results.append((stats, [p.detach().clone() for p in trainer.model.parameters()]))
    (s_pad, w_pad), (s_pk, w_pk) = results
    assert s_pk["loss"] == pytest.approx(s_pad["loss"], abs=1e-5)
    worst = max(float((a - b).abs().max()) for a, b in zip(w_pk, w_pad))
    assert worst <= 1e-2 * 1e-2, worst


def test_packed_forward_runs_under_bf16_autocast_and_agrees_with_the_padded_one():
    """The bf16 trainer runs its forward and backward under autocast (trainer/worker.py): attention
    then returns bf16 while the rotated queries are float32. Both forwards must run there and agree
    to bf16's precision, gradients finite."""
    trainer = Trainer(make_tiny_model(GQA, seed=1), TrainerConfig(), temperature=0.9, pad_token_id=0)
    groups = heavy_tailed_groups(1, 3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        b_pad, lp_pad, _, g_pad = forward(trainer, groups, packed=False)
        _, lp_pk, _, g_pk = forward(trainer, groups, packed=True)
    m = b_pad["mask"]
    assert float((lp_pk[m] - lp_pad[m]).abs().max()) <= 0.05 * (1.0 + float(lp_pad[m].abs().max()))
    assert all(torch.isfinite(g).all() for g in g_pk)
    assert any(float(g.abs().max()) > 0 for g in g_pk)


def test_shared_prefix_len_by_hand():
    assert shared_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert shared_prefix_len([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shortest keeps a token of its own
    assert shared_prefix_len([[1, 2, 3]]) == 0  # one prompt: nothing to share
    assert shared_prefix_len([[5, 1], [6, 1]]) == 0


def test_a_shared_system_prompt_runs_once_and_the_step_equals_the_unshared_one():
    """4 groups whose prompts begin with the same 13 tokens (a 12-token system prompt after token 1):
    the packed forward embeds them once, (4 - 1) x 13 tokens fewer than with every prompt packed
    whole, micro-batches count the same tokens, and logprobs and every gradient equal those of the
    forward that packs each prompt whole."""
    groups = heavy_tailed_groups(5, 4, 4, head=12)
    prompts = list(dict.fromkeys(tuple(s.prompt_ids) for g in groups for s in g.samples))
    assert len(prompts) == 4 and shared_prefix_len(prompts) == 13
    trainer = Trainer(make_tiny_model(GQA, seed=3), TrainerConfig(packed=True), temperature=1.0, pad_token_id=0)
    batch = trainer.batch_of(groups)
    embedded: list[int] = []
    trainer.model.model.embed_tokens.register_forward_hook(lambda _m, args, _out: embedded.append(args[0].numel()))
    results = []
    for share in (True, False):
        hidden = packed_hidden(trainer.model, batch, share_prefix=share)  # (N, hidden)
        trainer.model.zero_grad(set_to_none=True)
        (hidden * torch.linspace(-1, 1, hidden.shape[-1])).sum().backward()
        results.append((hidden.detach(), [p.grad.clone() for p in trainer.model.parameters()]))
    whole = sum(map(len, prompts)) + sum(max(len(s.completion_ids) - 1, 0) for g in groups for s in g.samples)
    assert embedded == [whole - 3 * 13, whole]
    samples = sum(1 for g in groups for _ in g.samples)
    assert forward_tokens(groups, "packed-prefix") == whole - 3 * 13 + samples
    assert forward_tokens(groups, "packed") == whole + samples
    (h_shared, g_shared), (h_whole, g_whole) = results
    assert close(h_shared, h_whole)
    for a, b in zip(g_shared, g_whole):
        assert close(a, b)
