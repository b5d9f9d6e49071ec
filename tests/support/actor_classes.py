"""Classes the tests spawn as actors in their own processes (a spawned process imports its class
by name): `Echo` for the runtime's backends, `DataParallelRank` and `TrainerRankHost` for trainer
ranks that meet in a process group."""

from __future__ import annotations

import os
import time

import torch


class Echo:
    """A small actor for runtime tests."""

    def __init__(self, base: int = 0, fail_init: bool = False) -> None:
        if fail_init:
            raise ValueError("refusing to start")
        self.base = base

    def add(self, x: int, y: int = 0) -> int:
        return self.base + x + y

    def threads(self) -> int:
        return torch.get_num_threads()

    def fail(self) -> None:
        raise KeyError("no such thing")

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def crash(self) -> None:
        os._exit(3)

    async def wait_for(self, key: str) -> str:
        """Returns only after `release(key)`: proves async calls are served concurrently."""
        import asyncio

        events = self.__dict__.setdefault("_events", {})
        await events.setdefault(key, asyncio.Event()).wait()
        return key

    async def echo(self, payload: bytes) -> bytes:
        """Answers with its argument: many large calls fill both directions of the pipe at once."""
        return payload

    async def release(self, key: str) -> None:
        import asyncio

        self.__dict__.setdefault("_events", {}).setdefault(key, asyncio.Event()).set()


class DataParallelRank:
    """One data-parallel trainer rank for tests: a fresh ParallelTrainer per config, one step."""

    def __init__(self, model_dir: str, pad_token_id: int) -> None:
        self.model_dir, self.pad_token_id = model_dir, pad_token_id

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        from nonstop.trainer.parallel import join_group

        join_group(host, port, rank, world, timeout_s=120)

    def step(self, cfg, groups, temperature: float, max_new_tokens: int | None = None) -> dict:
        """Train one step; every rank returns the full parameters (numpy) and the metrics."""
        from nonstop.hf import load_model
        from nonstop.trainer.parallel import ParallelTrainer

        trainer = ParallelTrainer(
            load_model(self.model_dir),
            cfg,
            temperature,
            self.pad_token_id,
            mode=cfg.data_parallel,
            max_new_tokens=max_new_tokens,
        )
        metrics = trainer.step(groups)
        params = {n: t.detach().numpy().copy() for n, t in trainer.publishable().named_parameters()}
        return {"params": params, "metrics": metrics, "version": trainer.policy_version}


class TrainerRankHost:
    """One trainer rank process for tests that run several trainers one after the other in the
    same processes: it builds a real TrainerWorker, joins its process group, and forwards calls."""

    def __init__(self) -> None:
        self.worker = None

    def make(self, model_path: str, cfg, pad_token_id: int, host: str, port: int, rank: int, world: int) -> None:
        from nonstop.trainer.worker import TrainerWorker

        self.worker = TrainerWorker(model_path, cfg, 1.0, pad_token_id, seed=0, total_steps=10)
        self.worker.join_group(host, port, rank, world, timeout_s=120)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def optimizer_state(self) -> dict:
        """This rank's AdamW moments as numpy (its shard, with FSDP2), by parameter name."""
        t = self.worker.trainer
        names = {id(p): n for n, p in t.model.named_parameters()}
        out = {}
        for p, st in t.optimizer.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                v = st[k]
                v = v.to_local() if hasattr(v, "to_local") else v
                out[f"{names[id(p)]}.{k}"] = v.detach().numpy().copy()
            out[f"{names[id(p)]}.step"] = float(st["step"])
        return out

    def close(self) -> None:
        self.worker.close()
        self.worker = None
