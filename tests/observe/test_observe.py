"""The span log, the run report and the capacity planner's calibration, on one real short run.

One module-scoped run (orchestrator + engine process + trainer process, the small random model)
feeds every test that needs a span log; the report test opens the rendered page in headless
Chromium and reads back what the page's own script found (figures decoded, script errors).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from nonstop.config import load_config
from nonstop.observe.spans import CHUNK_S, PassRecorder, SpanLog, read_spans, span_path
from nonstop.observe.timeline import Timeline, union_length
from nonstop.orchestrator.actors import span_file
from support.cli import nonstop, records, sets, small_model_args

STEPS = 8


@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("observe")
    r = nonstop(
        [
            "train",
            *small_model_args(tiny_dir),
            *sets(
                {
                    "run.out_dir": out,
                    "run.name": "obs",
                    "run.max_steps": STEPS,
                    "run.max_time_s": None,
                    "task.eval_size": 20,
                    "rollout.prompts_per_step": 8,
                    "rollout.filter_uniform_reward": False,
                    "checkpoint.every_steps": None,
                    "run.eval_every": 4,
                }
            ),
        ],
        cwd=out,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return out / "obs"


def test_span_files_share_one_timeline(tmp_path):
    """Two processes' files with different anchors land on one timeline through their anchors."""
    a, b = SpanLog(span_path(tmp_path, "orchestrator")), SpanLog(span_path(tmp_path, "engine-0"))
    t = time.monotonic()
    a.emit("rl_start", t=t)
    a.emit("train", step=1, t0=t + 1.0, t1=t + 2.0, groups=[], queued=0)
    b.emit("busy", t0=t + 0.5, t1=t + 0.75, passes=3, rows=30, busy_s=0.2)
    a.close()
    b.close()
    with span_path(tmp_path, "engine-0").open("a") as f:
        f.write('{"t0": 1.0, "t1"')  # a killed process's partial last line is skipped
    spans = read_spans(tmp_path)
    assert spans["orchestrator"][1]["t0"] == pytest.approx(1.0, abs=1e-3)
    assert spans["engine-0"] == [
        {
            "t0": pytest.approx(0.5, abs=1e-3),
            "t1": pytest.approx(0.75, abs=1e-3),
            "passes": 3,
            "rows": 30,
            "busy_s": 0.2,
            "ev": "busy",
        }
    ]


def test_pass_recorder_coalesces_passes_into_chunks(tmp_path):
    log = SpanLog(tmp_path / "e.jsonl")
    rec = PassRecorder(log)
    assert CHUNK_S == 0.05
    for i in range(10):  # back-to-back 8 ms passes: a chunk holds 6 (48 ms), the 7th would pass CHUNK_S
        rec.record(100 + 0.008 * i, 100 + 0.008 * (i + 1), 8)
    rec.record(101.0, 101.01, 2)  # after a pause: a chunk of its own
    rec.flush()
    log.close()
    chunks = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()[1:]]
    assert [c["passes"] for c in chunks] == [6, 4, 1]
    assert sum(c["rows"] for c in chunks) == 82
    assert all(c["t1"] - c["t0"] <= CHUNK_S + 1e-9 for c in chunks)


def test_pass_recorder_counts_prefills_when_the_engine_reports_them(tmp_path):
    """Passes that prefilled new prompts, and their tokens, summed per chunk; an engine that does
    not report them (vLLM's) writes chunks without the fields, not zeros."""
    log = SpanLog(tmp_path / "e.jsonl")
    rec = PassRecorder(log)
    for i, prefill in enumerate([(1, 12), (0, 0), (1, 30), (0, 0)]):
        rec.record(100 + 0.008 * i, 100 + 0.008 * (i + 1), 8, prefill=prefill)
    rec.flush()
    rec.record(101.0, 101.01, 2)
    rec.flush()
    rec.record(102.0, 102.01, 2, reads=40)
    rec.record(102.01, 102.02, 2, reads=44)
    rec.flush()
    log.close()
    chunks = [json.loads(x) for x in (tmp_path / "e.jsonl").read_text().splitlines()[1:]]
    assert (chunks[0]["prefills"], chunks[0]["prefill_tokens"]) == (2, 42)
    assert "prefills" not in chunks[1] and "reads" not in chunks[1]
    assert chunks[2]["reads"] == 84


def test_spans_off_names_no_file(tmp_path):
    assert span_file(load_config(overrides=["run.spans=false"]), tmp_path, "engine-0") is None
    assert span_file(load_config(), tmp_path, "engine-0") == str(tmp_path / "spans" / "engine-0.jsonl")


def test_union_length_clips_and_merges():
    assert union_length([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_length([(0, 2), (1, 3), (5, 6)], 1.5, 5.5) == pytest.approx(2.0)


def test_run_span_log_accounts_for_every_group_step_and_token(run_dir):
    tl = Timeline.load(run_dir)
    recs = [r for r in records(run_dir) if not r.get("final_eval")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert len(recs) == STEPS
    steps = tl.events["trainer-0"]
    assert [e["version"] for e in steps if e["ev"] == "step"] == list(range(1, STEPS + 1))
    assert len([e for e in steps if e["ev"] == "publish"]) == STEPS
    # every generated sample is in exactly one group event; every trained group is one of them
    assert sum(len(g.lens) for g in tl.groups) == summary["samples_generated"]
    ids = {g.id for g in tl.groups}
    assert len(ids) == len(tl.groups)
    for r in recs:
        assert {tuple(p) for p in r["prompts"]} == {k for k, s in tl.trained.items() if s == r["step"]}
        assert {tuple(p) for p in r["prompts"]} <= ids
    # the engine generated at least every token of every group (plus the held-out evaluations)
    rows = sum(e["rows"] for e in tl.events["engine-0"] if e["ev"] == "busy")
    assert rows >= sum(sum(g.lens) for g in tl.groups)
    # and prefilled every group's prompt once, in passes it counts (a pass may prefill several)
    chunks = [e for e in tl.events["engine-0"] if e["ev"] == "busy"]
    assert all(0 <= e["prefills"] <= e["passes"] for e in chunks)
    assert 0 < sum(e["prefills"] for e in chunks) and sum(e["prefill_tokens"] for e in chunks) >= len(tl.groups)
    # decode attention reads at least every decode row's prompt and the tokens before it
    assert all(e["reads"] >= e["rows"] for e in chunks) and sum(e["reads"] for e in chunks) > rows
    # one clock: each group's life is ordered, and trained groups were generated before their step began
    train_t0 = {e["step"]: e["t0"] for e in tl.events["orchestrator"] if e["ev"] == "train"}
    for g in tl.groups:
        assert g.t_admit <= g.t_gen0 <= g.t_gen1 <= g.t_done
        if g.id in tl.trained:
            assert g.t_done <= train_t0[tl.trained[g.id]] + 1e-3
    # depth 1: engines applied each published version; no trained token lags more than 1
    applied = [e["version"] for e in tl.events["engine-0"] if e["ev"] == "apply"]
    assert applied and applied == sorted(applied) and applied[-1] >= STEPS - 1
    assert max(tl.lag_hist()) <= 1
    assert 0.0 <= tl.idle_fraction("trainer") < 1.0 and 0.0 <= tl.idle_fraction("engine") < 1.0
    # processor time: positive, and no more than the wall time an actor had (one thread of torch each)
    timed = [e for e in tl.events["engine-0"] if e["ev"] == "busy"] + [e for e in steps if e["ev"] == "step"]
    assert all(0 < e["cpu_s"] <= (e["t1"] - e["t0"]) * 1.05 + 0.002 for e in timed)
    start = [e for e in tl.events["orchestrator"] if e["ev"] == "rl_start"][0]
    assert start["cpus"] >= 1 and start["cpu_actors"] is True


def test_report_renders_and_loads_in_headless_chromium(run_dir, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed here (apt-get install -y chromium; .ci/run installs it)")
    r = nonstop(["report", str(run_dir), "--out", str(tmp_path / "page.html")], cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    page = tmp_path / "page.html"
    assert sorted(p.stem for p in (tmp_path / "report").glob("*.png")) == sorted(
        ["drops", "lag", "ratios", "rewards", "throughput", "timeline"]
    )
    dom = subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert 'data-figures="6/6"' in dom and 'data-errors="0"' in dom, dom[:300]


def test_report_of_a_folder_that_is_not_a_run_says_so(tmp_path):
    """Not a run: said as such, not blamed on run.spans; a folder of runs names them. A run
    without a span log (run.spans off) is told that instead."""
    (tmp_path / "runs" / "first").mkdir(parents=True)
    (tmp_path / "runs" / "first" / "config.yaml").write_text("run:\n  spans: false\n")
    (tmp_path / "runs" / "notes").mkdir()
    r = nonstop(["report", str(tmp_path)], cwd=tmp_path)
    assert r.returncode == 2 and f"{tmp_path}: not a run folder" in r.stderr, r.stderr
    assert "run.spans" not in r.stderr and "runs/<name>" in r.stderr, r.stderr
    r = nonstop(["report", str(tmp_path / "runs")], cwd=tmp_path)
    assert r.returncode == 2 and "not a run folder" in r.stderr and "the runs in it: first" in r.stderr, r.stderr
    assert "notes" not in r.stderr
    r = nonstop(["report", str(tmp_path / "runs" / "first")], cwd=tmp_path)
    assert r.returncode == 2 and "no span log (was run.spans off?)" in r.stderr, r.stderr


def test_simulate_calibrates_on_the_run_and_recommends(run_dir, tmp_path):
    """`nonstop simulate RUN_DIR` fits its costs to the run's span log, predicts the run's own
    pipeline near what the span log measured, and sweeps to a recommendation."""
    from nonstop.planner.calibrate import calibrate
    from nonstop.planner.model import simulate
    from nonstop.planner.params import PlanParams, Shape

    tl = Timeline.load(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    p = calibrate(tl, cfg)
    assert p.pass_s >= 0 and p.pass_row_s >= 0 and p.step_token_s >= 0 and p.pass_s + p.pass_row_s > 0
    assert sum(len(g) for g in p.groups_lens) == sum(len(g.lens) for g in tl.groups)
    # The orchestrator's own costs, measured. The per-group handling time is a robust (median)
    # fit that may come out 0 on a run this short when few groups queued behind each other (it
    # did once in CI); the batch call's cost per sample is measured directly.
    assert p.orch_group_s >= 0 and p.call_sample_s > 0
    assert p.cores is None or 0 < p.cores <= 32  # from the processor time the actors got
    pred = simulate(p, Shape.of(cfg))
    assert 0.5 < pred.samples_per_s / tl.samples_per_s() < 2.0  # a loose bar: this machine is shared
    r = nonstop(
        [
            "simulate",
            str(run_dir),
            "--sweep",
            "buffer.depth=0,1",
            "--sweep",
            "runtime.num_engines=1,2",
            "--write-params",
            str(tmp_path / "costs.json"),
            "--seeds",
            "1",
        ],
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "recommended: --set buffer.depth=" in r.stdout
    assert PlanParams.load(tmp_path / "costs.json") == p
    bad = nonstop(["simulate", str(run_dir), "--sweep", "buffer.depht=1"], cwd=tmp_path)
    assert bad.returncode == 2 and "buffer.depht" in bad.stdout
