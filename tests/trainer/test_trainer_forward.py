"""The shared-prompt training forward computes what the model's own forward computes, in fewer tokens."""

import random

import pytest
import torch

from nonstop.config import LoraConfig, TinyModelConfig, TrainerConfig
from nonstop.models.tiny import make_tiny_model
from nonstop.trainer.core import Trainer
from nonstop.trainer.forward import unsupported
from nonstop.types import Group, Sample

GQA = TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48)
MHA = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=48)


def _groups(seed: int, G: int, n: int, max_prompt: int, max_completion: int, shared: bool = True) -> list[Group]:
    """Random token groups: prompts of 2..max_prompt+1 tokens, completions of 1..max_completion."""
    rng = random.Random(seed)

    def prompt() -> list[int]:
        return [1] + [rng.randrange(3, 128) for _ in range(rng.randint(1, max_prompt))]

    groups = []
    for g in range(G):
        p = prompt()
        samples = []
        for j in range(n):
            c = [rng.randrange(3, 128) for _ in range(rng.randint(1, max_completion))]
            samples.append(
                Sample(p if shared else prompt(), c, [-1.0] * len(c), [0] * len(c), "stop", reward=float(j % 2))
            )
        groups.append(Group(g, "", "", samples))
    return groups


def _both(trainer: Trainer, groups: list[Group]):
    """Logprobs and gradients of the same batch through the shared-prompt and the plain forward."""
    out = []
    for shared in (True, False):
        trainer.shared_prompts = shared
        batch = trainer.batch_of(groups)
        assert ("prompt_ids" in batch) == shared
        logp = trainer.logprobs(batch)
        trainer.model.zero_grad(set_to_none=True)
        logp[batch["mask"]].sum().backward()
        grads = [p.grad.clone() for p in trainer.model.parameters() if p.requires_grad]
        out.append((batch, logp.detach(), grads))
    return out


@pytest.mark.parametrize("tiny", [GQA, MHA], ids=["gqa", "mha"])
@pytest.mark.parametrize(
    "shape",
    [(4, 8, 6, 5, True), (3, 4, 8, 1, True), (5, 3, 5, 6, False)],
    ids=["groups", "one-token-completions", "distinct-prompts"],
)
def test_shared_prompt_forward_matches_the_models_own_forward(tiny, shape):
    G, n, max_prompt, max_completion, shared = shape
    trainer = Trainer(make_tiny_model(tiny, seed=1), TrainerConfig(), temperature=0.9, pad_token_id=0)
    assert trainer.shared_prompts
    groups = _groups(0, G, n, max_prompt, max_completion, shared)
    (b_sh, lp_sh, g_sh), (b_hf, lp_hf, g_hf) = _both(trainer, groups)
    distinct = len({tuple(s.prompt_ids) for g in groups for s in g.samples})
    assert b_sh["prompt_ids"].shape[0] == distinct  # each distinct prompt computed once
    for key in ("targets", "behaviour", "mask", "versions", "advantages", "truncated"):
        assert torch.equal(b_sh[key], b_hf[key]), key
    m = b_hf["mask"]
    assert torch.allclose(lp_sh[m], lp_hf[m], atol=1e-5)
    for a, b in zip(g_sh, g_hf):
        assert _close(a, b)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Gradients agree to 1e-5 of the tensor's largest entry: the two forwards sum in different
    orders, so an entry near zero can differ by more than an element-wise rtol allows (how much
    depends on the CPU's instruction set), while an ignored adapter or a wrong mask differs by O(1)."""
    return float((a - b).abs().max()) <= 1e-5 * (1.0 + float(b.abs().max()))


def test_shared_prompt_forward_applies_lora_adapters():
    from nonstop.lora import wrap_with_peft

    model = wrap_with_peft(make_tiny_model(GQA, seed=1), LoraConfig(enabled=True, rank=4), None)
    for module in model.modules():  # non-zero adapters, so an ignored adapter would show
        for b in getattr(module, "lora_B", {}).values():
            torch.nn.init.normal_(b.weight, std=0.2)
    trainer = Trainer(model, TrainerConfig(), temperature=1.0, pad_token_id=0)
    assert trainer.shared_prompts
    (b_sh, lp_sh, g_sh), (_, lp_hf, g_hf) = _both(trainer, _groups(1, 3, 4, 5, 4))
    assert len(g_sh) == len(g_hf) > 0  # only adapters train
    assert torch.allclose(lp_sh[b_sh["mask"]], lp_hf[b_sh["mask"]], atol=1e-5)
    for a, b in zip(g_sh, g_hf):
        assert _close(a, b)


def test_models_outside_the_supported_family_keep_the_plain_forward():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128, n_positions=32))
    assert "model_type 'gpt2'" in unsupported(gpt2)
    assert not Trainer(gpt2, TrainerConfig(), 1.0, 0).shared_prompts
    qwen = make_tiny_model(MHA, seed=0)
    qwen.config.attention_dropout = 0.1
    assert unsupported(qwen) == "attention dropout"


def _twin_steps(groups: list[Group], ahead: list[Group], cfg: TrainerConfig):
    """The same step on two identical trainers: one with `ahead`'s forward run first, one without."""
    out = []
    for first in (ahead, []):
        trainer = Trainer(make_tiny_model(GQA, seed=3), cfg, temperature=0.9, pad_token_id=0)
        held = trainer.forward_ahead(first)
        metrics = trainer.step(groups)
        out.append((held, metrics, [p.detach().clone() for p in trainer.model.parameters()]))
    return out


@pytest.mark.parametrize("entropy_coef", [0.0, 0.01], ids=["plain", "entropy"])
def test_a_forward_run_ahead_gives_the_step_the_whole_batch_would_take(entropy_coef):
    groups = _groups(2, 5, 4, 6, 7)
    longest = lambda gs: max(len(s.completion_ids) for g in gs for s in g.samples)  # noqa: E731
    # the groups that came first are not the batch's first, came in another order than the batch's,
    # and are shorter than its longest: their rows move and are padded when the batch is put together
    ahead = [groups[2], groups[1]]
    assert longest(ahead) < longest(groups)
    cfg = TrainerConfig(entropy_coef=entropy_coef)
    (held, split, w_split), (_, whole, w_whole) = _twin_steps(groups, ahead, cfg)
    assert held == 2 and split["ahead_groups"] == 2 and whole["ahead_groups"] == 0
    for key in ("loss", "tokens", "samples", "mismatch_kl", "grad_norm") + (("entropy",) if entropy_coef else ()):
        assert split[key] == pytest.approx(whole[key], rel=1e-5, abs=1e-6), key
    assert split["lag_hist"] == whole["lag_hist"]
    for a, b in zip(w_split, w_whole):
        assert _close(a, b)


def test_a_held_forward_serves_only_its_own_group_at_its_own_weights():
    groups = _groups(4, 3, 4, 5, 5)
    trainer = Trainer(make_tiny_model(GQA, seed=3), TrainerConfig(), temperature=0.9, pad_token_id=0)
    assert trainer.forward_ahead(groups[:2]) == 2
    other = _groups(5, 3, 4, 5, 5)  # the same prompt keys, other completions
    assert trainer.step(other)["ahead_groups"] == 0
    assert trainer.forward_ahead(groups[:2]) == 2
    trainer.policy_version += 1  # weights moved on since (a step the held forward did not see)
    assert trainer.step(groups)["ahead_groups"] == 0
    assert trainer.step(groups)["ahead_groups"] == 0  # the store empties at every step
