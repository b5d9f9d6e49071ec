"""nonstop: asynchronous RL post-training of LLMs.

Generation (engines) and learning (trainer) run in separate processes joined by a bounded
rollout buffer; new weights reach the engines through a weight transport without stopping
them; every generated token carries the policy_version that produced it.

Python API (docs/python_api.md): `nonstop.train(config, dataset=..., reward=...)` returns a
`RunSummary`; `Config` and `load_config` build configs, and `from_trl(grpo_config)` builds one
from TRL's GRPOConfig (docs/from_trl.md). They are imported on first use, so `import nonstop`
stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nonstop.api import train
    from nonstop.config import Config, load_config
    from nonstop.config.trl import from_trl
    from nonstop.orchestrator.records import RunSummary

__version__ = "0.1.0"
__all__ = ["Config", "RunSummary", "from_trl", "load_config", "train"]

_EXPORTS = {
    "train": "nonstop.api",
    "Config": "nonstop.config",
    "load_config": "nonstop.config",
    "RunSummary": "nonstop.orchestrator.records",
    "from_trl": "nonstop.config.trl",
}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nonstop' has no attribute {name!r}")
