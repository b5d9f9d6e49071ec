"""vLLM as an engine actor (`engine.kind: vllm`): the same calls as EngineWorker, vLLM's scheduler.

`VllmEngineWorker` answers `connect_transport`, `generate`, `ping`, `stats` and `close` like
the built-in EngineWorker, so the pool, heartbeats, restarts and the ledger work unchanged.
Inside, one task (`vllm-step-loop`) drives a vLLM `LLMEngine` running in this process
(engine/vllm_setup.py) one scheduler step at a time, and between two steps:
- receives new weights from nonstop's transport into a staging copy of the model in its
  checkpoint layout (a transformers model: the names the trainer sends, LoRA adapters merged
  by the transport's target), and loads them into vLLM with its in-place reload
  (`collective_rpc("nonstop_reload_weights")`, vllm_setup.NonstopWorkerExtension);
- admits queued requests as the update mode allows.

Per-token versions: every token a step returns carries the policy_version live during that
step (async scheduling is off, so a step's tokens come back before the next step runs); an
update between two steps stamps every later token with the new version.

Update modes, mapped onto vLLM's pause modes (AsyncLLM.pause_generation):
- never_stop ~ "keep": reload between two steps; in-flight sequences keep their KV cache;
- abort_retry ~ "abort" + re-submission: in-flight sequences are aborted, the weights
  reloaded, and each is re-submitted as prompt + its completion so far (re-prefilled under the
  new weights; its earlier tokens keep their versions and logprobs);
- drain ~ "wait": once a version is waiting, nothing is admitted until in-flight sequences
  finish, then the reload;
- blocking: requests are admitted in static batches; reloads happen only between batches;
- save_resume has no vLLM counterpart and is refused by the config (config.py).

Behaviour logprobs: vLLM's `processed_logprobs` (temperature applied), per token. Truncated
sampling (top-k / top-p / min-p) is refused: vLLM does not return the kept token set the
trainer needs. Each of a request's n completions is its own vLLM request.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from nonstop.config import EngineConfig
from nonstop.engine.scheduler import RequestError
from nonstop.engine.vllm_setup import start_engine
from nonstop.types import FinishReason, GenerationRequest, Sample, TransportHandle


@dataclass(eq=False)  # identity: a completion is found in the queue by itself
class _Seq:
    """One completion in flight: what vLLM returned so far, with a version per token."""

    group: _Group
    index: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason = "length"


@dataclass(eq=False)
class _Group:
    request: GenerationRequest
    future: asyncio.Future
    samples: list[Sample | None]

    def finished(self, seq: _Seq) -> None:
        self.samples[seq.index] = Sample(list(self.request.prompt_ids), seq.ids, seq.logprobs, seq.versions,
                                         seq.finish)
        if all(s is not None for s in self.samples) and not self.future.done():
            self.future.set_result(list(self.samples))


class VllmEngineWorker:
    def __init__(self, model_path: str, eos_token_ids: list[int], pad_token_id: int, seed: int = 0,
                 initial_version: int = 0, settings: EngineConfig | None = None, span_path: str | None = None) -> None:
        """The same arguments as EngineWorker; `settings.vllm` configures vLLM. `span_path` is
        accepted for the same spawn call, but this engine records no spans yet."""
        self.settings = settings or EngineConfig(kind="vllm")
        self.model_path = model_path
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.engine = start_engine(model_path, self.settings.vllm, seed)
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.policy_version = initial_version
        self.mode = self.settings.update_mode
        self.staging: torch.nn.Module | None = None
        self.source: Any = None
        self.waiting: int | None = None
        self.queue: deque[_Seq] = deque()  # completions not yet handed to vLLM
        self.running: dict[str, _Seq] = {}  # vLLM request id -> completion
        self._ids = itertools.count()
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats_: dict[str, float | int] = {
            "forward_passes": 0, "tokens_generated": 0, "groups_done": 0, "swaps": 0, "swap_s": 0.0,
            "max_swap_s": 0.0, "aborted_seqs": 0, "busy_s": 0.0}

    # --- the actor's calls ---------------------------------------------------------------

    def connect_transport(self, handle: TransportHandle, rank: int = 1) -> None:
        from nonstop.hf import load_model
        from nonstop.transport import open_source

        self.staging = load_model(self.model_path)
        self.source = open_source(handle, self.staging, rank)

    def check(self, request: GenerationRequest) -> None:
        p = request.params
        if not request.prompt_ids:
            raise RequestError("prompt_ids: empty prompt")
        if request.n < 1 or p.max_new_tokens < 1:
            raise RequestError(f"n ({request.n}) and max_new_tokens ({p.max_new_tokens}) must be at least 1")
        if len(request.prompt_ids) + p.max_new_tokens > self.max_model_len:
            raise RequestError(f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {p.max_new_tokens} "
                               f"exceeds vLLM's max_model_len of {self.max_model_len} tokens")
        if p.truncates:
            raise RequestError("top_k/top_p/min_p: truncated sampling is refused by the vllm engine: vLLM does not "
                               "return the kept token set (Keep Sampling Mask) the trainer needs")
        if p.temperature < 0:
            raise RequestError(f"temperature: must be >= 0 (got {p.temperature})")

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        for r in requests:
            self.check(r)  # all or nothing: reject before queueing any
        return list(await asyncio.gather(*(self.submit(r) for r in requests)))

    def submit(self, request: GenerationRequest) -> asyncio.Future:
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        group = _Group(request, fut, [None] * request.n)
        seqs = [_Seq(group, i) for i in range(request.n)]
        self.queue.extend(seqs)
        fut.add_done_callback(lambda f: self._abort(seqs) if f.cancelled() else None)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="vllm-step-loop")
        self._work.set()
        return fut

    async def ping(self) -> int:
        """Heartbeat: answered on the actor's loop between two vLLM steps."""
        return self.policy_version

    async def stats(self) -> dict[str, float | int]:
        return {"policy_version": self.policy_version, **self.stats_}

    async def sampling_state(self) -> dict[str, bytes]:
        """Empty: vLLM's sampler state lives in its engine core, out of reach; checkpoints hold
        none for this engine (rollout.seed_per_prompt makes completions reproducible anyway)."""
        return {}

    async def load_sampling_state(self, state: dict[str, bytes]) -> None:
        """Nothing to restore (see sampling_state)."""

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self.source is not None:
            self.source.close()

    # --- the step loop -------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._between_steps()
            if not self.running:
                self._work.clear()
                await self._work.wait()
                continue
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as e:  # fail the requests, keep serving
                self._fail_all(e)
                continue
            self.stats_["forward_passes"] += 1
            self._take(outputs)
            self.stats_["busy_s"] += time.perf_counter() - t0
            await asyncio.sleep(0)  # let calls (generate, ping, stats) in between two steps

    def _between_steps(self) -> None:
        if self.source is not None:
            version = self.source.maybe_update(self.staging)
            if version is not None:
                self.waiting = version
        if self.waiting is not None:
            if self.mode == "never_stop":
                self._reload()
            elif self.mode == "abort_retry":
                retry = list(self.running.values())
                self.engine.abort_request(list(self.running))
                self.running.clear()
                self.stats_["aborted_seqs"] += len(retry)
                self._reload()
                for seq in retry:
                    self._add(seq)
            elif not self.running:  # drain, blocking: in-flight sequences have finished
                self._reload()
        if self.mode == "drain" and self.waiting is not None:
            return
        if self.mode == "blocking" and self.running:
            return
        while self.queue:
            self._add(self.queue.popleft())

    def _reload(self) -> None:
        assert self.staging is not None and self.waiting is not None
        t0 = time.perf_counter()
        with torch.no_grad():
            self.engine.collective_rpc("nonstop_reload_weights", args=(list(self.staging.named_parameters()),))
        dt = time.perf_counter() - t0
        self.policy_version, self.waiting = self.waiting, None
        self.stats_["swaps"] += 1
        self.stats_["swap_s"] += dt
        self.stats_["max_swap_s"] = max(self.stats_["max_swap_s"], dt)

    def _add(self, seq: _Seq) -> None:
        """Hand one completion to vLLM: the prompt plus what it generated so far (abort_retry)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = seq.group.request.params
        params = SamplingParams(
            n=1, max_tokens=p.max_new_tokens - len(seq.ids), temperature=p.temperature,
            seed=None if p.seed is None else p.seed + seq.index, logprobs=0,
            stop=list(p.stop) or None, stop_token_ids=self.eos_token_ids + list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA, detokenize=bool(p.stop))
        rid = f"{seq.group.request.request_id}-{seq.index}-{next(self._ids)}"
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(seq.group.request.prompt_ids) + seq.ids), params)
        self.running[rid] = seq

    def _take(self, outputs: list[Any]) -> None:
        for out in outputs:
            seq = self.running.get(out.request_id)
            if seq is None:
                continue
            completion = out.outputs[0]
            for tok, lp in zip(completion.token_ids, completion.logprobs or []):
                seq.ids.append(int(tok))
                seq.logprobs.append(float(lp[tok].logprob))
                seq.versions.append(self.policy_version)
            self.stats_["tokens_generated"] += len(completion.token_ids)
            if out.finished:
                del self.running[out.request_id]
                seq.finish = "length" if completion.finish_reason == "length" else "stop"
                seq.group.finished(seq)
                if seq.group.future.done():
                    self.stats_["groups_done"] += 1

    def _abort(self, seqs: list[_Seq]) -> None:
        ids = [rid for rid, s in self.running.items() if s in seqs]
        if ids:
            self.engine.abort_request(ids)
        for rid in ids:
            del self.running[rid]
        for s in seqs:
            if s in self.queue:
                self.queue.remove(s)

    def _fail_all(self, error: BaseException) -> None:
        if self.running:
            self.engine.abort_request(list(self.running))
        for seq in [*self.running.values(), *self.queue]:
            if not seq.group.future.done():
                seq.group.future.set_exception(error)
        self.running.clear()
        self.queue.clear()
