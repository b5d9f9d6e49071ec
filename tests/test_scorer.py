import math

import pytest

from nonstop.orchestrator.score import FunctionScorer, RewardError, exact_match, partial_credit, resolve_reward
from nonstop.types import Group, Sample


def _group(texts, answer="42"):
    samples = [Sample([1], [5], [-0.1], [0], "stop", text=t) for t in texts]
    return Group(0, "40+02=", answer, samples)


def test_builtin_rewards():
    assert exact_match(" 42 ", "42") == 1.0 and exact_match("43", "42") == 0.0
    assert partial_credit("42", "42") == 1.0
    assert partial_credit("43", "42") == pytest.approx(0.25)
    assert partial_credit("", "42") == 0.0


def test_resolve_reward_by_import_path_and_errors():
    assert resolve_reward("exact_match") is exact_match
    assert resolve_reward("nonstop.orchestrator.score:partial_credit") is partial_credit
    with pytest.raises(RewardError, match="task.reward: unknown reward"):
        resolve_reward("nope")
    with pytest.raises(RewardError, match="cannot import"):
        resolve_reward("nonstop.orchestrator.score:missing")


def test_raising_reward_is_counted_and_group_skipped():
    def flaky(completion, answer):
        if completion == "boom":
            raise ZeroDivisionError("bad")
        return 1.0

    scorer = FunctionScorer(flaky)
    assert scorer.score_group(_group(["42", "1"])) is True
    assert scorer.score_group(_group(["42", "boom", "boom"])) is False
    assert scorer.errors["reward_raised"] == 2
    assert "ZeroDivisionError" in scorer.last_error


def test_non_finite_reward_is_counted():
    scorer = FunctionScorer(lambda c, a: math.nan if c == "x" else 0.0)
    assert scorer.score_group(_group(["x", "y"])) is False
    assert scorer.errors["reward_not_finite"] == 1


def test_fail_fast_raises_at_the_first_failing_sample():
    scorer = FunctionScorer(lambda c, a: math.inf if c == "x" else 0.0, fail_fast=True)
    assert scorer.score_group(_group(["y", "z"])) is True
    with pytest.raises(RewardError, match=r"returned inf(.|\n)*task.reward_fail_fast"):
        scorer.score_group(_group(["y", "x"]))
    assert scorer.errors["reward_not_finite"] == 1
