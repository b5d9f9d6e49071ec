"""TRL's synchronous GRPOTrainer as the benchmarks run it: what bench/vs_trl.py and bench/long_rollout.py share.

- `grpo_config(out, max_steps, bf16=False, seed=0, **batch)`: the GRPOConfig of a CPU arm: the batch
  fields the caller matches to nonstop's step (per_device_train_batch_size, num_generations,
  max_completion_length, learning_rate, num_iterations), on the CPU without gradient
  checkpointing, seeded, sampling at temperature 1.0 as nonstop's rollouts do, and nothing
  reported, saved or logged (logging would take time the arm is timed on);
- `answer_dataset(examples)`: a task's examples as the dataset GRPOTrainer reads (prompt, answer);
- `exact_match_reward`: the task's exact-match reward in TRL's reward-function form;
- `step_ends(trainer)`: the perf_counter at the end of each of the trainer's steps, the list the
  arms time their steady state on.

trl, transformers and datasets are the bench extra (pip install -e .[bench]), imported by each
function so a script's parent process, which runs no TRL arm itself, starts without them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from nonstop.scoring.rewards import exact_match


def grpo_config(out: str, max_steps: int, bf16: bool = False, seed: int = 0, **batch: Any) -> Any:
    from trl import GRPOConfig  # the bench extra, loaded by the TRL arm's process only

    return GRPOConfig(
        output_dir=out,
        **batch,
        max_steps=max_steps,
        bf16=bf16,
        use_cpu=True,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        logging_steps=10**6,
        disable_tqdm=True,
        seed=seed,
        temperature=1.0,
    )


def answer_dataset(examples: Iterable[Any]) -> Any:
    from datasets import Dataset  # the bench extra, loaded by the TRL arm's process only

    return Dataset.from_list([{"prompt": e.prompt, "answer": e.answer} for e in examples])


def exact_match_reward(
    prompts: list[str], completions: list[str], answer: list[str], **_: Any
) -> list[float | None]:  # TRL types a reward as a list that may hold None (no score)
    return [exact_match(c, a) for c, a in zip(completions, answer)]


def step_ends(trainer: Any) -> list[float]:
    """A list that gets time.perf_counter() at the end of every step the trainer takes from now on."""
    from transformers import TrainerCallback  # the bench extra, loaded by the TRL arm's process only

    ends: list[float] = []

    class Ends(TrainerCallback):
        def on_step_end(self, *a: Any, **kw: Any) -> None:
            ends.append(time.perf_counter())

    trainer.add_callback(Ends())
    return ends
