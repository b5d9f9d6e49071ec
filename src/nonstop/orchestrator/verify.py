"""`nonstop verify RUN_DIR`: recount a run from what the trainer trained and the buffer dropped.

The orchestrator's prompt ledger says what happened to every prompt, but a check that reads that
ledger checks the ledger against itself. This one rebuilds what the run should have consumed
from the dataset's own order and compares it with the records the consuming sides wrote
(observe/consumed.py), sample by sample:

- drawn: the first N (epoch, prompt index) pairs of the prompt stream, rebuilt from the run's
  config.yaml (its task and `run.seed`, the same `PromptStream`), where N is the stream position
  saved in the newest intact checkpoint, which must be the record's last step;
- trained: RUN_DIR/trained.jsonl, written by the trainer, one line per step; dropped, by reason:
  RUN_DIR/dropped.jsonl, written by the buffer, and the steps the trainer skipped (their
  samples were consumed and not learned from);
- in flight at the end: drawn, not yet trained or dropped when that checkpoint was taken (its
  in-flight list, which a resume generates again): the one figure taken from the orchestrator;
- lost: a drawn prompt with no record and not in flight, or a sample missing from a prompt's
  records (single-turn groups hold `rollout.group_size` samples, ids '0.0' .. '0.{n-1}');
- duplicated: a sample recorded more than once (trained twice, trained and dropped, ...).

Every count names its source. A record that cannot be read (missing, not JSON, no checkpoint to
take N from, a dataset that cannot be rebuilt) is an error, never a count of 0.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from nonstop.checkpoint import CheckpointError, latest_valid
from nonstop.config import ConfigError, load_config
from nonstop.errors import RunError
from nonstop.observe.consumed import DROPPED, TRAINED, lines_of
from nonstop.orchestrator.launch import run_rows
from nonstop.tasks.data import PromptStream

Key = tuple[int, int]  # (epoch, prompt index)
SHOWN = 20  # problems listed by name; the rest are counted


class VerifyError(RunError, RuntimeError):
    """A record or count could not be read: the run cannot be verified (never a count of 0)."""


@dataclass
class Verdict:
    """The recount: (name, value, source) rows and each problem found, naming the sample."""

    rows: list[tuple[str, int, str]] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.lost or self.duplicated or self.unknown)

    def lines(self) -> list[str]:
        width = max(len(name) for name, _, _ in self.rows)
        out = [f"{'count':<{width}}  {'value':>7}  from"]
        out += [f"{name:<{width}}  {value:>7}  {source}" for name, value, source in self.rows]
        for label, found in (("lost", self.lost), ("duplicated", self.duplicated), ("never drawn", self.unknown)):
            out += [f"{label}: {p}" for p in found[:SHOWN]]
            if len(found) > SHOWN:
                out.append(f"{label}: ... and {len(found) - SHOWN} more")
        out.append("verify: OK" if self.ok else "verify: FAILED")
        return out


def _where(e: int, i: int, sid: str) -> str:
    return f"epoch {e} prompt {i} sample {sid}"


def _records(path: Path, who: str) -> list[dict]:
    if not path.is_file():
        raise VerifyError(f"{path.name} is missing: no record of what the {who} did (a run of an older nonstop?)")
    out = []
    for n, line in enumerate(lines_of(path), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise VerifyError(f"{path.name} line {n} is not JSON ({e.msg})") from None
    return out


def _train_split(run_dir: Path):
    """The run's train prompts, as its launch loaded them (`run_rows`)."""
    try:
        cfg = load_config(str(run_dir / "config.yaml"), ())
    except (ConfigError, OSError) as err:
        raise VerifyError(f"config.yaml: {err}") from None
    if cfg.env is not None and cfg.env.policies:
        raise VerifyError("env.policies: own policies keep no record of what they trained yet")
    return cfg, run_rows(cfg).train


def verify(run_dir: Path) -> Verdict:
    """Recount `run_dir`; raises VerifyError when something it needs cannot be read."""
    cfg, train = _train_split(run_dir)
    steps = _records(run_dir / TRAINED, "trainer")
    drops = _records(run_dir / DROPPED, "buffer")
    try:
        ckpt = latest_valid(run_dir / "checkpoints", report=lambda m: None)
    except CheckpointError as err:
        raise VerifyError(f"no intact checkpoint to read the number of prompts drawn from: {err}") from None
    # Groups in flight at the checkpoint may be dropped while the run shuts down; a resume generates
    # them again, so the drops that count are those the checkpoint's copy holds.
    saved = lines_of(ckpt.path / DROPPED)
    if lines_of(run_dir / DROPPED)[: len(saved)] != saved:
        raise VerifyError(f"{DROPPED} does not begin with checkpoint step {ckpt.step}'s copy of it")
    late, drops = len(drops) - len(saved), drops[: len(saved)]
    if ckpt.step != len(steps):
        raise VerifyError(
            f"{TRAINED} holds {len(steps)} steps, the newest intact checkpoint is step {ckpt.step}: the steps "
            "after it are not accounted for (resume the run, which trains them again, then verify)"
        )
    state = ckpt.state
    if state["train_size"] != len(train):
        raise VerifyError(
            f"config.yaml's task gives {len(train)} train prompts, the run had {state['train_size']} "
            "(prompts screened as too long for the model): the dataset's order cannot be rebuilt"
        )
    stream = state["stream"]
    drawn_n = 0 if stream["epoch"] < 0 else stream["epoch"] * len(train) + len(train) - len(stream["order"])
    fresh = PromptStream(train, cfg.run.seed, cfg.run.max_epochs)
    drawn: list[Key] = []
    for _ in range(drawn_n):
        d = fresh.next()
        if d is None:
            raise VerifyError(f"checkpoint step {ckpt.step}: its stream position is past the dataset's end")
        drawn.append((d.epoch, d.example.index))
    in_flight = {(int(e), int(i)) for e, i in [*state["ledger"]["in_flight"], *stream["requeued"]]}

    seen: dict[tuple[int, int, str], list[str]] = defaultdict(list)  # sample -> where recorded
    trained: set[Key] = set()
    skipped: set[Key] = set()
    dropped: dict[Key, str] = {}
    reasons: Counter[str] = Counter()
    samples_trained = 0
    for n, line in enumerate(steps, 1):
        if line.get("step") != n:
            raise VerifyError(f"{TRAINED} line {n} is step {line.get('step')}: the record is out of order")
        for e, i, sid, _vmin, _vmax in line["samples"]:
            seen[(e, i, sid)].append(f"step {n}" + (" (skipped)" if line["skipped"] else ""))
            (skipped if line["skipped"] else trained).add((e, i))
            samples_trained += 0 if line["skipped"] else 1
    for n, line in enumerate(drops, 1):
        key = (line["epoch"], line["prompt_index"])
        for sid in line["samples"]:
            seen[(*key, sid)].append(f"dropped ({line['reason']}, line {n})")
        if line["reason"] != "max_lag_episode":  # episodes taken out of a group that still trained
            dropped[key] = line["reason"]
            reasons[line["reason"]] += 1

    v = Verdict()
    for (e, i, sid), at in sorted(seen.items()):
        if len(at) > 1:
            v.duplicated.append(f"{_where(e, i, sid)} recorded {len(at)} times: {', '.join(at)}")
    drawn_set = set(drawn)
    recorded = trained | skipped | set(dropped)
    v.unknown = [f"epoch {e} prompt {i} is recorded but was never drawn" for e, i in sorted(recorded - drawn_set)]
    for e, i in drawn:
        if (e, i) not in recorded and (e, i) not in in_flight:
            v.lost.append(f"epoch {e} prompt {i}: drawn, never trained or dropped, not in flight at the end")
    if cfg.env is None:  # a single-turn group is the n completions of its request, every one accounted for
        want = {f"0.{k}" for k in range(cfg.rollout.group_size)}
        have: dict[Key, set[str]] = defaultdict(set)
        for e, i, sid in seen:
            have[(e, i)].add(sid)
        for key in sorted(recorded & drawn_set):
            v.lost += [f"{_where(*key, sid)}: missing from its group's records" for sid in sorted(want - have[key])]
    both = sorted(in_flight & recorded)
    v.duplicated += [f"epoch {e} prompt {i}: in flight at the end, yet recorded" for e, i in both]

    trainer, buffer = f"{TRAINED} (trainer)", f"{DROPPED} (buffer)"
    v.rows = [
        ("prompts drawn", drawn_n, f"config.yaml's task in run.seed's order, to checkpoint {ckpt.step}'s position"),
        ("prompts trained", len(trained), trainer),
        ("samples trained", samples_trained, trainer),
        ("steps", len(steps), trainer),
        *((f"dropped: {r}", c, buffer) for r, c in sorted(reasons.items())),
        ("dropped: skipped_step", len(skipped), f"{TRAINED} (trainer: steps it skipped)"),
        ("in flight at the end", len(in_flight), f"checkpoint step {ckpt.step}'s in-flight list (orchestrator)"),
        ("dropped after the checkpoint", late, f"{DROPPED} past the checkpoint's copy (generated again on resume)"),
        ("lost", len(v.lost), "drawn, less trained, dropped and in flight; samples missing from a group"),
        ("duplicated", len(v.duplicated), "samples recorded more than once"),
    ]
    if v.unknown:
        v.rows.append(("never drawn", len(v.unknown), "recorded prompts outside the drawn ones"))
    return v
