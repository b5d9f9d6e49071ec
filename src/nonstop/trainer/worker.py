"""Trainer actor: a Trainer in its own process; owns the sending end of the weight transport.

`step(groups)` trains on one batch (policy_version + 1 unless the step was skipped);
`publish()` then sends the new weights through the transport, so when the orchestrator sees
`publish()` return version v every engine can load v. Both go to every rank: with FSDP2 each
rank takes part in the gathers that assemble the published weights.
`save_checkpoint(dir)` writes the weights (`dir/model`) and everything else a resume needs
(`dir/trainer.pt`: optimizer, RNG states, policy_version, skip counters); a trainer built from
`dir/model` and given `load_checkpoint(dir)` continues exactly where the saved one stood.
With `trainer.ranks` > 1 every rank is such an actor: rank 0 calls `rendezvous`, all call
`join_group` (trainer/parallel.py), then every step, save and checkpoint goes to all ranks
(they meet in collectives); only rank 0 holds the transport publisher and writes trainer.pt. DDP
ranks hold identical optimizer states, so rank 0's trainer.pt serves every rank on resume;
FSDP2 ranks each hold a shard of it, which they write to and read from `dir/optimizer/` with
torch.distributed.checkpoint (trainer.pt then has no optimizer state).

With LoRA (`lora.enabled`) the base is frozen, only the adapters train and travel, the KL
reference is the plain base, and `save` / `save_checkpoint` write peft adapter folders
(adapter_config.json + adapter_model.safetensors). A LoRA trainer resumes from the base
(`model_path`) plus `adapter_path` (the checkpoint's `model/`), and, since an engine holds only
the base, publishes its current adapters as soon as the transport is connected.

Precision (docs/precision.md): `trainer.precision` resolves here, in the trainer's process, to
float32 or bfloat16; with bfloat16 every forward and backward runs under torch.autocast in it
while the weights, gradients and AdamW state stay float32. A single-rank bfloat16 trainer also
casts its weights once per optimizer step into bfloat16 copies that every forward's matmuls read
and the publish sends (trainer/compute.py), and holds its KL reference's matmul weights in
bfloat16 (cast once). Every step record carries the
resolved `precision`, the step's FLOPs (observe/flops.py), its achieved FLOP/s over the step's
own time plus the forwards it ran ahead, and that figure's fraction of this process's matmul
peak in the step's dtype, probed once when the worker starts.

With `record_path` (rank 0 of the run's shared policy: RUN_DIR/trained.jsonl) every step appends
one line naming each sample it consumed, with the versions of its tokens (observe/consumed.py):
the trainer's own account of what it trained, which `nonstop verify` recounts the run from.
`save_checkpoint` copies it into the checkpoint, and a trainer given `load_checkpoint` counts its
steps on from that copy (the resume put it back as the live record, launch.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from nonstop.config import DistillConfig, LoraConfig, TrainerConfig, TransportConfig
from nonstop.device import dtype_name, on, place, resolve_device, resolve_dtype, retain_freed_memory
from nonstop.hf import CausalLM, load_model
from nonstop.lora import wrap_with_peft
from nonstop.observe import consumed
from nonstop.observe.flops import FlopModel, PeakProbe, rate, train_flops
from nonstop.observe.spans import SpanLog, now
from nonstop.trainer.checkpointing import load_state, save_state, save_weights
from nonstop.trainer.compute import ComputeWeights, cast_linears
from nonstop.trainer.core import Trainer
from nonstop.trainer.parallel import ParallelTrainer, join_group, node_host, rendezvous
from nonstop.transport import WeightPublisher, open_publisher, plan_transport
from nonstop.transport.base import layout_dtype, sent_tensors, weights_crc32
from nonstop.types import AheadResult, Group, PublishResult, StepResult, TransportHandle


class TrainerWorker:
    def __init__(
        self,
        model_path: str,
        cfg: TrainerConfig,
        temperature: float,
        pad_token_id: int,
        seed: int = 0,
        max_lag: int | None = None,
        reject: str = "group",
        reference_path: str | None = None,
        total_steps: int = 1000,
        lora: LoraConfig | None = None,
        adapter_path: str | None = None,
        max_new_tokens: int | None = None,
        span_path: str | None = None,
        distill: DistillConfig | None = None,
        record_path: str | None = None,
    ):
        """`span_path`: this rank's span file (nonstop.observe.spans), None records nothing.
        `reference_path`: the KL reference weights when they differ from `model_path` (on resume).
        `max_new_tokens`: rollout.max_new_tokens, the constant divisor of dr_grpo's normalisation.
        `lora`: train adapters on the base `model_path`, starting from `adapter_path` if given.
        `distill`: the teacher term's weight, for samples that carry teacher logprobs.
        `record_path`: the record of consumed samples this trainer appends to (None: none)."""
        torch.manual_seed(seed)
        self.model_path = model_path
        self.lora = lora if lora is not None and lora.enabled else None
        self.device = resolve_device(cfg.device, "trainer.device")
        if self.device.type == "cpu":
            retain_freed_memory()  # before the weights load: every step reuses its memory (nonstop/device.py)
        base = place(load_model(model_path), self.device)
        model: CausalLM = base
        if self.lora is not None:
            model = wrap_with_peft(base, self.lora, adapter_path)
            reference_path = model_path  # the plain base, not a copy of the peft model
        self.trainer = Trainer(
            model, cfg, temperature, pad_token_id, max_lag, reject, total_steps, max_new_tokens, distill
        )
        if reference_path is not None and self.trainer.reference is not None:
            self.trainer.reference = place(load_model(reference_path), self.device).eval().requires_grad_(False)
        self.publisher: WeightPublisher | None = None
        self.handle: TransportHandle | None = None
        self.publish_bytes = 0
        self.published_version = self.trainer.policy_version  # what the engines hold (they start from it)
        self.busy_s = 0.0
        self.spans = SpanLog(span_path)
        self.dtype = resolve_dtype(cfg.precision or "float32", self.device, "trainer.precision")
        if self.dtype == torch.float16:
            raise ValueError("trainer.precision: float16 autocast needs loss scaling; use bfloat16")
        self.compute: ComputeWeights | None = None
        if self.dtype != torch.float32:
            self.compute = self.trainer.compute = ComputeWeights(model, self.dtype)
            if self.trainer.reference is not None:
                cast_linears(self.trainer.reference, self.dtype)
        self.flop_model = FlopModel.of(model)
        # LoRA: the frozen base needs activation gradients only (2 x forward instead of 3 x)
        self.flop_factor = (2 if self.lora is not None else 3) + (1 if self.trainer.reference is not None else 0)
        self.peak = PeakProbe(self.dtype, self.device)
        self.ahead_s = 0.0  # forwards run ahead since the last step: part of the next step's work
        self.record = Path(record_path) if record_path is not None else None
        if self.record is not None:
            self.record.touch()  # an empty record says "no step yet"; a missing one says nothing
        self.steps = 0  # steps taken, counted on from a checkpoint's record on resume
        # trainer.publish_overlap: sends on one thread of their own; the next optimizer step waits for one
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="nonstop-publish")
        self.sending: Future[PublishResult] | None = None
        self.last_sent: PublishResult | None = None
        self.sends = 0
        self.send_wait_s = 0.0  # how long steps waited for an overlapped send (in the step's metrics)
        self.span_due: dict[str, Any] | None = None
        self.trainer.before_update = self._join_send

    def _precision(self) -> contextlib.ExitStack:
        """The context of every forward and backward: autocast in bfloat16 with the bf16 copies of the
        weights in the model's Linear modules (trainer/compute.py), or nothing in float32."""
        stack = contextlib.ExitStack()
        if self.dtype != torch.float32:
            stack.enter_context(torch.autocast(self.device.type, dtype=self.dtype))
        if self.compute is not None:
            stack.enter_context(self.compute.swapped())
        return stack

    def rendezvous(self, host: str | None) -> tuple[str, int]:
        return rendezvous(host)

    def join_group(self, host: str, port: int, rank: int, world: int, timeout_s: float) -> None:
        """Become rank `rank` of `world` data-parallel trainer ranks (blocks until all joined)."""
        t = self.trainer
        join_group(host, port, rank, world, timeout_s, cuda=next(t.model.parameters()).is_cuda)
        if t.routing is not None:
            t.routing.close()  # the parallel trainer hooks the same routers again
        self.trainer = ParallelTrainer(
            t.model,
            t.cfg,
            t.temperature,
            t.pad_token_id,
            t.max_lag,
            t.reject,
            t.cfg.data_parallel,
            t.total_steps,
            t.max_new_tokens,
        )
        self.trainer.reference = t.reference  # the worker may have loaded it from elsewhere (resume)
        self.trainer.distill = t.distill
        self.compute = None  # DDP and FSDP2 hook the model's own parameters: autocast alone

    def _publishes_on_connect(self) -> bool:
        """A resumed LoRA trainer's engines hold only the base: they need the adapters at once."""
        return self.lora is not None and self.trainer.policy_version > 0

    def plan_transport(
        self, cfg: TransportConfig, num_engines: int, host: str | None = "127.0.0.1", first_engines: int | None = None
    ) -> TransportHandle:
        version = self.trainer.policy_version
        handle = plan_transport(
            cfg,
            self.trainer.model,
            num_engines,
            self.lora,
            next_version=version if self._publishes_on_connect() else version + 1,
            host=node_host(host),
            first_engines=first_engines,
        )
        self.publisher = open_publisher(handle)
        self.handle = handle
        self.publish_bytes = handle.total_bytes
        return handle

    def connect_transport(self) -> None:
        assert self.publisher is not None, "plan_transport must come first"
        self.publisher.connect()
        if self._publishes_on_connect():
            self.publisher.publish(self.trainer.model, self.trainer.policy_version)

    def step(self, groups: list[Group]) -> StepResult:
        t0, cpu0 = now(), time.process_time()
        self.send_wait_s = 0.0
        with on(self.device), self._precision():
            metrics: dict[str, Any] = self.trainer.step(groups)
        if self.trainer.cfg.publish_overlap:
            metrics["publish_wait_s"] = self.send_wait_s  # the optimizer step's wait for the previous send
        t1, cpu_s = now(), time.process_time() - cpu0
        train_s = t1 - t0
        self.busy_s += train_s
        head_once = self.trainer.layout() == "packed-prefix"  # the prompts' shared head computed once
        flops = train_flops(self.flop_model, groups, self.trainer.shared_prompts, self.flop_factor, head_once)
        peak = self.peak.tick()  # after the timed step: a probe again is not part of it
        achieved, frac = rate(flops, train_s + self.ahead_s, peak)
        self.ahead_s = 0.0
        metrics.update(
            train_s=train_s,
            precision=dtype_name(self.dtype),
            flops=flops,
            flops_per_s=achieved,
            peak_flops_per_s=peak,
            peak_frac=frac,
        )
        self.steps += 1
        consumed.append(
            self.record,
            consumed.trained_line(self.steps, self.trainer.policy_version, bool(metrics["skipped"]), groups),
        )
        update_s = metrics["update_s"]
        assert isinstance(update_s, float)  # Trainer.step reports it in seconds
        self.spans.emit(
            "step",
            t0=round(t0, 6),
            t1=round(t1, 6),
            version=self.trainer.policy_version,
            tokens=sum(g.num_tokens for g in groups),
            samples=sum(len(g.samples) for g in groups),
            update_s=round(update_s, 6),
            cpu_s=round(cpu_s, 6),
        )
        return StepResult(self.trainer.policy_version, metrics)

    def forward_ahead(self, groups: list[Group]) -> AheadResult:
        """The forward pass of the coming batch's first groups, for the next step (trainer/ahead.py)."""
        t0, cpu0 = now(), time.process_time()
        with on(self.device), self._precision():
            held = self.trainer.forward_ahead(groups)
        t1 = now()
        self.busy_s += t1 - t0
        self.ahead_s += t1 - t0
        self.spans.emit(
            "ahead", t0=round(t0, 6), t1=round(t1, 6), groups=held, cpu_s=round(time.process_time() - cpu0, 6)
        )
        return AheadResult(held, t1 - t0)

    def publish(self, resend: bool = False) -> PublishResult:
        """Send the weights of the current policy_version unless the engines already have them
        (`resend`: send them anyway, for an engine that replaced a dead one). With
        trainer.publish_overlap the send goes on on the sender thread and the result says `pending`:
        `published()` waits for it (the first send, a resend and data-parallel ranks stay inline)."""
        self._join_send()
        t0 = now()
        version = self.trainer.policy_version
        sent = resend or version != self.published_version
        full = self.handle.total_bytes if self.handle is not None else 0
        if not sent:
            return PublishResult(version, now() - t0, self.publish_bytes, full)
        weights = self._publishable()
        self.published_version = version
        if self.publisher is not None and self._overlaps(resend):
            # the first send re-homed the sent tensors into the transport's buffer: this one only reads them
            self.sending = self.sender.submit(self._send, weights, version, t0, False)
            launch_s = now() - t0
            self.busy_s += launch_s
            return PublishResult(version, launch_s, 0, full, pending=True)
        return self._send(weights, version, t0, True)

    def _overlaps(self, resend: bool) -> bool:
        """Whether this publish sends on the sender thread."""
        single = not isinstance(self.trainer, ParallelTrainer)
        return self.trainer.cfg.publish_overlap and single and not resend and self.sends > 0

    def _send(self, weights: torch.nn.Module, version: int, t0: float, inline: bool) -> PublishResult:
        """The send itself, inline or on the sender thread; its result as `published()` reports it."""
        if self.publisher is not None:
            self.publisher.publish(weights, version)
            self.publish_bytes = self.publisher.sent_bytes
        else:  # a rank without the publisher still takes part in every gather (FSDP2)
            for _ in weights.named_parameters():
                pass
        self.sends += 1
        t1 = now()
        span = {"t0": round(t0, 6), "t1": round(t1, 6), "version": version, "bytes": self.publish_bytes}
        if inline:  # an overlapped send is not the trainer's wait; its span is written by the thread that joins it
            self.busy_s += t1 - t0
            self.spans.emit("publish", **span)
        else:
            self.span_due = span
        full = self.handle.total_bytes if self.handle is not None else 0
        self.last_sent = PublishResult(version, t1 - t0, self.publish_bytes, full)
        return self.last_sent

    def _join_send(self) -> None:
        """Wait for the send on the sender thread, if one is under way: before anything writes the weights
        it reads (an optimizer step) or reads the transport (another publish, a checkpoint, a checksum)."""
        sending, self.sending = self.sending, None
        if sending is not None:
            t0 = now()
            sending.result()  # a failed send raises here (TransportError names the peer and the version)
            self.send_wait_s += now() - t0
        if self.span_due is not None:
            self.spans.emit("publish", overlapped=True, **self.span_due)
            self.span_due = None

    async def published(self) -> PublishResult:
        """What the newest send cost, once it ended: engines can then load its version. At once when the
        send was inline. An async call: it waits beside the trainer's next forward and step."""
        sending = self.sending
        if sending is not None:
            return await asyncio.wrap_future(sending)
        assert self.last_sent is not None or self.sends == 0
        return self.last_sent or PublishResult(self.published_version, 0.0, 0, 0)

    def _publishable(self) -> torch.nn.Module:
        """What the transport sends: the bf16 copies where they are what travels (no second cast), else the
        trainer's weights (cast by the transport as it writes)."""
        handle, compute = self.handle, self.compute
        if compute is not None and handle is not None and self.lora is None:
            if layout_dtype(handle.layout) == compute.dtype:
                return compute.published()
        return self.trainer.publishable()

    def weights_crc32(self) -> tuple[int, int]:
        """(policy_version, CRC32 of the current weights as the transport sends them): an engine that
        holds this version exactly reports the same from its own `weights_crc32`. Every rank takes
        part (FSDP2 gathers each parameter)."""
        self._join_send()
        weights = self.trainer.publishable()
        named = sent_tensors(weights, self.lora) if self.lora is not None else weights.named_parameters()
        wire = {s.name: getattr(torch, s.dtype) for s in self.handle.layout} if self.handle is not None else {}
        return self.trainer.policy_version, weights_crc32(t.to(wire.get(n, t.dtype)) for n, t in named)

    def save(self, path: str) -> str:
        """Write the current weights (checkpointing.save_weights): a model folder, or with LoRA an adapter folder."""
        save_weights(self.trainer, Path(path))
        return path

    def save_checkpoint(self, path: str) -> int:
        out = Path(path)
        self.save(str(out / "model"))
        save_state(self.trainer, out, self.record)
        return self.trainer.policy_version

    def load_checkpoint(self, path: str) -> int:
        """Restore the state next to the weights this trainer was built from."""
        self._join_send()
        load_state(self.trainer, Path(path))
        self.published_version = (
            self.trainer.policy_version
        )  # engines start from these weights (LoRA: connect publishes them)
        if self.record is not None:
            self.steps = len(consumed.lines_of(Path(path) / self.record.name))
        return self.trainer.policy_version

    def close(self) -> None:
        try:
            self._join_send()  # a send under way ends before the transport closes
        finally:
            self.sender.shutdown(wait=False)
            self.spans.close()
            if self.publisher is not None:
                self.publisher.close()
        if isinstance(self.trainer, ParallelTrainer):
            self.trainer.close()
