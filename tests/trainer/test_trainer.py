import math

import pytest
import torch

from nonstop.config import ShmTransportConfig, TrainerConfig
from nonstop.engine.core import TorchEngine
from nonstop.hf import load_model, load_tokenizer
from nonstop.trainer.core import Trainer
from nonstop.transport import open_publisher, open_receiver, plan_transport
from nonstop.types import GenerationRequest, Group, SamplingParams


def _rollouts(engine, tok, prompts, n=4, temperature=0.8):
    reqs = [
        GenerationRequest(i, tok(p)["input_ids"], n, SamplingParams(5, temperature, seed=i))
        for i, p in enumerate(prompts)
    ]
    groups = []
    for i, (p, samples) in enumerate(zip(prompts, engine.generate(reqs))):
        for j, s in enumerate(samples):
            s.reward = float(j % 2)  # mixed rewards: non-zero advantages
        groups.append(Group(i, p, "x", samples))
    return groups


def test_on_policy_first_step_has_ratio_one_and_publishes_new_weights(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), temperature=0.8, pad_token_id=tok.pad_token_id)
    groups = _rollouts(engine, tok, ["1+2=", "33+44=", "7+0="])

    batch = trainer.batch_of(groups)
    with torch.no_grad():
        recomputed = trainer.logprobs(batch)
    m = batch["mask"]
    assert torch.allclose(recomputed[m], batch["behaviour"][m], atol=1e-4)

    before = [p.detach().clone() for p in trainer.model.parameters()]
    metrics = trainer.step(groups)
    assert abs(metrics["ratio_max"] - 1) < 1e-4 and abs(metrics["ratio_min"] - 1) < 1e-4
    assert metrics["lag_hist"] == {"0": metrics["tokens"]}
    assert trainer.policy_version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))

    # the engine picks the new weights up through a real transport and stamps version 1
    handle = plan_transport(ShmTransportConfig(), trainer.model, 1)
    publisher = open_publisher(handle)
    receiver = open_receiver(handle, engine.model)
    engine.weights = receiver
    try:
        publisher.publish(trainer.model, trainer.policy_version)
        new_groups = _rollouts(engine, tok, ["5+5="])
        assert all(v == 1 for s in new_groups[0].samples for v in s.versions)
        with torch.no_grad():
            b2 = trainer.batch_of(new_groups)
            assert torch.allclose(trainer.logprobs(b2)[b2["mask"]], b2["behaviour"][b2["mask"]], atol=1e-4)
    finally:
        receiver.close()
        publisher.close()


def test_step_raises_the_probability_of_rewarded_completions(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=3e-2), temperature=1.0, pad_token_id=tok.pad_token_id)
    groups = _rollouts(engine, tok, ["12+30="], n=6, temperature=1.0)
    batch = trainer.batch_of(groups)
    with torch.no_grad():
        before = (trainer.logprobs(batch) * batch["mask"]).sum(-1)
    for _ in range(5):
        trainer.step(groups)
    with torch.no_grad():
        after = (trainer.logprobs(batch) * batch["mask"]).sum(-1)
    adv = batch["advantages"]
    assert (after - before)[adv > 0].mean() > 0 > (after - before)[adv < 0].mean()


def _stale_groups(tok, versions_per_sample):
    from nonstop.types import Sample

    samples = []
    for j, versions in enumerate(versions_per_sample):
        comp = tok("12")["input_ids"][: len(versions)]
        samples.append(
            Sample(
                tok("1+1=")["input_ids"],
                comp,
                [-1.0] * len(comp),
                versions,
                "length" if j == 0 else "stop",
                reward=float(j % 2),
            )
        )
    return [Group(0, "1+1=", "2", samples)]


def test_token_and_sample_rejection_and_overlong_filter_are_counted(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    versions = [[3, 5], [5, 5], [2, 3], [5, 4]]  # trainer at version 5, max_lag 1
    cases = [
        ("token", {"rejected_tokens": 3, "rejected_samples": 0}),
        ("sample", {"rejected_tokens": 4, "rejected_samples": 2}),
    ]
    for reject, expected in cases:
        trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(), 1.0, tok.pad_token_id, max_lag=1, reject=reject)
        trainer.policy_version = 5
        m = trainer.step(_stale_groups(tok, versions))
        assert {k: m[k] for k in expected} == expected, reject
        assert m["tokens"] == 8 - expected["rejected_tokens"]
        assert m["lag_hist"] == {"0": 4, "1": 1, "2": 2, "3": 1}
    dapo = Trainer(load_model(str(tiny_dir)), TrainerConfig(loss="dapo"), 1.0, tok.pad_token_id)
    m = dapo.step(_stale_groups(tok, [[0, 0]] * 4))
    assert m["overlong_samples"] == 1 and m["tokens"] == 6


@pytest.mark.parametrize("loss", ["grpo", "dr_grpo", "dapo", "gspo", "reinforce_pp"])
def test_every_loss_trains_with_kl_and_entropy(tiny_dir, loss):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    # overlong filtering off: a random tiny model rarely ends before max_new_tokens, and with every
    # sample filtered dapo would (correctly) not move at all
    cfg = TrainerConfig(loss=loss, kl_coef=0.1, entropy_coef=0.01, correction="tis", overlong_filter=False)
    trainer = Trainer(load_model(str(tiny_dir)), cfg, 1.0, tok.pad_token_id, max_new_tokens=5)
    groups = _rollouts(engine, tok, ["1+2=", "3+4="], temperature=1.0)
    m1 = trainer.step(groups)
    m2 = trainer.step(groups)
    assert m1["kl_ref"] == pytest.approx(0.0, abs=1e-6) and m2["kl_ref"] > 0  # moved away from the reference
    assert m1["entropy"] > 0 and math.isfinite(m2["loss"])


def _far_behind_groups(tok):
    """One group of four two-token samples, rewards 0, 1, 0, 1, whose behaviour logprobs (-20) lie
    far below any the trainer computes, so every ratio exceeds e^10."""
    from nonstop.types import Sample

    comp = tok("12")["input_ids"][:2]
    samples = [
        Sample(tok("1+1=")["input_ids"], comp, [-20.0] * 2, [0, 0], "stop", reward=float(j % 2)) for j in range(4)
    ]
    return [Group(0, "1+1=", "2", samples)]


def test_dual_clip_and_group_std_in_the_trainer(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    groups = _far_behind_groups(tok)
    # rewards 0, 1, 0, 1: advantages -1, +1, -1, +1 (population std 0.5), or +-sqrt(3)/2 (unbiased, 1/sqrt(1/3) x 0.5)
    unbiased = Trainer(load_model(str(tiny_dir)), TrainerConfig(group_std="unbiased"), 1.0, tok.pad_token_id)
    h = 3**0.5 / 2
    assert torch.allclose(unbiased.batch_of(groups)["advantages"], torch.tensor([-h, h, -h, h]), atol=1e-5)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(clip_ratio_c=3.0), 1.0, tok.pad_token_id)
    assert torch.allclose(trainer.batch_of(groups)["advantages"], torch.tensor([-1.0, 1.0, -1.0, 1.0]), atol=1e-5)
    m = trainer.step(groups)
    # every ratio > 3: A = -1 tokens are capped at 3, A = +1 tokens clipped at 1.2; per sample
    # 3, -1.2, 3, -1.2 -> mean 0.9; half the tokens dual-clipped, and every token's gradient is 0
    assert m["loss"] == pytest.approx(0.9, rel=1e-5)  # A = +-0.5 / (0.5 + 1e-6)
    assert m["dual_clip_frac"] == 0.5 and m["clip_frac"] == 0.5
    assert m["grad_norm"] == 0.0
    plain = Trainer(load_model(str(tiny_dir)), TrainerConfig(), 1.0, tok.pad_token_id).step(groups)
    assert plain["dual_clip_frac"] == 0.0 and plain["loss"] > 1e3  # uncapped: |A| x ratio, ratio > e^10


def test_dr_grpo_needs_the_generation_budget(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    with pytest.raises(ValueError, match=r"trainer.loss 'dr_grpo' divides by samples x rollout.max_new_tokens"):
        Trainer(load_model(str(tiny_dir)), TrainerConfig(loss="dr_grpo"), 1.0, tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(loss="dr_grpo"), 1.0, tok.pad_token_id, max_new_tokens=8)
    groups = _far_behind_groups(tok)
    for s in groups[0].samples:
        s.logprobs = [-1.0, -1.0]
    batch = trainer.batch_of(groups)
    with torch.no_grad():
        logp = trainer.logprobs(batch)
    m = trainer.step(groups)
    # dr_grpo: advantages r - mean = -0.5, +0.5, ...; per token -clip-min(ratio A); sum / (4 samples x 8)
    ratio = torch.exp(logp - batch["behaviour"])
    adv = batch["advantages"].unsqueeze(-1)
    per_token = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    assert m["loss"] == pytest.approx(float(per_token.sum() / 32), rel=1e-5)


def test_kl_clamp_is_counted(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    cfg = TrainerConfig(lr=1e-2, kl_coef=0.1, kl_clamp=1e-6)
    trainer = Trainer(load_model(str(tiny_dir)), cfg, 1.0, tok.pad_token_id)
    groups = _far_behind_groups(tok)
    first = trainer.step(groups)  # the policy is the reference: log-ratio 0 everywhere
    assert first["kl_clamped_frac"] == 0.0 and first["kl_ref"] == 0.0
    second = trainer.step(groups)  # moved by lr 1e-2: every log-ratio is beyond 1e-6
    assert second["kl_clamped_frac"] == 1.0
    # k3 of a log-ratio clamped to +-1e-6 is ~5e-13 (float32 rounding of exp(-d) + d - 1: ~1e-7);
    # the same two steps without the clamp move the policy measurably away from the reference
    assert abs(second["kl_ref"]) < 1e-6
    free = Trainer(load_model(str(tiny_dir)), cfg.model_copy(update={"kl_clamp": None}), 1.0, tok.pad_token_id)
    free.step(groups)
    unclamped = free.step(groups)
    assert unclamped["kl_ref"] > 1e-4 and "kl_clamped_frac" not in unclamped


def test_keep_sampling_mask_replays_the_engine_support(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(), temperature=0.9, pad_token_id=tok.pad_token_id)
    reqs = [
        GenerationRequest(i, tok(p)["input_ids"], 4, SamplingParams(5, 0.9, seed=i, top_k=4, top_p=0.9))
        for i, p in enumerate(["1+2=", "33+44="])
    ]
    groups = [Group(i, "p", "a", samples) for i, samples in enumerate(engine.generate(reqs))]
    batch = trainer.batch_of(groups)
    m = batch["mask"]
    with torch.no_grad():
        kept_lp = trainer.logprobs(batch)
        full_lp = trainer.logprobs({**batch, "keep": None})
    # renormalisation: log p_kept(a) = log p(a) - log sum_{k in kept} p(k), checked against a plain forward
    s = groups[0].samples[0]
    with torch.no_grad():
        logits = trainer.model(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0] / 0.9
    P = len(s.prompt_ids)
    for t, kept in enumerate(s.sampling_mask):
        full = torch.log_softmax(logits[P - 1 + t], -1)
        expected = full[s.completion_ids[t]] - torch.logsumexp(full[kept], -1)
        assert abs(kept_lp[0, t].item() - expected.item()) < 1e-5
        assert abs(full_lp[0, t].item() - full[s.completion_ids[t]].item()) < 1e-5
    assert torch.allclose(kept_lp[m], batch["behaviour"][m], atol=1e-4)  # ratio 1 on policy
    assert not torch.allclose(full_lp[m], batch["behaviour"][m], atol=1e-3)  # without the mask it is not


def test_non_finite_step_is_skipped_with_weights_unchanged_and_counted(tiny_dir):
    from nonstop.trainer.core import NumericalError

    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    trainer = Trainer(load_model(str(tiny_dir)), TrainerConfig(max_consecutive_skips=3), 1.0, tok.pad_token_id)
    good = _rollouts(engine, tok, ["1+2="], temperature=1.0)
    bad = _rollouts(engine, tok, ["1+2="], temperature=1.0)
    bad[0].samples[0].logprobs[0] = float("nan")  # a corrupted behaviour logprob poisons the loss
    before = [p.detach().clone() for p in trainer.model.parameters()]
    m = trainer.step(bad)
    assert m["skipped"] == 1 and m["skipped_steps"] == 1 and trainer.policy_version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    m = trainer.step(good)
    assert m["skipped"] == 0 and trainer.policy_version == 1 and trainer.skips_in_row == 0
    trainer.step(bad)
    trainer.step(bad)
    with pytest.raises(NumericalError, match="3 consecutive steps had a non-finite loss"):
        trainer.step(bad)
    assert trainer.skipped_steps == 4


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    from nonstop.trainer.core import lr_factor

    assert [lr_factor(n, 4, "constant", 100) for n in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert lr_factor(4, 4, "cosine", 104) == 1.0
    assert abs(lr_factor(54, 4, "cosine", 104) - 0.55) < 1e-9  # halfway: 0.1 + 0.9 * 0.5
    assert abs(lr_factor(104, 4, "cosine", 104) - 0.1) < 1e-9 and abs(lr_factor(500, 4, "cosine", 104) - 0.1) < 1e-9


def test_checkpoint_restores_the_trainer_exactly(tiny_dir, tmp_path):
    """A trainer rebuilt from save_checkpoint takes the next step exactly as the original does."""
    from nonstop.trainer.worker import TrainerWorker

    tok = load_tokenizer(str(tiny_dir))
    cfg = TrainerConfig(lr=1e-2, lr_warmup_steps=3, lr_schedule="cosine", entropy_coef=0.01)
    original = TrainerWorker(str(tiny_dir), cfg, 1.0, tok.pad_token_id, total_steps=10)
    for _ in range(2):
        original.step(_stale_groups(tok, [[0, 0]] * 4))
    assert original.save_checkpoint(str(tmp_path)) == 2
    resumed = TrainerWorker(str(tmp_path / "model"), cfg, 1.0, tok.pad_token_id, total_steps=10)
    assert resumed.load_checkpoint(str(tmp_path)) == 2
    a, b = original.step(_stale_groups(tok, [[2, 2]] * 4)), resumed.step(_stale_groups(tok, [[2, 2]] * 4))
    assert a.policy_version == b.policy_version == 3 and a.metrics["lr"] == b.metrics["lr"]
    for (name, p), q in zip(original.trainer.model.named_parameters(), resumed.trainer.model.parameters()):
        assert torch.equal(p, q), name


def test_two_updates_per_batch_equal_two_steps_on_it_and_move_the_version_once(tiny_dir):
    """With correction none every update is clipped against the behaviour logprobs, so mu = 2
    updates of one batch are exactly two mu = 1 steps on it; the version and lr schedule move once."""
    tok = load_tokenizer(str(tiny_dir))
    engine = TorchEngine(load_model(str(tiny_dir)), [tok.eos_token_id], tok.pad_token_id)
    groups = _rollouts(engine, tok, ["1+2=", "33+44=", "7+0="], temperature=1.0)
    two = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2, updates_per_batch=2), 1.0, tok.pad_token_id)
    one = Trainer(load_model(str(tiny_dir)), TrainerConfig(lr=1e-2), 1.0, tok.pad_token_id)
    m = two.step(groups)
    first = one.step(groups)
    second = one.step(groups)
    for a, b in zip(two.model.parameters(), one.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert m["updates"] == 2 and two.policy_version == 1 and two.scheduler.last_epoch == 1
    assert m["loss"] == pytest.approx(first["loss"], abs=1e-6)  # the step reports its first update
    assert m["last_update_loss"] == pytest.approx(second["loss"], abs=1e-6)
    assert m["last_update_clip_frac"] == pytest.approx(second["clip_frac"], abs=1e-6)
    assert second["ratio_max"] > 1 + 1e-3  # the second update did see a moved policy
