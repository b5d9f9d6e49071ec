"""The Trainer: one policy-gradient step on a batch of groups, then a new policy_version.

`Trainer.step(groups)`:
1. advantages per group from the rewards (`trainer.advantage`, defaulting per loss);
2. the loss mask: completion tokens, minus truncated samples under the overlong filter, minus
   samples or tokens older than `max_lag` when rejection is per sample or per token (counted);
3. one forward pass, token logprobs of the completion tokens under the engine's sampling
   temperature: each distinct prompt computed once and its completions attending to its keys
   (trainer/forward.py) for Qwen2/Llama-shaped models, else prompt + completion per row (right
   padding, attention mask, no cache) through the model's own forward;
4. importance weights of the off-policy correction against the behaviour logprobs, the loss of
   `trainer.loss`, optional KL to the reference (initial) policy and entropy bonus;
5. backward, global grad-norm clip, AdamW; policy_version += 1. A non-finite loss or gradient
   skips the step instead (weights and version unchanged, counted); `max_consecutive_skips`
   in a row raise NumericalError.
A batch whose forward is over `trainer.micro_batch_tokens` tokens runs steps 3-5 micro-batch by
micro-batch (trainer/micro.py): forward + backward of each, gradients accumulated, each loss divided
by the whole batch's denominators, then one clip and AdamW step; the update and every statistic
equal the unsplit step's up to float rounding (tests/trainer/test_micro_batch.py). With
`trainer.activation_checkpointing` each decoder layer is recomputed in the backward.
With a mixture-of-experts model whose samples carry the engine's routes, the forward of step 3
compares the trainer's routing with them and, with `trainer.routing_replay: r3`, uses the
recorded experts (trainer/routing.py).
`forward_ahead(groups)` runs step 3 for the groups of the coming batch that are already there, while the trainer would
otherwise wait for the rest (trainer/ahead.py); `step` then uses those forwards and runs the others' only. The loss
and every statistic are still computed over the whole batch; the values agree with an unsplit forward to float
rounding. Not with a mixture-of-experts model (routes are armed for one batch at a time): it then holds nothing.
Reported: loss, ratio and correction statistics, the mismatch KL between behaviour and trainer logprobs and the spread
(std) of their log ratio, the routing fractions (MoE: how often the trainer's free router disagrees with the engine's,
and how often the experts used were the engine's), the per-token lag histogram (lag = version before the step - token
version), and rejections. Publishing the weights is the worker's job.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from nonstop.config import DistillConfig, TrainerConfig
from nonstop.errors import TrainerError
from nonstop.hf import CausalLM
from nonstop.trainer.ahead import AheadForwards, assemble, by_group
from nonstop.trainer.batch import Batch, BatchBuilder
from nonstop.trainer.compute import ComputeWeights
from nonstop.trainer.forward import prompt_shared_hidden, unsupported
from nonstop.trainer.logprobs import token_logprobs
from nonstop.trainer.micro import Layout, forward_tokens
from nonstop.trainer.packed import packed_logprobs
from nonstop.trainer.routing import RouterHooks, moe_experts, moe_routers
from nonstop.trainer.token_advantages import distill_advantages, distill_term, process_advantages
from nonstop.trainer.updates import micro_updates, whole_updates
from nonstop.types import Group


class NumericalError(TrainerError, RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient."""


def lr_factor(step: int, warmup_steps: int, schedule: str, total_steps: int) -> float:
    """Multiplier of trainer.lr after `step` optimizer steps: linear warm-up, then constant or cosine to 0.1."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw(params: list[torch.nn.Parameter], lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where the parameters allow it (plain tensors on CPU or
    CUDA): one pass over each parameter, its gradient and both moments instead of a dozen
    elementwise passes (0.4 s against 3.0 s per step for 494 M float32 parameters on one CPU
    thread). Sharded (DTensor) parameters keep the foreach implementation."""
    fused = all(not isinstance(p, DTensor) and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)


def checkpoint_layers(model: CausalLM) -> None:
    """transformers' own activation checkpointing of each decoder layer, for the model's own forward
    (the trainer's plain path); non-reentrant, so frozen embeddings (LoRA) need no input gradient."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"trainer.activation_checkpointing: {type(model).__name__} supports neither the shared-prompt "
            "forward nor transformers' gradient checkpointing"
        )
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.x's name
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


class Trainer(BatchBuilder):
    def __init__(
        self,
        model: CausalLM,
        cfg: TrainerConfig,
        temperature: float,
        pad_token_id: int,
        max_lag: int | None = None,
        reject: str = "group",
        total_steps: int = 1000,
        max_new_tokens: int | None = None,
        distill: DistillConfig | None = None,
    ) -> None:
        """`max_new_tokens`: the generation budget (rollout.max_new_tokens), the constant per-sample
        divisor of the 'constant' normalisation (dr_grpo); needed by that loss only. `distill`:
        the weight of the teacher term when samples carry teacher logprobs."""
        self.distill = distill
        if cfg.norm == "constant" and max_new_tokens is None:
            raise ValueError(
                f"trainer.loss {cfg.loss!r} divides by samples x rollout.max_new_tokens: "
                "pass max_new_tokens to the Trainer"
            )
        self.max_new_tokens = max_new_tokens
        self.model = model.train()
        self.cfg = cfg
        self.temperature = temperature
        self.pad_token_id = pad_token_id
        self.max_lag = max_lag
        self.reject = reject
        self.policy_version = 0
        self.skipped_steps = 0
        self.skips_in_row = 0
        self.reference = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
        self.total_steps = total_steps
        # Each distinct prompt computed once per batch (trainer/forward.py) where the model allows it.
        self.shared_prompts = unsupported(model) is None
        if cfg.activation_checkpointing and not self.shared_prompts:  # the shared-prompt forwards do their own
            checkpoint_layers(model)
        routers = moe_routers(model)
        if cfg.routing_replay == "r3" and not routers:
            raise ValueError(
                "trainer.routing_replay: 'r3' replays MoE routes, but the model has no top-k router "
                "(model.layers.{i}.mlp.gate); set trainer.routing_replay none"
            )
        # after the reference copy, which must route freely
        self.routing = (
            RouterHooks(routers, moe_experts(model, routers), cfg.routing_replay == "r3") if routers else None
        )
        self.ahead = AheadForwards()
        self.compute: ComputeWeights | None = None  # bf16 copies refreshed per optimizer step (trainer/compute.py)
        self.before_update: Callable[[], None] | None = None  # the worker waits for a send still reading the weights
        self.make_optimizer()

    def make_optimizer(self) -> None:
        """(Re)build the optimizer and its lr schedule over the current trainable parameters."""
        cfg = self.cfg
        self.optimizer = adamw(
            [p for p in self.model.parameters() if p.requires_grad], cfg.learning_rate, cfg.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda n: lr_factor(n, cfg.lr_warmup_steps, cfg.lr_schedule, self.total_steps)
        )

    # Data-parallel seam: one rank holding the whole batch needs none of this; trainer/parallel.py
    # overrides these four so that M ranks take exactly the step one rank would.
    def denominators(self, mask: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """Global divisors of the loss reductions by norm (and 'gspo'); None: this batch is all.
        Keys: 'sequence' and 'gspo' (samples with loss tokens), 'token' (loss tokens),
        'constant' (samples x max_new_tokens)."""
        return None

    def all_finite(self, loss: torch.Tensor) -> bool:
        return bool(torch.isfinite(loss))

    def clip_grads(self) -> torch.Tensor:
        # the optimizer's parameters, in the model's order: the float32 masters even while `compute` has
        # swapped bf16 copies into the model's modules
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)

    def publishable(self) -> torch.nn.Module:
        """What the weight transport packs: an object whose named_parameters() are full tensors."""
        return self.model

    def logprobs(self, batch: Batch, model: CausalLM | None = None, with_entropy: bool = False):
        """Logprobs (B, T) of the completion tokens under `model` (default: the policy)."""
        model = model or self.model
        checkpoint, compiled, chunk = self._checkpoint(model), bool(self.cfg.compile), self.cfg.logprob_chunk_rows
        if "prompt_ids" in batch and self.cfg.packed:  # real tokens only (trainer/packed.py)
            share = self.cfg.shared_prefix
            return packed_logprobs(model, batch, self.temperature, chunk, with_entropy, checkpoint, compiled, share)
        if "prompt_ids" in batch:
            hidden = prompt_shared_hidden(model, batch, checkpoint, compiled)  # (B, T, H)
        else:
            states = model.get_decoder()(
                input_ids=batch["ids"], attention_mask=batch["attn"], use_cache=False
            ).last_hidden_state  # (B, L, H)
            hidden = states.gather(1, batch["gather_pos"].unsqueeze(-1).expand(-1, -1, states.shape[-1]))  # (B, T, H)
        return token_logprobs(
            hidden,
            model.get_output_embeddings(),
            batch["targets"],
            self.temperature,
            chunk,
            with_entropy,
            batch["keep"],
        )

    def _checkpoint(self, model: CausalLM) -> bool:
        """Whether the shared-prompt forwards of `model` recompute each layer in the backward: the
        policy's, under trainer.activation_checkpointing (the reference runs without gradients)."""
        return self.cfg.activation_checkpointing and model is self.model

    def layout(self) -> Layout:
        """How the forward lays out a batch's tokens (trainer/micro.py counts them by it)."""
        if not self.shared_prompts:
            return "plain"
        if self.cfg.packed:
            return "packed-prefix" if self.cfg.shared_prefix else "packed"
        return "shared"

    def forward_batch(self, batch: Batch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.logprobs(batch, with_entropy=with_entropy)
        return out if with_entropy else (out, None)  # (B, T) each

    def forward_ahead(self, groups: list[Group]) -> int:
        """Run the forward pass of `groups`, the first groups of the coming batch, now; the next
        `step` uses it. Returns how many groups are held (0 with a mixture-of-experts model). With
        trainer.micro_batch_tokens, the held forwards (their graphs are kept) stay within one
        micro-batch: groups beyond it are left to the step, and a call that can add none returns
        how many are held already."""
        if self.routing is not None or not groups:
            return 0
        budget = self.cfg.micro_batch_tokens
        if budget is not None:
            held = self.ahead.groups()
            fits = 0
            while fits < len(groups) and forward_tokens([*held, *groups[: fits + 1]], self.layout()) <= budget:
                fits += 1
            if not fits:
                return len(held)
            groups = groups[:fits]
        self.ahead.hold(
            groups, self.policy_version, *self.forward_batch(self.batch_of(groups), self.cfg.entropy_coef > 0)
        )
        return len(groups)

    def policy_logprobs(
        self, groups: list[Group], batch: Batch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(B, T) logprobs [and entropy] of the batch under the policy, and how many of its groups
        came from `forward_ahead`."""
        found = self.ahead.take(groups, self.policy_version)
        if not any(found):
            return *self.forward_batch(batch, with_entropy), 0
        rest = [g for g, h in zip(groups, found) if h is None]
        fresh = by_group(rest, *self.forward_batch(self.batch_of(rest), with_entropy)) if rest else iter(())
        return *assemble(found, fresh, batch["targets"].shape[1], with_entropy), sum(h is not None for h in found)

    def _loss_mask(self, batch: Batch, lag: torch.Tensor) -> tuple[torch.Tensor, dict[str, int]]:
        mask = batch["mask"].clone()
        counts = {"overlong_samples": 0, "rejected_samples": 0, "rejected_tokens": 0}
        if self.cfg.filter_overlong:
            counts["overlong_samples"] = int(batch["truncated"].sum())
            mask &= ~batch["truncated"].unsqueeze(-1)
        if self.max_lag is not None and self.reject in ("sample", "token"):
            stale = (lag > self.max_lag) & mask  # (B, T)
            if self.reject == "sample":
                stale_rows = stale.any(-1)
                counts["rejected_samples"] = int(stale_rows.sum())
                stale = stale_rows.unsqueeze(-1) & mask
            counts["rejected_tokens"] = int(stale.sum())
            mask &= ~stale
        return mask, counts

    def token_advantages(self, batch: Batch, student: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, float]]:
        """The advantages of the loss: (B,) from the rewards, or (B, T) with process rewards or a
        distillation teacher (trainer/token_advantages.py); `student` (B, T) are the detached
        logprobs of the policy at the start of the step (needed with a teacher only)."""
        adv, stats = batch["advantages"], {}
        inside = batch["mask"]
        if "token_rewards" in batch:
            adv = process_advantages(adv, batch["token_rewards"], inside, batch["group_of"])
        if "teacher" in batch:
            if self.distill is None:
                raise ValueError("samples carry teacher logprobs but the trainer has no distill settings")
            assert student is not None, "a teacher's advantages need the student's logprobs"
            adv = distill_advantages(
                adv,
                student,
                batch["teacher"],
                inside,
                self.distill.coef,
                self.distill.task_reward,
                self.distill.normalize,
            )
            k = distill_term(student, batch["teacher"], inside)[inside]
            stats["teacher_kl"] = float(k.mean()) if k.numel() else 0.0
        return adv, stats

    def update(self, loss: torch.Tensor) -> tuple[int, torch.Tensor, float]:
        """Backward, clip and one optimizer step; (1 if applied else 0, grad norm, seconds of the
        clip and optimizer step). A non-finite loss or gradient leaves the weights as they are."""
        self.optimizer.zero_grad(set_to_none=True)
        return self.apply_update(self.backward(loss))

    def backward(self, loss: torch.Tensor) -> bool:
        """Add the gradient of `loss` if it is finite (on M ranks: if it is on all of them, which
        then all take the backward pass); whether it was."""
        ok = self.all_finite(loss)
        if ok:
            loss.backward()
        return ok

    def apply_update(self, loss_ok: bool) -> tuple[int, torch.Tensor, float]:
        """Clip the accumulated gradients and take the optimizer step, unless a loss or the
        gradient is not finite; as `update`."""
        grad_norm = torch.tensor(float("nan"))
        t0 = time.perf_counter()  # from here on the cost does not grow with the batch's tokens
        if loss_ok:
            grad_norm = self.clip_grads()
        if not (loss_ok and torch.isfinite(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            return 0, grad_norm, time.perf_counter() - t0
        if self.before_update is not None:
            self.before_update()
        self.optimizer.step()
        # autocast's cached casts of the weights are stale now: a later update of this batch in the same
        # autocast region would read the weights as they were before this step
        torch.clear_autocast_cache()
        if self.compute is not None:
            self.compute.refresh()
        return 1, grad_norm, time.perf_counter() - t0

    def routed_forward(self, batch: Batch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """The batch's forward with the engine's MoE routes replayed (trainer.routing_replay)."""
        assert self.routing is not None
        routes = batch["routes"]
        self.routing.arm(routes.reshape(-1, *routes.shape[2:]))  # router rows are (b, position) flattened
        try:
            logp, entropy = self.forward_batch(batch, with_entropy)
        except BaseException:
            self.routing.reset()  # the forward's own error, not an unused-routes one
            raise
        return logp, entropy, self.routing.disarm()

    def step(self, groups: list[Group]) -> dict[str, float | int | dict]:
        """One batch: trainer.updates_per_batch optimizer updates on it (GRPO's mu), the first from
        the forward pass (or the one `forward_ahead` ran), each later one from a fresh forward
        against the same behaviour logprobs, advantages and weights; policy_version and the lr
        schedule move once per batch, when at least one update was applied. A batch whose forward
        is over trainer.micro_batch_tokens runs as micro-batches (trainer/updates.py)."""
        cfg = self.cfg
        batch = self.batch_of(groups)
        lag = self.policy_version - batch["versions"]  # (B, T), against the version before the step
        mask, counts = self._loss_mask(batch, lag)
        budget = cfg.micro_batch_tokens
        if budget is not None and forward_tokens(groups, self.layout()) > budget:
            run = micro_updates(self, groups, batch, mask, budget)
        else:
            run = whole_updates(self, groups, batch, mask)
        loss, grad_norm, applied, extra = run.loss, run.grad_norm, run.applied, run.extra
        teachers = Counter(s.teacher for g in groups for s in g.samples if s.teacher is not None)
        if teachers:
            extra["teacher_samples"] = dict(teachers)  # samples by the teacher identity@version that scored them
        skipped = applied == 0
        if skipped:  # weights stay as they are; the version does not move
            self.skipped_steps += 1
            self.skips_in_row += 1
            if self.skips_in_row >= cfg.max_consecutive_skips:
                raise NumericalError(
                    f"{self.skips_in_row} consecutive steps had a non-finite loss or gradient "
                    f"(trainer.max_consecutive_skips); last loss {float(loss.detach())}, grad norm {float(grad_norm)}"
                )
        else:
            self.scheduler.step()
            self.skips_in_row = 0
            self.policy_version += 1
        if cfg.updates_per_batch > 1:
            extra["updates"] = applied
            extra["last_update_loss"] = float(run.last_loss.detach())
            if run.last_clip is not None:
                extra["last_update_clip_frac"] = float(run.last_clip)
        sel = batch["mask"]
        d = (batch["behaviour"] - run.prox)[sel]  # log mu - log pi
        return {
            "skipped": int(skipped),
            "skipped_steps": self.skipped_steps,
            "loss": float(loss.detach()),
            **{k: float(v) for k, v in run.stats.items()},
            **{k: float(v) for k, v in run.is_stats.items()},
            "mismatch_kl": float(d.mean()) if d.numel() else 0.0,  # k1 estimate of KL(mu || pi)
            "mismatch_kl_k3": float((torch.exp(-d) + d - 1).mean()) if d.numel() else 0.0,
            "log_ratio_std": float(d.std()) if d.numel() > 1 else 0.0,  # spread of log pi - log mu
            **run.routing,
            **extra,
            **counts,
            "grad_norm": float(grad_norm),
            "lr": self.optimizer.param_groups[0]["lr"],
            "lag_hist": {str(k): v for k, v in sorted(Counter(lag[sel].tolist()).items())},
            "samples": int(batch["targets"].shape[0]),
            "ahead_groups": run.ahead,
            "tokens": int(mask.sum()),
            "update_s": run.update_s,  # gradient clips and optimizer steps
        }
