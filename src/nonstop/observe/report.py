"""`nonstop report RUN_DIR`: one self-contained HTML page (and its figures as PNGs) about a run.

Reads the run folder (metrics.jsonl, summary.json, config.yaml and the span log, via
nonstop.observe.timeline) and draws with matplotlib (the optional extra `report`):

1. reward and held-out accuracy over RL time;
2. a timeline (Gantt) of the engines, the trainer ranks and the orchestrator's waits, for the
   whole run and zoomed in on a few steps in its middle;
3. the per-token lag histogram of the trained tokens;
4. importance-ratio and clip statistics per step;
5. samples/s generated and the engines' and trainer's busy fractions over time;
6. groups dropped, by reason, and how long groups took from admission to delivery.
Its table of facts includes the trainer's and the engines' achieved FLOP/s and their fraction of
the probed matmul peak (summary.json's `flops`, docs/precision.md). Above the figures, the run
doctor's findings (summary.json's `doctor`; for a run without one, diagnosed from metrics.jsonl
now, observe/doctor.py): what it saw, the likely cause, the setting to try.

The page embeds every figure as a base64 PNG, so it is one file that opens anywhere; the PNGs
are written beside it (`RUN_DIR/report/`). A small inline script checks that every figure
decoded and marks the body (`data-figures`, `data-errors`), which the test reads back from
headless Chromium.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from nonstop.config import DoctorConfig
from nonstop.errors import ObserveError
from nonstop.observe.doctor import Context, diagnose, read_records
from nonstop.observe.timeline import Interval, Timeline

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

LANE_COLORS = {
    "busy": "#4C72B0",
    "apply": "#DD8452",
    "step": "#55A868",
    "publish": "#C44E52",
    "ahead": "#8DC79A",
    "wait": "#BBBBBB",
    "eval": "#8172B3",
    "checkpoint": "#937860",
}


class ReportError(ObserveError, RuntimeError):
    """The run folder lacks what the report needs; the message says what."""


def _plt():
    try:  # optional: the report extra
        import matplotlib
    except ImportError:
        raise ReportError("nonstop report needs matplotlib: pip install 'nonstop[report]'") from None
    matplotlib.use("Agg")  # no display here; set before pyplot is imported
    import matplotlib.pyplot as plt  # optional: the report extra, found above

    return plt


def _merge(intervals: list[Interval], gap_s: float) -> list[Interval]:
    """Intervals closer than gap_s joined (a figure cannot show gaps below a pixel anyway)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if out and a - out[-1][1] <= gap_s:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def gantt(ax: Axes, tl: Timeline, lo: float, hi: float) -> None:
    lanes = [*tl.actors("engine"), *tl.actors("trainer"), "orchestrator"]
    gap = (hi - lo) / 2000
    seen: set[str] = set()
    for row, actor in enumerate(reversed(lanes)):
        for kind, ivs in tl.lanes.get(actor, {}).items():
            if kind not in LANE_COLORS or (actor == "orchestrator" and kind not in ("wait", "eval", "checkpoint")):
                continue
            bars = [(a, b - a) for a, b in _merge(ivs, gap) if b >= lo and a <= hi]
            height = 0.35 if kind in ("apply", "publish") else 0.7
            ax.broken_barh(
                bars, (row - height / 2, height), color=LANE_COLORS[kind], label=kind if kind not in seen else None
            )
            seen.add(kind)
    ax.set_yticks(range(len(lanes)), list(reversed(lanes)))
    ax.set_xlim(lo, hi)
    ax.set_xlabel("seconds since RL start")
    ax.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(seen), frameon=False)


def zoom_window(tl: Timeline, steps: int = 4) -> tuple[float, float]:
    """A few trainer steps in the middle of the run (the whole run if it has fewer)."""
    train = [e for e in tl.events.get("orchestrator", []) if e["ev"] == "train"]
    if len(train) <= steps:
        return 0.0, tl.end
    mid = len(train) // 2
    return train[mid]["t0"] - 0.05 * (train[mid + steps - 1]["t1"] - train[mid]["t0"]), train[mid + steps - 1]["t1"]


def fig_rewards(plt, tl: Timeline, metric: str = "exact_match") -> Figure:
    """`metric`: the held-out score's name (summary.json's eval_metric: the task's reward)."""
    fig, ax = plt.subplots(figsize=(9, 3.2))
    t = [r["time_s"] for r in tl.steps]
    ax.plot(t, [r["reward_mean"] for r in tl.steps], color="#4C72B0", lw=1, label="reward (trained samples)")
    evals = [(r["time_s"], r["eval_accuracy"]) for r in tl.steps if "eval_accuracy" in r]
    evals += [(tl.steps[-1]["time_s"], r["eval_accuracy"]) for r in tl.final_evals if tl.steps]
    if evals:
        ax.plot(*zip(*evals), "o-", color="#C44E52", label=f"held-out {metric}")
    ax.set_xlabel("RL seconds")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title(f"reward and held-out {metric}")
    return fig


def fig_gantt(plt, tl: Timeline) -> Figure:
    rows = len(tl.actors("engine")) + len(tl.actors("trainer")) + 1
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 1.2 + 1.1 * rows))
    gantt(a1, tl, 0.0, tl.end)
    a1.set_title("timeline: whole run", loc="left")
    lo, hi = zoom_window(tl)
    gantt(a2, tl, lo, hi)
    a2.set_title(f"timeline: zoom {lo:.1f}-{hi:.1f} s", loc="left")
    fig.tight_layout()
    return fig


def fig_lag(plt, tl: Timeline) -> Figure:
    fig, ax = plt.subplots(figsize=(5, 3))
    hist = tl.lag_hist()
    total = sum(hist.values()) or 1
    ax.bar([str(k) for k in hist], [v / total for v in hist.values()], color="#4C72B0")
    ax.set_xlabel("lag (trainer version - token version)")
    ax.set_ylabel("fraction of trained tokens")
    ax.set_title(f"per-token lag ({total} tokens)")
    return fig


def fig_ratios(plt, tl: Timeline) -> Figure:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
    s = [r["step"] for r in tl.steps]
    if tl.steps and "ratio_mean" in tl.steps[0]:
        a1.fill_between(
            s, [r["ratio_min"] for r in tl.steps], [r["ratio_max"] for r in tl.steps], alpha=0.3, label="min-max"
        )
        a1.plot(s, [r["ratio_mean"] for r in tl.steps], lw=1, label="mean")
    a1.set_title("importance ratio pi/mu per step")
    a1.set_xlabel("step")
    a1.legend(fontsize=8)
    for key in ("clip_frac", "dual_clip_frac", "is_truncated_frac", "is_masked_frac"):
        if tl.steps and key in tl.steps[0]:
            a2.plot(s, [r[key] for r in tl.steps], lw=1, label=key)
    a2.set_title("clipped / corrected token fractions")
    a2.set_xlabel("step")
    a2.legend(fontsize=7)
    fig.tight_layout()
    return fig


def fig_throughput(plt, tl: Timeline) -> Figure:
    b = tl.binned()
    fig, a1 = plt.subplots(figsize=(9, 3.2))
    a1.plot(b["t"], b["samples_per_s"], color="#4C72B0", label="samples/s generated")
    a1.set_xlabel("RL seconds")
    a1.set_ylabel("samples/s")
    a2 = a1.twinx()
    a2.plot(b["t"], [1 - x for x in b["engine_busy"]], color="#DD8452", lw=1, label="engine idle")
    a2.plot(b["t"], [1 - x for x in b["trainer_busy"]], color="#55A868", lw=1, label="trainer idle")
    a2.set_ylim(0, 1)
    a2.set_ylabel("idle fraction")
    lines = a1.get_legend_handles_labels()[0] + a2.get_legend_handles_labels()[0]
    a1.legend(lines, [str(x.get_label()) for x in lines], fontsize=8, loc="lower right")
    a1.set_title("throughput and idle over time")
    return fig


def fig_drops(plt, tl: Timeline) -> Figure:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3))
    drops = dict(tl.drops) or {"none": 0}
    a1.barh(list(drops), list(drops.values()), color="#C44E52")
    a1.set_title(f"groups dropped by reason ({sum(tl.drops.values())} of {len(tl.groups)})")
    gen = [g.t_gen1 - g.t_gen0 for g in tl.groups]
    wait = [g.t_gen0 - g.t_admit for g in tl.groups]
    if gen:
        a2.hist([gen, wait], bins=40, label=["generation", "admitted -> engine call"], histtype="step")
    a2.set_xlabel("seconds")
    a2.set_title("group latencies")
    a2.legend(fontsize=8)
    fig.tight_layout()
    return fig


FIGURES = {
    "rewards": fig_rewards,
    "timeline": fig_gantt,
    "lag": fig_lag,
    "ratios": fig_ratios,
    "throughput": fig_throughput,
    "drops": fig_drops,
}


def _flop_facts(flops: dict[str, Any]) -> list[tuple[str, str]]:
    """summary.json's achieved FLOP/s (observe/flops.py) as 'GFLOP/s (fraction of the probed peak)'."""
    out = []
    for side in ("trainer", "engine"):
        achieved, frac = flops.get(f"{side}_flops_per_s"), flops.get(f"{side}_peak_frac")
        if achieved is not None and frac is not None:
            out.append((f"{side} achieved FLOP/s", f"{achieved / 1e9:.1f} GFLOP/s ({frac:.0%} of its matmul peak)"))
    return out


def _facts(tl: Timeline, run_dir: Path) -> list[tuple[str, str]]:
    facts: list[tuple[str, str]] = [("run folder", str(run_dir))]
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        s: dict[str, Any] = json.loads(summary_path.read_text())
        final = s.get("final_accuracy")
        facts += [
            (
                f"held-out {s.get('eval_metric', 'exact_match')}",
                f"base {s['base_accuracy']:.1%} -> final {'-' if final is None else f'{final:.1%}'}",
            ),
            ("steps", f"{s['steps']} (policy_version {s['policy_version']})"),
            ("samples/s (summary)", f"{s['samples_per_s']:.1f}"),
        ]
        facts += _flop_facts(s.get("flops") or {})
    facts += [
        ("samples/s (span log)", f"{tl.samples_per_s():.1f}"),
        ("engine idle", f"{tl.idle_fraction('engine'):.1%}"),
        ("trainer idle", f"{tl.idle_fraction('trainer'):.1%}"),
        ("engines / trainer ranks", f"{len(tl.actors('engine'))} / {len(tl.actors('trainer'))}"),
        ("groups generated / dropped", f"{len(tl.groups)} / {sum(tl.drops.values())}"),
    ]
    cfg_path = run_dir / "config.yaml"
    if cfg_path.exists():
        cfg = yaml.safe_load(cfg_path.read_text())
        facts.append(("buffer", ", ".join(f"{k} {v}" for k, v in cfg.get("buffer", {}).items())))
        r = cfg.get("rollout", {})
        facts.append(
            (
                "rollout",
                f"{r.get('prompts_per_step')} prompts x {r.get('group_size')} completions, "
                f"max_new_tokens {r.get('max_new_tokens')}",
            )
        )
    return facts


def doctor_findings(run_dir: Path, tl: Timeline | None = None) -> list[dict[str, Any]] | None:
    """The run doctor's findings: summary.json's, else diagnosed from metrics.jsonl and config.yaml
    (a run still going, or one that stopped early); None when the doctor was off."""
    summary_path, cfg_path = run_dir / "summary.json", run_dir / "config.yaml"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    if summary.get("doctor") is not None:
        return summary["doctor"]["findings"] if summary["doctor"]["enabled"] else None
    tree = (yaml.safe_load(cfg_path.read_text()) or {}) if cfg_path.exists() else {}
    cfg = DoctorConfig.model_validate(tree.get("doctor") or {})
    if not cfg.enabled:
        return None
    base = summary.get("base_accuracy")
    if base is None and tl is not None:  # a run still going (or one that failed): its span log has it
        starts = [e for e in tl.events.get("orchestrator", []) if e["ev"] == "rl_start" and "base_accuracy" in e]
        base = starts[0]["base_accuracy"] if starts else None
    records = read_records(run_dir / "metrics.jsonl")
    if base is None:  # no span log either: the first evaluation stands in for the base
        base = next((r["eval_accuracy"] for r in records if r.get("eval_accuracy") is not None), 0.0)
    return [f.to_dict() for f in diagnose(records, base, Context.of(tree), cfg)]


def _doctor_html(findings: list[dict[str, Any]] | None) -> str:
    if findings is None:
        return "<h2>doctor</h2><p>off (doctor.enabled false)</p>"
    if not findings:
        return "<h2>doctor</h2><p class='doctor'>no findings: none of the patterns of a run that stopped learning</p>"
    items = "".join(
        f"<li class='finding'><b>{html.escape(f['code'])}</b> (step {f['step']}): {html.escape(f['seen'])}. "
        f"<br>Likely: {html.escape(f['cause'])}.<br>Try: {html.escape('; '.join(f['try']))}"
        + (f"<br>Cleared: {html.escape(f['cleared'])}" if f.get("cleared") else "")
        + "</li>"
        for f in findings
    )
    return f"<h2>doctor</h2><ul class='doctor'>{items}</ul>"


CHECK_SCRIPT = """
window.addEventListener('error', function () {
  document.body.dataset.errors = String(Number(document.body.dataset.errors || 0) + 1);
});
window.addEventListener('load', function () {
  var imgs = document.querySelectorAll('img.figure');
  var ok = 0;
  imgs.forEach(function (i) { if (i.complete && i.naturalWidth > 0) { ok += 1; } });
  document.body.dataset.figures = ok + '/' + imgs.length;
  document.body.dataset.errors = document.body.dataset.errors || '0';
});
"""


RUN_FILES = ("config.yaml", "metrics.jsonl")
"""What every run folder holds (launch writes config.yaml before anything runs): a folder with
neither is not a run, whatever else is missing from it."""


def _not_a_run(folder: Path) -> ReportError:
    runs = sorted(d.name for d in folder.iterdir() if d.is_dir() and any((d / f).exists() for f in RUN_FILES))
    inside = f"; the runs in it: {', '.join(runs[:10])}{', ...' if len(runs) > 10 else ''}" if runs else ""
    return ReportError(
        f"{folder}: not a run folder (no {' or '.join(RUN_FILES)}; give the folder `nonstop train` "
        f"wrote, as runs/<name>){inside}"
    )


def render(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Write the report page (default RUN_DIR/report.html) and its PNGs; returns the page's path."""
    run_dir = Path(run_dir)
    if not any((run_dir / f).exists() for f in RUN_FILES):
        raise _not_a_run(run_dir)
    try:
        tl = Timeline.load(run_dir)
    except FileNotFoundError as e:
        raise ReportError(f"{run_dir}: {e}") from None
    if not tl.steps:
        raise ReportError(f"{run_dir}/metrics.jsonl: no trainer steps recorded yet")
    plt = _plt()
    page = Path(out) if out is not None else run_dir / "report.html"
    png_dir = page.parent / "report"
    png_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    summary = run_dir / "summary.json"
    metric = json.loads(summary.read_text()).get("eval_metric", "exact_match") if summary.exists() else "exact_match"
    for name, draw in FIGURES.items():
        fig = fig_rewards(plt, tl, metric) if draw is fig_rewards else draw(plt, tl)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        (png_dir / f"{name}.png").write_bytes(buf.getvalue())
        parts.append(
            f'<h2>{name}</h2><img class="figure" alt="{name}" '
            f'src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'
        )
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _facts(tl, run_dir))
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>nonstop run report</title>"
        "<style>body{font-family:sans-serif;max-width:1250px;margin:1em auto}img{max-width:100%}"
        "th{text-align:left;padding-right:1em}</style>"
        f"<script>{CHECK_SCRIPT}</script></head><body><h1>nonstop run report</h1>"
        f"<table>{rows}</table>{_doctor_html(doctor_findings(run_dir, tl))}{''.join(parts)}</body></html>"
    )
    return page
