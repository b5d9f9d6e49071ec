"""The built-in torch engine: continuous batching over a lean KV-cache runner, versioned tokens.

Contract of `TorchEngine`:
- `generate(requests)` completes each request's prompt `n` times and returns one list of
  samples per request, in request order; it drives the scheduler until those requests are done
  (the synchronous driver; `engine/aio.py` is the asynchronous one, sharing one decode loop
  between any number of concurrent callers);
- `submit(...)` / `step()` / `has_work()` expose the scheduler for drivers;
- the KV cache holds `max_concurrent_seqs` x `max_seq_len` tokens, allocated once: the settings'
  values, which a training run resolves from its need (sizing/defaults.py); an engine built
  directly sizes what is unset from the budget `kv_cache_fraction` of the machine's memory
  (`kv_limits`): with neither set, the model's positions (at most 4096) and as many slots as
  the budget holds; with the slots set, as many positions as the budget gives each slot (at
  most the model's, at most 4096). A cache set by hand larger than the machine's memory is
  refused, naming both fields;
- the behaviour logprob of a token is that of the distribution actually sampled from
  (tempered, renormalised over the kept set under top-k / top-p / min-p, whose ids are recorded
  per token as the Keep Sampling Mask); greedy tokens carry the untempered log-softmax;
- new weights come from `weights` (a transport's engine end, set by the worker) and meet
  in-flight sequences as `settings.update_mode` says (engine/scheduler.py, docs/engine.md);
  `weight_model` is the module the transport must write into (the live model, or its staging
  copy for the modes that apply updates later).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from nonstop.config import EngineConfig
from nonstop.device import on
from nonstop.engine.runner import KVRunner
from nonstop.engine.sampling import keep_mask
from nonstop.engine.scheduler import RequestError, Scheduler
from nonstop.engine.updates import WeightGate, WeightReceiver
from nonstop.observe.flops import FlopModel
from nonstop.sizing.defaults import engine_limits
from nonstop.sizing.machine import machine_memory
from nonstop.types import GenerationRequest, Sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["Engine", "RequestError", "TorchEngine", "WeightReceiver", "keep_mask"]


class Engine(Protocol):
    @property
    def policy_version(self) -> int: ...

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]: ...


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What one cached token costs the runner's dense cache (keys and values of every layer)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_limits(settings: EngineConfig, max_positions: int, per_token: int, device: torch.device) -> tuple[int, int]:
    """(max_seq_len, max_concurrent_seqs) of an engine: the settings where set, the rest within the
    budget engine.kv_cache_fraction of the machine's memory (see the module docstring)."""
    memory = machine_memory().total
    max_len, slots = engine_limits(settings, max_positions, per_token, memory)
    if settings.max_seq_len is None and settings.max_concurrent_seqs is not None:
        fit = int(settings.kv_cache_fraction * memory // (slots * per_token))
        max_len = max(2, min(max_len, fit))
    elif device.type == "cpu" and slots * max_len * per_token > memory:
        raise ValueError(
            f"engine.max_concurrent_seqs {slots} x engine.max_seq_len {max_len} tokens x {per_token:,} bytes a "
            f"token is a KV cache of {slots * max_len * per_token / 2**30:.1f} GiB, more than this machine's "
            f"{memory / 2**30:.1f} GiB: lower either, or leave engine.max_seq_len unset to fit the slots to "
            f"engine.kv_cache_fraction"
        )
    return max_len, slots


class TorchEngine:
    def __init__(
        self,
        model: PreTrainedModel,
        eos_token_ids: list[int],
        pad_token_id: int,
        weights: WeightReceiver | None = None,
        policy_version: int = 0,
        settings: EngineConfig | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.model = model.eval()
        self.settings = settings or EngineConfig()
        self.pad_token_id = pad_token_id
        self.device = next(model.parameters()).device
        per_token = kv_bytes_per_token(model.config, self.model.dtype)
        max_len, slots = kv_limits(self.settings, model.config.max_position_embeddings, per_token, self.device)
        with on(self.device):
            self.runner = KVRunner(self.model, slots, max_len)
        # transports fill float32 tensors, on the host unless the transport has a GPU path (receive_on)
        self.gate = WeightGate(self.model, staged_mode=self.settings.update_mode != "never_stop")
        self.scheduler = Scheduler(self.runner, eos_token_ids, self.settings, self.gate, detokenize, policy_version)
        self.scheduler.flop_model = FlopModel.of(self.model)
        if weights is not None:
            self.weights = weights

    @property
    def weights(self) -> WeightReceiver | None:
        return self.gate.receiver

    @weights.setter
    def weights(self, receiver: WeightReceiver | None) -> None:
        self.gate.receiver = receiver

    @property
    def weight_model(self) -> torch.nn.Module:
        return self.gate.target

    def receive_weights_on(self, device: torch.device, dtype: torch.dtype = torch.float32) -> None:
        """Have transports fill tensors of `dtype` on `device` (the engine's GPU, for a GPU path); before
        attaching one."""
        self.gate.receive_on(device, dtype)

    @property
    def policy_version(self) -> int:
        return self.scheduler.policy_version

    @property
    def forward_passes(self) -> int:
        return int(self.scheduler.stats["forward_passes"])

    @property
    def tokens_generated(self) -> int:
        return int(self.scheduler.stats["tokens_generated"])

    def submit(
        self,
        request: GenerationRequest,
        on_done: Callable[[list[Sample]], None],
        on_fail: Callable[[BaseException], None] | None = None,
        on_token: Callable[[int, int, float, int], None] | None = None,
    ):
        return self.scheduler.submit(request, on_done, on_fail, on_token)

    def step(self) -> None:
        with on(self.device):
            self.scheduler.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        for r in requests:
            self.scheduler.check(r)
        results: list[list[Sample] | None] = [None] * len(requests)
        errors: list[BaseException] = []
        for i, r in enumerate(requests):
            self.submit(r, functools.partial(results.__setitem__, i), errors.append)
        while any(r is None for r in results) and not errors:
            try:
                self.step()
            except BaseException as e:
                self.scheduler.fail_all(e)
                raise
        if errors:
            raise errors[0]
        done = [r for r in results if r is not None]
        assert len(done) == len(results)  # the loop runs until every request finished or one failed
        return done
