"""Trainer actor: a Trainer in its own process; owns the sending end of the weight transport.

`step(groups)` trains on one batch and publishes the new weights as policy_version + 1 before
it returns, so when the orchestrator sees version v every engine can load v.
`save_checkpoint(dir)` writes the weights (`dir/model`) and everything else a resume needs
(`dir/trainer.pt`: optimizer, RNG states, policy_version, skip counters); a trainer built from
`dir/model` and given `load_checkpoint(dir)` continues exactly where the saved one stood.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from nonstop.config import TrainerConfig, TransportConfig
from nonstop.hf import load_model
from nonstop.trainer.core import Trainer
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

    def plan_transport(self, cfg: TransportConfig, num_engines: int) -> TransportHandle:
        handle = plan_transport(cfg, self.trainer.model, num_engines)
        self.sink = open_sink(handle)
        return handle

    def connect_transport(self) -> None:
        assert self.sink is not None, "plan_transport must come first"
        self.sink.connect()

    def step(self, groups: list[Group]) -> StepResult:
        t0 = time.perf_counter()
        metrics = self.trainer.step(groups)
        t1 = time.perf_counter()
        if self.sink is not None and not metrics["skipped"]:
            self.sink.publish(self.trainer.model, self.trainer.policy_version)
        t2 = time.perf_counter()
        self.busy_s += t2 - t0
        metrics.update(train_s=t1 - t0, publish_s=t2 - t1)
        return StepResult(self.trainer.policy_version, metrics)

    def save(self, path: str) -> str:
        """Write the current weights with save_pretrained (safetensors), loadable by transformers."""
        out = Path(path)
        self.trainer.model.save_pretrained(out)
        return str(out)

    def save_checkpoint(self, path: str) -> int:
        out = Path(path)
        t = self.trainer
        t.model.save_pretrained(out / "model")
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
