"""A batch of groups as the trainer's tensors: `Batch` (what each tensor holds, by shape) and
`BatchBuilder`, the `Trainer`'s mixin that builds one from flat per-token lists, with the
group-relative advantages of its samples.

`BatchBuilder` is a mixin of trainer/core.py's `Trainer` (trainer/parallel.py cuts a rank's
share of the batch over it); the attributes declared below are the Trainer's.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import torch

from nonstop.config import TrainerConfig
from nonstop.hf import CausalLM
from nonstop.trainer.losses import group_advantages
from nonstop.trainer.routing import RouterHooks, route_tensor
from nonstop.types import Group


class Batch(TypedDict):
    """The tensors of one training batch: B samples, T completion tokens; the model inputs are
    either the distinct prompts plus completions (shared-prompt forward, trainer/forward.py) or
    prompt + completion right-padded to L tokens."""

    targets: torch.Tensor  # (B, T) completion token ids
    behaviour: torch.Tensor  # (B, T) behaviour logprobs
    mask: torch.Tensor  # (B, T) bool, tokens in the loss
    versions: torch.Tensor  # (B, T) policy_version of each token
    advantages: torch.Tensor  # (B,)
    group_of: torch.Tensor  # (B,) index of each row's group
    truncated: torch.Tensor  # (B,) bool, cut at max_new_tokens
    keep: torch.Tensor | None  # (B, T, V) bool, the engine's kept sets (None: no truncated sampling)
    ids: NotRequired[torch.Tensor]  # (B, L) token ids, right-padded
    attn: NotRequired[torch.Tensor]  # (B, L) attention mask
    gather_pos: NotRequired[torch.Tensor]  # (B, T) position whose hidden state predicts completion token t
    prompt_ids: NotRequired[torch.Tensor]  # (Q, Lp) the distinct prompts, right-padded
    prompt_len: NotRequired[torch.Tensor]  # (Q,)
    row_prompt: NotRequired[torch.Tensor]  # (B,) index of each row's prompt
    completion_in: NotRequired[torch.Tensor]  # (B, T - 1) completion inputs after the prompt
    completion_len: NotRequired[torch.Tensor]  # (B,) completion tokens per row (the packed forward's)
    token_rewards: NotRequired[torch.Tensor]  # (B, T) process-step rewards at step ends
    teacher: NotRequired[torch.Tensor]  # (B, T) distillation teacher's logprobs of the completion tokens
    routes: NotRequired[torch.Tensor]  # (B, L, moe_layers, k) int16, the engine's experts per input token, -1: none


class BatchBuilder:
    # set by Trainer (trainer/core.py); declared here for the type checker only
    model: CausalLM
    cfg: TrainerConfig
    pad_token_id: int
    shared_prompts: bool
    routing: RouterHooks | None

    def batch_of(self, groups: list[Group]) -> Batch:
        """Tensors of one batch, built from flat per-token lists (no per-sample tensor calls).

        Per row b and completion position t (B, T): targets, behaviour, mask, versions; with the
        shared-prompt forward, the distinct prompts (Q, Lp), each row's prompt and its completion
        inputs (trainer/forward.py); otherwise prompt + completion right-padded (B, L) with the
        positions that predict each completion token."""
        samples = [s for g in groups for s in g.samples]
        advantages = self._advantages(groups)  # (B,)
        clen = torch.tensor([len(s.completion_ids) for s in samples])  # (B,)
        B, T = len(samples), int(clen.max())
        in_completion = torch.arange(T)[None, :] < clen[:, None]  # (B, T); row-major order = concatenation order

        def per_token(values: list, dtype: torch.dtype) -> torch.Tensor:  # flat per-token values -> (B, T), 0-padded
            out = torch.zeros((B, T), dtype=dtype)
            out[in_completion] = torch.tensor(values, dtype=dtype)
            return out

        targets = per_token([t for s in samples for t in s.completion_ids], torch.long)
        batch = Batch(
            targets=targets,
            behaviour=per_token([x for s in samples for x in s.logprobs], torch.float32),
            mask=per_token([x for s in samples for x in s.loss_mask], torch.bool),
            versions=per_token([x for s in samples for x in s.versions], torch.long),
            advantages=advantages,
            truncated=torch.tensor([s.finish_reason == "length" for s in samples]),
            keep=None,
            group_of=torch.tensor([i for i, g in enumerate(groups) for _ in g.samples]),
        )
        for key, values in (
            ("token_rewards", [s.token_rewards for s in samples]),
            ("teacher", [s.teacher_logprobs for s in samples]),
        ):
            given = [v is not None for v in values]
            if any(given):
                if not all(given):
                    raise ValueError(f"{key}: given for {sum(given)} of {len(given)} samples of one batch")
                batch[key] = per_token([x for v in values for x in v or ()], torch.float32)  # type: ignore[literal-required]
        if self.shared_prompts:
            distinct: dict[tuple[int, ...], int] = {}
            row_prompt = torch.tensor([distinct.setdefault(tuple(s.prompt_ids), len(distinct)) for s in samples])
            plen = torch.tensor([len(p) for p in distinct])  # (Q,)
            prompt_ids = torch.full((len(distinct), int(plen.max())), self.pad_token_id, dtype=torch.long)
            prompt_ids[torch.arange(prompt_ids.shape[1])[None, :] < plen[:, None]] = torch.tensor(
                [t for p in distinct for t in p], dtype=torch.long
            )
            # Padded completion inputs hold token 0: causal attention keeps them from every real position.
            batch["prompt_ids"], batch["prompt_len"], batch["row_prompt"] = prompt_ids, plen, row_prompt
            batch["completion_in"], batch["completion_len"] = targets[:, :-1], clen
        else:
            plen_rows = torch.tensor([len(s.prompt_ids) for s in samples])  # (B,)
            seq_len = plen_rows + clen
            in_seq = torch.arange(int(seq_len.max()))[None, :] < seq_len[:, None]  # (B, L)
            ids = torch.full(in_seq.shape, self.pad_token_id, dtype=torch.long)
            ids[in_seq] = torch.tensor(
                [t for s in samples for t in (*s.prompt_ids, *s.completion_ids)], dtype=torch.long
            )
            # Completion token t of row b sits at input position P_b + t and is predicted at P_b + t - 1.
            gather_pos = torch.where(in_completion, plen_rows[:, None] - 1 + torch.arange(T)[None, :], 0)
            batch["ids"], batch["attn"], batch["gather_pos"] = ids, in_seq.long(), gather_pos
            if self.routing is not None and (self.routing.replay or all(s.routes is not None for s in samples)):
                batch["routes"] = route_tensor(samples, ids.shape[1], self.routing.routers)
        if any(s.sampling_mask for s in samples):  # Keep Sampling Mask: replay the engine's support
            vocab = self.model.get_output_embeddings().weight.shape[0]
            keep = torch.ones((B, T, vocab), dtype=torch.bool)
            for b, s in enumerate(samples):
                for t, kept in enumerate(s.sampling_mask or []):
                    keep[b, t] = False
                    keep[b, t, kept] = True
            batch["keep"] = keep
        return batch

    def _advantages(self, groups: list[Group]) -> torch.Tensor:
        """(B,) advantages: the producer's own when every sample carries one (episodes with per-role
        baselines, groups of any size), else group-relative from the rewards of equal-size groups."""
        samples = [s for g in groups for s in g.samples]
        given = [s.advantage for s in samples]
        if all(a is not None for a in given):
            return torch.tensor(given, dtype=torch.float32)
        widths = {len(g.samples) for g in groups}
        if len(widths) != 1:
            raise ValueError(f"groups of different sizes in one batch: {sorted(widths)}")
        rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)  # (G, n)
        return group_advantages(rewards, self.cfg.advantage_mode, self.cfg.group_std).reshape(-1)
