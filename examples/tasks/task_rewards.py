"""Reward functions of the example tasks, named in configs as `task.reward: task_rewards:<name>`.

A reward function takes (completion text, answer) and returns a float; here 1.0 for a right
answer and 0.0 otherwise, each with its own notion of "right".
"""


def same_number(completion: str, answer: str) -> float:
    """1.0 when the completion is the answer's integer (leading zeros and spaces allowed)."""
    text = completion.strip()
    return 1.0 if text.isdigit() and int(text) == int(answer) else 0.0


def same_word(completion: str, answer: str) -> float:
    """1.0 when the completion is the answer word, ignoring case and surrounding spaces."""
    return 1.0 if completion.strip().lower() == answer.strip().lower() else 0.0
