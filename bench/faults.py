"""Fault injection, measured: each fault once on the same one-epoch run, side by side.

Every row trains one epoch (80 prompts of addition 0-9, 8 per step, a checkpoint every 2
steps) of a small random model with a length reward, through the real CLI, with one fault
injected from inside the orchestrator by a test reward function (tests/support/fault_rewards.py):

    none        no fault (the reference for wall time)
    engine_kill SIGKILL of the engine while it generates
    engine_hang SIGSTOP of the engine (alive but silent); heartbeat 0.5 s, timeout 3 s
    trainer_kill SIGKILL of the trainer; the run stops, then `nonstop train --resume` finishes it
    corrupt_ckpt a bit flipped in the newest checkpoint before the resume (previous one used)
    nan_loss    rewards whose group statistics overflow: non-finite loss, step skipped
    engines_kill two engines, engine-0 SIGKILLed while generating; engine-1 keeps serving
    ctrl_c      Ctrl-C (SIGINT to the orchestrator): checkpoint after the step, exit 130, then
                `nonstop train --resume` finishes it
    broadcast_kill two engines on the broadcast transport, engine-0 SIGKILLed while generating: the
                trainer rebuilds the group with the replacement and sends the weights again
    ddp_resume  two DDP trainer ranks, SIGKILL of rank 0, then `nonstop train --resume`
    fsdp2_resume two FSDP2 trainer ranks (sharded checkpoint), SIGKILL of rank 0, then resume

Node-level rows run on a Ray cluster of several nodes on this host, one raylet per node, each on
its own loopback address (tests/support/cluster.py; bench/cluster.py has the longer scenarios),
through `runtime.ray_address`, with the event set off by the run's reward function:

    node_loss   head node (trainer, room for two engines) and one worker node (one engine), the
                engines spread one per node, 380 prompts; the worker node is SIGKILLed mid-run: its
                engine is re-placed on the head (runtime.node_loss 'replace'); broadcast transport
    node_join   one engine on one worker node, runtime.max_engines 2 (2480 prompts: the newcomer
                needs time to start): a node joins, engine-1 starts there, takes the current
                weights (files transport on a shared folder) and serves; detect is '-', recover
                is node alive -> engine in the pool
    network_stall two engines on one worker node, broadcast; one engine is paused (SIGSTOP) for
                8 s, then continued (SIGCONT): nothing reaches it or comes from it meanwhile, the
                heartbeat (0.5 s, timeout 3 s) declares it hung, it is replaced, and the trainer's
                send goes out again in a group with the replacement

Every fault proves that it fired (tests/support/faults.py): the injector sends its signal, reads
the process's state back from /proc (dead, or stopped), and records it in the row's working
folder; the row then matches that record with the run's own: the killed or stopped pid must be the
one a restart reason (or the trainer's failure) names; a corrupted checkpoint must have changed on
disk (CRC32 before and after) and be the one the resume refused; a Ctrl-C must have gone to the
process this bench started, which exited 130; a NaN row must have returned the overflowing
rewards and the trainer's own record must hold a skipped step; a crashed node's processes and
engines must be gone from /proc and the run must name its engine; a joined node must hold an
engine in Ray's GCS that the run counted as joined. The reference row must see no fault at all.

Columns: whether the epoch completed, whether the fault was proven fired (the evidence is printed
under the table), what was lost and duplicated (prompts and samples) as `nonstop verify` counts
them from the trainer's and the buffer's own records against the dataset's order, not from the
run's ledger (a count verify could not read shows as 'unread' and fails the row), engine
restarts, time to detect and to recover, and wall time relative to the fault-free run (all
invocations of the row summed). For a node loss, detection is wall clock from the node's SIGKILL
to the run noticing. The last line: `RESULT scenarios=<n> survived=<n> fired=<n> lost=<total>
duplicated=<total> unread=<n>`, where a scenario survived if its epoch completed, its fault was
proven fired and verify read no prompt lost or duplicated (a node row also needs every socket of
the cluster and the run to have stayed on loopback); lost and duplicated read 'unread' when any
row's count could not be read, never a sum that counts it as 0.

    python bench/faults.py                     # every row, one after the other
    python bench/faults.py --only node_loss,node_join,network_stall
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from support import faults as ev  # noqa: E402
from support.cli import sets  # noqa: E402
from support.faults import epoch_args  # noqa: E402

NONSTOP = str(Path(sys.executable).parent / "nonstop")
TRAIN = 80


def cli(args: list[str], cwd: Path) -> tuple[int, int, float, str]:
    """(exit code, pid, seconds, output) of `nonstop *args`: the pid to match a Ctrl-C's record with."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]), "COLUMNS": "200"}
    t0 = time.perf_counter()
    p = subprocess.Popen(
        [NONSTOP, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        out, _ = p.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
    return p.returncode, p.pid, time.perf_counter() - t0, out


def epoch(model: Path, name: str, reward: str, *extra: str) -> list[str]:
    return epoch_args(model, name, f"support.fault_rewards:{reward}", *extra)


def scenario(name: str, model: Path, work: Path) -> dict:
    cwd = work / name
    cwd.mkdir()
    run_dir, resume = cwd / "runs" / name, ["train", "--resume", str(Path("runs") / name)]
    wall, out = 0.0, ""
    # each row's CLI invocations in order; "flip" corrupts the newest checkpoint between two of them
    plans: dict[str, list[list[str] | Literal["flip"]]] = {
        "none": [epoch(model, name, "length_reward")],
        "engine_kill": [epoch(model, name, "kill_engine_once_reward")],
        "engine_hang": [
            epoch(
                model,
                name,
                "hang_engine_once_reward",
                *sets({"runtime.heartbeat_interval_s": 0.5, "runtime.heartbeat_timeout_s": 3}),
            )
        ],
        "trainer_kill": [epoch(model, name, "kill_trainer_reward"), resume],
        "corrupt_ckpt": [epoch(model, name, "kill_trainer_after_two_checkpoints_reward"), "flip", resume],
        "nan_loss": [epoch(model, name, "overflow_reward", *sets({"trainer.max_consecutive_skips": 50}))],
        "engines_kill": [epoch(model, name, "kill_engine_0_once_reward", *sets({"runtime.num_engines": 2}))],
        "ctrl_c": [epoch(model, name, "interrupt_once_reward"), resume],
        "broadcast_kill": [
            epoch(
                model,
                name,
                "kill_engine_0_once_reward",
                *sets({"runtime.num_engines": 2, "transport.kind": "broadcast"}),
            )
        ],
        "ddp_resume": [epoch(model, name, "kill_trainer_reward", *sets({"trainer.ranks": 2})), resume],
        "fsdp2_resume": [
            epoch(model, name, "kill_trainer_reward", *sets({"trainer.ranks": 2, "trainer.data_parallel": "fsdp2"})),
            resume,
        ],
    }
    codes: list[int] = []
    pids: list[int] = []
    change: dict | None = None
    for args in plans[name]:
        if args == "flip":
            change = ev.corrupt_newest_checkpoint(run_dir)
            continue
        code, pid, seconds, text = cli(args, cwd)
        codes.append(code)
        pids.append(pid)
        wall += seconds
        out += text
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    ledger = summary.get("prompts", {})
    faults = summary.get("engine_faults", {})
    proof = local_proof(name, cwd, run_dir, summary, codes, pids, out, change)
    return row(codes[-1] == 0, codes, proof, ev.verified(run_dir), summary, wall, out) | {
        "detect_s": faults.get("max_detect_s", 0.0),
        "recover_s": faults.get("max_recover_s", 0.0),
        "requeued": ledger.get("requeued", 0) + faults.get("requeued", 0),
        "fell_back": "is corrupted" in out,
        "resumed": "resumed from" in out,
    }


def local_proof(
    name: str, cwd: Path, run_dir: Path, summary: dict, codes: list[int], pids: list[int], out: str, change: dict | None
) -> ev.Proof:
    """The evidence that row `name`'s fault fired and that the run saw it (support/faults.py)."""
    if name == "none":
        return ev.proved_no_fault(cwd, summary)
    if name in ("engine_kill", "engine_hang"):
        return ev.proved_engine_signalled(cwd, summary, "SIGKILL" if name == "engine_kill" else "SIGSTOP")
    if name in ("engines_kill", "broadcast_kill"):
        return ev.proved_engine_signalled(cwd, summary, "SIGKILL", "nonstop-engine-0")
    if name in ("trainer_kill", "ddp_resume", "fsdp2_resume"):
        return ev.proved_trainer_killed(cwd, codes, out)
    if name == "corrupt_ckpt":
        killed, corrupted = ev.proved_trainer_killed(cwd, codes, out), ev.proved_corrupted(change, out)
        return ev.Proof(killed.fired and corrupted.fired, f"{killed.evidence}; {corrupted.evidence}")
    if name == "nan_loss":
        return ev.proved_overflow(cwd, run_dir)
    if name == "ctrl_c":
        return ev.proved_interrupted(cwd, codes, pids, out)
    raise ValueError(f"no proof for scenario {name!r}")


def row(
    completed: bool, codes: list[int], proof: ev.Proof, counts: ev.Verified, summary: dict, wall: float, out: str
) -> dict:
    """The measured row: survived only if completed, the fault proven fired and verify read 0 and 0."""
    faults = summary.get("engine_faults", {})
    return {
        "completed": completed,
        "fired": proof.fired,
        "evidence": proof.evidence,
        "survived": completed and proof.fired and counts.clean,
        "exit_codes": codes,
        "lost": counts.lost,
        "duplicated": counts.duplicated,
        "unread_why": None if counts.lost is not None and counts.duplicated is not None else counts.why,
        "restarts": faults.get("restarts", 0),
        "skipped_steps": summary.get("skipped_steps", 0),
        "wall_s": wall,
        "output_tail": out[-1500:] if not completed else "",
    }


def cluster_scenarios() -> dict:
    """The node-level rows (see the module docstring), as support.cluster scenarios."""
    from support.cluster import Scenario, add_node, remove_engine_node, stall_engine, then, until_engine_on_added_node

    return {
        "node_loss": Scenario(
            "node_loss",
            head={"trainer_node": 1.0, "engine_node": 2.0},
            head_cpus=3,
            workers=[({"engine_node": 1.0}, 1)],
            # 380 prompts: on a quiet host the 80 of the other rows are done within a second of
            # the 160th sample, before the lost engine's absence could matter
            sets={"transport.kind": "broadcast", "task.max_operand": "19"},
            events="remove@160",
            actions={"remove": remove_engine_node},
        ),
        "node_join": Scenario(
            "node_join",
            head={"trainer_node": 1.0},
            workers=[({"engine_node": 1.0}, 1)],
            sets={
                "runtime.num_engines": "1",
                "runtime.max_engines": "2",
                "transport.kind": "files",
                "transport.dir": "{root}/shared-weights",
                "task.max_operand": "49",
            },
            events="add@40",
            # then wait until Ray's GCS shows an engine on the new node: the evidence that it joined
            actions={"add": then(add_node({"engine_node": 1.0}, cpus=1), until_engine_on_added_node(timeout_s=300.0))},
        ),
        "network_stall": Scenario(
            "network_stall",
            head={"trainer_node": 1.0},
            workers=[({"engine_node": 2.0}, 2)],
            sets={
                "transport.kind": "broadcast",
                "runtime.heartbeat_interval_s": "0.5",
                "runtime.heartbeat_timeout_s": "3",
            },
            events="stall@160",
            actions={"stall": stall_engine(8.0)},
        ),
    }


CLUSTER_TRAIN = {"node_loss": 380, "node_join": 2480, "network_stall": TRAIN}


def cluster_scenario(name: str, model: Path, work: Path) -> dict:
    sc = cluster_scenarios()[name]
    from support.cluster import run_scenario

    t0 = time.perf_counter()
    out = run_scenario(sc, model, work)
    wall = time.perf_counter() - t0
    summary, rec = out.summary, out.record
    ledger, faults = summary.get("prompts", {}), summary.get("engine_faults", {})
    detect: float | None = faults.get("max_detect_s", 0.0)
    recover: float | None = faults.get("max_recover_s", 0.0)
    if "removed_at" in rec:  # a node loss: from the node's death, wall clock, to the run noticing
        detect = max((at - rec["removed_at"] for at in faults.get("noticed_at", [])), default=None)
    if name == "node_join":
        joins = summary.get("engine_joins", [])
        detect = None
        recover = joins[0]["at"] - rec["added_alive_at"] if joins and "added_alive_at" in rec else None
    proof = {"node_loss": ev.proved_node_lost, "node_join": ev.proved_node_joined, "network_stall": ev.proved_stalled}[
        name
    ](rec, summary)
    completed = bool(out.codes) and out.codes[-1] == 0 and not out.foreign and not out.errors
    counts = ev.verified(next((work / name / "runs").glob("*"), None))
    text = out.output if completed else f"{out.errors} {out.foreign[:5]}\n{out.output}"
    return row(completed, out.codes, proof, counts, summary, wall, text) | {
        "detect_s": detect,
        "recover_s": recover,
        "requeued": ledger.get("requeued", 0) + faults.get("requeued", 0),
        "fell_back": False,
        "resumed": False,
    }


SCENARIOS = (
    "none",
    "engine_kill",
    "engine_hang",
    "trainer_kill",
    "corrupt_ckpt",
    "nan_loss",
    "engines_kill",
    "ctrl_c",
    "broadcast_kill",
    "ddp_resume",
    "fsdp2_resume",
    "node_loss",
    "node_join",
    "network_stall",
)


def main() -> None:
    import argparse

    from nonstop.config import TinyModelConfig
    from nonstop.hf import quiet_transformers
    from nonstop.models.tiny import save_tiny

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")
    ap.add_argument("--json", help="write the measured rows here")
    args = ap.parse_args()
    quiet_transformers()
    console = Console(width=170)
    with tempfile.TemporaryDirectory(prefix="nonstop-faults-") as tmp:
        work = Path(tmp)
        model = save_tiny(
            work / "model",
            TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
            seed=0,
        )
        rows = {}
        for name in args.only.split(","):
            console.log(f"scenario {name} ...")
            rows[name] = (cluster_scenario if name in CLUSTER_TRAIN else scenario)(name, model, work)
    table = Table(title="Fault injection: one epoch of 80 prompts per row (node_loss: 380, node_join: 2480)")
    for col in (
        "fault",
        "epoch completed",
        "fault fired",
        "prompts lost",
        "duplicated",
        "re-queued",
        "engine restarts",
        "detect s",
        "recover s",
        "skipped steps",
        "wall vs none",
    ):
        table.add_column(col, justify="right")
    base = rows["none"]["wall_s"] if "none" in rows else float("nan")
    for name, r in rows.items():
        done = (
            ("yes" if r["completed"] else "NO")
            + (" (resumed)" if r["resumed"] else "")
            + (" (fell back)" if r["fell_back"] else "")
        )
        table.add_row(
            name,
            done,
            ("n/a" if name == "none" else "yes") if r["fired"] else "NO",
            "unread" if r["lost"] is None else str(r["lost"]),
            "unread" if r["duplicated"] is None else str(r["duplicated"]),
            str(r["requeued"]),
            str(r["restarts"]),
            "-" if r["detect_s"] is None else f"{r['detect_s']:.2f}",
            "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}",
            str(r["skipped_steps"]),
            f"{r['wall_s'] / base:.2f}x",
        )
    console.print(table)
    # plain print: the evidence and the output hold brackets
    for name, r in rows.items():
        print(f"{name}: {'fired' if r['fired'] else 'NOT PROVEN FIRED'}: {r['evidence']}")
        if r["unread_why"]:
            print(f"{name}: verify's counts unread: {r['unread_why']}")
    for name, r in rows.items():
        if r["output_tail"]:
            print(f"{name} did not complete; its output ended with:\n{r['output_tail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    print(
        f"RESULT scenarios={len(rows)} survived={sum(r['survived'] for r in rows.values())} "
        f"fired={sum(r['fired'] for r in rows.values())} lost={ev.total(r['lost'] for r in rows.values())} "
        f"duplicated={ev.total(r['duplicated'] for r in rows.values())} "
        f"unread={sum(r['lost'] is None or r['duplicated'] is None for r in rows.values())}"
    )


if __name__ == "__main__":
    main()
