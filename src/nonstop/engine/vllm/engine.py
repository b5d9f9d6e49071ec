"""vLLM as an engine actor (`engine.kind: vllm`): the same calls as EngineWorker, vLLM's scheduler.

`VllmEngineWorker` answers `connect_transport`, `generate`, `ping`, `stats` and `close` like
the built-in EngineWorker, so the pool, heartbeats, restarts and the ledger work unchanged.
Inside, one task (`vllm-step-loop`) drives a vLLM `LLMEngine` running in this process
(engine/vllm/setup.py) one scheduler step at a time, and between two steps:
- receives new weights from nonstop's transport into a staging copy of the model in its
  checkpoint layout (a transformers model: the names the trainer sends, LoRA adapters merged
  by the transport's target), and loads them into vLLM with its in-place reload
  (`collective_rpc("nonstop_reload_weights")`, setup.NonstopWorkerExtension);
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

Keep Routing (MoE): for a Qwen3-MoE / Qwen2-MoE model (setup.route_layout), the worker
extension records the experts vLLM's routers chose for every token it computed
(engine/vllm/routes.py); each sample's `routes` holds them in the built-in engine's layout
(kept.Routes: its prompt's P tokens and completion tokens 0..T-2, MoE layers only). After an
abort_retry re-submission the prefix's routes are the re-prefill's, as in the built-in engine.

Spans: with `span_path`, forward passes (coalesced `busy` chunks) and weight applies go to the
span log (nonstop.observe.spans) as the built-in engine writes them, so `nonstop report` and `nonstop
simulate` read vLLM runs too. For `nonstop serve`, the worker is also a ServedEngine
(serve/protocol.py): `check`, `submit` with a token queue, `stream`, `health`.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import torch

from nonstop.config import EngineConfig
from nonstop.engine.aio import TokenEvent, stream_events
from nonstop.engine.scheduler import RequestError
from nonstop.engine.vllm.sequence import VllmSeq, VllmSeqGroup
from nonstop.engine.vllm.setup import RouteLayout, VllmSetupError, route_layout, start_engine
from nonstop.hf import load_model
from nonstop.kept import Routes
from nonstop.observe.spans import PassRecorder, SpanLog, now
from nonstop.transport import open_receiver
from nonstop.transport.base import receiver_crc32
from nonstop.transport.names import per_expert_slices
from nonstop.types import GenerationRequest, Sample, TransportHandle


def checkpoint_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's parameters under checkpoint names, for vLLM's loader: transformers' fused
    experts of a MoE block (`experts.gate_up_proj`) as the per-expert views checkpoints hold
    (`experts.{e}.gate_proj.weight`, ...; transport/names.py), everything else as named."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, tensor in model.named_parameters():
        out += per_expert_slices(name, tensor) or [(name, tensor)]
    return out


class VllmEngineWorker:
    def __init__(
        self,
        model_path: str,
        eos_token_ids: list[int],
        pad_token_id: int,
        seed: int = 0,
        initial_version: int = 0,
        settings: EngineConfig | None = None,
        span_path: str | None = None,
    ) -> None:
        """The same arguments as EngineWorker; `settings.vllm` configures vLLM; `span_path`: this
        engine's span file (nonstop.observe.spans), None records nothing."""
        self.settings = settings or EngineConfig(kind="vllm")
        self.model_path = model_path
        self.eos_token_ids = list(eos_token_ids)
        self.seed = seed
        self.engine = start_engine(model_path, self.settings.vllm, seed)
        self.layout: RouteLayout | None = route_layout(model_path)
        if self.layout is not None:
            [bound] = self.engine.collective_rpc(
                "nonstop_record_routes", args=(self.layout.layers, self.layout.num_experts)
            )
            if bound != len(self.layout.layers):
                raise VllmSetupError(
                    f"model {model_path}: vLLM's model has {bound} hookable MoE routers where the "
                    f"checkpoint has {len(self.layout.layers)}; its routes cannot be recorded "
                    "(Keep Routing); use engine.kind: builtin"
                )
        self.vllm_ids: dict[str, str] = {}  # our request id -> vLLM's (it appends a suffix)
        self._dropped: list[str] = []  # vLLM ids aborted since the last route take
        self.max_model_len = int(self.engine.model_config.max_model_len)
        self.vocab_size = int(self.engine.model_config.get_vocab_size())
        self.spans = SpanLog(span_path)
        self._passes = PassRecorder(self.spans) if self.spans.enabled else None
        self.policy_version = initial_version
        self.mode = self.settings.update_mode
        self.staging: torch.nn.Module | None = None
        self.receiver: Any = None
        self.waiting: int | None = None
        self.queue: deque[VllmSeq] = deque()  # completions not yet handed to vLLM
        self.running: dict[str, VllmSeq] = {}  # vLLM request id -> completion
        self._ids = itertools.count()
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.stats_: dict[str, float | int] = {
            "forward_passes": 0,
            "tokens_generated": 0,
            "groups_done": 0,
            "swaps": 0,
            "swap_s": 0.0,
            "max_swap_s": 0.0,
            "aborted_seqs": 0,
            "busy_s": 0.0,
            "routes_missing": 0,
        }

    # --- the actor's calls ---------------------------------------------------------------

    def connect_transport(self, handle: TransportHandle, rank: int = 1) -> None:
        self.staging = load_model(self.model_path)
        self.receiver = open_receiver(handle, self.staging, rank)

    def check(self, request: GenerationRequest) -> None:
        p = request.params
        if not request.prompt_ids:
            raise RequestError("prompt_ids: empty prompt")
        if request.n < 1 or p.max_new_tokens < 1:
            raise RequestError(f"n ({request.n}) and max_new_tokens ({p.max_new_tokens}) must be at least 1")
        if len(request.prompt_ids) + p.max_new_tokens > self.max_model_len:
            raise RequestError(
                f"prompt of {len(request.prompt_ids)} tokens + max_new_tokens {p.max_new_tokens} "
                f"exceeds vLLM's max_model_len of {self.max_model_len} tokens"
            )
        if p.truncates:
            raise RequestError(
                "top_k/top_p/min_p: truncated sampling is refused by the vllm engine: vLLM does not "
                "return the kept token set (Keep Sampling Mask) the trainer needs"
            )
        if p.temperature < 0:
            raise RequestError(f"temperature: must be >= 0 (got {p.temperature})")
        if any(t < 0 or t >= self.vocab_size for t in request.prompt_ids):
            raise RequestError(f"prompt_ids: token ids must be in [0, {self.vocab_size}) (the model's vocabulary)")

    async def generate(self, requests: list[GenerationRequest]) -> list[list[Sample]]:
        for r in requests:
            self.check(r)  # all or nothing: reject before queueing any
        return list(await asyncio.gather(*(self.submit(r) for r in requests)))

    def submit(self, request: GenerationRequest, queue: asyncio.Queue | None = None) -> asyncio.Future:
        """A future of the request's n samples (call `check` first); `queue` (bounded by the
        caller) receives a TokenEvent per token; cancelling the future aborts the request."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        group = VllmSeqGroup(request, fut, [None] * request.n, queue)
        seqs = [VllmSeq(group, i) for i in range(request.n)]
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

    async def weights_crc32(self) -> tuple[int, int]:
        """(policy_version, CRC32 of the weights as this worker received them from the transport,
        in its layout order), before they are loaded into vLLM's engine core."""
        if self.receiver is None:
            raise RuntimeError("weights_crc32: the engine is not attached to a weight transport yet")
        return self.policy_version, receiver_crc32(self.receiver)

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
        if self._passes is not None:
            self._passes.flush()
        self.spans.close()
        if self.receiver is not None:
            self.receiver.close()

    # --- what `nonstop serve` asks of an engine (serve/protocol.py ServedEngine) -----------

    def stream(self, request: GenerationRequest) -> AsyncIterator[TokenEvent | list[Sample]]:
        return stream_events(self.submit, request)

    @property
    def max_seq_len(self) -> int:
        return self.max_model_len

    def health(self) -> dict[str, int]:
        return {"policy_version": self.policy_version, "running": len(self.running), "waiting": len(self.queue)}

    # --- the step loop -------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            self._between_steps()
            if not self.running:
                if self._passes is not None:
                    self._passes.flush()
                self._work.clear()
                await self._work.wait()
                continue
            t0, tokens = now(), self.stats_["tokens_generated"]
            try:
                outputs = self.engine.step()
            except Exception as e:  # fail the requests, keep serving
                self._fail_all(e)
                continue
            self.stats_["forward_passes"] += 1
            self._take(outputs)
            t1 = now()
            self.stats_["busy_s"] += t1 - t0
            if self._passes is not None:
                self._passes.record(t0, t1, int(self.stats_["tokens_generated"] - tokens))
            await asyncio.sleep(0)  # let calls (generate, ping, stats) in between two steps

    def _between_steps(self) -> None:
        if self.receiver is not None:
            version = self.receiver.maybe_update(self.staging)
            if version is not None:
                self.waiting = version
        if self.waiting is not None:
            if self.mode == "never_stop":
                self._reload()
            elif self.mode == "abort_retry":
                retry = list(self.running.values())
                self._stop(list(self.running))
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
        t0 = now()
        with torch.no_grad():
            self.engine.collective_rpc("nonstop_reload_weights", args=(checkpoint_tensors(self.staging),))
        t1 = now()
        dt = t1 - t0
        self.policy_version, self.waiting = self.waiting, None
        self.spans.emit("apply", t0=round(t0, 6), t1=round(t1, 6), version=self.policy_version)
        self.stats_["swaps"] += 1
        self.stats_["swap_s"] += dt
        self.stats_["max_swap_s"] = max(self.stats_["max_swap_s"], dt)

    def _add(self, seq: VllmSeq) -> None:
        """Hand one completion to vLLM: the prompt plus what it generated so far (abort_retry)."""
        # optional: vllm, the vllm extra (this module is imported without it)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        p = seq.group.request.params
        params = SamplingParams(
            n=1,
            max_tokens=p.max_new_tokens - len(seq.ids),
            temperature=p.temperature,
            seed=None if p.seed is None else p.seed + seq.index,
            logprobs=0,
            stop=list(p.stop) or None,
            stop_token_ids=self.eos_token_ids + list(p.stop_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=bool(p.stop),
        )
        rid = f"{seq.group.request.request_id}-{seq.index}-{next(self._ids)}"
        prompt = TokensPrompt(prompt_token_ids=list(seq.group.request.prompt_ids) + seq.ids)
        try:
            self.vllm_ids[rid] = self.engine.add_request(rid, prompt, params)
        except Exception as e:  # vLLM refused this request: fail its group, keep serving the others
            self._fail_group(seq.group, e)
            return
        self.running[rid] = seq

    def _take(self, outputs: list[Any]) -> None:
        finished: list[tuple[str, VllmSeq]] = []
        for out in outputs:
            seq = self.running.get(out.request_id)
            if seq is None:
                continue
            completion = out.outputs[0]
            queue = seq.group.queue
            for tok, lp in zip(completion.token_ids, completion.logprobs or []):
                seq.ids.append(int(tok))
                seq.logprobs.append(float(lp[tok].logprob))
                seq.versions.append(self.policy_version)
                if queue is not None:
                    queue.put_nowait(TokenEvent(seq.index, int(tok), seq.logprobs[-1], self.policy_version))
            self.stats_["tokens_generated"] += len(completion.token_ids)
            if out.finished:
                del self.running[out.request_id]
                seq.finish = "length" if completion.finish_reason == "length" else "stop"
                finished.append((self.vllm_ids.pop(out.request_id), seq))
        if self.layout is not None and (finished or self._dropped):
            [rows] = self.engine.collective_rpc("nonstop_take_routes", args=([v for v, _ in finished], self._dropped))
            self._dropped = []
            for vid, seq in finished:
                seq.routes = self._routes(seq, rows.get(vid, b""))
        for _, seq in finished:
            seq.group.finished(seq)
            if seq.group.future.done():
                self.stats_["groups_done"] += 1

    def _routes(self, seq: VllmSeq, data: bytes) -> Routes | None:
        """The recorded routes of a finished completion: the rows of its last vLLM request, whose
        prompt was the request's prompt plus the tokens before a re-submission, so P + T - 1
        rows (rows past that belong to tokens vLLM dropped after a stop string)."""
        assert self.layout is not None
        layout = self.layout
        routes = Routes(len(layout.layers), layout.top_k, layout.num_experts)
        prompt_len, rows = len(seq.group.request.prompt_ids), len(seq.group.request.prompt_ids) + len(seq.ids) - 1
        if len(data) < rows * routes.token_bytes:
            self.stats_["routes_missing"] += 1  # the trainer refuses r3 on such a sample, naming sample.routes
            return None
        routes.prompt = data[: prompt_len * routes.token_bytes]
        routes.completion = bytearray(data[prompt_len * routes.token_bytes : rows * routes.token_bytes])
        return routes

    def _stop(self, rids: list[str]) -> None:
        """Abort these running vLLM requests and forget them (and their recorded routes)."""
        if rids:
            self.engine.abort_request(rids)
        for rid in rids:
            del self.running[rid]
            vid = self.vllm_ids.pop(rid)
            if self.layout is not None:
                self._dropped.append(vid)

    def _abort(self, seqs: list[VllmSeq]) -> None:
        self._stop([rid for rid, s in self.running.items() if s in seqs])
        for s in seqs:
            if s in self.queue:
                self.queue.remove(s)

    def _fail_group(self, group: VllmSeqGroup, error: BaseException) -> None:
        self._stop([rid for rid, s in self.running.items() if s.group is group])
        self.queue = deque(s for s in self.queue if s.group is not group)
        if not group.future.done():
            group.future.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        for seq in [*self.running.values(), *self.queue]:
            if not seq.group.future.done():
                seq.group.future.set_exception(error)
        self._stop(list(self.running))
        self.queue.clear()
