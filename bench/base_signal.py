"""How much signal does a base give RL? Greedy accuracy, pass@k and the signal fraction of saved bases.

GRPO learns only from groups whose samples score differently: a prompt the base always gets wrong,
or always right, teaches nothing. Two bases at the same greedy accuracy can differ a lot in that
(docs/recipe.md, section 5, fourteenth session: a subtraction base that solved no borrows crossed
the warm-up's gate 3x sooner than one that solved some of every case, and RL lifted it half as
much). For each base folder (a warm-up cache entry `base-*`, a run's `final/`, any saved model with
its tokenizer) this samples `--k` completions at temperature 1 for `--prompts` prompts of the task,
scores them with the task's reward, and prints:

- greedy: the share of prompts whose greedy answer scores 1.0 (what the warm-up's gate measures);
- pass@k: the share where at least one of the k samples scores 1.0;
- signal: the share whose k rewards are not all equal (the groups a GRPO step can learn from);
- with `--by borrow` (operands `dd-dd=`), greedy accuracy split by whether the units digit borrows.

    python bench/base_signal.py --task subtraction BASE [BASE ...] [--k 8] [--prompts 400] [--by borrow]

Last line: `RESULT signal=<each base's signal fraction, in order> pass_at_k=<...> greedy=<...>`.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
TASKS = ROOT / "examples" / "tasks"


def borrow(prompt: str) -> str:
    a, b = prompt.rstrip("=").split("-")
    return "borrow" if int(a[-1]) < int(b[-1]) else "no borrow"


GROUPS = {"borrow": borrow}


def complete(model, tok, prompt: str, n: int, sample: bool, max_new: int) -> list[str]:
    ids = torch.tensor([tok.encode(prompt)]).repeat(n, 1)
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=sample,
            temperature=1.0 if sample else None,
            top_k=0 if sample else None,
            top_p=None,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        )
    return [tok.decode(row[ids.shape[1] :], skip_special_tokens=True).split("\n")[0] for row in out]


def measure(base: Path, rows: list[tuple], reward, k: int, max_new: int, by, seed: int) -> dict:
    torch.manual_seed(seed)  # each base draws the same way wherever it stands in the list
    tok = PreTrainedTokenizerFast.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base).eval()
    greedy = passed = signal = 0
    groups: dict[str, list[int]] = {}
    for prompt, answer, *_ in rows:
        right = reward(complete(model, tok, prompt, 1, False, max_new)[0], answer) >= 1.0
        scores = [reward(c, answer) for c in complete(model, tok, prompt, k, True, max_new)]
        greedy += right
        passed += max(scores) >= 1.0
        signal += len(set(scores)) > 1
        if by:
            g = groups.setdefault(by(prompt), [0, 0])
            g[0] += right
            g[1] += 1
    n = len(rows)
    return {
        "greedy": greedy / n,
        "pass_at_k": passed / n,
        "signal": signal / n,
        "groups": {key: v[0] / v[1] for key, v in sorted(groups.items())},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bases", nargs="+", type=Path)
    ap.add_argument("--task", required=True, help="a task of examples/tasks/ (its JSONL and its YAML's reward)")
    ap.add_argument("--k", type=int, default=8, help="samples per prompt (rollout.group_size's default)")
    ap.add_argument("--prompts", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--by", choices=sorted(GROUPS), default=None)
    ns = ap.parse_args()
    torch.set_num_threads(1)
    cfg = yaml.safe_load((TASKS / f"{ns.task}.yaml").read_text())
    sys.path.insert(0, str(TASKS))
    from nonstop.config.flow import RolloutConfig
    from nonstop.scoring.rewards import resolve_reward
    from nonstop.tasks.data import read_jsonl

    reward = resolve_reward(cfg["task"]["reward"])
    max_new = cfg.get("rollout", {}).get("max_new_tokens", RolloutConfig().max_new_tokens)
    rows, report = read_jsonl(TASKS / f"{ns.task}.jsonl")
    if report.rows_skipped:
        print(f"skipped {report.rows_skipped} bad row(s): " + "; ".join(report.problems[:3]))
    random.Random(ns.seed).shuffle(rows)
    rows = rows[: ns.prompts]
    print(f"{'base':>48} {'greedy':>7} {'pass@' + str(ns.k):>7} {'signal':>7}  groups (greedy)")
    results = []
    for base in ns.bases:
        m = measure(base, rows, reward, ns.k, max_new, GROUPS.get(ns.by) if ns.by else None, ns.seed)
        results.append(m)
        groups = ", ".join(f"{key} {v:.1%}" for key, v in m["groups"].items())
        print(f"{str(base)[-48:]:>48} {m['greedy']:>7.1%} {m['pass_at_k']:>7.1%} {m['signal']:>7.1%}  {groups}")
    fmt = lambda key: ",".join(f"{m[key]:.3f}" for m in results)  # noqa: E731
    print(f"RESULT signal={fmt('signal')} pass_at_k={fmt('pass_at_k')} greedy={fmt('greedy')}")


if __name__ == "__main__":
    main()
