"""Code that test child processes import (spawned processes need importable targets)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch


class Echo:
    """A small actor for runtime tests."""

    def __init__(self, base: int = 0, fail_init: bool = False) -> None:
        if fail_init:
            raise ValueError("refusing to start")
        self.base = base

    def add(self, x: int, y: int = 0) -> int:
        return self.base + x + y

    def threads(self) -> int:
        return torch.get_num_threads()

    def fail(self) -> None:
        raise KeyError("no such thing")

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def crash(self) -> None:
        os._exit(3)

    async def wait_for(self, key: str) -> str:
        """Returns only after `release(key)`: proves async calls are served concurrently."""
        import asyncio

        events = self.__dict__.setdefault("_events", {})
        await events.setdefault(key, asyncio.Event()).wait()
        return key

    async def echo(self, payload: bytes) -> bytes:
        """Answers with its argument: many large calls fill both directions of the pipe at once."""
        return payload

    async def release(self, key: str) -> None:
        import asyncio

        self.__dict__.setdefault("_events", {}).setdefault(key, asyncio.Event()).set()


def perturbed_model(model_dir, seed: int):
    """The model at `model_dir` with N(0, 1) noise from `seed` added to every weight: weights an
    update can be told apart by."""
    from nonstop.hf import load_model

    model = load_model(str(model_dir))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g))
    return model


def receive_weights(handle, model_dir: str, rank: int, want_version: int, out_queue, deadline_s: float = 60.0) -> None:
    """Engine-side process: attach to the transport, wait for `want_version`, send the weights back."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_source

    model = load_model(model_dir)
    source = open_source(handle, model, rank)
    out_queue.put(("attached", None))
    end = time.monotonic() + deadline_s
    seen = []
    while time.monotonic() < end:
        v = source.maybe_update(model)
        if v is not None:
            seen.append(v)
            if v >= want_version:
                # numpy pickles by value; a torch tensor would travel as a shared fd that dies with us
                out_queue.put(("weights", (seen, {k: t.numpy().copy() for k, t in model.state_dict().items()})))
                source.close()
                return
        time.sleep(0.005)
    out_queue.put(("timeout", seen))


def receive_weights_in(
    handle, model_dir: str, dtype: str, rank: int, want_version: int, out_queue, deadline_s: float = 60.0
) -> None:
    """Engine-side process holding its model in `dtype` (a bf16 engine): attach, wait for
    `want_version`, send back the weights as float32 (exact for bf16) and their CRC32 in the
    transport's layout."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_source
    from nonstop.transport.base import source_crc32

    model = load_model(model_dir, getattr(torch, dtype))
    source = open_source(handle, model, rank)
    out_queue.put(("attached", None))
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = source.maybe_update(model)
        if v is not None and v >= want_version:
            state = {k: t.float().numpy().copy() for k, t in model.state_dict().items()}
            out_queue.put(("weights", (v, source_crc32(source), state)))
            source.close()
            return
        time.sleep(0.005)
    out_queue.put(("timeout", None))


def connect_then_hang(handle, model_dir: str, rank: int, out_queue) -> None:
    """Engine-side process that joins the broadcast group and then stops participating."""
    torch.set_num_threads(1)
    from nonstop.hf import load_model
    from nonstop.transport import open_source

    source = open_source(handle, load_model(model_dir), rank)
    source.close()  # the receiver thread stops: the peer process is alive but silent
    out_queue.put(("attached", None))
    time.sleep(120)


def kill_engine_reward(completion: str, answer: str) -> float:
    """A reward function that SIGKILLs the engine actor the first time it runs (fault injection)."""
    import multiprocessing as mp
    import signal

    for child in mp.active_children():
        if child.name == "nonstop-engine":
            os.kill(child.pid, signal.SIGKILL)
    return 0.0


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


def raising_reward(completion: str, answer: str) -> float:
    """Raises for answers divisible by 3 (about a third of the prompts); completion length otherwise."""
    if int(answer) % 3 == 0:
        raise RuntimeError("reward server unavailable")
    return float(len(completion))


def zero_reward(completion: str, answer: str) -> float:
    """The same reward for every completion: no group ever has a learning signal."""
    return 0.0


def ones_reward(completion: str, answer: str) -> float:
    """Counts the '1' characters: rare under a random tiny model, quickly learnt by RL."""
    return float(completion.count("1"))


def always_raising_reward(completion: str, answer: str) -> float:
    raise RuntimeError("reward server is down")


def length_reward(completion: str, answer: str) -> float:
    """Rewards longer completions: varies even for a random model, so advantages are non-zero."""
    return float(len(completion))


class DataParallelRank:
    """One data-parallel trainer rank for tests: a fresh ParallelTrainer per config, one step."""

    def __init__(self, model_dir: str, pad_token_id: int) -> None:
        self.model_dir, self.pad_token_id = model_dir, pad_token_id

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        from nonstop.trainer.parallel import join_group

        join_group(host, port, rank, world, timeout_s=120)

    def step(self, cfg, groups, temperature: float, max_new_tokens: int | None = None) -> dict:
        """Train one step; every rank returns the full parameters (numpy) and the metrics."""
        from nonstop.hf import load_model
        from nonstop.trainer.parallel import ParallelTrainer

        trainer = ParallelTrainer(
            load_model(self.model_dir),
            cfg,
            temperature,
            self.pad_token_id,
            mode=cfg.data_parallel,
            max_new_tokens=max_new_tokens,
        )
        metrics = trainer.step(groups)
        params = {n: t.detach().numpy().copy() for n, t in trainer.publishable().named_parameters()}
        return {"params": params, "metrics": metrics, "version": trainer.policy_version}


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


class TrainerRankHost:
    """One trainer rank process for tests that run several trainers one after the other in the
    same processes: it builds a real TrainerWorker, joins its process group, and forwards calls."""

    def __init__(self) -> None:
        self.worker = None

    def make(self, model_path: str, cfg, pad_token_id: int, host: str, port: int, rank: int, world: int) -> None:
        from nonstop.trainer.worker import TrainerWorker

        self.worker = TrainerWorker(model_path, cfg, 1.0, pad_token_id, seed=0, total_steps=10)
        self.worker.join_group(host, port, rank, world, timeout_s=120)

    def call(self, method: str, *args):
        return getattr(self.worker, method)(*args)

    def optimizer_state(self) -> dict:
        """This rank's AdamW moments as numpy (its shard, with FSDP2), by parameter name."""
        t = self.worker.trainer
        names = {id(p): n for n, p in t.model.named_parameters()}
        out = {}
        for p, st in t.optimizer.state.items():
            for k in ("exp_avg", "exp_avg_sq"):
                v = st[k]
                v = v.to_local() if hasattr(v, "to_local") else v
                out[f"{names[id(p)]}.{k}"] = v.detach().numpy().copy()
            out[f"{names[id(p)]}.step"] = float(st["step"])
        return out

    def close(self) -> None:
        self.worker.close()
        self.worker = None


def two_step_timeline(engine_cpu_s: float):
    """A synthetic span log for calibration tests: 8 groups 0.1 s apart, each generated by one
    engine chunk of 3 passes (16 ms of wall time, `engine_cpu_s` of processor time), then two
    trainer steps of 0.1 s at full speed (0.1 s processor time each), each followed by a publish."""
    from collections import Counter

    from nonstop.observe.timeline import GroupLife, Timeline

    groups = [
        GroupLife((0, i), 0.1 * i, 0.1 * i + 0.001, 0.1 * i + 0.02, 0.1 * i + 0.025, [3] * 8, (0, 0)) for i in range(8)
    ]
    orch = [dict(ev="rl_start", t=0.0, resumed=False, cpus=2, cpu_actors=True)]
    orch += [
        dict(
            ev="group",
            id=[0, g.id[1]],
            t_admit=g.t_admit,
            t_gen0=g.t_gen0,
            t_gen1=g.t_gen1,
            t_done=g.t_done,
            lens=g.lens,
            v=[0, 0],
        )
        for g in groups
    ]
    engine = [
        dict(ev="busy", t0=0.1 * i + 0.002, t1=0.1 * i + 0.018, passes=3, rows=24, busy_s=0.015, cpu_s=engine_cpu_s)
        for i in range(8)
    ]
    trainer = [
        dict(
            ev="step",
            t0=0.8 + 0.2 * k,
            t1=0.9 + 0.2 * k,
            version=k + 1,
            tokens=96,
            samples=32,
            update_s=0.01,
            cpu_s=0.1,
        )
        for k in range(2)
    ]
    trainer += [dict(ev="publish", t0=0.9 + 0.2 * k, t1=0.91 + 0.2 * k, version=k + 1, bytes=1) for k in range(2)]
    events = {"orchestrator": orch, "engine-0": engine, "trainer-0": trainer}
    lanes: dict[str, dict[str, list[tuple[float, float]]]] = {a: {} for a in events}
    for a, evs in events.items():
        for e in evs:
            if "t0" in e and e["ev"] != "group":
                lanes[a].setdefault(e["ev"], []).append((e["t0"], e["t1"]))
    return Timeline(Path("."), lanes, events, groups, Counter(), {})


def three_chars_reward(completion: str, answer: str) -> float:
    """1.0 for a completion of three characters, right or wrong: pays for a length the held-out exact
    match does not count (the run doctor's reward-without-held-out pattern). The shipped addition
    base writes three characters for about half the prompts (the sums over 99), so RL has signal."""
    return 1.0 if len(completion.strip()) == 3 else 0.0


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
