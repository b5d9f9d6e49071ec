"""Data-parallel training: M trainer ranks take exactly the step one rank takes on the whole batch.

Contract of `ParallelTrainer.step(groups)` (every rank is given the same, whole list of groups):
- rank r trains on its contiguous share of the groups (`shard_bounds`); advantages come from the
  whole batch's rewards, so 'batch' normalisation sees every group;
- every loss reduction divides by the global count (samples with loss tokens for 'sequence' and
  GSPO, loss tokens for 'token', B x max_new_tokens for 'constant'), one all-reduce per step,
  then by M because DDP and FSDP2 average gradients over ranks: the summed gradient is the
  one-rank gradient, clipping sees the same global norm, AdamW takes the same step;
- a step is skipped on all ranks or on none (the finiteness of the loss is all-reduced);
- `mode='ddp'`: a full model per rank, gradients all-reduced (DistributedDataParallel);
  `mode='fsdp2'`: parameters, gradients and optimizer state sharded per decoder layer with
  `fully_shard`; `publishable()` gathers one full parameter at a time on every rank (all ranks
  must iterate it, in order: only rank 0 keeps what it packs), `save_full` likewise;
  `save_optimizer(folder)` / `load_optimizer(folder)` write and read the sharded optimizer state
  with torch.distributed.checkpoint (each rank its own shard file, rank 0 the metadata; every
  rank calls them; the folder must be one all ranks can reach). DCP reshards on load, so a
  checkpoint of M ranks loads into M' ranks.
The process group is torch.distributed's default group (gloo on CPU, NCCL when the model is on
a GPU); the weight transport keeps its own group, so rank 0 publishes without the other ranks.
Reported metrics are rank 0's, except loss, samples and tokens, which are global.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from nonstop.config import TrainerConfig
from nonstop.hf import CausalLM
from nonstop.trainer.batch import Batch
from nonstop.trainer.core import Trainer
from nonstop.transport.base import free_port
from nonstop.types import Group

Mode = Literal["ddp", "fsdp2"]


def node_host(host: str | None) -> str:
    """The address other machines reach this actor on: `host`, or with None this Ray node's IP."""
    if host is not None:
        return host
    import ray  # optional: ray, the ray extra (only a Ray run asks its node's address)

    return ray.util.get_node_ip_address()


def rendezvous(host: str | None) -> tuple[str, int]:
    """Address rank 0 serves the process group on: its host and a free port there."""
    host = node_host(host)
    return host, free_port(host)


def join_group(host: str, port: int, rank: int, world: int, timeout_s: float, cuda: bool = False) -> None:
    """Join the trainer ranks' default process group (blocks until all `world` ranks have);
    NCCL when the model lives on a GPU (`cuda`), gloo otherwise."""
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )


def shard_bounds(num_groups: int, rank: int, world: int) -> tuple[int, int]:
    """Contiguous share [lo, hi) of rank `rank`; shares differ in size by at most one group."""
    base, extra = divmod(num_groups, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


class _Policy(torch.nn.Module):
    """The policy's logprob computation as one module, so DDP/FSDP2 hooks see the whole forward."""

    def __init__(self, trainer: "ParallelTrainer") -> None:
        super().__init__()
        self.model = trainer.model
        self._trainer = [trainer]  # a list: not a submodule, no parameter registration

    def forward(self, batch: Batch, with_entropy: bool):
        return Trainer.logprobs(self._trainer[0], batch, self.model, with_entropy)


class _FullParameters:
    """named_parameters() of a sharded model as full tensors, gathered one at a time."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self.model.named_parameters():
            yield name, p.full_tensor() if hasattr(p, "full_tensor") else p


class ParallelTrainer(Trainer):
    def __init__(
        self,
        model: CausalLM,
        cfg: TrainerConfig,
        temperature: float,
        pad_token_id: int,
        max_lag: int | None = None,
        reject: str = "group",
        mode: Mode = "ddp",
        total_steps: int = 1000,
        max_new_tokens: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ParallelTrainer needs the trainer process group: call join_group first")
        if cfg.micro_batch_tokens is not None:
            raise ValueError("trainer.micro_batch_tokens: a data-parallel rank trains its share in one forward")
        self.rank, self.world, self.mode = dist.get_rank(), dist.get_world_size(), mode
        super().__init__(
            model,
            cfg,
            temperature,
            pad_token_id,
            max_lag,
            reject,
            total_steps,  # the reference stays whole
            max_new_tokens,
        )
        if mode == "fsdp2":
            self.shared_prompts = False  # FSDP2 gathers a layer's parameters in that layer's forward: call it
            device = "cuda" if next(model.parameters()).is_cuda else "cpu"
            mesh = init_device_mesh(device, (self.world,))
            self.policy: torch.nn.Module = _Policy(self)
            for layer in getattr(model.get_decoder(), "layers", []):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.policy, mesh=mesh)  # in place: the module becomes an FSDP module
        else:
            self.policy = DistributedDataParallel(_Policy(self))
        self.make_optimizer()  # over the sharded / wrapped parameters
        self._samples = 0

    def batch_of(self, groups: list[Group]) -> Batch:
        lo, hi = shard_bounds(len(groups), self.rank, self.world)
        batch = super().batch_of(groups[lo:hi])
        advantages = self._advantages(groups)  # (B,) over the whole batch: 'batch' mode normalises over it
        start = sum(len(g.samples) for g in groups[:lo])
        batch["advantages"] = advantages[start : start + sum(len(g.samples) for g in groups[lo:hi])]  # (B_r,)
        self._samples = len(advantages)
        return batch

    def logprobs(self, batch, model=None, with_entropy: bool = False):
        if model is None:
            return self.policy(batch, with_entropy)
        return super().logprobs(batch, model, with_entropy)

    def denominators(self, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        counts = torch.tensor([mask.sum(), mask.any(-1).sum()], dtype=torch.float64)
        dist.all_reduce(counts)
        rows = max(float(counts[1]), 1.0)
        divisors = {"sequence": rows, "token": max(float(counts[0]), 1.0), "gspo": rows}
        if self.max_new_tokens is not None:  # Trainer.__init__ demands it for the 'constant' norm
            divisors["constant"] = float(self._samples * self.max_new_tokens)
        # / world: DDP and FSDP2 average the ranks' gradients, and we want their sum
        return {k: torch.tensor(v / self.world) for k, v in divisors.items()}

    def all_finite(self, loss: torch.Tensor) -> bool:
        bad = torch.tensor([0.0 if torch.isfinite(loss) else 1.0])
        dist.all_reduce(bad)
        return float(bad) == 0.0

    def clip_grads(self) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def forward_ahead(self, groups: list[Group]) -> int:
        """Nothing held: a rank's share of a batch is cut from the whole batch's groups, which a
        part of it does not tell."""
        return 0

    def step(self, groups: list[Group]) -> dict:
        metrics = super().step(groups)
        totals = torch.tensor([metrics["loss"], metrics["samples"], metrics["tokens"]], dtype=torch.float64)
        dist.all_reduce(totals)
        metrics.update(loss=float(totals[0]) / self.world, samples=int(totals[1]), tokens=int(totals[2]))
        return metrics

    def publishable(self) -> torch.nn.Module:
        # The transport reads only named_parameters(), which _FullParameters provides without being a Module.
        return _FullParameters(self.model) if self.mode == "fsdp2" else self.model  # type: ignore[return-value]

    def save_full(self, out: Path) -> None:
        """Every rank calls this; rank 0 writes the whole model with save_pretrained."""
        state = {name: t.detach().cpu().clone() for name, t in _FullParameters(self.model).named_parameters()}
        if self.rank == 0:
            self.model.save_pretrained(str(out), state_dict=state)
        dist.barrier()

    def save_optimizer(self, folder: Path) -> None:
        """FSDP2: every rank writes its shard of the optimizer state (DCP); collective."""
        dcp.save({"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}, checkpoint_id=str(folder))

    def load_optimizer(self, folder: Path) -> None:
        """FSDP2: read this rank's shard of the optimizer state `save_optimizer` wrote; collective."""
        state = {"optimizer": get_optimizer_state_dict(self.model, self.optimizer)}  # the layout to read into
        dcp.load(state, checkpoint_id=str(folder))
        set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
