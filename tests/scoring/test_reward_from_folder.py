"""A reward named 'mypkg.rewards:score' beside the user's config resolves from the folder they run
nonstop in, as `python -m` would find it, with no PYTHONPATH: in the CLI's own check, in a
process whose sys.path does not hold that folder, and in a reward worker whose current folder is
another (it is handed the user's folder); a module that is nowhere says how to make it importable.
Each is a real process started from a script outside that folder (a script's folder, not the
current one, is first on its sys.path, as for the `nonstop` console script)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from support import child_env
from support.cli import nonstop, sets, small_model_args

PROBE = """
import asyncio, os, sys
from nonstop.types import RewardRow
from nonstop.scoring.pool import RewardWorker
from nonstop.scoring.rewards import RewardError, resolve_reward

assert os.getcwd() not in sys.path and "" not in sys.path, sys.path
if sys.argv[1] == "here":
    print("score", resolve_reward("mypkg.rewards:score")("12", "12"))
elif sys.argv[1] == "worker":  # another current folder; the user's folder given, as ProcessRunner gives it
    worker = RewardWorker(1, folder=sys.argv[2])
    rows = [RewardRow(prompt="1+1=", completion="12", answer="12", extra={})]
    print("score", asyncio.run(worker.evaluate("sample", "mypkg.rewards:score", rows))[0])
    worker.close()
else:
    try:
        resolve_reward("otherpkg.rewards:score")
    except RewardError as e:
        print("refused", e)
"""


def _user_folder(tmp_path: Path) -> Path:
    user = tmp_path / "project"
    (user / "mypkg").mkdir(parents=True)
    (user / "mypkg" / "__init__.py").write_text("")
    (user / "mypkg" / "rewards.py").write_text(
        textwrap.dedent(
            """
            def score(completion, answer):
                return 1.0 if completion.strip() == answer.strip() else 0.0
            """
        )
    )
    return user


def _probe(tmp_path: Path, cwd: Path, *args: str) -> str:
    script = tmp_path / "elsewhere" / "probe.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(PROBE)
    env = child_env()  # this checkout's src and tests/ only: not the user's folder
    assert str(cwd) not in env["PYTHONPATH"]
    out = subprocess.run(
        [sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_reward_module_in_the_current_folder_resolves_without_pythonpath(tmp_path):
    user = _user_folder(tmp_path)
    assert "score 1.0" in _probe(tmp_path, user, "here")


def test_a_reward_worker_in_another_folder_resolves_from_the_users_folder(tmp_path):
    user = _user_folder(tmp_path)
    other = tmp_path / "worker-cwd"
    other.mkdir()
    assert "score 1.0" in _probe(tmp_path, other, "worker", str(user))


def test_a_reward_module_found_nowhere_says_how_to_make_it_importable(tmp_path):
    user = _user_folder(tmp_path)
    out = _probe(tmp_path, user, "missing")
    assert "refused task.reward: cannot import 'otherpkg.rewards:score'" in out, out
    assert f"neither installed nor in {user}" in out and "PYTHONPATH" in out, out


def test_the_cli_resolves_a_reward_from_the_folder_it_runs_in(tiny_dir, tmp_path):
    """`nonstop train` in the user's folder: the module is imported from there (the attribute, not
    the module, is what is missing), before any actor starts."""
    user = _user_folder(tmp_path)
    t0 = time.perf_counter()
    result = nonstop(
        ["train", *small_model_args(tiny_dir), *sets({"task.reward": "mypkg.rewards:nosuch"})], cwd=user, timeout_s=120
    )
    assert result.returncode == 2, result
    assert "task.reward: cannot import 'mypkg.rewards:nosuch'" in result.stdout, result.stdout
    assert "has no attribute 'nosuch'" in result.stdout, result.stdout
    assert "starting" not in result.stdout and time.perf_counter() - t0 < 60
