"""trainer.compile: the decoder layers' halves compiled by torch.compile compute the eager function.

The compiled halves fuse elementwise work, which reorders float sums: logprobs and gradients agree
with the eager forward to 1e-5 of each tensor's largest entry in float32 (the same bar as the packed
forward against the padded one). One test compiles both forwards, so CI pays the compile once.
"""

from __future__ import annotations

import pytest
from test_packed import GQA, close, forward, heavy_tailed_groups

from nonstop.config import Config, ConfigError, TrainerConfig, load_config
from nonstop.device import compile_blocker
from nonstop.models.tiny import make_tiny_model
from nonstop.sizing.defaults import compile_off_reason
from nonstop.trainer.core import Trainer

needs_compiler = pytest.mark.skipif(compile_blocker() is not None, reason=str(compile_blocker()))


@needs_compiler
def test_compiled_forwards_give_the_eager_logprobs_and_gradients():
    """Both forwards, compiled, equal the eager ones; the halves were compiled whole (no graph break)."""
    from torch._dynamo.utils import counters

    counters.clear()
    groups = heavy_tailed_groups(0, 3, 4)
    for packed in (False, True):
        results = []
        for compiled in (False, True):
            trainer = Trainer(
                make_tiny_model(GQA, seed=1), TrainerConfig(compile=compiled), temperature=0.9, pad_token_id=0
            )
            results.append(forward(trainer, groups, packed=packed, with_entropy=True))
        (b, lp_eager, ent_eager, g_eager), (_, lp_comp, ent_comp, g_comp) = results
        m = b["mask"]
        assert close(lp_comp[m], lp_eager[m]) and close(ent_comp[m], ent_eager[m]), packed
        assert all(close(a, e) for a, e in zip(g_comp, g_eager)), packed
        assert any(float(g.abs().max()) > 0 for g in g_comp)
    assert counters["stats"]["unique_graphs"] >= 2 and not counters["graph_break"], dict(counters)


@needs_compiler
def test_a_compiled_step_lands_on_the_eager_step_weights():
    """A whole step (loss, clip, AdamW) with compiled layers moves the weights as the eager step does:
    AdamW's first move is about lr x sign(gradient), so the bar is 1% of lr per weight (as packed)."""
    groups = heavy_tailed_groups(3, 4, 4)
    weights = []
    for compiled in (False, True):
        trainer = Trainer(
            make_tiny_model(GQA, seed=2), TrainerConfig(compile=compiled, lr=1e-2), temperature=1.0, pad_token_id=0
        )
        trainer.step(groups)
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    assert max(float((a - b).abs().max()) for a, b in zip(*weights)) <= 1e-2 * 1e-2


@needs_compiler
@pytest.mark.parametrize("packed", [False, True], ids=["shared", "packed"])
def test_compiled_layers_with_checkpointing_and_a_reference_step_as_the_eager_ones(packed):
    """The compiled halves inside activation checkpointing (recomputed in the backward) and in the
    reference model's forward without gradients (a KL penalty): the step lands where the eager one does."""
    groups = heavy_tailed_groups(5, 3, 4)
    weights, kls = [], []
    for compiled in (False, True):
        cfg = TrainerConfig(compile=compiled, packed=packed, activation_checkpointing=True, kl_coef=0.1, lr=1e-2)
        trainer = Trainer(make_tiny_model(GQA, seed=3), cfg, temperature=1.0, pad_token_id=0)
        trainer.reference = make_tiny_model(GQA, seed=4).eval().requires_grad_(False)
        stats = trainer.step(groups)
        kls.append(stats["kl_ref"])
        weights.append([p.detach().clone() for p in trainer.model.parameters()])
    assert kls[1] == pytest.approx(kls[0], rel=1e-4) and kls[0] > 0
    assert max(float((a - b).abs().max()) for a, b in zip(*weights)) <= 1e-2 * 1e-2


def test_compile_with_data_parallel_ranks_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="trainer.*compile needs ranks 1"):
        load_config(None, ["trainer.compile=true", "trainer.ranks=2"])


def test_compile_left_unset_stays_off_with_ranks_or_lora():
    assert "trainer.ranks 2" in str(compile_off_reason(Config.model_validate({"trainer": {"ranks": 2}})))
    lora = Config.model_validate({"model": {"lora": {"enabled": True}}})
    assert "model.lora" in str(compile_off_reason(lora))
    assert compile_off_reason(Config()) == compile_blocker()


def test_compile_blocker_names_a_missing_compiler(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setenv("CXX", "no-such-c++")
    assert "no C++ compiler" in str(compile_blocker())
