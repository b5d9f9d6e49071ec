"""The reference loop: plain synchronous GRPO in one process, readable top to bottom.

The algorithm nonstop distributes, without engines, buffers or transports, and the oracle the
pipeline is tested against (at buffer depth 0 without refill the two must learn alike). Same
model folder, task data, rewards and pure loss functions (trainer/losses.py). One step:

1. draw `rollout.prompts_per_step` prompts from the train split (seeded PromptStream);
2. sample `rollout.group_size` completions of each, the whole batch at once, with an HF forward
   and a KV cache, recording the behaviour logprob of every sampled token;
3. score each completion with the task's reward; group-normalised advantages;
4. with `rollout.filter_uniform_reward`, keep only groups whose rewards differ (the others have
   zero advantage everywhere); no more prompts are drawn to replace them;
5. one forward over prompt + completion, the clipped policy loss against the behaviour
   logprobs, backward, gradient-norm clip, one AdamW step.

Greedy held-out accuracy is measured before the first step and every `eval_every` steps.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from nonstop.config import Config, load_config
from nonstop.hf import load_model, load_tokenizer
from nonstop.models.base_policy import builds_warmup_base
from nonstop.scoring.rewards import exact_match, resolve_reward
from nonstop.sizing.defaults import learning_rate
from nonstop.tasks.data import PromptStream, load_task
from nonstop.trainer.core import adamw
from nonstop.trainer.logprobs import token_logprobs
from nonstop.trainer.losses import clipped_policy_loss, group_advantages


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, P) padded on the left, so every prompt ends at column P - 1, and the mask (B, P)."""
    P = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (P - len(p)) + p for p in prompts])
    return ids, (torch.arange(P) >= P - torch.tensor([[len(p)] for p in prompts])).long()


def positions(mask: torch.Tensor) -> torch.Tensor:
    return (mask.long().cumsum(-1) - 1).clamp_min(0)  # (B, L): pads before a prompt sit at 0


@torch.no_grad()
def sample(
    model,
    ids: torch.Tensor,
    mask: torch.Tensor,
    max_new: int,
    temperature: float,
    eos_id: int,
    pad_id: int,
    gen: torch.Generator | None = None,
):
    """Complete every row; temperature 0 is greedy. Returns tokens (B, T), behaviour logprobs
    (B, T) of the tempered distribution, and the loss mask (B, T): tokens up to and including EOS."""
    tokens, logps, alive = [], [], torch.ones(ids.shape[0], dtype=torch.bool)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True)
    for _ in range(max_new):
        logits = out.logits[:, -1].float()  # (B, V)
        if temperature > 0:
            logp_all = torch.log_softmax(logits / temperature, -1)
            tok = torch.multinomial(logp_all.exp(), 1, generator=gen).squeeze(-1)  # (B,)
        else:
            logp_all, tok = torch.log_softmax(logits, -1), logits.argmax(-1)
        tokens.append(torch.where(alive, tok, pad_id))
        logps.append(logp_all.gather(-1, tok.unsqueeze(-1)).squeeze(-1))
        alive = alive & (tok != eos_id)
        if not alive.any():
            break
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], -1)  # (B, P + t + 1)
        out = model(
            input_ids=tokens[-1].unsqueeze(-1),
            attention_mask=mask,
            position_ids=positions(mask)[:, -1:],
            cache=out.cache,
            use_cache=True,
        )
    ids_bt, logp_bt = torch.stack(tokens, 1), torch.stack(logps, 1)  # (B, T)
    was_alive = torch.ones_like(ids_bt, dtype=torch.bool)
    was_alive[:, 1:] = (ids_bt[:, :-1] != eos_id).cumprod(-1).bool()  # alive when token t was sampled
    return ids_bt, logp_bt, was_alive


def accuracy(model, tok, examples, max_new: int) -> float:
    ids, mask = left_pad([tok(ex.prompt)["input_ids"] for ex in examples], tok.pad_token_id)
    out, _, _ = sample(model, ids, mask, max_new, 0.0, tok.eos_token_id, tok.pad_token_id)
    texts = tok.batch_decode(out, skip_special_tokens=True)
    return sum(exact_match(t, ex.answer) for t, ex in zip(texts, examples)) / max(len(examples), 1)


def grpo_loss(model, ids, mask, completions, behaviour, loss_mask, advantages, cfg: Config) -> torch.Tensor:
    """The clipped policy loss of completions (B, T) after left-padded prompts ids (B, P): one
    forward over prompt + completion, logprobs of the completion tokens, ratio to the behaviour."""
    full = torch.cat([ids, completions], 1)  # (B, P + T)
    full_mask = torch.cat([mask, loss_mask.long()], 1)
    hidden = model.get_decoder()(
        input_ids=full, attention_mask=full_mask, position_ids=positions(full_mask), use_cache=False
    ).last_hidden_state  # (B, P + T, H)
    P, T = ids.shape[1], completions.shape[1]  # hidden at P - 1 + t predicts completion token t
    logp = token_logprobs(
        hidden[:, P - 1 : P - 1 + T],
        model.get_output_embeddings(),
        completions,
        cfg.rollout.temperature,
        cfg.trainer.logprob_chunk_rows,
    )  # (B, T)
    assert isinstance(logp, torch.Tensor)  # without entropy: the logprobs alone
    loss, _ = clipped_policy_loss(
        logp,
        behaviour,
        advantages,
        loss_mask,
        cfg.trainer.clip_low,
        cfg.trainer.clip_high,
        cfg.trainer.norm,
        max_new_tokens=cfg.rollout.max_new_tokens,
    )
    return loss


def run_reference(
    cfg: Config,
    base_dir: str,
    steps: int,
    seed: int | None = None,
    eval_every: int | None = None,
    threads: int = 2,
    log=None,
) -> list[dict]:
    """Train the model at `base_dir` for `steps` GRPO steps with cfg's task, rollout and trainer
    settings; return [{step, reward_mean, groups_trained, loss, samples, seconds[, eval_accuracy]}]."""
    seed = cfg.run.seed if seed is None else seed
    eval_every = eval_every or cfg.run.eval_every
    R, T = cfg.rollout, cfg.trainer
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model, tok = load_model(base_dir).train(), load_tokenizer(base_dir)
    data, reward = load_task(cfg.task), resolve_reward(cfg.task.reward)
    stream = PromptStream(data.train, seed)
    params = sum(p.numel() for p in model.parameters())
    lr, _ = learning_rate(cfg, params, builds_warmup_base(cfg))  # the pipeline's rule (sizing/defaults.py)
    opt = adamw(list(model.parameters()), lr, T.weight_decay)  # the trainer's optimizer, numerics included
    records = [
        {"step": 0, "samples": 0, "seconds": 0.0, "eval_accuracy": accuracy(model, tok, data.eval, R.max_new_tokens)}
    ]
    samples, t0 = 0, time.perf_counter()
    for step in range(1, steps + 1):
        # 1-2. a batch of prompts, each repeated group_size times, sampled all at once
        draws = [stream.next() for _ in range(R.prompts_per_step)]
        prompts = [d.example for d in draws if d is not None]  # the stream is endless (no max_epochs)
        ids, mask = left_pad(
            [tok(ex.prompt)["input_ids"] for ex in prompts for _ in range(R.group_size)], tok.pad_token_id
        )
        completions, behaviour, loss_mask = sample(
            model, ids, mask, R.max_new_tokens, R.temperature, tok.eos_token_id, tok.pad_token_id, gen
        )
        samples += len(completions)
        # 3. rewards (G, n) and advantages
        texts = tok.batch_decode(completions, skip_special_tokens=True)
        rewards = torch.tensor([float(reward(t, prompts[i // R.group_size].answer)) for i, t in enumerate(texts)])
        rewards = rewards.view(R.prompts_per_step, R.group_size)
        advantages = group_advantages(rewards, T.advantage_mode)  # (G, n)
        # 4. groups with a learning signal
        keep = (
            (rewards.max(-1).values > rewards.min(-1).values)
            if R.filter_uniform_reward
            else torch.ones(R.prompts_per_step, dtype=torch.bool)
        )
        record = {"step": step, "reward_mean": float(rewards.mean()), "groups_trained": int(keep.sum())}
        if keep.any():  # 5. one optimizer step on the kept groups
            rows = keep.repeat_interleave(R.group_size)  # (B,)
            loss = grpo_loss(
                model,
                ids[rows],
                mask[rows],
                completions[rows],
                behaviour[rows],
                loss_mask[rows],
                advantages[keep].reshape(-1),
                cfg,
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), T.max_grad_norm)
            opt.step()
            record["loss"] = float(loss.detach())
        record.update(samples=samples, seconds=round(time.perf_counter() - t0, 3))
        if step % eval_every == 0 or step == steps:
            model.eval()
            record["eval_accuracy"] = accuracy(model, tok, data.eval, R.max_new_tokens)
            model.train()
        records.append(record)
        if log is not None:
            log(record)
    return records


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Plain synchronous GRPO (the reference loop); prints one JSON line a step."
    )
    ap.add_argument("config", nargs="?", help="YAML config (default: the built-in defaults)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--base", required=True, help="folder of the base model and tokenizer")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--eval-every", type=int, default=None)
    a = ap.parse_args()
    run_reference(
        load_config(a.config, a.overrides),
        a.base,
        a.steps,
        a.seed,
        a.eval_every,
        log=lambda r: print(json.dumps(r), flush=True),
    )


if __name__ == "__main__":
    main()
