"""Do episodes learn? The tiny model on a multi-turn game, a tool task and self-play Nim.

Runs each environment example of examples/envs/ as a user would: the real CLI with its YAML,
which warms the shipped addition base up on transcripts of a weak player (cached in --cache),
then RL for `--seconds` through the whole pipeline (engine and trainer processes, weights over
the transport, episodes spanning versions). Per environment it prints the base and final
held-out success rate (win rate against the scripted random opponent for Nim), the gain in
points, warm-up and RL time, and the staleness of the episodes trained (drops by reason, the
lag histogram per episode, episodes whose tokens span several versions). The last line is

    RESULT multiturn_gain=<points> tool_gain=<points> selfplay_winrate_gain=<points> api_agent_gain=<points>
        api_agent_sampled_gain=<points>

`api_agent` is examples/api_agent: `nonstop train examples/api_agent/run.yaml` (agents.enabled)
beside the example's agent program (the openai client only), which plays guess_number through
the run's endpoint, rewards its episodes, and measures its own held-out success at temperature 0
before and after; its gain is the agent's measure. That measure is greedy play on 70 held-out
games with only 7 distinct hidden numbers, so a deterministic policy wins or loses each number as
a whole and the measure moves in large steps (docs/api_agents.md: 0% -> 100%). The row also
shows the run's own held-out evaluation of the same game (one sampled episode per held-out row,
as the other environments' rows measure), printed beside it and in the RESULT line as
`api_agent_sampled_gain`.

Targets: each at least +20 points. `--quick` gives each environment 100 s of RL (about 8 minutes
in all with the warm-ups cached; the first run also warms up, see docs/benchmarks.md).

    python bench/envs.py [--quick] [--seconds 120] [--envs guess_number,calculator,nim_selfplay] [--cache DIR]

`--envs verifiers_addition,textarena_nim` runs the adapters' examples the same way (their extras
installed); their gains print as `verifiers_gain`, `textarena_winrate_gain`. `--envs verifiers_tools`
runs examples/envs/verifiers_tools.yaml (a verifiers taskset with a tool, played by verifiers' own
rollout); its gain prints as `verifiers_tool_gain`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_run import ROOT, train

EXAMPLES = ROOT / "examples" / "envs"
KEYS = {
    "guess_number": "multiturn_gain",
    "calculator": "tool_gain",
    "nim_selfplay": "selfplay_winrate_gain",
    "api_agent": "api_agent_gain",
}
AGENT_DIR = ROOT / "examples" / "api_agent"
ADAPTERS = {
    "verifiers_addition": "verifiers_gain",
    "textarena_nim": "textarena_winrate_gain",
    "verifiers_tools": "verifiers_tool_gain",
}
"""Runs of the ecosystem adapters, not in the default set (`--envs verifiers_addition,textarena_nim`:
plumbing, learning not required; `--envs verifiers_tools`: verifiers' own rollout with a tool)."""


def run_api_agent(seconds: float, folder: Path, cache: Path, overrides: list[str]) -> dict:
    """The run with agents.enabled, and the example agent beside it; the agent's own before/after measure."""
    env = {**os.environ, "PYTHONPATH": ""}  # the agent imports nothing of nonstop
    agent = subprocess.Popen(
        [sys.executable, str(AGENT_DIR / "agent.py"), "--run-dir", str(folder / "runs" / "api_agent")],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        s = train(
            "api_agent",
            folder,
            [f"run.max_time_s={seconds}", "run.max_steps=100000", f"warmup.cache_dir={cache}", *overrides],
            config=AGENT_DIR / "run.yaml",
        )
        out, err = agent.communicate(timeout=600)
    finally:
        if agent.poll() is None:
            agent.kill()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if agent.returncode != 0 or not lines:
        raise SystemExit(f"the api_agent's agent failed (exit {agent.returncode}):\n{out[-2000:]}\n{err[-2000:]}")
    r = json.loads(lines[-1][len("RESULT ") :])
    sampled_final = s["final_accuracy"] if s["steps"] else s["base_accuracy"]  # no step trained: the base is final
    return {
        "env": "api_agent",
        "base": r["base"],
        "final": r["final"],
        "gain": r["final"] - r["base"],
        "sampled": (s["base_accuracy"], sampled_final),
        "warmup_s": s["warmup_s"],
        "rl_s": s["rl_wall_s"],
        "steps": s["steps"],
        "wall_s": s["cli_wall_s"],
        "drops": s["drops"],
        "episodes_dropped": s["agents"],
        "lag": {},
        "multi_version": 0,
        "episodes": r["episodes"],
        "errors": {},
        "roles": {},
    }


def run_env(name: str, seconds: float, folder: Path, cache: Path, overrides: list[str]) -> dict:
    if name == "api_agent":
        return run_api_agent(seconds, folder, cache, overrides)
    s = train(
        name,
        folder,
        [f"run.max_time_s={seconds}", f"warmup.cache_dir={cache}", *overrides],
        config=EXAMPLES / f"{name}.yaml",
    )
    ep = s["episodes"]
    final = s["final_accuracy"] if s["steps"] else s["base_accuracy"]  # no step trained: the base is final
    return {
        "env": name,
        "base": s["base_accuracy"],
        "final": final,
        "gain": final - s["base_accuracy"],
        "warmup_s": s["warmup_s"],
        "rl_s": s["rl_wall_s"],
        "steps": s["steps"],
        "wall_s": s["cli_wall_s"],
        "drops": s["drops"],
        "episodes_dropped": s["prompts"].get("episodes_dropped", {}),
        "lag": ep["episode_lag_hist"],
        "multi_version": ep["multi_version"],
        "episodes": ep["episodes"],
        "errors": ep["errors"],
        "roles": ep["roles"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--envs", default=",".join(KEYS))
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--quick", action="store_true", help="100 s of RL per environment")
    ap.add_argument("--cache", type=Path, default=ROOT / ".nonstop_cache", help="warm-up cache folder")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ns = ap.parse_args()
    seconds = 100.0 if ns.quick else ns.seconds
    rows = []
    t0 = time.perf_counter()
    print(f"{'environment':>18} {'base':>7} {'final':>7} {'gain':>8} {'warm-up s':>9} {'RL s':>6} {'steps':>6}")
    with tempfile.TemporaryDirectory(prefix="nonstop-envs-") as tmp:
        for name in ns.envs.split(","):
            r = run_env(name, seconds, Path(tmp), ns.cache.resolve(), ns.overrides)
            rows.append(r)
            print(
                f"{name:>18} {r['base']:7.1%} {r['final']:7.1%} {100 * r['gain']:+7.1f}p {r['warmup_s']:9.1f} "
                f"{r['rl_s']:6.1f} {r['steps']:6d}",
                flush=True,
            )
            if "sampled" in r:
                base, final = r["sampled"]
                print(
                    f"{'':>18} the agent's greedy measure above (temperature 0, 7 hidden numbers); the run's own "
                    f"sampled evaluation {base:.1%} -> {final:.1%} ({100 * (final - base):+.1f}p)",
                    flush=True,
                )
    print("\nstaleness per environment (episodes trained):")
    for r in rows:
        print(
            f"  {r['env']}: episode lag histogram {r['lag']}; {r['multi_version']} of {r['episodes']} episodes "
            f"span >1 policy version; group drops {r['drops']}; episodes dropped {r['episodes_dropped']}; "
            f"env errors {r['errors']}; roles {json.dumps(r['roles'])}"
        )
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    keys = {**KEYS, **ADAPTERS}
    gains = {keys[r["env"]]: round(100 * r["gain"], 1) for r in rows if r["env"] in keys}
    for r in rows:
        if "sampled" in r:
            gains[keys[r["env"]].replace("_gain", "_sampled_gain")] = round(
                100 * (r["sampled"][1] - r["sampled"][0]), 1
            )
    print("RESULT " + " ".join(f"{k}={v:+.1f}" for k, v in gains.items()))


if __name__ == "__main__":
    main()
