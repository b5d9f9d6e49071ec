"""Reward functions that inject a fault from inside the orchestrator, where rewards run: they kill or
stop an engine or a trainer, press Ctrl-C, or tell a multi-node harness when to act, once per
working folder (a marker file survives a resumed run). Named in configs as
`support.fault_rewards:kill_engine_once_reward`."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _once(marker: str) -> bool:
    """True the first time in this working directory (a marker file survives a resumed run)."""
    path = Path(marker)
    if path.exists():
        return False
    path.write_text("")
    return True


def _engine_pids() -> list[int]:
    import multiprocessing as mp

    return [c.pid for c in mp.active_children() if c.name == "nonstop-engine"]


_calls = {"n": 0}


def kill_engine_reward(completion: str, answer: str) -> float:
    """A reward function that SIGKILLs the engine actor the first time it runs (fault injection)."""
    import multiprocessing as mp
    import signal

    for child in mp.active_children():
        if child.name == "nonstop-engine":
            os.kill(child.pid, signal.SIGKILL)
    return 0.0


def kill_engine_once_reward(completion: str, answer: str) -> float:
    """SIGKILLs the engine once, 50 ms later, so the kill lands while it generates the next batch."""
    import signal
    import threading

    from support.faults import send

    if _once("engine_killed"):
        threading.Timer(0.05, lambda: [send("nonstop-engine", p, signal.SIGKILL) for p in _engine_pids()]).start()
    return float(len(completion))


def hang_engine_once_reward(completion: str, answer: str) -> float:
    """SIGSTOPs the engine once: it stays alive but answers nothing (a hang, not a crash)."""
    import signal

    from support.faults import send

    if _once("engine_hung"):
        for pid in _engine_pids():
            send("nonstop-engine", pid, signal.SIGSTOP)
    return float(len(completion))


def kill_trainer_reward(completion: str, answer: str) -> float:
    """SIGKILLs the trainer (rank 0 of several) at the 300th scored sample of the first run in this folder."""
    import multiprocessing as mp
    import signal

    from support.faults import send

    _calls["n"] += 1
    if _calls["n"] == 300 and _once("trainer_killed"):
        for c in mp.active_children():
            if c.name in ("nonstop-trainer", "nonstop-trainer-0"):
                send(c.name, c.pid, signal.SIGKILL)
    return float(len(completion))


def kill_trainer_after_two_checkpoints_reward(completion: str, answer: str) -> float:
    """SIGKILLs the trainer once the first run in this folder has two checkpoints (`runs/*/checkpoints`).

    A corrupted newest checkpoint must leave an older one to fall back to; killing at a fixed sample
    count does not promise that on a loaded machine, where the trainer lags the engines.
    """
    import multiprocessing as mp
    import signal

    from support.faults import send

    _calls["n"] += 1
    if _calls["n"] % 8 == 0 and len(list(Path("runs").glob("*/checkpoints/step_*"))) >= 2 and _once("trainer_killed"):
        for c in mp.active_children():
            if c.name in ("nonstop-trainer", "nonstop-trainer-0"):
                send(c.name, c.pid, signal.SIGKILL)
    return float(len(completion))


def overflow_reward(completion: str, answer: str) -> float:
    """Finite rewards whose group statistics overflow (inf - inf): a NaN loss from bad input."""
    if answer == "9":
        if _once("overflowed"):
            from support.faults import record

            record("overflow", target="reward")
        return 1e308 if len(completion) % 2 else -1e308
    return float(len(completion))


def kill_engine_0_once_reward(completion: str, answer: str) -> float:
    """With several engines, SIGKILLs engine-0 once, 50 ms later; the others go on serving."""
    import multiprocessing as mp
    import signal
    import threading

    from support.faults import send

    if _once("engine_0_killed"):
        pids = [c.pid for c in mp.active_children() if c.name == "nonstop-engine-0"]
        threading.Timer(0.05, lambda: [send("nonstop-engine-0", p, signal.SIGKILL) for p in pids]).start()
    return float(len(completion))


def interrupt_once_reward(completion: str, answer: str) -> float:
    """Presses Ctrl-C (SIGINT to the orchestrator, where rewards run) at the 300th scored sample
    of the first run in this folder: the run checkpoints and stops; a resume finishes it."""
    import signal

    from support.faults import send

    _calls["n"] += 1
    if _calls["n"] == 300 and _once("interrupted"):
        send("orchestrator", os.getpid(), signal.SIGINT)
    return float(len(completion))


_soak = {"last_kill": None, "next": 0}


def kill_an_engine_every_reward(completion: str, answer: str) -> float:
    """Soak test: SIGKILLs one engine (in turn) every NONSTOP_SOAK_KILL_EVERY_S seconds."""
    import multiprocessing as mp
    import signal
    import time

    now = time.monotonic()
    every_s = float(os.environ.get("NONSTOP_SOAK_KILL_EVERY_S", "60"))
    if _soak["last_kill"] is None:
        _soak["last_kill"] = now
    elif now - _soak["last_kill"] >= every_s:
        _soak["last_kill"] = now
        engines = sorted((c for c in mp.active_children() if c.name.startswith("nonstop-engine")), key=lambda c: c.name)
        if engines:
            from support.faults import send

            victim = engines[_soak["next"] % len(engines)]
            _soak["next"] += 1
            send(victim.name, victim.pid, signal.SIGKILL)
    return float(len(completion))


def cluster_event_reward(completion: str, answer: str) -> float:
    """For the multi-node tests (support/cluster.py): NONSTOP_TEST_EVENTS lists 'name@n,...'; when the
    run has scored its n-th sample, `name` is written to the FIFO at NONSTOP_TEST_FIFO, once per
    working directory (a resumed run does not repeat it). The harness then acts (removes a node, ...).
    'name@n!' also holds the scoring until the harness has acted (EventPipe touches FIFO.name.done),
    so the run cannot finish its last prompts before the fault lands."""
    _calls["events"] = _calls.get("events", 0) + 1
    for event in filter(None, os.environ.get("NONSTOP_TEST_EVENTS", "").split(",")):
        name, at = event.split("@")
        if _calls["events"] == int(at.rstrip("!")) and _once(f"event_{name}"):
            fifo = os.environ["NONSTOP_TEST_FIFO"]
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, f"{name}\n".encode())
            finally:
                os.close(fd)
            if at.endswith("!"):
                done, deadline = Path(f"{fifo}.{name}.done"), time.monotonic() + 120
                while not done.exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
    return float(len(completion))
