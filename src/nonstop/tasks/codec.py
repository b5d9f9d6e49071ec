"""Text <-> token ids at the orchestrator, and the held-out accuracy every part measures alike.

Engines work token-in, token-out; `Codec` is the one place prompts become ids and completions
text (the producers, the episode runner, evaluation, the warm-up). `greedy_requests` and
`exact_match_accuracy` are the held-out evaluation: one greedy completion per prompt, scored by
the built-in `exact_match` reward. The pipeline's evaluation (orchestrator/generate.py) and the
warm-up's accuracy gate (tasks/warmup.py) both use them, so a base policy's gate accuracy and
the run's base accuracy are the same measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nonstop.scoring.rewards import exact_match
from nonstop.tasks.data import Example
from nonstop.types import GenerationRequest, Sample, SamplingParams

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
