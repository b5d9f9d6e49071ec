"""A multi-node Ray cluster on this host, with nodes lost and added mid-run, measured.

Each run starts a fresh cluster of one raylet per node (tests/support/cluster.py): the head on
127.0.0.2 holds the trainer (resource `trainer_node`), worker nodes on 127.0.0.3, .4, ... hold
the engines (resource `engine_node`); every node, store and gloo group binds a loopback address.
`nonstop train` reaches the cluster through runtime.ray_address, as a user's run does, and trains
two epochs of addition 0-39 (1580 prompts) on a small random model; events are set off by the run's
reward function at chosen samples.

    grow_replace  transport broadcast, node_loss 'replace', num_engines 2, max_engines 3, one slot
                  per worker node: engine-2 waits for room. A node with two slots joins: engine-2
                  starts there, receives the current weights and serves. 3 s after it runs, a
                  worker node is SIGKILLed: its engine is re-placed on the joined node's free slot.
    wait_join     transport files (a folder every node sees), node_loss 'wait', two slots per worker
                  node: a worker node is SIGKILLed, its engine waits while the other serves (the
                  survivor has room, but 'wait' keeps it for a new node); 3 s later a node joins
                  and the engine starts there (its recovery time includes that wait).
    trainer_resume transport broadcast: the trainer on the head node is SIGKILLed; the run stops
                  naming `nonstop train --resume`, and the resume on the same cluster finishes.

Columns: nodes that took part, whether the fault was proven fired (tests/support/faults.py: a
crashed node's processes and engines gone from /proc and a restart of the run naming its engine's
pid; a joined node holding an engine in Ray's GCS that the run counted as joined; the killed
trainer's pid dead in /proc and named by the run's failure, then resumed), prompts lost and
duplicated as `nonstop verify` recounts them from the trainer's and the buffer's own records
against the dataset's order, not from the run's ledger ('unread' when verify could not read a
count: the row fails, and RESULT's total reads 'unread', never a sum that takes it for 0), engine
restarts, node-loss detection (node killed -> the run noticed, wall clock) and recovery (noticed ->
replacement serving), the engines that joined and how long after their node was added, whether
every engine's weights (CRC32 at the end) equal the trainer's, and sockets or Ray log lines off
loopback. The last line:
`RESULT nodes=<most nodes that took part in a run> lost=<total> duplicated=<total> detect_s=<max> recover_s=<max,
policy replace> wait_recover_s=<policy wait> joined_weights=<exact|DIFFER> resumed=<yes|no> fired=<runs whose
fault was proven> unread=<runs with a count verify could not read>`.

    python bench/cluster.py [--only grow_replace,wait_resume] [--json out.json]
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from support import faults as ev  # noqa: E402
from support.cluster import (  # noqa: E402
    HEAD_IP,
    Outcome,
    Scenario,
    add_node,
    kill_trainer,
    remove_engine_node,
    run_scenario,
    then,
    until_alive,
    until_engine_on_added_node,
)

ONE_SLOT = ({"engine_node": 1.0}, 1)
TWO_SLOTS = ({"engine_node": 2.0}, 2)
# two epochs of 1580 train prompts: room for the events
LONGER = {"task.max_operand": "39", "task.eval_size": "20", "run.max_epochs": "2"}
TRAIN = 2 * 1580


def scenarios() -> dict[str, Scenario]:
    return {
        "grow_replace": Scenario(
            "grow_replace",
            head={"trainer_node": 1.0},
            workers=[ONE_SLOT, ONE_SLOT],
            sets={
                **LONGER,
                "runtime.max_engines": "3",
                "runtime.node_loss.policy": "replace",
                "transport.kind": "broadcast",
            },
            events="add@80",
            actions={
                "add": then(
                    add_node({"engine_node": 2.0}, cpus=2), until_alive("engine-2", then_s=3.0), remove_engine_node
                )
            },
        ),
        "wait_join": Scenario(
            "wait_join",
            head={"trainer_node": 1.0},
            workers=[TWO_SLOTS, TWO_SLOTS],  # the survivor has room: 'wait' must not use it
            sets={
                **LONGER,
                "runtime.node_loss.policy": "wait",
                "runtime.node_loss.timeout_s": "120",
                "transport.kind": "files",
                "transport.dir": "{root}/shared-weights",
            },
            events="remove@400",
            actions={
                "remove": then(
                    remove_engine_node,
                    add_node({"engine_node": 1.0}, cpus=1, after_s=3.0),
                    until_engine_on_added_node(timeout_s=120.0),  # the replacement went to the new node (GCS)
                )
            },
        ),
        "trainer_resume": Scenario(
            "trainer_resume",
            head={"trainer_node": 1.0},
            workers=[ONE_SLOT, ONE_SLOT],
            sets={**LONGER, "transport.kind": "broadcast"},
            events="kill@2000",
            actions={"kill": kill_trainer},
            resume=True,
        ),
    }


def proof(name: str, out: Outcome) -> ev.Proof:
    """The evidence that run `name`'s faults fired and that the run saw them."""
    rec = out.record
    if name == "trainer_resume":
        return ev.proved_killed_trainer_resumed(
            rec.get("killed_pid", -1), rec.get("killed_state", "not killed"), out.codes, out.output
        )
    lost = ev.proved_node_lost(rec, out.summary)
    if name == "wait_join":  # its replacement must also have started on the node added after the loss
        joined = ev.proved_node_joined(rec, out.summary)
        return ev.Proof(lost.fired and joined.fired, f"{lost.evidence}; {joined.evidence}")
    return lost


def measure(name: str, out: Outcome, run_dir: Path) -> dict:
    s, rec = out.summary, out.record
    ledger, faults = s.get("prompts", {}), s.get("engine_faults", {})
    losses = [
        (at - rec["removed_at"], rs)
        for reason, at, rs in zip(faults.get("reasons", []), faults.get("noticed_at", []), faults.get("recover_s", []))
        if "left the Ray cluster" in reason and "removed_at" in rec
    ]
    weights = s.get("weights_crc32") or {}
    trainer = weights.get("trainer")
    engines = weights.get("engines", [])
    joined = s.get("engine_joins", [])
    names = [f"engine-{i}" for i in range(len(engines))]
    joined_exact = all(engines[names.index(j["engine"])] == trainer for j in joined if j["engine"] in names)
    stats = {f"engine-{i}": e for i, e in enumerate(s.get("engines", []))}
    counts, fired = ev.verified(run_dir), proof(name, out)
    return {
        "completed": bool(out.codes) and out.codes[-1] == 0,
        "exit_codes": out.codes,
        "nodes": out.nodes,
        "fired": fired.fired,
        "evidence": fired.evidence,
        "lost": counts.lost,
        "duplicated": counts.duplicated,
        "drawn": counts.drawn,
        "unread_why": None if counts.lost is not None and counts.duplicated is not None else counts.why,
        "requeued": faults.get("requeued", 0) + ledger.get("requeued", 0),
        "restarts": faults.get("restarts", 0),
        "reasons": faults.get("reasons", []),
        "detect_s": max((d for d, _ in losses), default=None),
        "recover_s": max((r for _, r in losses), default=None),
        "joined": [
            {
                "engine": j["engine"],
                "after_node_s": j["at"] - rec["added_at"] if "added_at" in rec else None,
                "tokens": stats.get(j["engine"], {}).get("tokens_generated"),
            }
            for j in joined
        ],
        "weights_exact": bool(engines) and all(e == trainer for e in engines),
        "joined_weights_exact": bool(joined) and joined_exact,
        "resumed": "resumed from" in out.output,
        "resume_hint": "nonstop train --resume" in out.output,
        "foreign": out.foreign,
        "errors": out.errors,
        "events": [n for n, _ in out.seen],
        "output_tail": out.output[-3000:] if not (out.codes and out.codes[-1] == 0) else "",
    }


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    import argparse

    from nonstop.config import TinyModelConfig
    from nonstop.hf import quiet_transformers
    from nonstop.models.tiny import save_tiny

    all_runs = scenarios()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(all_runs), help="comma-separated runs")
    ap.add_argument("--json", help="write the measured rows here")
    ap.add_argument("--keep", help="work in this folder and keep it (run folders, each run's output)")
    ap.add_argument("--events", help="replace the runs' events (name@samples,...)")
    args = ap.parse_args()
    quiet_transformers()
    console = Console(width=160)
    rows = {}
    with tempfile.TemporaryDirectory(prefix="nonstop-cluster-") as tmp:
        work = Path(args.keep or tmp)
        model = save_tiny(
            work / "model",
            TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
            seed=0,
        )
        for name in args.only.split(","):
            console.log(f"run {name} (head {HEAD_IP}) ...")
            sc = all_runs[name]
            if args.events is not None:
                sc.events = args.events
            rows[name] = measure(name, run_scenario(sc, model, work), work / name / "runs" / name)
    table = Table(title=f"Multi-node Ray cluster on loopback: {TRAIN} prompts (two epochs) per run")
    for col in (
        "run",
        "completed",
        "nodes",
        "fault fired",
        "lost",
        "dup",
        "re-queued",
        "restarts",
        "loss detect s",
        "loss recover s",
        "joined (s after node)",
        "weights = trainer",
        "off loopback",
    ):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        done = ("yes" if r["completed"] else "NO") + (" (resumed)" if r["resumed"] else "")
        joined = (
            ", ".join(f"{j['engine']} ({fmt(j['after_node_s'])}; {j['tokens']} tokens)" for j in r["joined"]) or "-"
        )
        table.add_row(
            name,
            done,
            str(r["nodes"]),
            "yes" if r["fired"] else "NO",
            "unread" if r["lost"] is None else str(r["lost"]),
            "unread" if r["duplicated"] is None else str(r["duplicated"]),
            str(r["requeued"]),
            str(r["restarts"]),
            fmt(r["detect_s"]),
            fmt(r["recover_s"]),
            joined,
            "exact" if r["weights_exact"] else "DIFFER",
            str(len(r["foreign"])),
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    console.print(table)
    for name, r in rows.items():
        print(f"{name}: {'fired' if r['fired'] else 'NOT PROVEN FIRED'}: {r['evidence']}")
        if r["unread_why"]:
            print(f"{name}: verify's counts unread: {r['unread_why']}")
        for reason in r["reasons"]:
            print(f"{name}: {reason}")
        if r["output_tail"] or r["errors"] or r["foreign"]:  # plain print: the output holds brackets
            print(f"{name}: errors {r['errors']}, off loopback {r['foreign'][:5]}\n{r['output_tail']}")
    replace = [r["recover_s"] for n, r in rows.items() if n == "grow_replace" and r["recover_s"] is not None]
    wait = [r["recover_s"] for n, r in rows.items() if n == "wait_join" and r["recover_s"] is not None]
    joins_exact = [r["joined_weights_exact"] for r in rows.values() if r["joined"]]
    resumed = any(r["resumed"] and r["resume_hint"] and r["completed"] for r in rows.values())
    print(
        f"RESULT nodes={max((r['nodes'] for r in rows.values()), default=0)} "
        f"lost={ev.total(r['lost'] for r in rows.values())} "
        f"duplicated={ev.total(r['duplicated'] for r in rows.values())} "
        f"detect_s={fmt(max((r['detect_s'] for r in rows.values() if r['detect_s'] is not None), default=None))} "
        f"recover_s={fmt(max(replace, default=None))} wait_recover_s={fmt(max(wait, default=None))} "
        f"joined_weights={'exact' if joins_exact and all(joins_exact) else 'DIFFER' if joins_exact else '-'} "
        f"resumed={'yes' if resumed else 'no'} "
        f"fired={sum(r['fired'] for r in rows.values())} "
        f"unread={sum(r['lost'] is None or r['duplicated'] is None for r in rows.values())}"
    )


if __name__ == "__main__":
    main()
