"""The reference loop (nonstop.reference) as an oracle of the pipeline.

Cheap and exact: on the same sampled batch, the pipeline's Trainer.step and the reference loop's
loss step make the same weight update (different padding and gathering code, same algorithm).
Statistical and slow: at buffer depth 0 without refill, the pipeline learns like the reference
loop over several seeds (test_pipeline_depth0_learns_like_the_reference_loop).
"""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from nonstop.config import load_config
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.shipped import shipped_dir
from nonstop.reference import grpo_loss, left_pad, run_reference, sample
from nonstop.scoring.rewards import partial_credit
from nonstop.tasks.data import load_task
from nonstop.trainer.core import Trainer
from nonstop.trainer.losses import group_advantages
from nonstop.types import Group, Sample
from support.cli import sets


def test_trainer_step_makes_the_reference_update_on_the_same_batch():
    cfg = load_config()
    base = shipped_dir()
    tok = load_tokenizer(str(base))
    reference, policy = load_model(str(base)), load_model(str(base))
    prompts = load_task(cfg.task).train[:6]
    n = cfg.rollout.group_size
    ids, mask = left_pad([tok(ex.prompt)["input_ids"] for ex in prompts for _ in range(n)], tok.pad_token_id)
    completions, behaviour, loss_mask = sample(
        reference,
        ids,
        mask,
        cfg.rollout.max_new_tokens,
        cfg.rollout.temperature,
        tok.eos_token_id,
        tok.pad_token_id,
        torch.Generator().manual_seed(3),
    )
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    rewards = torch.tensor([partial_credit(t, prompts[i // n].answer) for i, t in enumerate(texts)]).view(
        len(prompts), n
    )
    assert (rewards.max(-1).values > rewards.min(-1).values).sum() >= 3  # the batch carries signal

    opt = torch.optim.AdamW(reference.parameters(), lr=cfg.trainer.learning_rate, weight_decay=cfg.trainer.weight_decay)
    loss = grpo_loss(
        reference,
        ids,
        mask,
        completions,
        behaviour,
        loss_mask,
        group_advantages(rewards, cfg.trainer.advantage_mode).reshape(-1),
        cfg,
    )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), cfg.trainer.max_grad_norm)
    opt.step()

    groups = []
    for g, ex in enumerate(prompts):
        samples = []
        for j in range(n):
            b = g * n + j
            C = int(loss_mask[b].sum())  # tokens up to and including EOS
            samples.append(
                Sample(
                    tok(ex.prompt)["input_ids"],
                    completions[b, :C].tolist(),
                    behaviour[b, :C].tolist(),
                    [0] * C,
                    "stop" if completions[b, C - 1] == tok.eos_token_id else "length",
                    reward=float(rewards[g, j]),
                )
            )
        groups.append(Group(ex.index, ex.prompt, ex.answer, samples))
    trainer = Trainer(policy, cfg.trainer, cfg.rollout.temperature, tok.pad_token_id)
    metrics = trainer.step(groups)
    assert abs(metrics["loss"] - float(loss.detach())) < 1e-6, (metrics["loss"], float(loss.detach()))
    # Adam's first step moves every weight by about lr whatever the gradient's scale: compare the
    # clipped gradients themselves, then the weights.
    grads = [(p.grad, q.grad) for p, q in zip(policy.parameters(), reference.parameters())]
    largest = max(float(g.abs().max()) for g, _ in grads)
    assert largest > 1e-3 and max(float((g - h).abs().max()) for g, h in grads) < 1e-4 * largest
    # Where a gradient is float noise (|g| ~ 1e-10), Adam's first step still moves the weight by
    # ~lr in the noise's sign: compare the weights where the gradient is well above rounding.
    firm = [
        (p, q, h.abs() > 1e-3 * largest)
        for (p, q), (_, h) in zip(zip(policy.parameters(), reference.parameters()), grads)
    ]
    assert sum(int(m.sum()) for _, _, m in firm) > 0.2 * sum(p.numel() for p, _, _ in firm)
    assert max(float((p - q)[m].abs().max()) if m.any() else 0.0 for p, q, m in firm) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_pipeline_depth0_learns_like_the_reference_loop(tmp_path):
    """Held-out gain after 30 steps from the shipped base, 3 seeds per arm, same batch semantics
    (depth 0, no refill). Passes when the mean gains differ by less than 3 pooled standard errors
    (plus 1 point) and both arms gained; a pipeline that learned wrongly (sign, scale, stale
    weights) falls outside."""
    from support.cli import nonstop

    steps, seeds = 30, (0, 1, 2)
    over = ["rollout.refill=false", "buffer.depth=0", "buffer.max_lag=0"]
    cfg = load_config(overrides=over)
    ref = [run_reference(cfg, str(shipped_dir()), steps, seed, eval_every=steps, threads=1) for seed in seeds]
    ref_gain = [r[-1]["eval_accuracy"] - r[0]["eval_accuracy"] for r in ref]
    pipe_gain = []
    for seed in seeds:
        args = [
            "train",
            *sets(
                {
                    "run.name": f"s{seed}",
                    "run.seed": seed,
                    "run.max_steps": steps,
                    "run.max_time_s": None,
                    "run.eval_every": steps,
                    "run.progress": "plain",
                }
            ),
            *sets(over),
        ]
        result = nonstop(args, cwd=tmp_path)
        assert result.returncode == 0, result.stdout + result.stderr
        s = json.loads((tmp_path / "runs" / f"s{seed}" / "summary.json").read_text())
        pipe_gain.append(s["final_accuracy"] - s["base_accuracy"])
    spread = ((statistics.variance(ref_gain) + statistics.variance(pipe_gain)) / 2) ** 0.5  # within-arm
    se = max(spread, 0.01) * (2 / len(seeds)) ** 0.5
    diff = statistics.mean(pipe_gain) - statistics.mean(ref_gain)
    print(f"held-out gain after {steps} steps: reference {ref_gain}, pipeline depth 0 {pipe_gain}")
    assert min(ref_gain) > 0 and min(pipe_gain) > 0, (ref_gain, pipe_gain)
    assert abs(diff) < 3 * se + 0.01, (ref_gain, pipe_gain)
