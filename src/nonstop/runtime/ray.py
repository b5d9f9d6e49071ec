"""Ray actor backend: the same seam as the local backend, with every actor a Ray actor.

Contract (shared with runtime/local.py):
- `spawn(name, cls, *args, **kwargs)` returns once `cls(*args, **kwargs)` is built inside the
  actor; a constructor failure raises ActorDied naming the actor, with the remote traceback;
- methods declared `async def` on `cls` are served concurrently on the actor's event loop,
  plain methods one at a time, in order, on one worker thread (a Ray async actor whose plain
  calls go through a one-thread executor). Ray does not promise that an async actor starts
  calls in submission order, so every call carries a sequence number and the actor admits
  calls strictly in that order (a plain call is queued on the thread when admitted);
- a remote exception raises ActorCallError naming `actor.method`; a dead actor fails every
  pending and later call with ActorDied naming it; a call past its timeout raises TimeoutError
  naming the actor and the method;
- every actor sets `torch.set_num_threads(1)` before it builds its object.

Resources: an actor's role comes from its name (runtime/pinning.py `role_of`: "engine-1" and a
role's own policy's "b-engine" -> engine, "b-trainer-0" -> trainer); engines and trainer ranks
get `runtime.ray_engine` / `runtime.ray_trainer` CPUs, GPUs and custom resources (a role placed
on the nodes that offer its resource), spread over nodes when asked; other actors one CPU.
Cluster: `runtime.ray_address` connects to a running cluster; without it a private local
cluster is started on a loopback address (`PRIVATE_NODE_IP`), its temp and log folder under /tmp
(Ray's socket paths must stay short) and linked from the run folder, with a random auth token
passed through the environment, so nothing is written to the home folder. That cluster ends with `shutdown()`.
Ray starts a dashboard process even with include_dashboard=False (its usage-stats module alone),
and that module asks cloud metadata endpoints (169.254.169.254, metadata.google.internal) which
cloud it runs on, whatever RAY_USAGE_STATS_ENABLED says: traffic off this machine. The private
cluster's processes therefore start with a dead HTTP proxy on loopback (`cloud_probe_refused`;
Ray's own gRPC ignores proxies), and each actor gets this process's proxy settings back through
its runtime_env.

Nodes. Each actor reports the node it runs on. When an actor dies, the backend asks Ray whether
its node is still alive; if not, the death is a node loss (the reason says so) and the next
actor spawned under the same name is placed by `runtime.node_loss`: 'replace' on any node with
room, 'wait' only on a node that was not alive when the loss was seen (a Ray label selector on
the node id, so Ray's scheduler places it when such a node joins), either way within
`node_loss.timeout_s`. An engine whose index is at or past `runtime.num_engines` (one of
`runtime.max_engines`) waits for room without a time limit: Ray places it when a node with room
joins, and `spawn` returns then.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from nonstop.config import RayActorResources, RayRuntimeConfig
from nonstop.runtime.base import ActorCallError, ActorDied
from nonstop.runtime.pinning import role_of

try:
    import ray
    import ray.exceptions as rex
except ImportError as e:
    raise ImportError("runtime.backend=ray needs Ray: install the extra with `pip install nonstop[ray]`") from e


class _Shim:
    """Runs inside the Ray actor process and serves calls on the wrapped object."""

    def __init__(self, name: str, cls: type, args: tuple, kwargs: dict) -> None:
        import torch  # spawn: runs in the Ray actor's process

        torch.set_num_threads(1)
        self.name = name
        self.obj = cls(*args, **kwargs)
        self.serial = ThreadPoolExecutor(1, thread_name_prefix=f"{name}-calls")
        self.admitted = 0  # sequence number of the next call to admit
        self.turn: asyncio.Condition | None = None  # made on the actor's loop

    async def call(self, seq: int, method: str, args: tuple, kwargs: dict) -> Any:
        self.turn = self.turn or asyncio.Condition()
        async with self.turn:
            await self.turn.wait_for(lambda: self.admitted == seq)
            fn = getattr(self.obj, method, None)
            plain = None
            if fn is not None and not inspect.iscoroutinefunction(fn):
                plain = asyncio.get_running_loop().run_in_executor(self.serial, functools.partial(fn, *args, **kwargs))
            self.admitted += 1
            self.turn.notify_all()
        if fn is None:
            raise AttributeError(f"{type(self.obj).__name__} has no method {method!r}")
        return await (plain if plain is not None else fn(*args, **kwargs))

    async def ready(self) -> tuple[int, str, str]:
        """This actor's pid, and the id and address of the Ray node it runs on."""
        ctx = ray.get_runtime_context()
        return os.getpid(), ctx.get_node_id(), ray.util.get_node_ip_address()

    async def watch(self) -> None:
        """Never answers; the orchestrator learns of the actor's death when this call fails."""
        await asyncio.Event().wait()

    async def close(self) -> None:
        closer = getattr(self.obj, "close", None)
        if callable(closer):
            await asyncio.get_running_loop().run_in_executor(self.serial, closer)


# Ray rewrites a node address of 127.0.0.1 (and a cluster address on it) into the machine's own
# non-loopback address wherever it allows multi-node clusters (Linux): the private cluster's
# processes would then all talk over that address. Any other loopback address it keeps.
PRIVATE_NODE_IP = "127.0.0.2" if sys.platform.startswith("linux") else "127.0.0.1"
_PROXY_VARS = ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")
NO_EGRESS_PROXY = "http://127.0.0.1:9"  # nothing listens there: an HTTP request through it fails at once


@contextlib.contextmanager
def cloud_probe_refused() -> Iterator[dict[str, str]]:
    """While Ray starts processes: HTTP through a dead proxy on loopback (see the module's
    docstring). Yields this process's own proxy settings ('' for unset), for the actors."""
    saved = {k: os.environ.get(k) for k in _PROXY_VARS}
    if os.environ.get("RAY_grpc_enable_http_proxy", "0").lower() in ("1", "true"):
        yield {}  # Ray's gRPC would go through the proxy too: leave the environment alone
        return
    os.environ.update({k: NO_EGRESS_PROXY for k in _PROXY_VARS})
    try:
        yield {k: v or "" for k, v in saved.items()}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _cause(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _reload_auth_settings() -> None:
    """Ray caches RAY_AUTH_MODE / RAY_AUTH_TOKEN when it is imported; re-read them as Ray's own
    `ray.init` does when it turns token auth on."""
    # optional: Ray's internals, read only where runtime.backend is ray and token auth is asked for
    from ray._private.authentication.authentication_token_setup import _enable_token_auth  # noqa: F401

    # Private names of Ray's compiled module, absent from its type stubs.
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _alive_nodes() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class RayActor:
    def __init__(self, name: str, actor: Any, call_timeout_s: float) -> None:
        self.name = name
        self.actor = actor
        self.call_timeout_s = call_timeout_s
        self.pid: int | None = None
        self.node_id: str | None = None  # the Ray node it runs on, once started
        self.node_ip: str | None = None
        self.lost_nodes_alive: set[str] | None = None  # set when it went with its node: the nodes alive then
        self._seq = 0  # every call is numbered; the actor admits them in this order
        self._dead: str | None = None
        self._watch: asyncio.Task | None = None

    async def _death(self, e: rex.RayActorError) -> str:
        """Why the actor is gone: its node left the cluster (asked of Ray's GCS), or its own death."""
        if self.node_id is not None and self._dead is None:
            alive = await asyncio.to_thread(_alive_nodes)
            # Ray's own words count too: its GCS may not have marked the node dead when the call fails
            if self.node_id not in alive or "its node has died" in str(e):
                self.lost_nodes_alive = alive
                return self._died(
                    f"actor '{self.name}' (pid {self.pid}) went with its node {self.node_ip} "
                    f"(id {self.node_id[:12]}), which left the Ray cluster"
                )
        return self._died(f"actor '{self.name}' (pid {self.pid}) died: {_cause(e)}")

    def _died(self, reason: str) -> str:
        """Record the first reason the actor is gone (later ones do not replace it); return it."""
        if self._dead is None:
            self._dead = reason
        return self._dead

    def start_watch(self) -> None:
        self._watch = asyncio.get_running_loop().create_task(self._watch_death(), name=f"watch-{self.name}")

    async def _watch_death(self) -> None:
        try:
            await self.actor.watch.remote()
        except rex.RayActorError as e:
            await self._death(e)

    async def call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        if self._dead is not None:
            raise ActorDied(self._dead)
        limit_s = timeout_s or self.call_timeout_s
        ref = self.actor.call.remote(self._seq, method, args, kwargs)
        self._seq += 1
        try:
            return await asyncio.wait_for(ref, limit_s)
        except TimeoutError:  # not cancelled remotely: a numbered call that never ran would block later ones
            raise TimeoutError(f"actor '{self.name}': call '{method}' did not answer within {limit_s:g} s") from None
        except rex.RayActorError as e:
            raise ActorDied(await self._death(e)) from None
        except rex.RayTaskError as e:
            raise ActorCallError(f"{self.name}.{method} raised:\n{e}") from None

    def is_alive(self) -> bool:
        return self._dead is None

    async def kill(self) -> None:
        """End the actor now (a hung one too); its pending calls fail with ActorDied."""
        self._died(f"actor '{self.name}' (pid {self.pid}) was killed")
        ray.kill(self.actor, no_restart=True)

    async def stop(self, timeout_s: float = 10.0) -> None:
        if self._dead is None and self.pid is not None:  # one never placed has nothing to close
            try:
                await asyncio.wait_for(self.actor.close.remote(), timeout_s)
            except (TimeoutError, rex.RayError):
                pass
        self._died(f"actor '{self.name}' was stopped")
        ray.kill(self.actor, no_restart=True)
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)


def _resources(cfg: RayRuntimeConfig, role: str, cluster_gpus: float) -> dict[str, Any]:
    """The Ray options that place an actor of `role`: CPUs, GPUs, custom resources, strategy."""
    spec: RayActorResources | None = {"engine": cfg.ray_engine, "trainer": cfg.ray_trainer}.get(role)
    if spec is None:
        return {"num_cpus": 1.0, "num_gpus": 0.0}
    gpus = spec.num_gpus if spec.num_gpus is not None else (1.0 if cluster_gpus >= 1 else 0.0)
    options: dict[str, Any] = {"num_cpus": spec.num_cpus, "num_gpus": gpus}
    if spec.resources:
        options["resources"] = dict(spec.resources)
    if spec.spread:
        options["scheduling_strategy"] = "SPREAD"
    return options


def _engine_index(name: str) -> int | None:
    """i of an engine named 'engine-i' (None for other actors, or a lone 'engine')."""
    role, _, tail = name.partition("-")
    return int(tail) if role == "engine" and tail.isdigit() else None


class RayBackend:
    def __init__(self, cfg: RayRuntimeConfig, run_dir: Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.actors: list[RayActor] = []
        self.latest: dict[str, RayActor] = {}  # the newest actor spawned under each name
        self.temp_dir: Path | None = None
        self._started = False
        self._cls = ray.remote(_Shim)
        self._actor_env: dict[str, str] = {}  # environment variables every actor gets back (private cluster)

    def _init(self) -> None:
        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if self.cfg.ray_address is not None:
            ray.init(address=self.cfg.ray_address, log_to_driver=False, include_dashboard=False)
            return
        # A private cluster: token auth with a token that lives only in this environment
        # (Ray would otherwise write ~/.ray/auth_token), temp/logs under a short /tmp path.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        if os.environ["RAY_AUTH_MODE"] == "token":
            os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
        _reload_auth_settings()
        self.temp_dir = Path(tempfile.mkdtemp(prefix="nsray-"))
        if self.run_dir is not None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            link = self.run_dir / "ray"
            if not link.exists():
                link.symlink_to(self.temp_dir, target_is_directory=True)
        with cloud_probe_refused() as own_proxies:
            ray.init(
                num_cpus=self.cfg.ray_num_cpus,
                num_gpus=self.cfg.ray_num_gpus,
                _temp_dir=str(self.temp_dir),
                _node_ip_address=PRIVATE_NODE_IP,
                include_dashboard=False,
                log_to_driver=False,
            )
        self._actor_env = own_proxies
        self._started = True

    @property
    def host(self) -> str | None:
        """Loopback for the private cluster; on a running cluster each node's own address, so
        actors on other machines reach it."""
        return None if self.cfg.ray_address is not None else "127.0.0.1"

    def _placement(self, name: str) -> tuple[dict[str, Any], float | None, str]:
        """Extra Ray options for actor `name`, how long it may take to start (None: no limit), and
        what the limit is named by: a node loss's replacement and a growth engine are placed
        differently from the rest (see the module's docstring)."""
        previous = self.latest.get(name)
        if previous is not None and previous.lost_nodes_alive is not None:
            loss = self.cfg.node_loss
            limit = f"runtime.node_loss.timeout_s, policy '{loss.policy}'"
            if loss.policy == "wait":
                ids = ",".join(sorted(previous.lost_nodes_alive))
                return {"label_selector": {"ray.io/node-id": f"!in({ids})"}}, loss.timeout_s, limit
            return {}, loss.timeout_s, limit
        index = _engine_index(name)
        if index is not None and index >= self.cfg.num_engines:
            return {}, None, "runtime.max_engines"
        return {}, self.cfg.start_timeout_s, "runtime.start_timeout_s"

    async def spawn(self, name: str, cls: type, *args: Any, **kwargs: Any) -> RayActor:
        self._init()  # blocking once per run; ray.init wants the main thread
        res = _resources(self.cfg, role_of(name) or name, ray.cluster_resources().get("GPU", 0.0))
        extra, limit_s, limit = self._placement(name)
        if self._actor_env:
            extra["runtime_env"] = {"env_vars": self._actor_env}
        # Any: Ray's stubs type an actor's methods as plain coroutines, without `.remote`.
        # Named in Ray by role (`ray list actors`, a cluster's tools); the suffix keeps a replacement's name unique.
        ray_name = f"nonstop:{name}:{secrets.token_hex(4)}"
        handle: Any = self._cls.options(name=ray_name, max_restarts=0, max_concurrency=1000, **res, **extra).remote(
            name, cls, args, kwargs
        )
        actor = RayActor(name, handle, self.cfg.call_timeout_s)
        self.actors.append(actor)
        previous, self.latest[name] = self.latest.get(name), actor
        try:
            actor.pid, actor.node_id, actor.node_ip = await asyncio.wait_for(handle.ready.remote(), limit_s)
        except asyncio.CancelledError:
            # withdrawn, or Ray would place it later and it would hold its node; a next start is
            # placed as this one would have been
            ray.kill(handle, no_restart=True)
            if previous is not None:
                self.latest[name] = previous
            raise
        except TimeoutError:
            ray.kill(handle, no_restart=True)  # withdraw the request: Ray would place it later
            raise ActorDied(
                f"actor {name} did not start within {limit_s:g} s ({limit}; asked for {res | extra}; "
                f"free: {ray.available_resources()})"
            ) from None
        except rex.RayActorError as e:
            raise ActorDied(f"actor {name} failed to start:\n{e}") from None
        actor.start_watch()
        return actor

    async def shutdown(self) -> None:
        await asyncio.gather(*(a.stop() for a in self.actors), return_exceptions=True)
        self.actors.clear()
        if self._started:
            await asyncio.to_thread(ray.shutdown)
            self._started = False
            if self.run_dir is not None and self.temp_dir is not None:
                # keep Ray's logs with the run, then drop the temp folder
                logs = self.temp_dir / "session_latest" / "logs"
                link = self.run_dir / "ray"
                if link.is_symlink():
                    link.unlink()
                if logs.is_dir():
                    shutil.copytree(logs, link, dirs_exist_ok=True, ignore_dangling_symlinks=True)
            if self.temp_dir is not None:
                shutil.rmtree(self.temp_dir, ignore_errors=True)
