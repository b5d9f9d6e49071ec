"""The run doctor (observe/doctor.py) on hand-built step records: each pattern is found on a
sequence built to show it, named once, with its cause and the setting to try; a healthy run and
a solved task stay silent. The real runs (a reward that pays for a length, the default job) are
in tests/orchestrator/test_doctor_runs.py and tests/orchestrator/test_e2e.py."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from nonstop.config import ConfigError, DoctorConfig, load_config
from nonstop.observe.doctor import Context, Doctor, diagnose, read_records
from nonstop.orchestrator.records import ROLLOUT_FIELDS, Vitals
from nonstop.types import Group, Sample

CTX = Context(max_new_tokens=4, reward="exact_match", group_size=8, lr=6e-4)


def lerp(a: float, b: float) -> Callable[[int, int], float]:
    """A value going from a at step 1 to b at the last step."""
    return lambda step, steps: a + (b - a) * (step - 1) / max(steps - 1, 1)


HEALTHY = {
    "reward": lerp(0.3, 0.6),
    "heldout": lerp(0.3, 0.6),
    "signal": lerp(0.5, 0.5),
    "entropy": lerp(0.8, 0.6),
    "truncated": lerp(0.02, 0.02),
    "clip": lerp(0.02, 0.02),
}
"""A run that learns: reward and held-out accuracy rise together, the rest holds."""


def run_records(steps: int = 200, eval_every: int = 25, groups: int = 40, **curves) -> list[dict]:
    """metrics.jsonl lines of a synthetic run: each quantity a function of (step, steps), HEALTHY's
    unless given; `exact` (the samples' exact-match rate) follows the reward unless given."""
    c = {**HEALTHY, **curves}
    c.setdefault("exact", c["reward"])
    out = []
    for step in range(1, steps + 1):
        r = {
            "step": step,
            "reward_mean": 0.5,  # trained groups only: the doctor reads the rollout fields
            "prompts": [[0, i] for i in range(32)],
            "clip_frac": c["clip"](step, steps),
            "lr": 6e-4,
            "rollout_groups": groups,
            "rollout_signal_groups": round(c["signal"](step, steps) * groups),
            "rollout_reward_mean": c["reward"](step, steps),
            "rollout_exact_frac": c["exact"](step, steps),
            "rollout_tokens_mean": 3.0,
            "rollout_truncated_frac": c["truncated"](step, steps),
            "rollout_entropy": c["entropy"](step, steps),
        }
        if step % eval_every == 0:
            r["eval_accuracy"] = c["heldout"](step, steps)
        out.append(r)
    return out


def codes(records: list[dict], base: float = 0.3, cfg: DoctorConfig | None = None, ctx: Context = CTX) -> list[str]:
    return [f.code for f in diagnose(records, base, ctx, cfg)]


def test_a_healthy_run_is_silent():
    """Reward and held-out accuracy rise together, signal and entropy hold, nothing is cut or clipped."""
    assert codes(run_records()) == []


def test_reward_rising_while_heldout_is_flat_names_the_reward():
    recs = run_records(heldout=lerp(0.30, 0.31), exact=lerp(0.30, 0.31), reward=lerp(0.30, 0.55))
    (f,) = diagnose(recs, 0.3, Context(4, "my_rewards:right_length", 8, 6e-4))
    assert f.code == "reward_not_heldout" and f.step == 125  # the first evaluation after a rise of 0.1
    assert "0.315 -> 0.441 over steps 0-125" in f.seen and "30.0%" in f.seen and "exact match moved only" in f.seen
    assert "my_rewards:right_length" in f.cause and "task.reward=exact_match" in f.tries


def test_reward_and_train_exact_match_rising_while_heldout_is_flat_names_the_training_prompts():
    recs = run_records(heldout=lerp(0.30, 0.31), reward=lerp(0.30, 0.55), exact=lerp(0.30, 0.55))
    for r in recs:
        r["prompts"] = [[r["step"] // 20, i] for i in range(32)]  # a small train split, drawn again and again
    (f,) = diagnose(recs, 0.3, CTX)
    assert f.code == "reward_not_heldout" and "does not carry to held-out" in f.cause
    assert "drawn about" in f.seen and any("dataset" in t for t in f.tries)


def test_heldout_that_stopped_rising_is_found_later_in_the_run():
    """Held-out rose, then stopped at step 100 while the reward kept climbing (the issue's run)."""
    heldout = lambda s, n: min(0.30 + 0.002 * s, 0.50)  # noqa: E731
    recs = run_records(steps=300, heldout=heldout, reward=lerp(0.3, 0.8), exact=lerp(0.3, 0.35))
    (f,) = diagnose(recs, 0.3, CTX)
    assert f.code == "reward_not_heldout" and f.step >= 150


def test_a_rise_within_noise_is_not_flagged():
    assert codes(run_records(heldout=lerp(0.30, 0.31), reward=lerp(0.30, 0.36))) == []


def test_signal_collapse_with_entropy_names_the_learning_rate():
    recs = run_records(heldout=lerp(0.3, 0.3), signal=lerp(0.6, 0.0), entropy=lerp(0.8, 0.1), reward=lerp(0.3, 0.3))
    found = {f.code: f for f in diagnose(recs, 0.3, CTX)}
    assert set(found) == {"signal_collapse"}
    assert "trainer.lr=0.0003" in found["signal_collapse"].tries and "entropy" in found["signal_collapse"].seen


def test_signal_collapse_without_entropy_collapse_names_the_group_size():
    recs = run_records(heldout=lerp(0.3, 0.3), signal=lerp(0.6, 0.0), reward=lerp(0.3, 0.3))
    (f,) = diagnose(recs, 0.3, CTX)
    assert f.code == "signal_collapse" and any(t.startswith("rollout.group_size=16") for t in f.tries)


def test_entropy_collapse():
    recs = run_records(heldout=lerp(0.3, 0.3), entropy=lambda s, n: max(0.9 - 0.01 * s, 0.01), reward=lerp(0.3, 0.3))
    (f,) = diagnose(recs, 0.3, CTX)
    assert f.code == "entropy_collapse" and "trainer.lr=0.0003" in f.tries and f.step == 100


def test_collapse_of_a_solved_task_is_not_a_finding():
    """All-right groups carry no signal and a right policy needs no entropy: not a collapse."""
    recs = run_records(heldout=lerp(0.5, 0.97), signal=lerp(0.6, 0.0), entropy=lerp(0.9, 0.0))
    assert codes(recs, base=0.5) == []


def test_completions_drifting_to_the_limit():
    (f,) = diagnose(run_records(truncated=lerp(0.0, 0.9)), 0.3, CTX)
    assert f.code == "length_at_limit" and "drifted" in f.seen
    assert "trainer.overlong_filter=true (cut completions leave the loss)" in f.tries


def test_completions_cut_from_the_start_ask_for_more_tokens():
    (f,) = diagnose(run_records(truncated=lerp(0.9, 0.9)), 0.3, CTX)
    assert f.code == "length_at_limit" and f.tries == ("rollout.max_new_tokens=8",)


def test_ratio_clipping_most_tokens():
    (f,) = diagnose(run_records(clip=lerp(0.5, 0.6)), 0.3, CTX)
    assert f.code == "ratio_clipping" and "trainer.lr=0.0003" in f.tries and "buffer.depth=0" in f.tries[1]


def test_heldout_below_the_base():
    recs = run_records(heldout=lerp(0.25, 0.15), reward=lerp(0.3, 0.3))
    (f,) = diagnose(recs, 0.3, CTX)
    assert f.code == "below_base" and "30.0%" in f.seen
    one_dip = run_records(heldout=lambda s, n: 0.2 if s == n else 0.32)
    assert "below_base" not in codes(one_dip)


def test_a_dip_below_the_base_that_the_run_climbs_out_of_is_marked_cleared():
    """Two evaluations under the base early, then learning: found when seen, cleared at the end."""
    recs = run_records(heldout=lambda s, n: 0.15 if s <= 50 else 0.3 + 0.3 * s / n, reward=lerp(0.3, 0.6))
    doctor = Doctor(DoctorConfig(), CTX, 0.3)
    seen = [f for r in recs for f in doctor.observe(r)]
    assert [f.code for f in seen] == ["below_base"] and seen[0].cleared is None
    (cleared,) = doctor.finish({})
    assert cleared.code == "below_base" and "60.0%" in cleared.cleared and "cleared" in cleared.line()
    assert doctor.report()["findings"][0]["cleared"] == cleared.cleared
    assert [f.cleared for f in diagnose(recs, 0.3, CTX)] == [cleared.cleared]
    still_below = run_records(heldout=lambda s, n: 0.15 if s <= 50 else 0.31)
    (f,) = [f for f in diagnose(still_below, 0.3, CTX) if f.code == "below_base"]
    assert f.cleared is None


def test_each_pattern_is_reported_once_and_memory_stays_bounded():
    doctor = Doctor(DoctorConfig(), CTX, 0.3)
    new = [doctor.observe(r) for r in run_records(steps=2000, clip=lerp(0.5, 0.5))]
    assert sum(len(n) for n in new) == 1 and [f.code for f in doctor.findings] == ["ratio_clipping"]
    assert len(doctor.early) == len(doctor.late) == 25
    assert doctor.report() == {"enabled": True, "findings": [doctor.findings[0].to_dict()]}
    assert set(doctor.report()["findings"][0]) == {"code", "step", "seen", "cause", "try"}


def test_disabled_doctor_and_thresholds_from_the_config():
    recs = run_records(clip=lerp(0.5, 0.5))
    assert codes(recs, cfg=DoctorConfig(enabled=False)) == []
    assert codes(recs, cfg=load_config(overrides=["doctor.clip_max_frac=0.8"]).doctor) == []
    assert codes(recs, cfg=DoctorConfig(min_steps=5000)) == []
    with pytest.raises(ConfigError, match="doctor.min_steps"):
        load_config(overrides=["doctor.min_steps=10"])
    assert Context.of(load_config(overrides=["rollout.max_new_tokens=9"]).model_dump()).max_new_tokens == 9


def test_records_of_a_run_without_rollout_fields_fall_back_to_the_trained_reward(tmp_path):
    """An older metrics.jsonl (before the rollout fields) and a line cut short by a crash."""
    recs = run_records(heldout=lerp(0.30, 0.30), reward=lerp(0.3, 0.6))
    for r in recs:
        r["reward_mean"] = r.pop("rollout_reward_mean")
        for k in ROLLOUT_FIELDS:
            r.pop(k, None)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"step": 201, "rew')
    back = read_records(path)
    assert len(back) == 200 and len(read_records(path, upto_step=100)) == 100
    (f,) = diagnose(back, 0.3, CTX)
    assert f.code == "reward_not_heldout" and "training prompts" in f.cause  # no exact-match rate to tell


def sample(reward: float, text: str, logprobs: list[float], finish: str = "stop") -> Sample:
    n = len(logprobs)
    return Sample([5], list(range(n)), logprobs, [0] * n, finish, reward=reward, text=text)  # type: ignore[arg-type]


def test_vitals_of_scored_groups():
    v = Vitals()
    v.add(Group(0, "1+1=", "2", [sample(1.0, "2", [-0.5, -0.1]), sample(0.0, "3", [-1.0, -0.4])]))
    v.add(Group(1, "1+2=", "3", [sample(0.0, "44", [-0.2, -0.2, -0.2, -0.2], "length"), sample(0.0, "5", [-0.6])]))
    env = sample(1.0, "3", [-0.3, 0.0, -0.3])
    env.loss_mask = [True, False, True]  # an environment's token: no policy logprob
    v.add(Group(2, "x", "3", [env, sample(1.0, "3", [-0.2])]))
    got = v.take()
    assert got == {
        "rollout_groups": 3,
        "rollout_signal_groups": 1,
        "rollout_reward_mean": pytest.approx(3 / 6),
        "rollout_exact_frac": pytest.approx(3 / 6),
        "rollout_tokens_mean": pytest.approx(12 / 6),
        "rollout_truncated_frac": pytest.approx(1 / 6),
        "rollout_entropy": pytest.approx(4.2 / 12),
    }
    assert set(got) == set(ROLLOUT_FIELDS) and v.take() == {}  # a new window each step


def test_sharpening_toward_greedy_answers_is_a_finding_only_when_heldout_never_rose():
    """With an exact-match reward the sampled accuracy rises toward the greedy one while greedy
    answers stay: RL sharpening. After a held-out gain (a late plateau) that is no finding; with
    none at all the base sits where RL cannot move it (examples/tasks/reverse.yaml, one base)."""
    stuck = run_records(steps=300, heldout=lerp(0.25, 0.26), reward=lerp(0.10, 0.24))
    (f,) = diagnose(stuck, 0.25, CTX)
    assert f.code == "reward_not_heldout" and "sharpens" in f.cause and any("warmup.seed" in t for t in f.tries)
    plateau = lambda s, n: min(0.30 + 0.004 * s, 0.60)  # noqa: E731  a gain, then a plateau from step 75
    assert codes(run_records(steps=300, heldout=plateau, reward=lerp(0.30, 0.55)), base=0.3) == []


def test_a_run_that_waits_for_signal_is_found_at_its_end():
    """Refill with (almost) every group uniform: few steps or none, so the window checks never run;
    at the end the groups scored since (and over the last window) say it."""
    doctor = Doctor(DoctorConfig(), CTX, 0.0)
    (f,) = doctor.finish({"rollout_groups": 4000, "rollout_signal_groups": 3, "rollout_reward_mean": 0.001})
    assert f.code == "signal_collapse" and "4000 groups" in f.seen and "too weak" in f.cause
    few = Doctor(DoctorConfig(), CTX, 0.26)
    for r in run_records(steps=20, signal=lerp(0.01, 0.01), reward=lerp(0.99, 0.99), groups=1500):
        few.observe(r)
    (f,) = few.finish({})
    assert "earn the reward alike" in f.cause and f.step == 20
    assert Doctor(DoctorConfig(), CTX, 0.3).finish({"rollout_groups": 50, "rollout_signal_groups": 0}) == []
    solved = Doctor(DoctorConfig(), CTX, 0.95)
    assert solved.finish({"rollout_groups": 4000, "rollout_signal_groups": 0, "rollout_reward_mean": 1.0}) == []
