"""Precision and achieved FLOP/s (device.py, observe/flops.py, docs/precision.md).

- the FLOP count of a small Qwen2 model equals the hand-computed one, for a forward pass and for
  a trainer step over real (unpadded) tokens, with and without the shared-prompt forward;
- the matmul peak probe returns a positive figure, and a trainer worker's recorded fraction is
  its achieved FLOP/s over that peak; a probe that read low (under load) is raised by a later one
  when due, and left alone before; the engines' counters are read at most every few seconds;
- real runs of the CLI: float32 at depth 0 reports a mismatch KL of ~0; bf16 engine + trainer
  (on a CPU with bf16 only) trains and reports a nonzero one; both write the precision, FLOP/s
  and peak fields to metrics.jsonl and summary.json.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from nonstop.config import TrainerConfig
from nonstop.device import bf16_supported, resolve_dtype
from nonstop.hf import load_model
from nonstop.observe.flops import FlopModel, FlopTally, PeakProbe, causal_pairs, matmul_peak, train_flops
from nonstop.trainer.worker import TrainerWorker
from nonstop.types import Group, Sample
from support.cli import nonstop, records, sets, small_model_args

CPU_BF16 = bf16_supported(torch.device("cpu"))


def sample(prompt: list[int], completion: list[int]) -> Sample:
    n = len(completion)
    return Sample(prompt, completion, [-1.0] * n, [0] * n, "stop", [True] * n, reward=float(n))


def test_flop_count_of_the_small_model_equals_the_hand_computed_one(tiny_dir):
    model = load_model(str(tiny_dir))
    c = model.config
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (32, 1, 2, 1)
    assert c.intermediate_size == 64
    # one layer: q 32x32, k and v 32x16 (one KV head of 16), o 32x32, MLP gate/up/down 3 x 32x64
    body = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64
    head = 32 * c.vocab_size
    fm = FlopModel.of(model)
    assert (fm.body, fm.head, fm.attn_width) == (body, head, 1 * 2 * 16)
    assert causal_pairs(0, 4) == 1 + 2 + 3 + 4 and causal_pairs(3, 2) == 4 + 5
    assert fm.forward(10, 3, 55) == 2 * body * 10 + 2 * head * 3 + 4 * 32 * 55

    # two samples of one 3-token prompt, completions of 2 and 4 tokens
    groups = [Group(0, "p", "a", [sample([5, 6, 7], [8, 9]), sample([5, 6, 7], [8, 9, 10, 11])])]
    shared = fm.forward(3 + 1 + 3, 2 + 4, (1 + 2 + 3) + 4 + (4 + 5 + 6))  # prompt once, completion inputs after it
    assert train_flops(fm, groups, True, 3) == 3 * shared
    padded_free = fm.forward(5 + 7, 6, 15 + 28)  # prompt + completion per row, no pad positions
    assert train_flops(fm, groups, False, 2) == 2 * padded_free
    # the packed forward: a second prompt that shares [5, 6] with the first; the head once, each tail after it
    groups.append(Group(1, "q", "b", [sample([5, 6, 4, 4], [8])]))
    packed = fm.forward(2 + 1 + 2 + 1 + 3, 2 + 4 + 1, (1 + 2) + 3 + (3 + 4) + 4 + (4 + 5 + 6))
    assert train_flops(fm, groups, True, 3, shared_prefix=True) == 3 * packed
    assert train_flops(fm, groups, True, 3) == 3 * fm.forward(3 + 4 + 1 + 3, 7, 6 + 10 + 4 + 15)


def test_a_low_peak_is_raised_by_a_later_probe_only_when_due():
    cpu = torch.device("cpu")
    quiet = PeakProbe(torch.float32, cpu, refresh_s=0.02, first_refresh_s=1e9)
    quiet.best = 1.0  # as if the first probe had run while other processes held the cores
    assert quiet.tick() == 1.0  # not due: no probe, no cost
    due = PeakProbe(torch.float32, cpu, refresh_s=0.02, first_refresh_s=0.0)
    due.best = 1.0
    assert due.tick() > 1e6  # probed again: the machine does far more than 1 FLOP/s
    tally = FlopTally(engines_every_s=5.0)
    assert tally.engines_due(100.0) and not tally.engines_due(104.0) and tally.engines_due(105.0)


def test_the_peak_probe_and_the_recorded_fraction(tiny_dir):
    peak = matmul_peak(torch.float32, torch.device("cpu"), seconds=0.05)
    assert peak > 0 and math.isfinite(peak)
    worker = TrainerWorker(str(tiny_dir), TrainerConfig(lr=1e-3), 1.0, 0)
    try:
        groups = [
            Group(i, "p", "a", [sample([5, 6, 7 + i], [8, 9]), sample([5, 6, 7 + i], [8, 9, 10])]) for i in range(2)
        ]
        m = worker.step(groups).metrics
        assert m["precision"] == "float32" and m["peak_flops_per_s"] == worker.peak.best > 0
        assert m["flops"] == train_flops(worker.flop_model, groups, worker.trainer.shared_prompts, 3)
        assert m["flops_per_s"] == pytest.approx(m["flops"] / m["train_s"])  # no forward ran ahead
        assert m["peak_frac"] == pytest.approx(m["flops_per_s"] / m["peak_flops_per_s"])
    finally:
        worker.close()


def run_args(tiny_dir, name: str, extra: list[str]) -> list[str]:
    small = {
        "buffer.depth": 0,
        "buffer.max_lag": 0,
        "run.max_steps": 3,
        "run.name": name,
        "rollout.filter_uniform_reward": False,
        "rollout.max_new_tokens": 6,
        "task.max_operand": 9,
        "task.eval_size": 8,
        "task.reward": "support.rewards:length_reward",
    }
    return ["train", *small_model_args(tiny_dir), *sets(small), *sets(extra)]


def check_records(run_dir, precision: str) -> list[dict]:
    recs = records(run_dir)
    assert len(recs) == 3
    for r in recs:
        assert r["precision"] == precision
        assert r["flops"] > 0 and r["flops_per_s"] > 0 and r["peak_flops_per_s"] > 0
        assert r["peak_frac"] == pytest.approx(r["flops_per_s"] / r["peak_flops_per_s"])
    # the engines' counters are read at the first step, at evaluations and every few seconds between
    read = [r for r in recs if "engine_flops_per_s" in r]
    assert read[0] is recs[0] and read[-1] is recs[-1]
    for r in read:
        assert r["engine_flops_per_s"] > 0 and 0 < r["engine_peak_frac"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["flops"]["trainer_peak_frac"] > 0 and summary["flops"]["engine_peak_frac"] > 0
    return recs


def test_a_float32_run_at_depth_0_has_no_mismatch(tiny_dir, tmp_path):
    result = nonstop(run_args(tiny_dir, "fp32", []), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "mfu" in result.stdout
    recs = check_records(tmp_path / "runs" / "fp32", "float32")
    summary = json.loads((tmp_path / "runs" / "fp32" / "summary.json").read_text())
    assert all(e["bf16"] == 0 for e in summary["engines"])
    for r in recs:
        assert abs(r["mismatch_kl_k3"]) < 1e-9 and abs(r["mismatch_kl"]) < 1e-6, r


@pytest.mark.skipif(not CPU_BF16, reason="this CPU has no native bf16 (no avx512_bf16 / amx_bf16): auto means float32")
def test_a_bf16_run_trains_and_reports_its_mismatch(tiny_dir, tmp_path):
    assert resolve_dtype("auto", torch.device("cpu"), "trainer.precision") == torch.bfloat16
    extra = ["engine.dtype=auto", "trainer.precision=auto", "trainer.correction=tis", "trainer.lr=1e-2"]
    result = nonstop(run_args(tiny_dir, "bf16", extra), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "bf16"
    recs = check_records(run_dir, "bfloat16")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert all(e["bf16"] == 1 for e in summary["engines"])
    assert all(r["mismatch_kl_k3"] > 0 for r in recs)  # bf16 engine and trainer round differently
    assert recs[-1]["policy_version"] == 3 and all(r["skipped"] == 0 for r in recs)


def test_a_bf16_engine_receives_bf16_weights_and_holds_the_trainers(tiny_dir, tmp_path):
    """engine.dtype bfloat16 beside a float32 trainer, on any CPU: transport.dtype 'auto' sends the
    weights in bfloat16 (half the bytes), and at the end every engine's weights equal the trainer's cast
    to bfloat16, bit for bit (the run's end-to-end checksum)."""
    extra = ["engine.dtype=bfloat16", "trainer.precision=float32", "transport.checksum=true"]
    result = nonstop(run_args(tiny_dir, "wire", extra), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "wire"
    summary = json.loads((run_dir / "summary.json").read_text())
    trainer, engines = summary["weights_crc32"]["trainer"], summary["weights_crc32"]["engines"]
    assert trainer[0] == 3 and engines and all(e == trainer for e in engines)
    params = sum(p.numel() for p in load_model(str(tiny_dir)).parameters())
    sent = {r["publish_bytes"] for r in records(run_dir)}  # 2 bytes a parameter, each tensor 64-byte aligned
    assert len(sent) == 1 and 2 * params <= sent.pop() < 3 * params
