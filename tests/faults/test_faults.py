"""Fault injection on real runs: every fault proven fired, every prompt consumed exactly once.

CI's fault tier (the default tier, with tests/faults/test_node_loss.py): the engine SIGKILL, the
trainer SIGKILL + resume and the corrupted checkpoint here, the node loss on a loopback cluster
there. The hang, the NaN run and the multi-engine and multi-rank kills are marked slow (their
mechanisms have fast unit tests). Each run trains one epoch (`run.max_epochs=1`) of the 80 train
prompts of addition 0-9 on a small random model, with a fault injected from inside the
orchestrator (a reward function that kills or stops an actor, or produces an overflow).

Each test first proves that its fault fired (support/faults.py: the injector read the killed or
stopped process's state back from /proc, and the run's own records name that very pid; the
corrupted file's CRC32 changed and the resume refused that checkpoint), then checks the
accounting: `nonstop verify` recounts the run from the trainer's and the buffer's own records
against the dataset's order (lost 0, duplicated 0, read, never assumed), beside the run's prompt
ledger (summary.json) and the per-step prompt lists of metrics.jsonl.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from support.cli import nonstop, records, sets
from support.faults import (
    Verified,
    corrupt_newest_checkpoint,
    epoch_args,
    proved_corrupted,
    proved_engine_signalled,
    proved_overflow,
    proved_trainer_killed,
    verified,
)

TRAIN_PROMPTS = 80


def assert_epoch_consumed_exactly_once(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    ledger = summary["prompts"]
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    assert ledger["in_flight"] == 0 and ledger["settled"] == TRAIN_PROMPTS, ledger
    # independently: the record of each step (a resume sets aside those of the steps it trains again)
    by_step = {r["step"]: r for r in records(run_dir) if "prompts" in r}
    trained = [tuple(p) for r in by_step.values() for p in r["prompts"]]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    dropped = sum(summary["drops"].values())
    assert len(trained) + dropped == TRAIN_PROMPTS, (len(trained), summary["drops"])
    # and from the trainer's and the buffer's own records, against the dataset's order; verify reads how
    # many prompts were drawn from the newest checkpoint, so a run that wrote none (the vLLM kill test's
    # short run) is checked by the ledger and the step records above only
    if not any((run_dir / "checkpoints").glob("step_*")):
        return summary
    assert assert_verified(run_dir).drawn == TRAIN_PROMPTS
    return summary


def assert_verified(run_dir: Path) -> Verified:
    """`nonstop verify` read its counts (none missing) and found nothing lost or duplicated."""
    counts = verified(run_dir)
    assert counts.clean, f"{counts.why}\n{counts.output}"
    return counts


def assert_rolled_back_set_aside(run_dir: Path, before: list[str], resumed_at: int) -> int:
    """After a resume from step `resumed_at`: metrics.jsonl holds each step once, in order; the
    records of the steps after it that the first session wrote are in metrics.rolled_back.jsonl,
    as they were; every line written before the resume is in one of the two. Returns how many
    were set aside."""
    steps = [r["step"] for r in records(run_dir) if not r.get("final_eval")]
    assert steps == sorted(set(steps)), steps
    side_path = run_dir / "metrics.rolled_back.jsonl"
    side = side_path.read_text().splitlines() if side_path.exists() else []
    assert [line for line in before if json.loads(line)["step"] > resumed_at] == side
    kept = set((run_dir / "metrics.jsonl").read_text().splitlines())
    assert all(line in kept or line in side for line in before)
    return len(side)


def test_sigkilled_engine_is_restarted_and_no_prompt_is_lost(tiny_dir, tmp_path):
    result = nonstop(
        epoch_args(tiny_dir, "kill", "support.fault_rewards:kill_engine_once_reward"), cwd=tmp_path, timeout_s=400
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = assert_epoch_consumed_exactly_once(tmp_path / "runs" / "kill")
    proof = proved_engine_signalled(tmp_path, summary, "SIGKILL")
    assert proof.fired, proof.evidence
    faults = summary["engine_faults"]
    assert faults["restarts"] == 1 and "killed by signal 9" in faults["reasons"][0], faults
    assert "engine restarts" in result.stdout


@pytest.mark.slow  # unit-tested fast in test_restart / test_checkpoint / test_trainer
def test_hung_engine_is_detected_killed_and_restarted(tiny_dir, tmp_path):
    result = nonstop(
        epoch_args(
            tiny_dir,
            "hang",
            "support.fault_rewards:hang_engine_once_reward",
            *sets({"runtime.heartbeat_interval_s": 0.5, "runtime.heartbeat_timeout_s": 3}),
        ),
        cwd=tmp_path,
        timeout_s=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = assert_epoch_consumed_exactly_once(tmp_path / "runs" / "hang")
    proof = proved_engine_signalled(tmp_path, summary, "SIGSTOP")
    assert proof.fired, proof.evidence
    faults = summary["engine_faults"]
    assert faults["restarts"] == 1, faults
    assert f"killed by signal {signal.SIGKILL.value}" in faults["reasons"][0] or "was killed" in faults["reasons"][0]
    assert 2.5 <= faults["max_detect_s"] <= 10, faults  # heartbeat timeout 3 s (+ scheduling on a busy machine)


def test_killed_trainer_stops_the_run_and_resume_repeats_the_run_token_for_token(tiny_dir, tmp_path):
    sync = sets(
        {
            "buffer.depth": 0,
            "buffer.max_lag": 0,
            "rollout.filter_uniform_reward": False,
            "rollout.seed_per_prompt": True,
        }
    )
    ref = nonstop(epoch_args(tiny_dir, "ref", "support.rewards:length_reward", *sync), cwd=tmp_path, timeout_s=400)
    assert ref.returncode == 0, ref.stdout + ref.stderr

    first = nonstop(
        epoch_args(tiny_dir, "crash", "support.fault_rewards:kill_trainer_reward", *sync), cwd=tmp_path, timeout_s=400
    )
    assert first.returncode == 1, first.stdout + first.stderr
    run_dir = tmp_path / "runs" / "crash"
    assert "the trainer failed" in first.stdout and f"--resume {run_dir.resolve()}" in first.stdout
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    resumed = nonstop(["train", "--resume", str(Path("runs") / "crash")], cwd=tmp_path, timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    proof = proved_trainer_killed(tmp_path, [first.returncode, resumed.returncode], first.stdout + resumed.stdout)
    assert proof.fired, proof.evidence
    summary = assert_epoch_consumed_exactly_once(run_dir)
    assert summary["resumed_from"] is not None
    # synchronous and seeded per prompt: every step trains the same prompts with the same
    # completions, token for token, as the uninterrupted run (the steps after the checkpoint too)
    steps = lambda d: {r["step"]: (r["prompts"], r["completions_crc32"]) for r in records(d) if "prompts" in r}  # noqa: E731
    resumed_steps, ref_steps = steps(run_dir), steps(tmp_path / "runs" / "ref")
    assert resumed_steps == ref_steps
    assert len({crc for _, crc in ref_steps.values()}) == len(ref_steps)  # the digest tells steps apart
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert len(json.loads((newest / "state.json").read_text())["engine_rng"]) == 1  # the engine's generator state
    at = re.search(r"resumed from .*?\(step (\d+),", resumed.stdout, re.S)
    assert at is not None and 0 < int(at.group(1)) < max(ref_steps), (
        resumed.stdout
    )  # some steps were generated again after the resume
    assert_rolled_back_set_aside(run_dir, before, int(at.group(1)))


def test_corrupted_checkpoint_falls_back_to_the_previous_one(tiny_dir, tmp_path):
    args = epoch_args(
        tiny_dir, "corrupt", "support.rewards:length_reward", *sets({"run.max_epochs": None, "run.max_steps": 4})
    )
    result = nonstop(args, cwd=tmp_path, timeout_s=400)
    assert result.returncode == 0, result.stdout + result.stderr
    run_dir = tmp_path / "runs" / "corrupt"
    ckpts = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in ckpts] == ["step_00000002", "step_00000004"]
    change = corrupt_newest_checkpoint(run_dir)
    before = (run_dir / "metrics.jsonl").read_text().splitlines()
    resumed = nonstop(
        ["train", "--resume", str(Path("runs") / "corrupt"), *sets({"run.max_steps": 6})], cwd=tmp_path, timeout_s=400
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    proof = proved_corrupted(change, resumed.stdout)
    assert proof.fired and change["step"] == "step_00000004", proof.evidence
    assert "model.safetensors fails its CRC32" in resumed.stdout
    assert "resumed from" in resumed.stdout and "step 2," in resumed.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["prompts"]["duplicated"] == 0
    assert assert_rolled_back_set_aside(run_dir, before, 2) >= 2  # steps 3 and 4, which the fallback trained again
    # the steps trained again are in trained.jsonl once: the fallback's rolled-back lines were set aside
    assert_verified(run_dir)


@pytest.mark.slow  # unit-tested fast in test_restart / test_checkpoint / test_trainer
def test_nan_loss_skips_the_step_and_the_epoch_still_completes(tiny_dir, tmp_path):
    result = nonstop(
        epoch_args(
            tiny_dir, "nan", "support.fault_rewards:overflow_reward", *sets({"trainer.max_consecutive_skips": 50})
        ),
        cwd=tmp_path,
        timeout_s=400,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = assert_epoch_consumed_exactly_once(tmp_path / "runs" / "nan")
    proof = proved_overflow(tmp_path, tmp_path / "runs" / "nan")
    assert proof.fired, proof.evidence
    assert summary["skipped_steps"] >= 1
    assert summary["prompts"]["outcomes"].get("skipped_step", 0) >= 1


@pytest.mark.slow  # ~1 min: a real epoch with two engines
def test_one_of_several_engines_killed_the_others_keep_serving(tiny_dir, tmp_path):
    result = nonstop(
        epoch_args(
            tiny_dir, "two", "support.fault_rewards:kill_engine_0_once_reward", *sets({"runtime.num_engines": 2})
        ),
        cwd=tmp_path,
        timeout_s=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = assert_epoch_consumed_exactly_once(tmp_path / "runs" / "two")
    proof = proved_engine_signalled(tmp_path, summary, "SIGKILL", "nonstop-engine-0")
    assert proof.fired, proof.evidence
    faults = summary["engine_faults"]
    assert faults["restarts"] == 1 and "'engine-0'" in faults["reasons"][0], faults
    assert len(summary["engines"]) == 2 and all(e["tokens_generated"] > 0 for e in summary["engines"]), summary[
        "engines"
    ]


@pytest.mark.slow  # ~1-2 min: a real epoch with two engines; tests/transport/test_transport.py re-plans the group fast
def test_engine_killed_on_the_broadcast_transport_rejoins_a_rebuilt_group(tiny_dir, tmp_path):
    result = nonstop(
        epoch_args(
            tiny_dir,
            "bcast",
            "support.fault_rewards:kill_engine_0_once_reward",
            *sets({"runtime.num_engines": 2, "transport.kind": "broadcast"}),
        ),
        cwd=tmp_path,
        timeout_s=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = assert_epoch_consumed_exactly_once(tmp_path / "runs" / "bcast")
    proof = proved_engine_signalled(tmp_path, summary, "SIGKILL", "nonstop-engine-0")
    assert proof.fired, proof.evidence
    faults = summary["engine_faults"]
    assert faults["restarts"] == 1 and "'engine-0'" in faults["reasons"][0], faults
    assert len(summary["engines"]) == 2 and all(e["tokens_generated"] > 0 for e in summary["engines"]), summary[
        "engines"
    ]
    # the replacement was sent the current weights before it served: none of its groups lagged
    assert summary["drops"].get("max_lag", 0) == 0, summary["drops"]


@pytest.mark.slow  # ~2-3 min: two runs with two trainer ranks; tests/trainer/test_parallel.py checks the state fast
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_killed_trainer_rank_and_resume_with_two_ranks(tiny_dir, tmp_path, mode):
    args = epoch_args(
        tiny_dir,
        mode,
        "support.fault_rewards:kill_trainer_reward",
        *sets({"trainer.ranks": 2, "trainer.data_parallel": mode}),
    )
    first = nonstop(args, cwd=tmp_path, timeout_s=600)
    assert first.returncode == 1 and "the trainer failed" in first.stdout, first.stdout + first.stderr
    run_dir = tmp_path / "runs" / mode
    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert checkpoints and (checkpoints[-1] / "optimizer").is_dir() == (mode == "fsdp2")
    resumed = nonstop(["train", "--resume", str(Path("runs") / mode)], cwd=tmp_path, timeout_s=600)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resumed from" in resumed.stdout
    proof = proved_trainer_killed(tmp_path, [first.returncode, resumed.returncode], first.stdout + resumed.stdout)
    assert proof.fired, proof.evidence
    assert_epoch_consumed_exactly_once(run_dir)
