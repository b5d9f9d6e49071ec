"""Tracking sinks: the per-step metrics of metrics.jsonl, also sent to TensorBoard, W&B, trackio, MLflow.

`open_sinks(cfg, run_dir)` returns a `MetricsSink` that writes every step record to
`metrics.jsonl` and to each tracker named in `cfg.tracking`; each tracker receives the same
record, flattened to scalars (`scalars`: nested dicts become `drops/max_lag`,
`lag_hist/1`; lists and strings are left out), at the record's step. Every tracker writes
inside the run folder unless its own environment variable points elsewhere:

| tracker | package (extra) | where it writes |
|---|---|---|
| tensorboard | tensorboard (`tensorboard`) | `RUN_DIR/tensorboard/` event files |
| wandb | wandb (`wandb`) | `RUN_DIR/wandb/`, offline unless `WANDB_MODE` says otherwise |
| trackio | trackio (`trackio`) | `RUN_DIR/trackio/` (its local database) unless `TRACKIO_DIR` is set |
| mlflow | mlflow-skinny or mlflow (`mlflow`) | `RUN_DIR/mlruns` file store unless `MLFLOW_TRACKING_URI` is set |

A tracker that cannot be imported fails the run at start with the pip command that adds it.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nonstop.errors import ObserveError

if TYPE_CHECKING:
    from nonstop.config import Config

PROJECT = "nonstop"


class TrackingError(ObserveError, RuntimeError):
    """A tracker named in `tracking` is not installed (the message names the extra)."""


class MetricsSink(Protocol):
    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The finite numbers of a record, nested dicts flattened with '/'."""
    out: dict[str, float] = {}
    for k, v in record.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(scalars(v, key + "/"))
        elif isinstance(v, (bool, int, float)) and math.isfinite(float(v)):
            out[key] = float(v)
    return out


def _need(module: str, extra: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackingError(f"tracking: '{extra}' needs the {module} package: pip install 'nonstop[{extra}]'") from None


class TensorBoardTracker:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # optional: the tensorboard extra, found above

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class _RunTracker:
    """A tracker whose run object logs a step's values and finishes (wandb and trackio share this API)."""

    run: Any

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class WandbTracker(_RunTracker):
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            os.environ.setdefault(var, str(run_dir / "wandb" / "home"))  # not the user's ~/.cache
        wandb = _need("wandb", "wandb")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=name,
            dir=str(run_dir),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="create_new",
        )


class TrackioTracker(_RunTracker):
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        wanted = Path(os.environ.setdefault("TRACKIO_DIR", str(run_dir / "trackio")))
        # trackio reads TRACKIO_DIR once, when it is first imported (TRL imports it), so a process
        # that imported it earlier keeps that folder: say where the database really goes
        self.trackio = _need("trackio", "trackio")
        self.dir = Path(importlib.import_module("trackio.utils").TRACKIO_DIR)
        if self.dir.resolve() != wanted.resolve():
            warnings.warn(
                f"tracking: trackio was imported before this run set TRACKIO_DIR={wanted}, so it "
                f"logs to {self.dir}; set TRACKIO_DIR before anything imports trackio (TRL does)",
                stacklevel=2,
            )
        self.run = self.trackio.init(project=PROJECT, name=name, config=config)


class MlflowTracker:
    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        self.mlflow = _need("mlflow", "mlflow")
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # a file store needs no database packages; MLflow 3 keeps it behind this opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            self.mlflow.set_tracking_uri((run_dir / "mlruns").resolve().as_uri())
        self.mlflow.set_experiment(PROJECT)
        self.run = self.mlflow.start_run(run_name=name)
        self.mlflow.log_params(_leaves(config))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _leaves(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Every leaf of a nested config as text, keyed by its path ('rollout/group_size': '8')."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}/"))
        else:
            out[f"{prefix}{k}"] = str(v)[:250]
    return out


TRACKERS = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "trackio": TrackioTracker,
    "mlflow": MlflowTracker,
}


class FanOut:
    """metrics.jsonl plus every tracker; a step record goes to all of them."""

    def __init__(self, jsonl: JsonlSink, trackers: list[Any]) -> None:
        self.jsonl, self.trackers = jsonl, trackers

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(record)
        if self.trackers:
            values = scalars(record)
            values.pop("step", None)  # given as each tracker's step instead
            for t in self.trackers:
                t.log(int(record["step"]), values)

    def close(self) -> None:
        self.jsonl.close()
        for t in self.trackers:
            t.close()


def open_sinks(cfg: Config, run_dir: Path) -> FanOut:
    trackers: list[Any] = []
    config = cfg.model_dump(mode="json")
    try:
        for name in cfg.tracking:
            trackers.append(TRACKERS[name](run_dir, run_dir.name, config))
    except BaseException:
        for t in trackers:
            t.close()
        raise
    return FanOut(JsonlSink(run_dir / "metrics.jsonl"), trackers)


class JsonlSink:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = path.open("a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()
