"""Actor runtime seam: spawn an actor, call it, await it, check its health.

The pipeline only sees `ActorBackend` and `ActorHandle`; the local backend runs each actor
in its own OS process. A Ray backend implements the same two protocols.
"""

from nonstop.runtime.base import ActorBackend, ActorCallError, ActorDied, ActorHandle, make_backend
from nonstop.runtime.supervisor import Supervisor

__all__ = ["ActorBackend", "ActorCallError", "ActorDied", "ActorHandle", "Supervisor", "make_backend"]
