"""Actor runtime seam: spawn an actor, call it, await it, check its health.

The orchestrator spawns actors through `ActorBackend` and talks to them through the typed
role clients of runtime/actor_clients.py (nonstop.clients), never through `ActorHandle.call` itself.
The local backend runs each actor in its own OS process; the Ray backend implements the same
two protocols. runtime/restart.py replaces an engine that crashes or hangs.

- base.py           the seam: `ActorBackend`, `ActorHandle`, `ActorDied`, `ActorCallError`;
- local.py          `LocalBackend`: one spawned OS process and one pipe per actor;
- ray.py            `RayBackend`: the same seam with every actor a Ray actor;
- procinfo.py       actor processes named by role in `ps`, and dying with the orchestrator;
- pinning.py        CPU pools: each role's actors pinned to its CPUs, CPU time measured per pool;
- oom.py            why an actor died, in words: the kernel's OOM killer named, with the actor's memory plan;
- actor_clients.py  typed clients of one actor (`EngineActor`, `TrainerActor`, the scoring actors):
                    the only code that names an actor method by a string;
- restart.py        `RestartingEngine`: an engine client that outlives crashes and hangs (heartbeat);
- supervisor.py     `Supervisor`: the orchestrator's background tasks, a failure ending the run.
`make_backend` (here, above both backends) starts the one `runtime.backend` names.
"""

from pathlib import Path

from nonstop.config import RayRuntimeConfig, RuntimeConfig
from nonstop.runtime.base import ActorBackend, ActorCallError, ActorDied, ActorHandle
from nonstop.runtime.local import LocalBackend
from nonstop.runtime.supervisor import Supervisor

__all__ = ["ActorBackend", "ActorCallError", "ActorDied", "ActorHandle", "Supervisor", "make_backend"]


def make_backend(cfg: RuntimeConfig, run_dir: Path | None = None) -> ActorBackend:
    """The backend `runtime.backend` names; `run_dir` receives the Ray cluster's logs."""
    if isinstance(cfg, RayRuntimeConfig):
        from nonstop.runtime.ray import RayBackend  # optional: the ray extra

        return RayBackend(cfg, run_dir)
    return LocalBackend(cfg)
