"""Configuration: pydantic models of a run, validated on load and frozen afterwards.

One module per part of the tree; everything public is re-exported here, so callers write
`from nonstop.config import Config, load_config`. What follows from the tree for a given model and
machine (the memory model) is nonstop/sizing/.

| module | holds |
|---|---|
| `root.py` | `Config` (the whole tree and its rules across sections), `ConfigError` |
| `loading.py` | `load_config` (YAML and `--set` overrides into a `Config`), `dump_config`, `config_reference` |
| `flow.py` | the run's own sections, those no actor owns: rollout, buffer, env, agents, checkpoint, run, doctor |
| `policy.py` | a policy's sections: model (with LoRA), engine (built-in and vLLM), trainer; a role's own policy |
| `kinds.py` | one model per transport kind and per runtime backend |
| `cpus.py` | `CpuPools`: the local runtime's disjoint CPU sets per role (`runtime.pin_cpus`) |
| `scoring.py` | the scoring stage: reward models, judges, process rewards, distillation |
| `task.py` | the task (dataset, reward) and the supervised warm-up |
| `schema.py` | `Section` (the frozen base model), field docs, `nonstop config --explain` |
| `preflight.py` | checks before any run folder or actor exists (`model.path`, `task.reward`) |
| `specs.py` | `package.module:attr` specs resolved to callables, errors naming the field |
| `trl.py`, `trl_fields.py` | `from_trl`: TRL's GRPOConfig as a `Config`, and the table of its fields |
"""

from __future__ import annotations

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
    BaseRuntimeConfig,
    BaseTransportConfig,
    BroadcastTransportConfig,
    FilesTransportConfig,
    LocalRuntimeConfig,
    NodeLossConfig,
    RayActorResources,
    RayRuntimeConfig,
    RuntimeConfig,
    ShmTransportConfig,
    TransportConfig,
)
from nonstop.config.loading import config_reference, dump_config, format_validation_error, load_config
from nonstop.config.policy import (
    EngineConfig,
    LoraConfig,
    ModelConfig,
    PolicyConfig,
    TinyModelConfig,
    TinyMoeConfig,
    TrainerConfig,
    VllmConfig,
)
from nonstop.config.root import Config, ConfigError
from nonstop.config.scoring import DistillConfig, JudgeConfig, ProcessRewardConfig, RewardModelConfig, ScoringConfig
from nonstop.config.task import TaskConfig, WarmupConfig

__all__ = [
    "BaseRuntimeConfig",
    "BaseTransportConfig",
    "BroadcastTransportConfig",
    "BufferConfig",
    "CheckpointConfig",
    "AgentsConfig",
    "Config",
    "config_reference",
    "ConfigError",
    "DistillConfig",
    "DoctorConfig",
    "dump_config",
    "EngineConfig",
    "EnvConfig",
    "FilesTransportConfig",
    "format_validation_error",
    "JudgeConfig",
    "load_config",
    "LocalRuntimeConfig",
    "LoraConfig",
    "ModelConfig",
    "PolicyConfig",
    "ProcessRewardConfig",
    "NodeLossConfig",
    "RayActorResources",
    "RayRuntimeConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "RuntimeConfig",
    "ScoringConfig",
    "ShmTransportConfig",
    "TaskConfig",
    "TinyModelConfig",
    "TinyMoeConfig",
    "TrainerConfig",
    "TransportConfig",
    "VllmConfig",
    "WarmupConfig",
]
