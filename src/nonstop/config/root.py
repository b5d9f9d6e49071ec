"""The root of the run configuration: `Config`, the whole tree of sections, and its rules across them.

Reading a config (YAML, `--set` overrides) into a `Config` is loading.py; a problem there or in
a rule here becomes one `ConfigError` naming the dotted field.

The transport and runtime sections hold one model per kind (config/kinds.py). Every rule across
fields is checked in `Config._combinations`; a default that depends on another field stays None
in the file and resolves in one `Config` property (`engine_settings`, `engine_restarts`,
`warmup_enabled`), so a written config.yaml resolves again from whatever is changed on resume.
Defaults that depend on the run's data, the model or the machine (engine limits, trainer.lr)
stay None too and resolve once per run in sizing/defaults.py, before any actor starts.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from nonstop.config.flow import (
    AgentsConfig,
    BufferConfig,
    CheckpointConfig,
    DoctorConfig,
    EnvConfig,
    RolloutConfig,
    RunConfig,
)
from nonstop.config.kinds import (
    LocalRuntimeConfig,
    RayRuntimeConfig,
    RuntimeConfig,
    ShmTransportConfig,
    TransportConfig,
    device_path_of,
)
from nonstop.config.policy import (
    EngineConfig,
    ModelConfig,
    TrainerConfig,
)
from nonstop.config.schema import Section as _Section
from nonstop.config.scoring import DistillConfig, ScoringConfig
from nonstop.config.task import TaskConfig, WarmupConfig
from nonstop.errors import NonstopError


class ConfigError(NonstopError, ValueError):
    """A configuration problem; the message names the offending field."""


class Config(_Section):
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    warmup: WarmupConfig = WarmupConfig()
    rollout: RolloutConfig = RolloutConfig()
    buffer: BufferConfig = BufferConfig()
    trainer: TrainerConfig = TrainerConfig()
    transport: TransportConfig = ShmTransportConfig()
    engine: EngineConfig = EngineConfig()
    runtime: RuntimeConfig = LocalRuntimeConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    run: RunConfig = RunConfig()
    tracking: tuple[Literal["tensorboard", "wandb", "trackio", "mlflow"], ...] = ()
    """Experiment trackers that receive every step's metrics besides metrics.jsonl, each an optional
    extra (pip install 'nonstop[tensorboard]' etc.); they write inside the run folder, wandb offline,
    unless their own environment variables say otherwise (docs/observability.md)."""
    scoring: ScoringConfig = ScoringConfig()
    distill: DistillConfig = DistillConfig()
    env: EnvConfig | None = None
    """An environment: episodes instead of single-turn prompts (None: single-turn prompts of the task)."""
    agents: AgentsConfig = AgentsConfig()
    doctor: DoctorConfig = DoctorConfig()
    """The run doctor: patterns that mean the run stopped learning, with their likely cause (docs/doctor.md)."""

    @property
    def engine_settings(self) -> EngineConfig:
        """The engine section as training engines get it: engine.max_lag None becomes buffer.max_lag."""
        if self.engine.max_lag is not None:
            return self.engine
        return self.engine.model_copy(update={"max_lag": self.buffer.max_lag})

    @property
    def engine_restarts(self) -> int:
        """runtime.max_engine_restarts resolved: None is 3 (every transport takes a restarted engine)."""
        return self.runtime.max_engine_restarts if self.runtime.max_engine_restarts is not None else 3

    @property
    def refill_ahead(self) -> bool:
        """rollout.refill_ahead resolved: None is on where a group admitted ahead and not needed
        still trains within max_lag (depth >= 1, max_lag > depth), and groups are refilled at all."""
        if self.rollout.refill_ahead is not None:
            return self.rollout.refill_ahead
        depth = self.buffer.depth
        return self.rollout.refill and depth is not None and depth >= 1 and self.buffer.max_lag > depth

    @property
    def forward_ahead(self) -> bool:
        """trainer.forward_ahead resolved: None is on with one trainer rank and buffer.depth != 0."""
        if self.trainer.forward_ahead is not None:
            return self.trainer.forward_ahead
        return self.trainer.ranks == 1 and self.buffer.depth != 0

    @property
    def warmup_time_limit_s(self) -> float | None:
        """warmup.max_time_s resolved: None is half of run.max_total_s (when set)."""
        if self.warmup.max_time_s is not None:
            return self.warmup.max_time_s
        return self.run.max_total_s / 2 if self.run.max_total_s is not None else None

    @property
    def max_engines(self) -> int:
        """runtime.max_engines resolved: the most engines a run has at once (runtime.num_engines
        unless a Ray run grows as nodes join)."""
        grow = self.runtime.max_engines if isinstance(self.runtime, RayRuntimeConfig) else None
        return grow if grow is not None else self.runtime.num_engines

    @property
    def warmup_enabled(self) -> bool:
        """warmup.enabled resolved: None is on for the built-in tiny model, off with model.path."""
        return self.warmup.enabled if self.warmup.enabled is not None else self.model.path is None

    @model_validator(mode="after")
    def _combinations(self) -> "Config":
        """Rules across sections; each message names the fields to change."""
        if (
            self.buffer.depth is not None
            and self.buffer.max_lag < self.buffer.depth
            and self.buffer.reject in ("group", "episode")
        ):
            raise ValueError(
                f"buffer.max_lag ({self.buffer.max_lag}) < buffer.depth ({self.buffer.depth}): "
                "most groups would be generated only to be dropped; raise max_lag or lower depth"
            )
        if self.rollout.refill_ahead and (
            self.buffer.depth is None or self.buffer.depth < 1 or not self.rollout.refill
        ):
            raise ValueError(
                f"rollout.refill_ahead: admitting replacements ahead needs rollout.refill and a bounded buffer.depth "
                f">= 1 (got refill={self.rollout.refill}, depth={self.buffer.depth}); at depth 0 a replacement "
                "not needed would train a step late; leave rollout.refill_ahead unset or set it to false"
            )
        if self.agents.enabled and self.agents.max_open_episodes < self.rollout.group_size:
            raise ValueError(
                f"agents.max_open_episodes ({self.agents.max_open_episodes}) < rollout.group_size "
                f"({self.rollout.group_size}): no group could ever complete"
            )
        if self.agents.enabled and self.env is not None and self.env.policies:
            raise ValueError("agents.enabled: agents train the shared policy; env.policies is not supported with it")
        if self.trainer.forward_ahead and self.trainer.ranks > 1:
            raise ValueError(
                f"trainer.forward_ahead needs one trainer rank (got trainer.ranks={self.trainer.ranks}): "
                "a rank's share of a batch is cut from the whole batch; leave it unset or false"
            )
        if self.trainer.ranks > 1 and self.model.lora.enabled:
            raise ValueError("trainer.ranks: data-parallel ranks with model.lora are not supported yet; use one rank")
        if self.trainer.ranks > self.rollout.prompts_per_step:
            raise ValueError(
                f"trainer.ranks ({self.trainer.ranks}) > rollout.prompts_per_step ({self.rollout.prompts_per_step}): "
                "every rank needs at least one group per step"
            )
        if self.warmup.enabled and self.model.path is not None:
            raise ValueError(
                "warmup.enabled: the warm-up trains the built-in tiny model; with model.path set the base policy is "
                "that model as it is: leave warmup.enabled unset or set it to false"
            )
        if self.engine.kind == "vllm":
            self._vllm_combinations()
        self._device_path_combinations()
        if self.rollout.seed_per_prompt and self.env is not None:
            raise ValueError(
                "rollout.seed_per_prompt: environment runs (env) are not seeded per prompt yet; "
                "set rollout.seed_per_prompt=false"
            )
        if self.env is not None and self.distill.teacher is not None:
            raise ValueError(
                "distill.teacher: a teacher scores samples in the scoring stage, which environment runs (env) do "
                "not run: no episode would ever be distilled; remove distill.teacher or env"
            )
        if self.env is not None and self.env.policies:
            self._policies_combinations()
        if isinstance(self.runtime, RayRuntimeConfig) and self.runtime.max_engines is not None:
            self._growth_combinations(self.runtime.max_engines)
        return self

    def _growth_combinations(self, max_engines: int) -> None:
        """Engines that join mid-run (runtime.max_engines) need a transport a newcomer can attach to."""
        if max_engines < self.runtime.num_engines:
            raise ValueError(
                f"runtime.max_engines ({max_engines}) < runtime.num_engines ({self.runtime.num_engines}): "
                "the run starts with num_engines and grows up to max_engines"
            )
        if max_engines > self.runtime.num_engines and self.transport.kind == "shm":
            raise ValueError(
                "runtime.max_engines: engines that join on new nodes cannot reach a shared-memory segment; "
                "use transport.kind 'broadcast' or 'files'"
            )

    def _policies_combinations(self) -> None:
        """What separate policies per role do not take (docs/environments.md says why)."""
        assert self.env is not None
        if self.env.name.startswith("verifiers/"):
            raise ValueError(
                "env.name: env.policies (separate policies per role) needs an environment with two or more "
                "roles; a verifiers taskset is played as one agent (role 'agent'), so it has no role to give "
                "a policy of its own; remove env.policies"
            )
        for role, own in self.env.policies.items():
            if own.lora and self.trainer.ranks > 1:
                raise ValueError(
                    f"env.policies.{role}.lora: data-parallel ranks (trainer.ranks={self.trainer.ranks}) with LoRA "
                    "are not supported yet, for an own policy as for the shared one; use one rank"
                )

    def _device_path_combinations(self) -> None:
        """A GPU-to-GPU weight path asked for by name needs both sides on a GPU and the built-in engine;
        a half-precision transport carries full weights to the built-in engine only."""
        wire = self.transport.dtype
        if wire not in ("auto", "float32") and (self.model.lora.enabled or self.engine.kind == "vllm"):
            lora = self.model.lora.enabled
            which = "model.lora (adapters train and travel in float32)" if lora else "engine.kind 'vllm'"
            raise ValueError(
                f"transport.dtype: '{wire}' carries full weights to the built-in engine; with {which} use 'auto' or "
                "'float32'"
            )
        path = device_path_of(self.transport)
        if path not in ("ipc", "nccl"):
            return
        for field, device in (("trainer.device", self.trainer.device), ("engine.device", self.engine.device)):
            if device == "cpu":
                raise ValueError(
                    f"transport.device_path: '{path}' moves weights GPU to GPU, but {field} is 'cpu'; "
                    f"use transport.device_path 'auto' or 'host', or put {field} on a GPU"
                )
        if self.engine.kind == "vllm":
            raise ValueError(
                f"transport.device_path: '{path}' is not available with engine.kind 'vllm' (it receives "
                f"into a host staging model and reloads from there); use 'auto' or 'host'"
            )

    def _vllm_combinations(self) -> None:
        if self.engine.update_mode == "save_resume":
            raise ValueError(
                "engine.update_mode: 'save_resume' is not possible with engine.kind 'vllm' (vLLM cannot hand out a "
                "sequence's KV cache to restore later); use never_stop (its pause 'keep'), abort_retry, "
                "drain or blocking"
            )
        if self.engine.group_cancel:
            raise ValueError("engine.group_cancel: not supported with engine.kind 'vllm'; set it to false")
        r = self.rollout
        if r.top_k > 0 or r.top_p < 1.0 or r.min_p > 0.0:
            raise ValueError(
                "rollout.top_k/top_p/min_p: truncated sampling is refused with engine.kind 'vllm': vLLM 0.32 does not "
                "return the kept token set (the Keep Sampling Mask) the trainer needs to renormalise its logprobs "
                "over; use rollout.top_k=0, top_p=1.0, min_p=0.0, or engine.kind 'builtin'"
            )

    @model_validator(mode="after")
    def _scoring_rules(self) -> "Config":
        """Per-token advantages (distillation, process rewards) against the rest of the config."""
        if self.distill.teacher is not None and not self.distill.task_reward and self.rollout.filter_uniform_reward:
            raise ValueError(
                "distill.task_reward: false trains on the teacher's signal alone, but rollout.filter_uniform_reward "
                "would drop every group whose task rewards are equal; set rollout.filter_uniform_reward=false"
            )
        per_token = self.distill.teacher is not None or self.scoring.process_reward is not None
        if per_token and self.trainer.loss == "gspo":
            raise ValueError(
                "trainer.loss: 'gspo' takes one advantage per sequence, but distill.teacher / scoring.process_reward "
                "give one per token; use another loss"
            )
        return self

    @model_validator(mode="after")
    def _base_choice(self) -> "Config":
        if self.model.base != "auto" and self.model.path is not None:
            raise ValueError(f"model.base: '{self.model.base}' applies to the tiny model only, but model.path is set")
        if self.model.base == "warmup" and self.warmup.enabled is False:
            raise ValueError("model.base: 'warmup' contradicts warmup.enabled=false")
        return self
