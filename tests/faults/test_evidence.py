"""The evidence the fault tests and benches rely on (support/faults.py) can say no: a signal's
effect is read back from /proc on a real process, a fault the run's records do not name is not
proven, a checkpoint flip that changed nothing is not a corruption, a count `nonstop verify` could
not read is None and 'unread', and bench/faults.py counts a row whose fault did not fire as failed."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess

from support import ROOT
from support.faults import (
    DEAD,
    Proof,
    Verified,
    fault_log,
    proved_corrupted,
    proved_each_kill,
    proved_engine_signalled,
    proved_node_lost,
    send,
    total,
    verified,
)


def test_send_reads_the_state_of_the_signalled_process_back_and_the_run_must_name_its_pid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the log goes to the working folder, as in a run's orchestrator
    victim = subprocess.Popen(["sleep", "60"])
    try:
        assert send("nonstop-engine", victim.pid, signal.SIGSTOP) == "T"
        assert send("nonstop-engine", victim.pid, signal.SIGKILL) in DEAD
    finally:
        victim.kill()
        victim.wait()
    log = fault_log(tmp_path)
    assert [(e["fault"], e["pid"]) for e in log] == [("SIGSTOP", victim.pid), ("SIGKILL", victim.pid)]
    named = {"engine_faults": {"reasons": [f"actor 'engine' (pid {victim.pid}) died (killed by signal 9)"]}}
    other = {"engine_faults": {"reasons": [f"actor 'engine' (pid {victim.pid + 1}) died (killed by signal 9)"]}}
    assert proved_engine_signalled(tmp_path, named, "SIGKILL").fired
    assert not proved_engine_signalled(tmp_path, other, "SIGKILL").fired  # the run saw another process die
    assert not proved_engine_signalled(tmp_path, named, "SIGKILL", "nonstop-engine-0").fired  # not that engine


def test_a_kill_that_left_the_process_running_or_unnoticed_is_not_proven(tmp_path):
    (tmp_path / "faults.jsonl").write_text(
        json.dumps({"fault": "SIGKILL", "target": "nonstop-engine", "pid": 7, "t": 0.0, "after": "S"}) + "\n"
    )
    summary = {"engine_faults": {"reasons": ["actor 'engine' (pid 7) died (killed by signal 9)"]}}
    assert not proved_engine_signalled(tmp_path, summary, "SIGKILL").fired  # /proc saw it sleeping, not dead
    kills = [{"pid": 7, "after": "Z"}, {"pid": 8, "after": "gone"}, {"pid": 9, "after": "gone"}]
    reasons = {"engine_faults": {"reasons": ["(pid 7)", "(pid 9)"]}}
    assert not proved_each_kill(kills, reasons, 2).fired  # pid 8, not the last, was never noticed
    assert proved_each_kill(kills[:2], reasons, 1).fired  # the last kill may meet a stopping run
    assert not proved_each_kill(kills[:1], reasons, 2).fired  # fewer kills than the schedule promised
    crash = {"removed_at": 1.0, "removed_ip": "127.0.0.3", "node_pids_after": {"5": "gone"}}
    lost = {"engine_faults": {"reasons": ["actor 'engine-1' (pid 7) went with its node 127.0.0.3"]}}
    assert proved_node_lost({**crash, "engine_pids_after": {"7": "Z"}}, lost).fired
    assert not proved_node_lost({**crash, "engine_pids_after": {"7": "S"}}, lost).fired  # its engine still ran
    assert not proved_node_lost({**crash, "engine_pids_after": {"8": "gone"}}, lost).fired  # the run named another


def test_a_checkpoint_flip_must_change_the_file_and_be_refused_by_the_resume():
    change = {"step": "step_00000004", "crc_before": 1, "crc_written": 2, "crc_read_back": 2}
    refused = "checkpoint step_00000004 is corrupted (...); resumed from step_00000002 (step 2, ...)"
    assert proved_corrupted(change, refused).fired
    assert not proved_corrupted({**change, "crc_read_back": 1}, refused).fired  # the disk kept the old bytes
    assert not proved_corrupted(change, "resumed from step_00000004").fired  # the resume used it anyway
    assert not proved_corrupted(None, refused).fired


def test_a_count_verify_could_not_read_is_none_and_unread_never_0(tmp_path):
    assert verified(tmp_path / "absent").lost is None
    (tmp_path / "runs" / "x").mkdir(parents=True)  # no config.yaml, no records: verify exits 2
    counts = verified(tmp_path / "runs" / "x")
    assert counts.lost is None and counts.duplicated is None and not counts.clean
    assert "exited 2" in counts.why and "config.yaml" in counts.why, counts.why
    assert total([0, None, 0]) == "unread" and total([0, 2]) == "2"


def test_bench_faults_counts_a_row_whose_fault_did_not_fire_as_failed():
    spec = importlib.util.spec_from_file_location("bench_faults", ROOT / "bench" / "faults.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    clean = Verified(lost=0, duplicated=0, drawn=80, why="", output="", code=0)
    summary = {"engine_faults": {"restarts": 0}}
    assert bench.row(True, [0], Proof(True, "seen"), clean, summary, 1.0, "")["survived"]
    assert not bench.row(True, [0], Proof(False, "not seen"), clean, summary, 1.0, "")["survived"]
    unread = Verified(lost=None, duplicated=None, drawn=None, why="verify exited 2", output="", code=2)
    assert not bench.row(True, [0], Proof(True, "seen"), unread, summary, 1.0, "")["survived"]
