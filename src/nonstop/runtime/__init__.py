"""Actor runtime seam: spawn an actor, call it, await it, check its health.

The orchestrator spawns actors through `ActorBackend` and talks to them through the typed
role clients of runtime/actor_clients.py (nonstop.clients), never through `ActorHandle.call` itself.
The local backend runs each actor in its own OS process; the Ray backend implements the same
two protocols. runtime/restart.py replaces an engine that crashes or hangs.
"""

from nonstop.runtime.base import ActorBackend, ActorCallError, ActorDied, ActorHandle, make_backend
from nonstop.runtime.supervisor import Supervisor

__all__ = ["ActorBackend", "ActorCallError", "ActorDied", "ActorHandle", "Supervisor", "make_backend"]
