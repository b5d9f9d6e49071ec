"""Trainer actor: a Trainer in its own process; owns the sending end of the weight transport.

`step(groups)` trains on one batch and publishes the new weights as policy_version + 1 before
it returns, so when the orchestrator sees version v every engine can load v. With LoRA
(`lora.enabled`) the base is frozen, only the adapters train and travel, and `save` writes a
peft adapter folder (adapter_config.json + adapter_model.safetensors) instead of a full model.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from nonstop.config import LoraConfig, TrainerConfig, TransportConfig
from nonstop.hf import load_model
from nonstop.trainer.core import Trainer
from nonstop.transport import WeightSink, open_sink, plan_transport
from nonstop.types import Group, StepResult, TransportHandle


class TrainerWorker:
    def __init__(self, model_path: str, cfg: TrainerConfig, temperature: float, pad_token_id: int, seed: int = 0,
                 max_lag: int | None = None, reject: str = "group", lora: LoraConfig | None = None):
        torch.manual_seed(seed)
        self.model_path = model_path
        self.lora = lora if lora is not None and lora.enabled else None
        model = load_model(model_path)
        if self.lora is not None:
            from nonstop.lora import wrap_with_peft

            model = wrap_with_peft(model, self.lora)
        self.trainer = Trainer(model, cfg, temperature, pad_token_id, max_lag, reject)
        self.sink: WeightSink | None = None
        self.publish_bytes = 0
        self.busy_s = 0.0

    def plan_transport(self, cfg: TransportConfig, num_engines: int) -> TransportHandle:
        handle = plan_transport(cfg, self.trainer.model, num_engines, self.lora)
        self.sink = open_sink(handle)
        self.publish_bytes = handle.total_bytes
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
        metrics.update(train_s=t1 - t0, publish_s=t2 - t1, publish_bytes=self.publish_bytes)
        return StepResult(self.trainer.policy_version, metrics)

    def save(self, path: str) -> str:
        """Write the current weights with save_pretrained (safetensors): the full model, loadable
        by transformers, or with LoRA the adapter folder, loadable by peft.PeftModel.from_pretrained
        on top of the base this run started from."""
        out = Path(path)
        self.trainer.model.save_pretrained(out)  # peft records the base's path in adapter_config.json
        return str(out)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
