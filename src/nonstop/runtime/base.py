"""Protocols of the actor seam, its errors, and the backend factory."""

from __future__ import annotations

from typing import Any, Protocol

from nonstop.errors import ActorError


class ActorDied(ActorError, RuntimeError):
    """An actor process ended (crash, kill, or failure to start) or stopped answering."""


class ActorCallError(ActorError, RuntimeError):
    """The actor raised while serving a call; the message carries its remote traceback."""


class ActorHandle(Protocol):
    name: str

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        """Run `method` on the actor; raise ActorCallError, ActorDied or TimeoutError."""
        ...

    def is_alive(self) -> bool: ...

    async def stop(self, timeout_s: float = 10.0) -> None: ...

    async def kill(self) -> None:
        """End the actor now, without its cooperation; pending calls fail with ActorDied."""
        ...


class ActorBackend(Protocol):
    @property
    def host(self) -> str | None:
        """Where a service that an actor opens for the others (the trainer group's store, the weight
        transport) must listen so every actor reaches it: an address, or None for the address of
        the node the actor runs on."""
        ...

    async def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> ActorHandle:
        """Start an actor running `cls(*args, **kwargs)`; returns once it is constructed."""
        ...

    async def shutdown(self) -> None: ...
