"""The Trainer: one policy-gradient step on a batch of groups, then a new policy_version.

`Trainer.step(groups)`:
1. advantages per group from the rewards (group mean, optionally divided by group std);
2. one forward pass over prompt + completion (right padding, attention mask, no cache), token
   logprobs of the completion tokens under the same temperature the engine sampled with;
3. the clipped GRPO loss with the per-token ratio against the behaviour logprobs;
4. backward, global grad-norm clip, AdamW; policy_version += 1.
It reports loss and ratio statistics, the per-token lag histogram (lag = the trainer's version
before the step minus the token's version) and sizes. Publishing is the worker's job.
"""

from __future__ import annotations

from collections import Counter

import torch

from nonstop.config import TrainerConfig
from nonstop.trainer.losses import clipped_policy_loss, group_advantages, token_logprobs
from nonstop.types import Group


class Trainer:
    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, temperature: float, pad_token_id: int) -> None:
        self.model = model.train()
        self.cfg = cfg
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.policy_version = 0
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay
        )

    def _batch(self, groups: list[Group]) -> dict[str, torch.Tensor]:
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
        widths = {len(g.samples) for g in groups}
        if len(widths) != 1:
            raise ValueError(f"groups of different sizes in one batch: {sorted(widths)}")
        seqs = [s.prompt_ids + s.completion_ids for s in samples]
        B, L = len(seqs), max(len(x) for x in seqs)
        T = max(len(s.completion_ids) for s in samples)
        ids = torch.full((B, L), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((B, L), dtype=torch.long)
        # Completion token t of row b sits at input position P_b + t and is predicted at P_b + t - 1.
        gather_pos = torch.zeros((B, T), dtype=torch.long)
        targets = torch.zeros((B, T), dtype=torch.long)
        behaviour = torch.zeros((B, T), dtype=torch.float32)
        mask = torch.zeros((B, T), dtype=torch.bool)
        versions = torch.zeros((B, T), dtype=torch.long)
        for b, (s, seq) in enumerate(zip(samples, seqs)):
            P, C = len(s.prompt_ids), len(s.completion_ids)
            ids[b, : len(seq)] = torch.tensor(seq)
            attn[b, : len(seq)] = 1
            gather_pos[b, :C] = torch.arange(P - 1, P - 1 + C)
            targets[b, :C] = torch.tensor(s.completion_ids)
            behaviour[b, :C] = torch.tensor(s.logprobs)
            mask[b, :C] = torch.tensor(s.loss_mask, dtype=torch.bool)
            versions[b, :C] = torch.tensor(s.versions)
        adv = group_advantages(rewards, "std").reshape(-1)  # (B,)
        return dict(ids=ids, attn=attn, gather_pos=gather_pos, targets=targets, behaviour=behaviour,
                    mask=mask, versions=versions, advantages=adv, rewards=rewards.reshape(-1))

    def logprobs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Current policy's logprobs of the completion tokens: (B, T)."""
        hidden = self.model.get_decoder()(
            input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False
        ).last_hidden_state  # (B, L, H)
        idx = batch["gather_pos"].unsqueeze(-1).expand(-1, -1, hidden.shape[-1])  # (B, T, H)
        picked = hidden.gather(1, idx)  # (B, T, H)
        return token_logprobs(
            picked, self.model.get_output_embeddings(), batch["targets"], self.temperature, self.cfg.logprob_chunk_rows
        )

    def step(self, groups: list[Group]) -> dict[str, float | int | dict]:
        batch = self._batch(groups)
        logp = self.logprobs(batch)
        loss, stats = clipped_policy_loss(
            logp, batch["behaviour"], batch["advantages"], batch["mask"],
            self.cfg.clip_eps, self.cfg.clip_eps_high, self.cfg.loss_norm,
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        self.optimizer.step()
        lags = (self.policy_version - batch["versions"])[batch["mask"]]
        self.policy_version += 1
        return {
            "loss": float(loss.detach()),
            **{k: float(v) for k, v in stats.items()},
            "grad_norm": float(grad_norm),
            "lag_hist": {str(k): v for k, v in sorted(Counter(lags.tolist()).items())},
            "samples": int(batch["ids"].shape[0]),
            "tokens": int(batch["mask"].sum()),
        }
