"""Soak: training for a bounded time with an engine killed every few minutes, beside a server
under concurrent load. Reports prompts lost and duplicated (must be 0), restarts, server errors
and the orchestrator's memory growth.

    NONSTOP_SOAK_S=1200 NONSTOP_SOAK_KILL_EVERY_S=180 pytest -m slow tests/faults/test_soak.py -s

Defaults (240 s, a kill every 60 s) keep it to about 5 minutes; at most 20 minutes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from nonstop.serve.client import HttpClient
from nonstop.types import SamplingParams
from support import child_env
from support.cli import NONSTOP, small_model_args

SOAK_S = min(float(os.environ.get("NONSTOP_SOAK_S", "240")), 1200.0)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _load_server(url: str, stop: threading.Event, counts: dict) -> None:
    async def client_loop(client: HttpClient, i: int) -> None:
        while not stop.is_set():
            try:
                samples = await client.complete([5 + i % 20, 6, 7], SamplingParams(8, 1.0, seed=i), n=2)
                counts["ok"] += len(samples) == 2
            except Exception as e:  # counted: the server must not fail
                counts["errors"] += 1
                counts["last_error"] = repr(e)

    async def main() -> None:
        client = HttpClient(url, max_connections=16)
        try:
            await asyncio.gather(*(client_loop(client, i) for i in range(16)))
        finally:
            await client.close()

    asyncio.run(main())


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_S) + 1500)  # start-up and the base evaluation on a loaded machine come on top
def test_soak_engine_kills_and_a_loaded_server(tiny_dir, tmp_path):
    env = child_env(PYTHONUNBUFFERED="1")
    serve = subprocess.Popen(
        [sys.executable, "-m", "nonstop.cli", "serve", "--model", str(tiny_dir), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    train = None
    stop, counts = threading.Event(), {"ok": 0, "errors": 0, "last_error": None}
    try:
        line = ""
        for line in serve.stdout:
            if "serving" in line:
                break
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        load = threading.Thread(target=_load_server, args=(url, stop, counts), name="soak-load", daemon=True)
        load.start()
        train = subprocess.Popen(
            [
                NONSTOP,
                "train",
                *small_model_args(tiny_dir),
                "--set",
                "run.name=soak",
                "--set",
                "run.max_steps=1000000",
                "--set",
                f"run.max_time_s={SOAK_S}",
                "--set",
                "task.eval_size=20",
                "--set",
                "runtime.num_engines=2",
                "--set",
                "runtime.max_engine_restarts=1000",
                "--set",
                "rollout.filter_uniform_reward=false",
                "--set",
                "task.reward=support.helpers:kill_an_engine_every_reward",
                "--set",
                "run.eval_every=1000000",
            ],
            cwd=tmp_path,
            env=env,
            stdout=(tmp_path / "train.log").open("w"),
            stderr=subprocess.STDOUT,
            text=True,
        )
        rss = []
        deadline = time.monotonic() + SOAK_S + 600
        while train.poll() is None and time.monotonic() < deadline:
            try:
                rss.append(_rss_mib(train.pid))
            except OSError:
                break
            time.sleep(5)
        train.wait(timeout=120)
        out = (tmp_path / "train.log").read_text()
    finally:
        stop.set()
        for p in (train, serve):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(timeout=60)
    summary = json.loads((tmp_path / "runs" / "soak" / "summary.json").read_text())
    ledger, faults = summary["prompts"], summary["engine_faults"]
    settled_rss = rss[len(rss) // 4 :] or rss  # after start-up
    growth = (max(settled_rss) - settled_rss[0]) / settled_rss[0]
    print(
        f"\nsoak {SOAK_S:.0f} s: steps {summary['steps']}, prompts settled {ledger['settled']}, in flight "
        f"{ledger['in_flight']}, duplicated {ledger['duplicated']}, re-queued {faults['requeued']}, engine restarts "
        f"{faults['restarts']}, server requests ok {counts['ok']} errors {counts['errors']}, orchestrator RSS "
        f"{settled_rss[0]:.0f} -> {max(settled_rss):.0f} MiB ({growth:+.0%})"
    )
    assert train.returncode == 0, out[-3000:]
    assert ledger["duplicated"] == 0 and ledger["unknown"] == 0, ledger
    # a run stopped by run.max_time_s leaves its admitted, untrained batches in flight (recorded,
    # not lost: a resume generates them again); admission bounds them by (depth + 1) batches
    cfg = yaml.safe_load((tmp_path / "runs" / "soak" / "config.yaml").read_text())
    window = ((cfg["buffer"].get("depth") or 0) + 1) * cfg["rollout"]["prompts_per_step"]
    assert ledger["in_flight"] <= window, (ledger, window)
    assert faults["restarts"] >= int(SOAK_S // float(os.environ.get("NONSTOP_SOAK_KILL_EVERY_S", "60"))) - 1, faults
    assert counts["errors"] == 0 and counts["ok"] > 0, counts
    assert growth < 0.5, rss
