"""Tracking sinks: each real tracker receives the step records and they read back from its own files."""

from __future__ import annotations

import importlib.util
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nonstop.config import ConfigError, load_config
from nonstop.observe.tracking import TrackingError, _need, open_sinks, scalars

RECORDS = [
    {
        "step": i,
        "reward_mean": 0.25 * i,
        "drops": {"max_lag": i},
        "lag_hist": {"0": 5, "1": i},
        "prompts": [[0, i]],
        "final_eval": False,
    }
    for i in (1, 2, 3)
]


def write_records(tmp_path: Path, tracker: str) -> Path:
    if importlib.util.find_spec(tracker) is None:  # not imported here: trackio reads TRACKIO_DIR on import
        pytest.skip(f"{tracker} is not installed (pip install 'nonstop[{tracker}]')")
    run = tmp_path / "run"
    run.mkdir()
    sink = open_sinks(load_config(overrides=[f"tracking=[{tracker}]"]), run)
    for r in RECORDS:
        sink.write(r)
    sink.close()
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    return run


def test_records_flatten_to_finite_scalars():
    assert scalars({"step": 2, "a": {"b": 1, "c": float("nan")}, "l": [1], "s": "x", "ok": True}) == {
        "step": 2.0,
        "a/b": 1.0,
        "ok": 1.0,
    }


def test_unknown_tracker_is_a_config_error_and_a_missing_package_names_the_extra():
    with pytest.raises(ConfigError, match="tracking"):
        load_config(overrides=["tracking=[tensorbored]"])
    with pytest.raises(TrackingError, match=r"pip install 'nonstop\[nosuch\]'"):
        _need("nonstop_no_such_module", "nosuch")


def test_tensorboard(tmp_path):
    run = write_records(tmp_path, "tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [e.value for e in acc.Scalars("drops/max_lag")] == [1.0, 2.0, 3.0]


def _wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B offline run file: a LevelDB-style log of 32 KiB blocks, each record a
    7-byte header (crc, little-endian length, type: 1 full, 2 first, 3 middle, 4 last) + data."""
    data = path.read_bytes()
    pos, buf, out = 7, b"", []  # after the file header ':W&B' + magic + version
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        kind = data[pos + 6]
        if room < 7 or kind == 0:  # the rest of the block is padding
            pos += room
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        if pos + 7 + length > len(data):  # a record still being written
            break
        buf += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(buf)
            buf = b""
    return out


def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    run = write_records(tmp_path, "wandb")
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + 60
    while True:  # wandb's service process may still be writing the file when finish() returned
        records, complete = [], True
        for raw in _wandb_records(path):
            rec = pb.Record()
            try:
                rec.ParseFromString(raw)
            except DecodeError:  # a block flushed in part; read again until the deadline
                if time.monotonic() > deadline:
                    raise
                complete = False
                break
            records.append(rec)
        if complete and any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        assert time.monotonic() < deadline, "wandb never wrote its exit record"
        time.sleep(0.5)
    history = [
        {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert all("step" not in h for h in history)
    assert [(h["_step"], h["reward_mean"], h["drops/max_lag"]) for h in history] == [
        (1, 0.25, 1),
        (2, 0.5, 2),
        (3, 0.75, 3),
    ]


TRACKIO_RUN = """
import os, sys, warnings
from pathlib import Path
if sys.argv[2] == "early":
    import trackio  # as TRL's import does, before the run sets TRACKIO_DIR
    del os.environ["TRACKIO_DIR"]
from nonstop.config import load_config
from nonstop.observe.tracking import open_sinks
run = Path(sys.argv[1])
run.mkdir()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    sink = open_sinks(load_config(overrides=["tracking=[trackio]"]), run)
    for step in (1, 2, 3):
        sink.write({"step": step, "reward_mean": 0.25 * step})
    sink.close()
print("WARNED:", *[str(w.message) for w in seen if "TRACKIO_DIR" in str(w.message)])
"""


def _trackio_run(tmp_path: Path, order: str) -> tuple[Path, str]:
    """A run with tracking=[trackio] in a fresh interpreter: trackio fixes its folder at first import."""
    if importlib.util.find_spec("trackio") is None:
        pytest.skip("trackio is not installed (pip install 'nonstop[trackio]')")
    env = {k: v for k, v in os.environ.items() if k != "TRACKIO_DIR"}
    if order == "early":
        env["TRACKIO_DIR"] = str(tmp_path / "early")
    run = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-c", TRACKIO_RUN, str(run), order], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return run, out.stdout.split("WARNED:", 1)[1].splitlines()[0].strip()


def _trackio_rewards(folder: Path) -> list[tuple[int, float]]:
    (db,) = folder.glob("*.db")
    rows = sqlite3.connect(db).execute("select step, metrics from metrics order by step").fetchall()
    return [(s, json.loads(m)["reward_mean"]) for s, m in rows]


def test_trackio_local(tmp_path):
    run, warned = _trackio_run(tmp_path, "fresh")
    assert _trackio_rewards(run / "trackio") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert warned == ""


def test_trackio_imported_before_the_run_is_named_where_it_really_logs(tmp_path):
    run, warned = _trackio_run(tmp_path, "early")
    assert _trackio_rewards(tmp_path / "early") == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert not (run / "trackio").exists()
    assert str(tmp_path / "early") in warned and "before" in warned, warned


def test_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = write_records(tmp_path, "mlflow")
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient((run / "mlruns").resolve().as_uri())
    (r,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(m.step, m.value) for m in client.get_metric_history(r.info.run_id, "reward_mean")] == [
        (1, 0.25),
        (2, 0.5),
        (3, 0.75),
    ]
    assert r.data.params["rollout/group_size"] == "8"
