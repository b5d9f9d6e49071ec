"""A run's mode (run.py `RunMode`), chosen once where the run is built (build.py `build_mode`).

- the choice: the task's groups without `env`, an environment's episodes with it, and agents over
  the API around either with agents.enabled (evaluated as the mode they wrap);
- what a mode adds to a checkpoint's state.json: both entries earlier checkpoints held (`envs`,
  `policies`), null where the run has none, so a checkpoint reads the same whatever the mode;
- the core of a run (run.py, pipeline.py, learn.py, recovery.py) names no mode: none of the modes'
  classes or modules, and no attribute of one (read with `ast`, nothing imported).
The modes' behaviour in a run is covered where each mode runs: test_learn.py and test_checkpoint.py
(groups from a task), tests/envs (episodes), test_policies.py (own policies), test_api_agents.py.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from typing import Any

import pytest

from nonstop.config import Config, load_config
from nonstop.observe.spans import SpanLog
from nonstop.orchestrator.buffer import make_buffer
from nonstop.orchestrator.build import build_mode
from nonstop.orchestrator.ledger import Ledger
from nonstop.orchestrator.modes.api_agents.mode import AgentsMode
from nonstop.orchestrator.modes.environment.mode import EnvMode
from nonstop.orchestrator.modes.single_turn import TaskMode
from nonstop.orchestrator.progress import Progress
from nonstop.orchestrator.run import RunMode
from support.source import PACKAGE

CORE = ("run", "pipeline", "learn", "recovery")
MODE_NAMES = {
    # the modes and what they hold
    "TaskMode", "EnvMode", "OwnPoliciesMode", "AgentsMode", "EnvRun", "Policies", "PolicySide", "AgentEndpoint",
    # the attributes the core once branched on
    "envs", "policies", "agents",
}  # fmt: skip
MODE_MODULES = ("modes",)  # every mode and its building blocks live under orchestrator/modes/


def chosen(tmp_path: Path, overrides: list[str]) -> RunMode:
    """The mode build_mode chooses for a config (no actor starts: none of these modes has its own)."""
    cfg: Config = load_config(None, [f"run.out_dir={tmp_path}", *overrides])
    ledger = Ledger(())
    buffer = make_buffer(cfg, ledger, SpanLog(None))
    progress = Progress("off", cfg.run.max_steps)
    weights = Path("unused")  # only a verifiers taskset or an own policy reads it
    backend: Any = None  # only an own policy starts actors
    return asyncio.run(
        build_mode(cfg, backend, weights, weights, None, buffer, ledger, tmp_path, SpanLog(None), progress)
    )


def test_the_mode_is_chosen_from_the_config(tmp_path: Path) -> None:
    assert type(chosen(tmp_path, [])) is TaskMode
    env = chosen(tmp_path, ["env.name=guess_number"])
    assert type(env) is EnvMode and env.env.cfg.name == "guess_number"
    agents = chosen(tmp_path, ["agents.enabled=true"])
    assert isinstance(agents, AgentsMode) and type(agents.evaluated) is TaskMode
    around_env = chosen(tmp_path, ["agents.enabled=true", "env.name=guess_number"])
    assert isinstance(around_env, AgentsMode) and type(around_env.evaluated) is EnvMode


def test_every_mode_writes_both_state_entries_in_one_order(tmp_path: Path) -> None:
    assert list(TaskMode().state_dict().items()) == [("envs", None), ("policies", None)]
    env = chosen(tmp_path, ["env.name=guess_number"])
    state = env.state_dict()
    assert list(state) == ["envs", "policies"] and state["policies"] is None and state["envs"]["episodes"] == 0
    assert chosen(tmp_path, ["agents.enabled=true", "env.name=guess_number"]).state_dict() == state
    assert env.report().keys() == {"episodes"} and TaskMode().report() == {}


def mode_names_in(source: str) -> list[str]:
    """The names, attributes and imported modules of `source` that belong to a mode."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in MODE_NAMES:
            found.append(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in MODE_NAMES:
            found.append(f".{node.attr}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            if parts[:2] == ["nonstop", "orchestrator"] and len(parts) > 2 and parts[2] in MODE_MODULES:
                found.append(node.module)
    return found


@pytest.mark.parametrize("module", CORE)
def test_the_core_of_a_run_names_no_mode(module: str) -> None:
    source = (PACKAGE / "orchestrator" / f"{module}.py").read_text()
    assert not mode_names_in(source), f"orchestrator/{module}.py names {mode_names_in(source)}"


def test_the_naming_check_can_fail() -> None:
    source = (
        "from nonstop.orchestrator.modes.environment.episode_flow import EnvRun\n"
        "from nonstop.orchestrator.modes.environment.mode import X\n"
        "if run.policies is not None:\n    pass\n"
    )
    assert mode_names_in(source) == [
        "nonstop.orchestrator.modes.environment.episode_flow",
        "nonstop.orchestrator.modes.environment.mode",
        ".policies",
    ]
