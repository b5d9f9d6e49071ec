"""Faults that leave evidence, and the checks that a fault really fired and that nothing was lost.

A fault test or bench row that counts "the run survived" on exit 0 proves nothing when the fault
never landed (a kill that missed its process, a checkpoint flip before the wrong file, a stall
that ended before anyone looked). So every injector here acts, then looks at what it did from
outside the code under test, and writes one line per fault to `FAULT_LOG` in the run's working
folder (the reward functions of support/fault_rewards.py run in the orchestrator, whose working folder
that is):

    {"fault": "SIGKILL", "target": "nonstop-engine", "pid": 4242, "t": <wall clock>, "after": "gone"}

`after` is the process's state read from /proc once the signal was sent: `gone` or `Z` (dead,
not yet reaped) for SIGKILL, `T` (stopped) for SIGSTOP, or what was seen instead. The `proved_*`
checks then match that line with the run's own records: the pid the injector killed must be the
one a restart reason or the trainer's failure names. A row passes only when both agree.

The node-level faults of the loopback cluster (support/cluster.py) keep the same kind of evidence
in the scenario's record dict (the node's process ids and their state after the crash).

`verified(run_dir)` runs `nonstop verify`, the recount from the trainer's and the buffer's own
records (observe/verify.py), and reads its lost and duplicated counts; a count it could not read
is None with the reason, never 0.
"""

from __future__ import annotations

import json
import os
import signal
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from support.cli import nonstop, sets, small_model_args

FAULT_LOG = "faults.jsonl"
DEAD = ("gone", "Z", "X")  # /proc states of a process that no longer runs
STOPPED = ("T", "t")


def process_state(pid: int) -> str:
    """The one-letter state of `pid` in /proc/PID/stat, or 'gone' when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return "gone"
    return stat.rsplit(")", 1)[1].split()[0]  # the name in parentheses may hold spaces


def await_state(pid: int, wanted: tuple[str, ...], timeout_s: float = 10.0) -> str:
    """Poll /proc until `pid` is in one of the `wanted` states; the state seen last."""
    deadline = time.monotonic() + timeout_s
    state = process_state(pid)
    while state not in wanted and time.monotonic() < deadline:
        time.sleep(0.02)
        state = process_state(pid)
    return state


def record(fault: str, **fields: object) -> None:
    """Append one line to FAULT_LOG in the working folder, flushed at once (a killed run keeps it)."""
    with open(FAULT_LOG, "a") as f:
        f.write(json.dumps({"fault": fault, "t": time.time(), **fields}) + "\n")


def send(target: str, pid: int, sig: signal.Signals) -> str:
    """Send `sig` to `pid`, read back what became of the process and record both; returns the state.
    A signal with no state to read back (SIGINT, which the target handles) is recorded before it is
    sent: sent to this very process, its handler may run before the next line would."""
    wanted = DEAD if sig == signal.SIGKILL else STOPPED if sig == signal.SIGSTOP else ()
    if not wanted:
        record(sig.name, target=target, pid=pid, after="sent")
        os.kill(pid, sig)
        return "sent"
    os.kill(pid, sig)
    after = await_state(pid, wanted, 5.0)
    record(sig.name, target=target, pid=pid, after=after)
    return after


def fault_log(cwd: Path) -> list[dict]:
    path = cwd / FAULT_LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def corrupt_newest_checkpoint(run_dir: Path) -> dict:
    """Flip one byte in the middle of the newest checkpoint's weights; returns the evidence that the
    file on disk changed: its step, and the CRC32 before, intended and read back after."""
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    weights = newest / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    before = zlib.crc32(data)
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    return {
        "step": newest.name,
        "crc_before": before,
        "crc_written": zlib.crc32(data),
        "crc_read_back": zlib.crc32(weights.read_bytes()),
    }


@dataclass(frozen=True)
class Proof:
    """Whether the fault demonstrably fired and the run saw it, and what was seen (for a table or an
    assertion message)."""

    fired: bool
    evidence: str


def _named(pid: int, texts: list[str]) -> bool:
    return any(f"(pid {pid})" in t for t in texts)


def _lines(cwd: Path, fault: str, target: str) -> list[dict]:
    return [e for e in fault_log(cwd) if e["fault"] == fault and e["target"].startswith(target)]


def proved_no_fault(cwd: Path, summary: dict) -> Proof:
    """The reference row: nothing injected and no restart either."""
    log, restarts = fault_log(cwd), summary.get("engine_faults", {}).get("restarts")
    return Proof(not log and restarts == 0, f"{len(log)} faults injected, {restarts} restarts")


def proved_engine_signalled(cwd: Path, summary: dict, sig: str, target: str = "nonstop-engine") -> Proof:
    """One `sig` (SIGKILL or SIGSTOP) to an engine, its effect seen in /proc, and a restart reason of
    the run naming that pid."""
    lines = _lines(cwd, sig, target)
    if len(lines) != 1:
        return Proof(False, f"{len(lines)} {sig} of {target} recorded, want 1")
    line = lines[0]
    effect_ok = line["after"] in (DEAD if sig == "SIGKILL" else STOPPED)
    reasons = summary.get("engine_faults", {}).get("reasons", [])
    noticed = _named(line["pid"], reasons)
    return Proof(
        effect_ok and noticed,
        f"{sig} pid {line['pid']} ({line['target']}): /proc {line['after']}; "
        + ("a restart names it" if noticed else f"no restart names it: {reasons}"),
    )


def proved_trainer_killed(cwd: Path, codes: list[int], output: str) -> Proof:
    """The trainer (rank 0) SIGKILLed and seen dead, the first invocation failed naming that pid, a
    resume ran and finished."""
    lines = _lines(cwd, "SIGKILL", "nonstop-trainer")
    if len(lines) != 1:
        return Proof(False, f"{len(lines)} SIGKILL of the trainer recorded, want 1")
    return proved_killed_trainer_resumed(lines[0]["pid"], lines[0]["after"], codes, output)


def proved_killed_trainer_resumed(pid: int, after: str, codes: list[int], output: str) -> Proof:
    """The trainer's pid seen dead after its SIGKILL (`after`: its /proc state), the first invocation
    failed naming that pid, and a resume ran and finished."""
    ok = (
        after in DEAD
        and codes[:1] == [1]
        and "the trainer failed" in output
        and _named(pid, [output])
        and codes[-1] == 0
        and "resumed from" in output
    )
    return Proof(ok, f"SIGKILL pid {pid}: /proc {after}; exit codes {codes}")


def proved_interrupted(cwd: Path, codes: list[int], pids: list[int], output: str) -> Proof:
    """SIGINT sent to the very process the caller started first (`pids[0]`), which stopped with 130,
    and a resume finished the run."""
    lines = _lines(cwd, "SIGINT", "orchestrator")
    if len(lines) != 1:
        return Proof(False, f"{len(lines)} SIGINT recorded, want 1")
    pid = lines[0]["pid"]
    ok = bool(pids) and pid == pids[0] and codes[:1] == [130] and codes[-1] == 0 and "resumed from" in output
    return Proof(ok, f"SIGINT pid {pid} (started {pids[:1]}); exit codes {codes}")


def proved_corrupted(change: dict | None, output: str) -> Proof:
    """The newest checkpoint's file changed on disk, and the resume refused exactly that checkpoint."""
    if change is None:
        return Proof(False, "no checkpoint was corrupted")
    changed = change["crc_before"] != change["crc_read_back"] == change["crc_written"]
    refused = f"{change['step']} is corrupted" in output and "resumed from" in output
    return Proof(
        changed and refused,
        f"{change['step']} CRC32 {change['crc_before']:08x} -> {change['crc_read_back']:08x}; "
        + ("the resume refused it" if refused else "the resume did not refuse it"),
    )


def proved_overflow(cwd: Path, run_dir: Path) -> Proof:
    """Overflowing rewards were returned, and the trainer's own record (trained.jsonl) holds a
    skipped step."""
    injected = bool(_lines(cwd, "overflow", ""))
    path = run_dir / "trained.jsonl"
    steps = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    skipped = sum(bool(s.get("skipped")) for s in steps)
    return Proof(
        injected and skipped > 0,
        f"overflow {'returned' if injected else 'never returned'}; "
        f"trained.jsonl: {skipped} of {len(steps)} steps skipped",
    )


def proved_each_kill(kills: list[dict], summary: dict, at_least: int) -> Proof:
    """Repeated SIGKILLs (a soak): at least `at_least`, every one seen dead in /proc (`after`), and
    every one named by a restart reason of the run but perhaps the last (a kill in the run's last
    seconds may meet a run that is already stopping)."""
    reasons = summary.get("engine_faults", {}).get("reasons", [])
    dead = [k for k in kills if k["after"] in DEAD]
    unnoticed = [k["pid"] for k in kills if not _named(k["pid"], reasons)]
    ok = len(kills) >= at_least and len(dead) == len(kills) and (not unnoticed or unnoticed == [kills[-1]["pid"]])
    return Proof(
        ok,
        f"{len(kills)} SIGKILLs (want >= {at_least}), {len(dead)} seen dead in /proc, "
        f"not named by a restart: {unnoticed}",
    )


def proved_node_lost(record: dict, summary: dict) -> Proof:
    """A worker node crashed: its processes are gone (read from /proc after the kill), and a restart
    reason of the run names the pid of an engine that ran on it."""
    if "removed_at" not in record:
        return Proof(False, "no node was removed")
    node, engines = record.get("node_pids_after", {}), record.get("engine_pids_after", {})
    gone = bool(node) and bool(engines) and all(s in DEAD for s in [*node.values(), *engines.values()])
    reasons = summary.get("engine_faults", {}).get("reasons", [])
    noticed = any(_named(int(pid), reasons) for pid in engines)
    return Proof(
        gone and noticed,
        f"node {record.get('removed_ip')}: its processes {node}, engines {engines}; "
        + ("a restart names its engine" if noticed else f"no restart names its engine: {reasons}"),
    )


def proved_node_joined(record: dict, summary: dict) -> Proof:
    """A node was added, Ray's GCS showed an engine on it, and the run counted that engine as joined."""
    on_node = record.get("engines_on_added", [])
    joined = [j["engine"] for j in summary.get("engine_joins", [])]
    ok = "added_ip" in record and bool(on_node) and any(e in joined for e in on_node)
    return Proof(ok, f"node {record.get('added_ip')}: engines there {on_node}; the run's joins {joined}")


def proved_stalled(record: dict, summary: dict) -> Proof:
    """An engine was stopped (SIGSTOP, seen as 'T' in /proc) and a restart reason names its pid."""
    if "stalled_pid" not in record:
        return Proof(False, "no engine was stalled")
    pid, state = record["stalled_pid"], record.get("stalled_state")
    reasons = summary.get("engine_faults", {}).get("reasons", [])
    noticed = _named(pid, reasons)
    return Proof(
        state in STOPPED and noticed,
        f"SIGSTOP pid {pid}: /proc {state}; "
        + ("a restart names it" if noticed else f"no restart names it: {reasons}"),
    )


def total(counts: Iterable[int | None]) -> str:
    """A RESULT's sum of counts, or 'unread' when any could not be read: never a sum that takes a
    missing count for 0."""
    values = list(counts)
    return "unread" if any(v is None for v in values) else str(sum(v for v in values if v is not None))


@dataclass(frozen=True)
class Verified:
    """`nonstop verify`'s lost and duplicated counts (None: could not be read, see `why`)."""

    lost: int | None
    duplicated: int | None
    drawn: int | None
    why: str
    output: str
    code: int | None = None  # verify's exit status: 1 also on a recorded prompt that was never drawn

    @property
    def clean(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.code == 0


def verified(run_dir: Path | None) -> Verified:
    """Run `nonstop verify run_dir` and read its counts; exit 2, no run folder or a row missing from
    its table leaves that count None."""
    if run_dir is None or not run_dir.is_dir():
        return Verified(None, None, None, f"no run folder {run_dir}", "")
    result = nonstop(["verify", str(run_dir)], cwd=run_dir.parent, timeout_s=300)
    text = result.stdout + result.stderr
    if result.returncode not in (0, 1):
        return Verified(None, None, None, f"verify exited {result.returncode}: {text.strip()[-300:]}", text)
    counts: dict[str, int] = {}
    for line in result.stdout.splitlines():
        head, _, rest = line.partition("  ")
        value = rest.split()[0] if rest.split() else ""
        if head.strip() in ("lost", "duplicated", "prompts drawn") and value.isdigit():
            counts[head.strip()] = int(value)
    missing = [k for k in ("lost", "duplicated", "prompts drawn") if k not in counts]
    why = f"verify printed no {', '.join(missing)} row" if missing else f"verify exited {result.returncode}"
    return Verified(
        counts.get("lost"), counts.get("duplicated"), counts.get("prompts drawn"), why, text, result.returncode
    )


def epoch_args(model: Path, name: str, reward: str, *extra: str) -> list[str]:
    """`nonstop train` over one epoch of a small addition task on `model`, checkpointing every 2 steps,
    scored by the reward function `reward` (a dotted path: the fault rewards make the fault)."""
    return [
        "train",
        *small_model_args(model),
        *sets(
            {
                "run.name": name,
                "run.max_epochs": 1,
                "run.max_time_s": None,
                "task.max_operand": 9,
                "task.eval_size": 20,
                "rollout.prompts_per_step": 8,
                "checkpoint.every_steps": 2,
                "run.eval_every": 100,
                "task.reward": reward,
            }
        ),
        *extra,
    ]
