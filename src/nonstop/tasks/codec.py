"""Text <-> token ids at the orchestrator, and the held-out score every part measures alike.

Engines work token-in, token-out; `Codec` is the one place prompts become ids and completions
text (the producers, the episode runner, evaluation, the warm-up). `eval_requests` and
`HeldOut.score` are the held-out evaluation: by default one greedy completion per prompt, scored
by the task's own reward (so a chat model that answers "59 + 63 = 122." scores what training
rewards, not an exact match of the whole text), or mean@k of k completions sampled at a
temperature. `greedy_requests` and `exact_match_accuracy` are the warm-up's accuracy gate
(models/warmup.py): the built-in tiny model trained on exact answers, where the default reward is
exact match, so the gate's accuracy and the run's base score are the same measurement.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nonstop.scoring.calls import evaluate
from nonstop.scoring.rewards import exact_match
from nonstop.tasks.data import Example
from nonstop.types import Failure, GenerationRequest, RewardRow, Sample, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


MEMO_SIZE = 1 << 16


@dataclass
class Codec:
    """Text <-> token ids at the orchestrator (engines work token-in, token-out). Encodings are
    memoised (up to MEMO_SIZE texts, then the memo starts over): the prompts of a task are encoded
    when they are screened and again at every draw."""

    tokenizer: PreTrainedTokenizerBase
    _encoded: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            if len(self._encoded) >= MEMO_SIZE:
                self._encoded.clear()
            ids = self._encoded[text] = self.tokenizer(text)["input_ids"]
        return list(ids)  # a copy: callers own their lists

    def decode(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)  # one sequence of ids decodes to one string
        return text


def greedy_requests(examples: list[Example], codec: Codec, max_new_tokens: int) -> list[GenerationRequest]:
    """One greedy (temperature 0) completion request per example, its index as the request id."""
    params = SamplingParams(max_new_tokens, 0.0)
    return [GenerationRequest(i, codec.encode(ex.prompt), 1, params) for i, ex in enumerate(examples)]


def exact_match_accuracy(results: list[list[Sample]], examples: list[Example], codec: Codec) -> float:
    """The fraction of examples whose first completion matches the answer exactly (0.0 for none)."""
    right = sum(exact_match(codec.decode(r[0].completion_ids), ex.answer) for r, ex in zip(results, examples))
    return right / max(len(examples), 1)


def eval_requests(
    examples: list[Example], codec: Codec, max_new_tokens: int, samples: int = 1, temperature: float = 0.0
) -> list[GenerationRequest]:
    """`samples` completions per example at `temperature` (0: greedy), its index as the request id."""
    params = SamplingParams(max_new_tokens, temperature)
    return [GenerationRequest(i, codec.encode(ex.prompt), samples, params) for i, ex in enumerate(examples)]


@dataclass
class HeldOut:
    """How held-out completions are scored: the task's reward function, under its name.

    `score` is the mean reward over every completion (mean@k with k completions a prompt); a reward
    that raised or returned a non-number scores 0 for that completion and is counted in `failures`
    (summary.json's eval_reward_failures), never dropped from the mean unseen."""

    reward: Callable[..., Any]
    metric: str
    samples: int = 1
    temperature: float = 0.0
    failures: int = 0

    async def score(self, results: list[list[Sample]], examples: list[Example], codec: Codec) -> float:
        total, count = 0.0, 0
        for completions, ex in zip(results, examples):
            texts = [codec.decode(s.completion_ids) for s in completions]
            rows = [
                RewardRow(ex.prompt, t, ex.answer, ex.extra, None, s.completion_ids, ex.messages)
                for t, s in zip(texts, completions)
            ]
            for outcome in await evaluate("sample", self.reward, rows):
                if isinstance(outcome, Failure) or not isinstance(outcome, float):
                    self.failures += 1
                else:
                    total += outcome
                count += 1
        return total / max(count, 1)
