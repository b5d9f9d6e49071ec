"""A Ray cluster of several nodes on this host, for the multi-node tests and bench/cluster.py.

`LoopbackCluster(root)` starts nodes with `ray.cluster_utils.Cluster`, one raylet per node, each
on its own loopback address: the head on 127.0.0.2, the others on 127.0.0.3, 127.0.0.4, ...
(127.0.0.1 is left out: Ray rewrites a bootstrap address of 127.0.0.1 into the machine's own
non-loopback address, and nothing here may talk to that). Ray's temp folder (and RAY_TMPDIR, where
Ray writes the address of the newest cluster) is inside `root`. The cluster uses token
authentication like a user's (docs/scaleout.md), and its head checks node health every 0.5 s,
so a node that dies is declared dead within about 1.5 s (Ray's default takes 15 s and more).

`nonstop_train(...)` runs the real CLI against the cluster through `runtime.ray_address`, as a
user would. `EventPipe` is the FIFO through which the run's reward function
(`support.fault_rewards:cluster_event_reward`) tells the harness that the moment for an event came
(remove a node, add one, kill the trainer); support/loopback.py watches that nothing leaves
loopback.

`run_scenario(...)` puts them together for one scenario of bench/cluster.py and bench/faults.py:
a fresh cluster, one run of one epoch with events at chosen samples (`remove_engine_node`,
`add_node`, `kill_trainer`, `stall_engine`), a resume if the run stopped, and what happened.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from support import child_env
from support.cli import NONSTOP, sets, small_model_args
from support.faults import DEAD, STOPPED, await_state
from support.loopback import LoopbackAudit, own_addresses, ray_logs_mention

HEAD_IP = "127.0.0.2"
# Ray's health check of the nodes, tightened for tests (names of Ray's own config entries)
FAST_HEALTH_CHECK = {
    "health_check_period_ms": 500,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
    "enable_worker_prestart": False,  # no idle workers waiting on every node: less memory
}


_ROOTS: list[Path] = []


def temp_root() -> Path:
    """A new temp folder for one cluster, short (Ray's socket paths are limited), removed at exit
    too: a later cluster in the same process can bring back the previous one's empty session folder."""
    root = Path(tempfile.mkdtemp(prefix="nsc-", dir="/tmp"))
    _ROOTS.append(root)
    return root


@atexit.register
def _remove_roots() -> None:
    for root in _ROOTS:
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class Node:
    ip: str
    resources: dict[str, float]
    handle: object  # ray._private.node.Node


class LoopbackCluster:
    def __init__(
        self, root: Path, head_resources: dict[str, float], head_cpus: int = 1, health_check: dict | None = None
    ) -> None:
        self.root = root
        (root / "ray").mkdir(parents=True, exist_ok=True)
        self.env = {
            "RAY_TMPDIR": str(root),
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
        }
        os.environ.update(self.env)  # the node processes inherit them
        from nonstop.runtime.ray import _reload_auth_settings

        _reload_auth_settings()  # Ray may have read the auth settings before they were set
        from ray.cluster_utils import Cluster

        from nonstop.runtime.ray import cloud_probe_refused

        # the head's dashboard asks cloud metadata endpoints which cloud it runs on: refused (runtime/ray.py)
        with cloud_probe_refused():
            self.cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "node_ip_address": HEAD_IP,
                    "num_cpus": head_cpus,
                    "resources": head_resources,
                    "temp_dir": str(root),
                    "include_dashboard": False,
                    "_system_config": {**FAST_HEALTH_CHECK, **(health_check or {})},
                },
            )
        self.address = self.cluster.address
        self.nodes: dict[str, Node] = {HEAD_IP: Node(HEAD_IP, head_resources, self.cluster.head_node)}
        self.last_octet = 2

    def add_node(self, resources: dict[str, float], cpus: int = 1) -> Node:
        """A new worker node on the next loopback address; returns once it is alive."""
        self.last_octet += 1
        ip = f"127.0.0.{self.last_octet}"
        handle = self.cluster.add_node(node_ip_address=ip, num_cpus=cpus, resources=resources)
        self.nodes[ip] = Node(ip, resources, handle)
        return self.nodes[ip]

    def remove_node(self, ip: str) -> float:
        """SIGKILL every process of the node (a crash, not a drain); returns the wall-clock time of the kill."""
        node = self.nodes.pop(ip)
        t = time.time()
        self.cluster.remove_node(node.handle, allow_graceful=False)
        return t

    def actors(self) -> dict[str, dict]:
        """The live nonstop actors by role name ('engine-1', 'trainer'), from Ray's GCS: each with its
        node's address and its pid."""
        table = self.cluster.global_state.actor_table(None)
        out = {}
        for info in table.values():
            name = info["Name"]
            if info["State"] == "ALIVE" and name.startswith("nonstop:"):
                out[name.split(":")[1]] = {"ip": info["Address"]["IPAddress"], "pid": info["Pid"]}
        return out

    def diagnosis(self, lines: int = 25) -> str:
        """What Ray knew when a scenario went wrong, for the failure message (the temp root with
        Ray's logs is removed afterwards): every nonstop actor's state with its death cause, every
        node's state, and the tails of the raylets', the GCS's and the workers' error logs."""
        out = ["actors:"]
        for info in self.cluster.global_state.actor_table(None).values():
            if info["Name"].startswith("nonstop:"):
                where = f"on {info['Address']['IPAddress']} pid {info['Pid']}"
                out.append(f"  {info['Name']} {info['State']} {where} {info.get('DeathCause') or ''}")
        out.append("nodes:")
        for node in self.cluster.global_state.node_table():
            out.append(f"  {node['NodeManagerAddress']} alive={node['Alive']} resources={node.get('Resources')}")
        sessions = [d for d in self.root.glob("session_*") if not d.is_symlink()]  # not session_latest
        for log in sorted(f for d in sessions for f in (d / "logs").glob("*")):
            wanted = log.name.startswith(("raylet", "gcs_server")) and log.suffix in (".out", ".err")
            if (wanted or log.name.startswith("worker-") and log.suffix == ".err") and log.stat().st_size:
                text = log.read_text(errors="replace").splitlines()
                tail = [line for line in text if line.strip() and not line.startswith("[state-dump]")][-lines:]
                out += [f"--- {log.name} (last {len(tail)} lines)", *tail]
        return "\n".join(out)

    def engines_on(self, ip: str) -> list[str]:
        return sorted(n for n, a in self.actors().items() if n.startswith("engine") and a["ip"] == ip)

    def shutdown(self) -> None:
        self.cluster.shutdown()
        for key in self.env:
            os.environ.pop(key, None)


class EventPipe:
    """A FIFO the run's reward function writes event names to; `on(name, action)` registers what
    to do, and `serve(process)` runs the actions in the calling thread (Ray starts a node only from
    the main thread) as their names arrive, until the process ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)
        # read-write: the open does not wait for a writer, and a writer never meets a missing reader
        self.fd = os.open(path, os.O_RDWR)
        self.actions: dict[str, Callable[[], None]] = {}
        self.seen: list[tuple[str, float]] = []
        self.errors: list[str] = []
        self.queue: queue.Queue[str] = queue.Queue()
        self.thread = threading.Thread(target=self._read, name="event-pipe", daemon=True)
        self.thread.start()

    def on(self, name: str, action: Callable[[], None]) -> None:
        self.actions[name] = action

    def _read(self) -> None:
        buf = b""
        while True:
            buf += os.read(self.fd, 256)
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                name = line.decode()
                if name == "_stop":
                    return
                self.seen.append((name, time.time()))
                self.queue.put(name)

    def serve(self, process: subprocess.Popen, timeout_s: float) -> None:
        """Run each event's action as it arrives, until `process` ends (killed past `timeout_s`)."""
        threading.Thread(target=lambda: (process.wait(), self.queue.put("_exit")), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                name = self.queue.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                process.kill()
                self.errors.append(f"the run did not end within {timeout_s:g} s")
                process.wait()
                return
            if name == "_exit":
                return
            try:
                self.actions.get(name, lambda: None)()
            except Exception as e:  # reported by the caller, never lost
                self.errors.append(f"{name}: {type(e).__name__}: {e}")
            Path(f"{self.path}.{name}.done").touch()  # releases a run that waits on it ('name@n!')

    def close(self) -> None:
        os.write(self.fd, b"_stop\n")
        self.thread.join(timeout=60)
        os.close(self.fd)


def nonstop_train(
    args: list[str], cwd: Path, cluster: LoopbackCluster, pipe: EventPipe, timeout_s: float, **env: str
) -> subprocess.CompletedProcess:
    """`nonstop train *args` against the cluster (the caller names runtime.ray_address in `args`),
    with the pipe's actions served in this thread while it runs."""
    log = cwd / f"nonstop-{len(list(cwd.glob('nonstop-*.log')))}.log"
    with open(log, "w") as out:
        process = subprocess.Popen(
            [NONSTOP, "train", *args],
            cwd=cwd,
            env=child_env(COLUMNS="200", **cluster.env, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
        pipe.serve(process, timeout_s)
    return subprocess.CompletedProcess(process.args, process.returncode, log.read_text(), "")


def cluster_args(model: Path, address: str, name: str, overrides: dict[str, str]) -> list[str]:
    """One epoch of the 80 train prompts of addition 0-9 (unless `overrides` says otherwise) on the
    cluster: engines on nodes with `engine_node`, the trainer on the node with `trainer_node`."""
    base = {
        "runtime.backend": "ray",
        "runtime.ray_address": address,
        "runtime.num_engines": "2",
        "runtime.ray_engine.resources": "{engine_node: 1}",
        "runtime.ray_engine.spread": "true",
        "runtime.ray_trainer.resources": "{trainer_node: 1}",
        "runtime.heartbeat_interval_s": "1",
        "runtime.heartbeat_timeout_s": "15",
        "transport.checksum": "true",
        "run.name": name,
        "run.max_epochs": "1",
        "run.max_time_s": "null",
        "task.max_operand": "9",
        "task.eval_size": "20",
        "rollout.prompts_per_step": "8",
        "checkpoint.every_steps": "2",
        "run.eval_every": "100",
        "task.reward": "support.fault_rewards:cluster_event_reward",
    }
    return [*small_model_args(model), *sets({**base, **overrides})]


Action = Callable[[LoopbackCluster, dict], None]


def remove_engine_node(cluster: LoopbackCluster, record: dict) -> None:
    """Crash the first worker node (by address) that hosts an engine. The evidence that it is gone
    (support/faults.py `proved_node_lost`): the /proc state of the node's own processes and of its
    engines after the kill."""
    ip = next(ip for ip in sorted(cluster.nodes) if ip != HEAD_IP and cluster.engines_on(ip))
    engines = {n: a["pid"] for n, a in cluster.actors().items() if n.startswith("engine") and a["ip"] == ip}
    node_pids = [p.pid for _, p in cluster.nodes[ip].handle.live_processes()]  # type: ignore[attr-defined]
    record["removed_engines"] = sorted(engines)
    record["removed_ip"] = ip
    record["removed_at"] = cluster.remove_node(ip)
    # the engines' processes end when they lose their raylet: a moment later, not at once
    record["node_pids_after"] = {str(pid): await_state(pid, DEAD) for pid in node_pids}
    record["engine_pids_after"] = {str(pid): await_state(pid, DEAD) for pid in engines.values()}


def add_node(resources: dict[str, float], cpus: int = 1, after_s: float = 0.0) -> Action:
    def act(cluster: LoopbackCluster, record: dict) -> None:
        time.sleep(after_s)  # the harness's own pace: a replacement node that comes a while after the loss
        record["added_at"] = time.time()
        record["added_ip"] = cluster.add_node(resources, cpus).ip
        record["added_alive_at"] = time.time()

    return act


def until_alive(name: str, timeout_s: float = 300.0, then_s: float = 0.0) -> Action:
    """Wait (checking Ray's GCS every 0.5 s) until actor `name` runs, then `then_s` more seconds."""

    def act(cluster: LoopbackCluster, record: dict) -> None:
        deadline = time.monotonic() + timeout_s
        while name not in cluster.actors():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start within {timeout_s:g} s")
            time.sleep(0.5)
        record[f"{name}_alive_at"] = time.time()
        time.sleep(then_s)

    return act


def until_engine_on_added_node(timeout_s: float = 300.0, then_s: float = 0.0) -> Action:
    """Wait (checking Ray's GCS every 0.5 s) until an engine runs on the node `add_node` added."""

    def act(cluster: LoopbackCluster, record: dict) -> None:
        deadline = time.monotonic() + timeout_s
        while not cluster.engines_on(record["added_ip"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no engine started on {record['added_ip']} within {timeout_s:g} s")
            time.sleep(0.5)
        record["engine_on_added_at"] = time.time()
        record["engines_on_added"] = cluster.engines_on(record["added_ip"])
        time.sleep(then_s)

    return act


def then(*actions: Action) -> Action:
    def act(cluster: LoopbackCluster, record: dict) -> None:
        for a in actions:
            a(cluster, record)

    return act


def kill_trainer(cluster: LoopbackCluster, record: dict) -> None:
    """SIGKILL the trainer actor on the head node."""
    trainer = cluster.actors()["trainer"]
    record["killed_at"] = time.time()
    os.kill(trainer["pid"], signal.SIGKILL)
    record["killed_pid"], record["killed_state"] = trainer["pid"], await_state(trainer["pid"], DEAD)


def stall_engine(seconds: float) -> Action:
    """Pause (SIGSTOP) an engine on a worker node for `seconds`, then let it go on (SIGCONT): to the
    trainer and the orchestrator it is a network that stopped carrying anything to or from it."""

    def act(cluster: LoopbackCluster, record: dict) -> None:
        name, actor = next((n, a) for n, a in sorted(cluster.actors().items()) if n.startswith("engine"))
        record["stalled_engine"], record["stalled_at"] = name, time.time()
        os.kill(actor["pid"], signal.SIGSTOP)
        record["stalled_pid"], record["stalled_state"] = actor["pid"], await_state(actor["pid"], STOPPED, 5.0)
        threading.Timer(seconds, lambda: _continue(actor["pid"])).start()

    return act


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # the run killed it meanwhile (declared hung)
        pass


@dataclass
class Scenario:
    name: str
    head: dict[str, float]
    workers: list[tuple[dict[str, float], int]]  # (resources, cpus) of each worker node at the start
    sets: dict[str, str]
    events: str  # 'name@samples,...' (support.fault_rewards:cluster_event_reward)
    actions: dict[str, Action]
    head_cpus: int = 1
    resume: bool = False  # the run is expected to stop (a dead trainer): resume it on the same cluster
    timeout_s: float = 900


@dataclass
class Outcome:
    codes: list[int]
    output: str
    summary: dict
    record: dict  # what the actions did, and when (wall clock)
    seen: list[tuple[str, float]]  # events as the harness received them
    errors: list[str]  # actions that failed
    foreign: list[str]  # sockets or Ray log lines off loopback
    nodes: int  # nodes that took part
    diagnosis: str = ""  # Ray's view and log tails, kept when the run failed or did not end (LoopbackCluster.diagnosis)


def run_scenario(sc: Scenario, model: Path, work: Path) -> Outcome:
    root = temp_root()
    cwd = work / sc.name
    cwd.mkdir(parents=True)
    audit = LoopbackAudit()
    cluster = LoopbackCluster(root, sc.head, sc.head_cpus)
    pipe = EventPipe(root / "events")
    record: dict = {}
    codes: list[int] = []
    output, diagnosis = "", ""
    try:
        for resources, cpus in sc.workers:
            cluster.add_node(resources, cpus)
        for event, action in sc.actions.items():
            pipe.on(event, lambda a=action: a(cluster, record))
        overrides = {k: v.replace("{root}", str(root)) for k, v in sc.sets.items()}
        env = {"NONSTOP_TEST_FIFO": str(root / "events"), "NONSTOP_TEST_EVENTS": sc.events}
        runs = [cluster_args(model, cluster.address, sc.name, overrides)]
        if sc.resume:
            runs.append(["--resume", str(Path("runs") / sc.name)])
        for args in runs:
            result = nonstop_train(args, cwd, cluster, pipe, sc.timeout_s, **env)
            codes.append(result.returncode)
            output += result.stdout + result.stderr
            if result.returncode == 0:
                break
        nodes = cluster.last_octet - 1
        if pipe.errors or codes[-1] != 0:
            diagnosis = cluster.diagnosis()
    finally:
        pipe.close()
        audit.stop()
        cluster.shutdown()
        foreign = sorted(audit.found) + ray_logs_mention(root, own_addresses())
        shutil.rmtree(root, ignore_errors=True)
    path = cwd / "runs" / sc.name / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {}
    return Outcome(codes, output, summary, record, pipe.seen, pipe.errors, foreign, nodes, diagnosis)
