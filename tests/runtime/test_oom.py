"""An actor ended by the kernel's OOM killer is named as such with its plan (runtime/oom.py), and
the cgroup and meminfo files it reads are parsed right (sizing/machine.py)."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from nonstop.config import LocalRuntimeConfig
from nonstop.runtime import ActorDied, make_backend
from nonstop.runtime.oom import death_reason, kernel_records, oom_line, remember_plan
from nonstop.sizing.machine import machine_memory, oom_kills, parse_counters
from support.actor_classes import Echo

V2_EVENTS = "low 0\nhigh 12\nmax 40\noom 3\noom_kill 2\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"
MEMINFO = "MemTotal:       24683664 kB\nMemFree:        21009708 kB\nMemAvailable:   23528280 kB\nHugePages_Total: 0\n"


def test_parse_counters_reads_cgroup_v2_v1_and_meminfo():
    assert parse_counters(V2_EVENTS) == {"low": 0, "high": 12, "max": 40, "oom": 3, "oom_kill": 2, "oom_group_kill": 0}
    assert parse_counters(V1_OOM_CONTROL)["oom_kill"] == 5
    info = parse_counters(MEMINFO)
    assert info["MemAvailable"] == 23_528_280 and info["HugePages_Total"] == 0
    assert parse_counters("garbage\nname notanumber\n\nkey 7 extra\n") == {"key": 7}


def test_machine_memory_is_this_machines():
    mem = machine_memory()
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < mem.available <= mem.total <= ram and mem.source


def test_death_reasons_in_words():
    assert death_reason("engine", 12, 3, 0) == "actor 'engine' (pid 12) died (exit code 3)"
    assert death_reason("engine", 12, -15, 0) == "actor 'engine' (pid 12) died (killed by signal 15)"
    assert death_reason("engine", 12, -9, None) == "actor 'engine' (pid 12) died (killed by signal 9)"


@pytest.mark.skipif(oom_kills() is None, reason="no cgroup memory counters readable here")
def test_a_sigkill_while_the_cgroup_counter_rose_names_the_oom_killer_and_the_plan():
    """The counter read now is above what it was 'at spawn' (one less): the kernel's OOM killer."""
    now = oom_kills()
    assert now is not None
    remember_plan(lambda name: 3 * 1024**3 if name == "engine-0" else None)
    try:
        msg = death_reason("engine-0", 9_999_999, -signal.SIGKILL, now - 1)
    finally:
        remember_plan(None)
    assert msg.startswith(
        f"actor 'engine-0' (pid 9999999) was killed by the kernel's OOM killer (planned: 3.0 GiB; the cgroup's "
        f"oom_kill count went {now - 1} -> {now})"
    )
    assert death_reason("engine-0", 9_999_999, -signal.SIGKILL, now).endswith("(killed by signal 9)")  # no rise


def test_a_real_child_killed_with_sigkill_reads_as_a_plain_signal():
    """A person's SIGKILL leaves the cgroup's OOM counter where it was."""

    async def go():
        backend = make_backend(LocalRuntimeConfig())
        try:
            remember_plan(lambda name: 1024**3)
            actor = await backend.spawn("engine-0", Echo)
            pending = asyncio.ensure_future(actor.call("sleep", 30))
            await asyncio.sleep(0.2)
            os.kill(actor.pid, signal.SIGKILL)
            with pytest.raises(ActorDied, match=r"^actor 'engine-0' \(pid \d+\) died \(killed by signal 9\)$"):
                await pending
        finally:
            remember_plan(None)
            await backend.shutdown()

    asyncio.run(go())


KMSG = [
    "6,1021,5312345,-;eth0: link up",
    "3,1022,5400001,-;Memory cgroup out of memory: Killed process 4242 (python) total-vm:25912344kB, "
    "anon-rss:23611232kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:46512kB oom_score_adj:0\n"
    " SUBSYSTEM=memory",
    "3,1023,5400002,-;Out of memory: Killed process 42421 (python) total-vm:1kB",
]


def test_the_kernels_oom_line_is_found_by_pid():
    line = oom_line(KMSG, 4242)
    assert line is not None and line.startswith("Memory cgroup out of memory: Killed process 4242 (python)")
    assert "anon-rss:23611232kB" in line and "SUBSYSTEM" not in line
    assert oom_line(KMSG, 42421) == "Out of memory: Killed process 42421 (python) total-vm:1kB"
    assert oom_line(KMSG, 424) is None and oom_line([], 4242) is None
    assert oom_line(["[ 12.5] Out of memory: Killed process 7 (x) total-vm:1kB"], 7).startswith("[ 12.5] Out of")


def test_kernel_records_are_read_where_readable():
    records = kernel_records()
    assert isinstance(records, list) and oom_line(records, 2**31 - 1) is None  # no such pid was ever killed
    assert kernel_records("/nonexistent/kmsg") == []
