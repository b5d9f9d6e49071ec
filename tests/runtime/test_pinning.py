"""runtime.pin_cpus: each role's actor processes run on their own CPUs, and each pool is measured."""

from __future__ import annotations

import asyncio
import os

import pytest

from nonstop.config import ConfigError, LocalRuntimeConfig, load_config
from nonstop.config.cpus import CpuPools, parse_cpu_list
from nonstop.runtime import make_backend
from nonstop.runtime.pinning import cpu_seconds, role_of
from support.pin_helpers import Spinner

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs this process may use")


def affinity_from_proc(pid: int) -> set[int]:
    """The CPUs the kernel lets process `pid` run on, as /proc/<pid>/status lists them."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return set(parse_cpu_list(line.split(":", 1)[1].strip()))
    raise AssertionError("no Cpus_allowed_list in /proc status")


def test_cpu_lists_parse_and_bad_ones_are_refused():
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list("3") == {3}
    for bad in ("", "a", "2-1", "1,,2", "-3"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)


def test_actor_names_map_to_pools():
    assert [role_of(n) for n in ("engine", "engine-1", "alice-engine", "trainer", "trainer-0", "bob-trainer-1")] == [
        "engine",
        "engine",
        "engine",
        "trainer",
        "trainer",
        "trainer",
    ]
    assert [role_of(n) for n in ("reward-worker-2", "reward-model", "teacher", "victim", "echo")] == [
        "scorer",
        "scorer",
        "scorer",
        None,
        None,
    ]


@two_cpus
def test_overlapping_missing_or_malformed_cpu_sets_are_config_errors():
    a, b = CPUS[0], CPUS[1]
    ok = load_config(overrides=[f"runtime.pin_cpus.engine={a}", f"runtime.pin_cpus.trainer={b}"])
    assert ok.runtime.pin_cpus.sets() == {"engine": {a}, "trainer": {b}}
    assert CpuPools(engine=[a], scorer=f"{b}").sets() == {"engine": {a}, "scorer": {b}}
    with pytest.raises(ConfigError, match=r"runtime.pin_cpus.*engine and trainer share CPU\(s\) \[" + str(a)):
        load_config(overrides=[f"runtime.pin_cpus.engine={a}-{b}", f"runtime.pin_cpus.trainer={a}"])
    missing = (os.cpu_count() or 1) + 7
    with pytest.raises(ConfigError, match=rf"runtime.pin_cpus.*trainer: CPU\(s\) \[{missing}\] do not exist"):
        load_config(overrides=[f"runtime.pin_cpus.engine={a}", f"runtime.pin_cpus.trainer={missing}"])
    with pytest.raises(ConfigError, match=r"runtime.pin_cpus.*engine: 'x1' is not a cpu list"):
        load_config(overrides=["runtime.pin_cpus.engine=x1"])
    with pytest.raises(ConfigError, match=r"runtime.pin_cpus.*name at least one"):
        load_config(overrides=["runtime.pin_cpus={}"])


@two_cpus
def test_spawned_actors_run_on_their_roles_cpus_and_pools_are_measured():
    a, b = CPUS[0], CPUS[1]

    async def go():
        backend = make_backend(LocalRuntimeConfig(pin_cpus=CpuPools(engine=f"{a}", trainer=f"{b}")))
        try:
            engine = await backend.spawn("engine", Spinner)
            trainer = await backend.spawn("trainer-0", Spinner)
            other = await backend.spawn("echo", Spinner)
            backend.pools.start()
            # the actor's own view (it may have started threads since) and the kernel's agree
            assert affinity_from_proc(engine.pid) == {a} and os.sched_getaffinity(engine.pid) == {a}
            assert affinity_from_proc(trainer.pid) == {b}
            assert affinity_from_proc(other.pid) == set(CPUS)  # in no pool: not pinned
            await engine.call("spin", 0.5)
            report = backend.pools.report()
            return report, cpu_seconds(engine.pid)
        finally:
            await backend.shutdown()

    report, engine_cpu = asyncio.run(go())
    assert set(report) == {"engine", "trainer"}
    eng, trn = report["engine"], report["trainer"]
    assert eng["cpus"] == [a] and trn["cpus"] == [b] and eng["actors"] == trn["actors"] == 1
    assert eng["cpu_s"] >= 0.45 and eng["busy_frac"] > trn["busy_frac"]  # the engine spun, the trainer slept
    assert eng["idle_frac"] == pytest.approx(1 - eng["busy_frac"], abs=1e-3) and trn["idle_frac"] > 0.5
    assert engine_cpu is not None and engine_cpu >= eng["cpu_s"]
