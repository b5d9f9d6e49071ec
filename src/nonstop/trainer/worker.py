"""Trainer actor: a Trainer in its own process; owns the sending end of the weight transport.

`step(groups)` trains on one batch and publishes the new weights as policy_version + 1 before
it returns, so when the orchestrator sees version v every engine can load v.
`save_checkpoint(dir)` writes the weights (`dir/model`) and everything else a resume needs
(`dir/trainer.pt`: optimizer, RNG states, policy_version, skip counters); a trainer built from
`dir/model` and given `load_checkpoint(dir)` continues exactly where the saved one stood.
With `trainer.ranks` > 1 every rank is such an actor: rank 0 calls `rendezvous`, all call
`join_group` (trainer/parallel.py), then every step, save and checkpoint goes to all ranks
(they meet in collectives); only rank 0 holds the transport sink and writes files. DDP ranks
hold identical optimizer states, so rank 0's trainer.pt serves every rank on resume.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from nonstop.config import TrainerConfig, TransportConfig
from nonstop.hf import load_model
from nonstop.trainer.core import Trainer
from nonstop.trainer.parallel import ParallelTrainer, join_group, node_host, rendezvous
from nonstop.transport import WeightSink, open_sink, plan_transport
from nonstop.types import Group, StepResult, TransportHandle


class TrainerWorker:
    def __init__(self, model_path: str, cfg: TrainerConfig, temperature: float, pad_token_id: int, seed: int = 0,
                 max_lag: int | None = None, reject: str = "group", reference_path: str | None = None,
                 total_steps: int = 1000):
        """`reference_path`: the KL reference weights when they differ from `model_path` (on resume)."""
        torch.manual_seed(seed)
        self.model_path = model_path
        self.trainer = Trainer(load_model(model_path), cfg, temperature, pad_token_id, max_lag, reject, total_steps)
        if reference_path is not None and self.trainer.reference is not None:
            self.trainer.reference = load_model(reference_path).eval().requires_grad_(False)
        self.sink: WeightSink | None = None
        self.busy_s = 0.0

    def rendezvous(self, host: str | None) -> tuple[str, int]:
        return rendezvous(host)

    def join_group(self, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Become rank `rank` of `world` data-parallel trainer ranks (blocks until all joined)."""
        t = self.trainer
        join_group(host, port, rank, world, timeout_s, cuda=next(t.model.parameters()).is_cuda)
        self.trainer = ParallelTrainer(t.model, t.cfg, t.temperature, t.pad_token_id, t.max_lag, t.reject,
                                       t.cfg.data_parallel, t.total_steps)
        self.trainer.reference = t.reference  # the worker may have loaded it from elsewhere (resume)

    def plan_transport(self, cfg: TransportConfig, num_engines: int, host: str | None = "127.0.0.1") -> TransportHandle:
        handle = plan_transport(cfg, self.trainer.model, num_engines, node_host(host))
        self.sink = open_sink(handle)
        return handle

    def connect_transport(self) -> None:
        assert self.sink is not None, "plan_transport must come first"
        self.sink.connect()

    def step(self, groups: list[Group]) -> StepResult:
        t0 = time.perf_counter()
        metrics = self.trainer.step(groups)
        t1 = time.perf_counter()
        if not metrics["skipped"]:
            weights = self.trainer.publishable()
            if self.sink is not None:
                self.sink.publish(weights, self.trainer.policy_version)
            else:  # a rank without the sink still takes part in every gather (FSDP2)
                for _ in weights.named_parameters():
                    pass
        t2 = time.perf_counter()
        self.busy_s += t2 - t0
        metrics.update(train_s=t1 - t0, publish_s=t2 - t1)
        return StepResult(self.trainer.policy_version, metrics)

    def save(self, path: str) -> str:
        """Write the current weights with save_pretrained (safetensors), loadable by transformers."""
        out = Path(path)
        if isinstance(self.trainer, ParallelTrainer):
            self.trainer.save_full(out)  # every rank takes part; rank 0 writes
        else:
            self.trainer.model.save_pretrained(out)
        return str(out)

    def save_checkpoint(self, path: str) -> int:
        out = Path(path)
        t = self.trainer
        self.save(str(out / "model"))
        if isinstance(t, ParallelTrainer) and t.rank > 0:
            return t.policy_version
        torch.save({
            "optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict(), "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(),
            "policy_version": t.policy_version, "skipped_steps": t.skipped_steps, "skips_in_row": t.skips_in_row,
        }, out / "trainer.pt")
        return t.policy_version

    def load_checkpoint(self, path: str) -> int:
        """Restore the state next to the weights this trainer was built from."""
        state = torch.load(Path(path) / "trainer.pt", weights_only=False)
        t = self.trainer
        t.optimizer.load_state_dict(state["optimizer"])
        t.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        t.policy_version, t.skipped_steps, t.skips_in_row = state["policy_version"], state["skipped_steps"], state["skips_in_row"]
        return t.policy_version

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        if isinstance(self.trainer, ParallelTrainer):
            self.trainer.close()
