"""A reward model: any AutoModelForSequenceClassification with one label, in its own actor process.

`RewardModelWorker` loads the model and its tokenizer and answers `score(texts)` with the
model's single logit for each text (prompt + completion), `batch_size` texts per forward pass,
right-padded with an attention mask (the model reads its score at the last real token).
`RewardModelComponent` merges the texts of the groups being scored into one call at a time
(pool.Batcher), adds `weight` x score to each sample's reward, and restarts a dead or hung
actor like an engine (pool.RewardModelPool, at most `max_restarts` times); the calls it carried fail
as 'worker_died' or 'timeout' and are retried by the stage.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import AutoModelForSequenceClassification

from nonstop.config.scoring import RewardModelConfig
from nonstop.hf import load_tokenizer, quiet_transformers
from nonstop.runtime.base import ActorBackend
from nonstop.scoring.base import Contribution
from nonstop.scoring.pool import Batcher, CallFailed, RewardModelPool
from nonstop.scoring.stage import TRANSIENT
from nonstop.types import Group


class RewardModelWorker:
    def __init__(self, path: str, batch_size: int) -> None:
        quiet_transformers()
        self.model = AutoModelForSequenceClassification.from_pretrained(path).eval().requires_grad_(False)
        if self.model.config.num_labels != 1:
            raise ValueError(
                f"scoring.reward_model: {path} has {self.model.config.num_labels} labels; "
                "a reward model has exactly one (its score)"
            )
        self.tokenizer = load_tokenizer(path)
        self.batch_size = batch_size

    def score(self, texts: list[str]) -> list[float]:
        out: list[float] = []
        with torch.no_grad():
            for lo in range(0, len(texts), self.batch_size):
                enc = [self.tokenizer(t)["input_ids"] for t in texts[lo : lo + self.batch_size]]
                L = max(len(x) for x in enc)
                pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
                ids = torch.full((len(enc), L), pad, dtype=torch.long)  # (b, L) right-padded
                attn = torch.zeros((len(enc), L), dtype=torch.long)
                for i, x in enumerate(enc):
                    ids[i, : len(x)] = torch.tensor(x)
                    attn[i, : len(x)] = 1
                logits = self.model(input_ids=ids, attention_mask=attn).logits  # (b, 1)
                out.extend(logits[:, 0].float().tolist())
        return out


class RewardModelComponent:
    name = "reward_model"
    retryable = TRANSIENT

    def __init__(
        self, cfg: RewardModelConfig, backend: ActorBackend, log: Callable[[str], None], timeout_s: float = 120.0
    ) -> None:
        self.cfg, self.timeout_s = cfg, timeout_s
        self.pool = RewardModelPool(
            backend,
            "reward-model",
            RewardModelWorker,
            (cfg.path, cfg.batch_size),
            max_restarts=cfg.max_restarts,
            log=log,
        )
        self.batcher = Batcher("reward-model", self._send, cfg.batch_size)

    async def _send(self, texts: list[str]) -> list[float]:
        return await self.pool.score(texts, self.timeout_s)

    async def start(self) -> None:
        await self.pool.start()

    async def contribute(self, group: Group) -> Contribution:
        scores = await self.batcher.submit([group.prompt + s.text for s in group.samples])
        bad = [x for x in scores if not math.isfinite(x)]
        if bad:
            raise CallFailed("not_finite", f"the reward model scored {bad[0]} on prompt {group.prompt!r}")
        return Contribution(rewards=[self.cfg.weight * float(x) for x in scores])

    async def close(self) -> None:
        await self.batcher.close()
        await self.pool.stop()
