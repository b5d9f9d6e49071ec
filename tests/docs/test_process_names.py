"""The process names docs/reliability.md promises are the ones `ps` and `top` show: a real process
takes each actor name the orchestrator gives (orchestrator/actors.py `actor_names`, for one and for
two engines and trainer ranks) through runtime/procinfo.py, and its /proc entries are read."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from nonstop.orchestrator.actors import actor_names
from support import ROOT, child_env

RENAME = """
import sys
from nonstop.runtime.procinfo import name_process
for role in sys.stdin:
    name_process(role.strip())
    print("named", flush=True)
"""


def documented_names() -> set[str]:
    text = (ROOT / "docs" / "reliability.md").read_text()
    paragraph = text.split("Actors are named by role", 1)[1].split("\n- ", 1)[0]
    return {n for n in re.findall(r"`([^`]+)`", paragraph) if n.startswith(("nonstop: ", "nonstop-", "ns-"))}


def test_documented_process_names_are_what_ps_and_top_show():
    pytest.importorskip("setproctitle")  # the dev install has it; the docs name both forms
    roles = [
        *actor_names("engine", 1),
        *actor_names("engine", 2),
        *actor_names("trainer", 1),
        *actor_names("trainer", 2),
    ]
    shown: dict[str, tuple[str, str]] = {}
    proc = subprocess.Popen(
        [sys.executable, "-c", RENAME], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env()
    )
    try:
        for role in roles:
            proc.stdin.write(role + "\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == "named"
            entry = Path(f"/proc/{proc.pid}")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            shown[role] = (cmdline, (entry / "comm").read_text().strip())
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert shown["engine"] == ("nonstop: engine", "nonstop-engine"), shown
    assert shown["engine-0"] == ("nonstop: engine-0", "ns-engine-0"), shown
    seen = {name for pair in shown.values() for name in pair}
    documented = documented_names()
    assert len(documented) >= 6 and documented <= seen, (documented - seen, seen)
