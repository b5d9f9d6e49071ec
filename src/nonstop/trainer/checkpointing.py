"""What a trainer writes into a checkpoint folder and reads back from it, beside its weights.

`save_weights(t, out)` writes the current weights with save_pretrained (safetensors): the full
model, loadable by transformers, or with LoRA the adapter folder, loadable by
peft.PeftModel.from_pretrained on top of the base the run started from; beside them their
policy_version (checkpoint.VERSION_FILE), which `nonstop serve` tags tokens with. With several
ranks every rank takes part and rank 0 writes.

`save_state(t, out, record)` writes everything else a resume needs: `out/trainer.pt` (AdamW's
state, the scheduler's, torch's and Python's RNG states, policy_version, the skip counters) and a
copy of the trainer's consumed-samples record. DDP ranks hold identical optimizer states, so rank
0's trainer.pt serves every rank; FSDP2 ranks each hold a shard, which they write to and read from
`out/optimizer/` with torch.distributed.checkpoint (trainer.pt then holds no optimizer state).
`load_state(t, path)` restores it into a trainer built from `path/model`: the trainer then
continues exactly where the saved one stood.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from nonstop.checkpoint import write_policy_version
from nonstop.observe import consumed
from nonstop.trainer.core import Trainer
from nonstop.trainer.parallel import ParallelTrainer

SHARDED_OPTIMIZER = "optimizer"
"""A checkpoint's folder of FSDP2 optimizer shards (torch.distributed.checkpoint)."""


def _sharded(t: Trainer | ParallelTrainer) -> bool:
    return isinstance(t, ParallelTrainer) and t.mode == "fsdp2"


def save_weights(t: Trainer | ParallelTrainer, out: Path) -> None:
    if isinstance(t, ParallelTrainer):
        t.save_full(out)  # every rank takes part; rank 0 writes
    else:
        t.model.save_pretrained(str(out))  # with LoRA, peft records the base's path in adapter_config.json
    if not isinstance(t, ParallelTrainer) or t.rank == 0:
        write_policy_version(out, t.policy_version)


def save_state(t: Trainer | ParallelTrainer, out: Path, record: Path | None) -> None:
    if isinstance(t, ParallelTrainer) and _sharded(t):
        t.save_optimizer(out / SHARDED_OPTIMIZER)
    if isinstance(t, ParallelTrainer) and t.rank > 0:
        return
    if record is not None:
        consumed.snapshot(record, out)
    torch.save(
        {
            "optimizer": None if _sharded(t) else t.optimizer.state_dict(),
            "scheduler": t.scheduler.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "policy_version": t.policy_version,
            "skipped_steps": t.skipped_steps,
            "skips_in_row": t.skips_in_row,
        },
        out / "trainer.pt",
    )


def load_state(t: Trainer | ParallelTrainer, path: Path) -> None:
    state = torch.load(path / "trainer.pt", weights_only=False)
    sharded = _sharded(t)
    if sharded != (state["optimizer"] is None):
        saved, now_ = ("fsdp2", "ddp or one rank") if state["optimizer"] is None else ("ddp or one rank", "fsdp2")
        raise ValueError(
            f"trainer.data_parallel: the checkpoint {path} holds the optimizer state of {saved} "
            f"trainer ranks, this run has {now_}; resume with the checkpoint's trainer.data_parallel"
        )
    if isinstance(t, ParallelTrainer) and sharded:
        t.load_optimizer(path / SHARDED_OPTIMIZER)
    else:
        t.optimizer.load_state_dict(state["optimizer"])
    t.scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    t.policy_version, t.skipped_steps, t.skips_in_row = (
        state["policy_version"],
        state["skipped_steps"],
        state["skips_in_row"],
    )
