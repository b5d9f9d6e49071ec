"""Reward functions of the example tasks, named in configs as `task.reward: task_rewards:<name>`.

A reward function takes (completion text, answer) and returns a float: 1.0 for a right answer,
each with its own notion of "right"; 0.0 for a wrong one, except the partial credits
(`digit_credit`, and `right_length_credit`, the shape docs/recipe.md found to mislead RL).
"""


def same_number(completion: str, answer: str) -> float:
    """1.0 when the completion is the answer's integer (leading zeros and spaces allowed)."""
    text = completion.strip()
    return 1.0 if text.isdigit() and int(text) == int(answer) else 0.0


def same_word(completion: str, answer: str) -> float:
    """1.0 when the completion is the answer word, ignoring case and surrounding spaces."""
    return 1.0 if completion.strip().lower() == answer.strip().lower() else 0.0


def same_lines(completion: str, answer: str) -> float:
    """1.0 when the completion has the answer's lines, each equal up to surrounding spaces."""
    got = [line.strip() for line in completion.strip().splitlines()]
    return 1.0 if got == [line.strip() for line in answer.strip().splitlines()] else 0.0


def digit_credit(completion: str, answer: str) -> float:
    """Partial credit for a number: 1.0 when right; otherwise 0.5 x the share of the answer's digits
    that are right in their place, counted from the units digit, for a completion of digits only.
    A wrong answer never earns more than half a right one, and each credit is a step toward it."""
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    if not got.isdigit():
        return 0.0
    right = sum(a == b for a, b in zip(reversed(got), reversed(want)))
    return 0.5 * right / max(len(want), len(got))


def right_length_credit(completion: str, answer: str) -> float:
    """The reward of issue 33's user: 1.0 when right, 0.2 for a wrong answer of the right length.
    It pays for a length held-out exact match does not count (docs/recipe.md measures it)."""
    got, want = completion.strip(), answer.strip()
    if got == want:
        return 1.0
    return 0.2 if len(got) == len(want) else 0.0


def line_credit(completion: str, answer: str) -> float:
    """Partial credit for an answer of several lines: 1.0 when every line is right, otherwise 0.5 x
    the share of the answer's lines that are right in their place."""
    got = [line.strip() for line in completion.strip().splitlines()]
    want = [line.strip() for line in answer.strip().splitlines()]
    if got == want:
        return 1.0
    return 0.5 * sum(a == b for a, b in zip(got, want)) / len(want)
