"""The span log: what every group went through and when every actor was busy, on one clock.

Each process that records writes its own append-only JSONL file under `RUN_DIR/spans/`
(`orchestrator.jsonl`, `engine-0.jsonl`, `trainer-0.jsonl`, ...), so no message between
processes changes and no lock is shared. Times are `time.monotonic()` seconds; the first line of
every file is a clock anchor `{"ev": "clock", "wall": time.time(), "mono": time.monotonic(), ...}`
taken at the same instant, so a reader maps any file's times to wall-clock time
(`wall + t - mono`) and lines files of different processes (or hosts) up on one timeline
(`read_spans`). On one host the monotonic clock is shared by every process, so the mapping
there is exact up to the anchor's microseconds.

Events (every time field is monotonic seconds; `t0`/`t1` bound an interval):
- orchestrator: `rl_start` (t; base_accuracy: the held-out accuracy RL starts from; cpus:
  processors this host lets the run use, cpu_actors: whether the engines and trainer ranks
  compute on them, as local processes do without an accelerator: the capacity planner then has
  them share those processors), `group` (id [epoch, prompt],
  t_admit, t_gen0, t_gen1, t_scored, t_done, lens: completion tokens per sample, v: [oldest,
  newest] policy_version of its tokens),
  `drop` (id, reason, t), `wait` (learning loop waiting for a batch; t0, t1, step; cpu: the
  orchestrator process's processor time so far, at t0), `train`
  (step, t0, t1, groups, queued), `ahead` (step, t0, t1, groups: the forward of a batch's first
  groups, run while the loop waits for the rest), `publish` (step, version, t0, t1), `eval` and
  `checkpoint` (t0, t1);
- engine: `busy` (t0, t1, passes, rows, busy_s, cpu_s: consecutive forward passes coalesced into
  one chunk of about `CHUNK_S`; rows = tokens emitted, summed over the passes; busy_s = the
  passes' own time, t1 - t0 = that plus the engine's work between them: taking requests,
  returning results; cpu_s = the processor time the engine's process got over the chunk, less
  than t1 - t0 when it shared a processor or waited; a chunk cut for length ends where the next
  begins), `apply` (t0, t1, version: a new policy_version made live);
- trainer rank: `step` (t0, t1, version, tokens, samples, update_s: the part of the step that
  does not grow with its tokens, gradient clip and optimizer step; cpu_s: the rank's processor
  time over the step), `ahead` (t0, t1, groups: a forward pass run ahead of its step),
  `publish` (t0, t1, version, bytes).

Cost: one `json.dumps` and a buffered write per event (a few microseconds); engines coalesce
their forward passes, so a busy engine writes about 1 / CHUNK_S lines a second. Files are
flushed every FLUSH_S seconds and on close; a killed process loses at most that tail.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from nonstop.config import Config

SPANS_DIR = "spans"
CHUNK_S = 0.05  # an engine's busy chunk is cut once it would grow longer than this
GAP_S = 0.25  # a longer pause between two passes ends a chunk (the engine also flushes when it runs out of work)
FLUSH_S = 1.0


def now() -> float:
    """The span log's clock."""
    return time.monotonic()


def host_cpus(cfg: Config) -> dict[str, Any]:
    """`rl_start`'s record of the processors the actors share (see the module docstring)."""
    # start-up: torch only here; `nonstop report` reads spans through this module without it
    from nonstop.device import resolve_device

    cpu = all(
        resolve_device(spec, field).type == "cpu"
        for spec, field in ((cfg.engine.device, "engine.device"), (cfg.trainer.device, "trainer.device"))
    )
    return {"cpus": cpu_count(), "cpu_actors": cpu and cfg.runtime.backend == "local"}


def cpu_count() -> int:
    """Processors this process may run on (its affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def span_path(run_dir: Path | str, actor: str) -> Path:
    return Path(run_dir) / SPANS_DIR / f"{actor}.jsonl"


class SpanLog:
    """One process's span file; `SpanLog(None)` records nothing (spans off) at the cost of a call."""

    def __init__(self, path: Path | str | None, actor: str = "") -> None:
        self._f: IO[str] | None = None
        self._flushed = now()
        if path is None:
            return
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        self._f = p.open("a", buffering=1 << 16)
        self.emit("clock", wall=time.time(), mono=now(), actor=actor or p.stem, pid=os.getpid())

    @property
    def enabled(self) -> bool:
        return self._f is not None

    def emit(self, ev: str, **fields: Any) -> None:
        f = self._f
        if f is None:
            return
        fields["ev"] = ev
        f.write(json.dumps(fields, separators=(",", ":")) + "\n")
        t = now()
        if t - self._flushed >= FLUSH_S:
            self._flushed = t
            f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class PassRecorder:
    """Coalesces an engine's forward passes into `busy` chunks (cut once longer than CHUNK_S, at
    pauses over GAP_S, and by `flush()` when the engine runs out of work), so the log stays small
    while keeping the rate per batch size. A chunk cut for length ends where the next one
    begins, so the chunks of a busy stretch tile it, the work between passes included. Engines
    that report them also count the passes that prefilled new prompts and the prompt tokens
    prefilled (`prefills`, `prefill_tokens`): a pass that admits groups costs more than its rows
    say, and the planner's calibration can only see that per chunk. The built-in engine also
    counts the cached positions its decode attention read (`reads`, padding included): with a long
    tail a pass's rows can read ten times more keys in one batch than in another."""

    def __init__(self, log: SpanLog) -> None:
        self.log = log
        self.t0 = self.t1 = 0.0
        self.cpu0 = self.cpu1 = 0.0  # the process's processor time at the chunk's first pass start, last pass end
        self.passes = self.rows = 0
        self.busy_s = 0.0
        self.prefills: tuple[int, int] | None = None  # (passes that prefilled, prompt tokens), when reported
        self.reads: int | None = None  # cached positions read by decode attention, when reported

    def record(
        self,
        t0: float,
        t1: float,
        rows: int,
        cpu0: float = 0.0,
        cpu1: float = 0.0,
        prefill: tuple[int, int] | None = None,
        reads: int | None = None,
    ) -> None:
        """One pass from t0 to t1 emitting `rows` tokens; cpu0, cpu1: `time.process_time()` at its
        start and end; `prefill`: (1 if it prefilled new prompts else 0, their tokens); `reads`:
        the cached positions its decode attention read, padding included."""
        if self.passes and t0 - self.t1 > GAP_S:
            self.flush()
        elif self.passes and t1 - self.t0 > CHUNK_S:
            self.flush(end=t0, cpu_end=cpu0)
        if not self.passes:
            self.t0, self.cpu0 = t0, cpu0
        self.t1, self.cpu1 = t1, cpu1
        self.passes += 1
        self.rows += rows
        self.busy_s += t1 - t0
        if prefill is not None:
            done = self.prefills or (0, 0)
            self.prefills = (done[0] + prefill[0], done[1] + prefill[1])
        if reads is not None:
            self.reads = (self.reads or 0) + reads

    def flush(self, end: float | None = None, cpu_end: float | None = None) -> None:
        """Write the open chunk, ending at `end` (default: its last pass's end)."""
        if self.passes:
            t1 = self.t1 if end is None else end
            cpu = (self.cpu1 if cpu_end is None else cpu_end) - self.cpu0
            extra = {} if self.prefills is None else {"prefills": self.prefills[0], "prefill_tokens": self.prefills[1]}
            if self.reads is not None:
                extra["reads"] = self.reads
            self.log.emit(
                "busy",
                t0=round(self.t0, 6),
                t1=round(t1, 6),
                passes=self.passes,
                rows=self.rows,
                busy_s=round(self.busy_s, 6),
                cpu_s=round(cpu, 6),
                **extra,
            )
        self.passes = self.rows = 0
        self.busy_s = 0.0
        self.prefills = None
        self.reads = None


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    with path.open() as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:  # a killed process's last, partial line
                continue


TIME_KEYS = ("t", "t0", "t1", "t_admit", "t_gen0", "t_gen1", "t_scored", "t_done")


def read_spans(run_dir: Path | str) -> dict[str, list[dict[str, Any]]]:
    """Every actor's events, times converted to seconds since the run's RL start (the
    orchestrator's `rl_start`, else the earliest clock anchor). Keys: actor names."""
    folder = Path(run_dir) / SPANS_DIR
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no span log (was run.spans off?)")
    raw: dict[str, list[dict[str, Any]]] = defaultdict(list)
    anchors: list[float] = []  # wall-clock time of every anchor; wall = mono + offset of the latest anchor
    for path in sorted(folder.glob("*.jsonl")):
        actor, offset = path.stem, None
        for e in _lines(path):
            if e["ev"] == "clock":
                offset = e["wall"] - e["mono"]  # a restarted actor appends a new anchor
                anchors.append(e["wall"])
                continue
            if offset is None:
                continue
            for k in TIME_KEYS:
                if k in e:
                    e[k] += offset
            raw[actor].append(e)
    if not anchors:
        raise FileNotFoundError(f"{folder}: no span files")
    starts = [e["t"] for e in raw.get("orchestrator", []) if e["ev"] == "rl_start"]
    origin = starts[-1] if starts else min(anchors)
    for events in raw.values():
        for e in events:
            for k in TIME_KEYS:
                if k in e:
                    e[k] = e[k] - origin
    return dict(raw)
