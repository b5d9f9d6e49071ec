"""Engines that join mid-run (runtime.max_engines): the engine pool grows as nodes with room join.

The run starts with `runtime.num_engines` engines. Each engine i with num_engines <= i <
max_engines is asked of the backend when the run starts, by one task per engine
(`join_engine`); the Ray backend holds the request until a node with room for it joins
(runtime/ray.py), so nothing polls. Once the engine runs, `Run.join(i)` (build.py) has attached
it to the weight transport as rank i + 1 holding the current weights: with broadcast the trainer
sends them again in a group rebuilt with the newcomer (transport/broadcast.py); with files the
engine loads the newest version before its first forward pass. It then enters the pool behind a
RestartingEngine like the others (heartbeat, restarts, its prompts re-submitted after a death)
and takes requests from then on. An engine that cannot join (it failed to start, or to attach)
is reported and the run goes on with the engines it has.
"""

from __future__ import annotations

import time

from nonstop.orchestrator.run import Run
from nonstop.runtime import ActorCallError, ActorDied, Supervisor


def start_joins(run: Run, supervisor: Supervisor) -> None:
    """One supervised task per engine the run may grow by."""
    if run.join is None:
        return
    for i in range(run.cfg.runtime.num_engines, run.cfg.max_engines):
        supervisor.spawn(join_engine(run, supervisor, i), name=f"join-engine-{i}")


async def join_engine(run: Run, supervisor: Supervisor, i: int) -> None:
    """Wait for engine i to start, then add it to the pool with its heartbeat."""
    assert run.join is not None
    try:
        engine = await run.join(i)
    except (ActorDied, ActorCallError, TimeoutError) as e:
        run.progress.log(f"[yellow]engine {i} could not join the pool: {e}[/]")
        return
    run.engines.append(engine)
    run.engine.add(engine)
    run.state.joins.append({"engine": engine.name, "at": time.time()})
    supervisor.spawn(engine.heartbeat(), name=f"{engine.name}-heartbeat")
    run.progress.log(f"{engine.name} joined the pool ({len(run.engines)} engines)")
