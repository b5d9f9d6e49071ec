"""Config sections with one model per kind: the weight transport (`transport.kind`) and the
actor runtime (`runtime.backend`).

Each section is a tagged union (see config/schema.py): the key selects a model holding the
fields every kind has (its base) plus only its own, so `transport.bucket_mb` with kind 'shm'
is an error naming the kind it belongs to. A section that omits the key gets the default kind.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Discriminator, Field, Tag, field_validator

from nonstop.config.cpus import CpuPools
from nonstop.config.schema import Section as _Section
from nonstop.config.schema import TagOf


class BaseTransportConfig(_Section):
    """Fields every weight transport has; `kind` selects the model that adds its own."""

    kind: str = "shm"
    """'shm': one shared-memory segment with N + 2 slots (N engines), engines point their weights at the
    newest complete slot (no copy); 'broadcast': torch.distributed broadcast in buckets (crosses hosts);
    'files': safetensors files and an atomically replaced version marker in a shared folder."""
    checksum: bool = False
    """The receiver verifies a CRC32 of every bucket (broadcast), slot (shm) or file (files);
    a mismatch is never applied."""
    timeout_s: float = Field(120.0, gt=0.0)
    """Longest a weight send or receive may take before the run fails naming the peer."""
    connect_timeout_s: float = Field(300.0, gt=0.0)
    """Longest the trainer and the engines may take to meet when the transport is set up."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype full weights travel in (the trainer casts while it writes). 'auto': the built-in engine's
    dtype when its weights live on the host (a bf16 engine then receives the very bits it would have cast
    itself, from half the bytes, and needs no float32 staging copy); float32 for LoRA adapters, vLLM
    engines and engines on a GPU. A lower dtype than the engine's rounds the engine's weights."""


class ShmTransportConfig(BaseTransportConfig):
    """Shared memory: trainer and engines on one host."""

    kind: Literal["shm"] = "shm"
    device_path: Literal["auto", "host", "ipc"] = "auto"
    """How weights go from a trainer on a GPU to engines on a GPU of the same node. 'host': through the
    shared-memory segment (the trainer copies to the host, the engine copies to its GPU); 'ipc': through two
    slots in the trainer's GPU memory that every engine maps once with a CUDA IPC handle and copies from,
    GPU to GPU (needs trainer.device and engine.device on CUDA and the built-in engine); 'auto': 'ipc' for a
    publish when the trainer is on a GPU and every engine mapped its slots, otherwise 'host'."""


class BroadcastTransportConfig(BaseTransportConfig):
    """torch.distributed broadcast from trainer rank 0 to every engine; a restarted engine joins a rebuilt group."""

    kind: Literal["broadcast"] = "broadcast"
    device_path: Literal["auto", "host", "nccl"] = "auto"
    """Where the buckets live and which process-group backend carries them. 'host': host buffers over gloo;
    'nccl': buffers on the trainer's and the engines' GPUs over NCCL (needs every member on CUDA and the
    built-in engine); 'auto': 'nccl' when the trainer and every engine present at the rendezvous are on
    CUDA, otherwise 'host'."""
    bucket_mb: float = Field(25.0, gt=0.0)
    """Size of each broadcast slice in MiB."""
    per_tensor: bool = False
    """Broadcast one parameter at a time instead of fixed-size buckets (for comparison)."""
    rejoin_timeout_s: float = Field(300.0, ge=0.0)
    """When a send fails because an engine died, how long the trainer waits for its replacement to
    join (the group is then rebuilt and the version sent again) before the run fails; 0: fail at once."""
    delta: bool = False
    """Send each version as only the elements whose bits changed since the version before (positions and
    values; docs/transport.md#deltas): engines rebuild it bit for bit. The full version goes at the first
    send, to a rebuilt group, and wherever the delta is not smaller (float32 weights change almost everywhere)."""


class FilesTransportConfig(BaseTransportConfig):
    """A folder shared by trainer and engines (a shared filesystem across hosts)."""

    kind: Literal["files"] = "files"
    dir: str | None = None
    """Folder shared by trainer and engines; None: a new temp folder, removed at the end."""
    keep: int = Field(2, ge=1)
    """Versions kept on disk."""
    notify: Literal["marker", "http"] = "marker"
    """How engines learn of a new version: 'marker' stats the LATEST file before each forward pass;
    'http' long-polls the trainer's notification server and loads the file off the decode path."""
    notify_host: str = "127.0.0.1"
    """Address the trainer's notification server binds to and engines connect to (notify 'http')."""
    delta: bool = False
    """Write each version as only the elements whose bits changed since the version before (positions and
    values; docs/transport.md#deltas), beside a full file every `full_every` versions: an engine that is
    current reads the small file and rebuilds the version bit for bit; one that starts or fell behind reads
    the newest full file and the deltas after it."""
    full_every: int = Field(50, ge=1)
    """With delta: a full file every this many versions (and at the first), so an engine that starts or fell
    behind reads one full file and at most full_every - 1 deltas. `keep` counts full files; the deltas after
    the oldest kept one stay."""


TransportConfig = Annotated[
    Union[
        Annotated[ShmTransportConfig, Tag("shm")],
        Annotated[BroadcastTransportConfig, Tag("broadcast")],
        Annotated[FilesTransportConfig, Tag("files")],
    ],
    Discriminator(TagOf("kind", "shm")),
]
"""The transport section: one model per `kind`, each holding only its own fields."""


class RayActorResources(_Section):
    num_cpus: float = Field(1.0, ge=0.0)
    """CPUs Ray reserves for each actor of this role."""
    num_gpus: float | None = Field(None, ge=0.0)
    """GPUs Ray reserves for each actor of this role; None: 1 when the cluster has GPUs, else 0."""
    resources: dict[str, float] = {}
    """Custom Ray resources each actor of this role asks for, e.g. {engine_node: 1}: it then runs only
    on nodes started with that resource (`ray start --resources='{"engine_node": 2}'`), and a node's
    amount caps how many such actors it holds. Placement by role, explicit; {}: any node with room."""
    spread: bool = False
    """Place the actors of this role on as many nodes as possible (Ray's SPREAD strategy) instead of
    packing them onto the fewest nodes first."""

    @field_validator("resources")
    @classmethod
    def _positive_amounts(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory", "object_store_memory"):
                raise ValueError(f"'{name}' is a built-in resource: use num_cpus / num_gpus")
            if not amount > 0:
                raise ValueError(f"amount of '{name}' must be > 0 (got {amount})")
        return value


class NodeLossConfig(_Section):
    """What happens to the engines of a Ray node that leaves the cluster (runtime.node_loss)."""

    policy: Literal["replace", "wait"] = "replace"
    """'replace': each engine that went with the node starts again on any node with room for it
    (the survivors, within runtime.ray_engine's resources); 'wait': it starts again only on a node
    that joined after the loss, so the survivors keep their load (the other engines serve meanwhile;
    with transport.kind 'broadcast' the trainer's next publish waits for it, up to
    transport.rejoin_timeout_s)."""
    timeout_s: float = Field(300.0, gt=0.0)
    """Longest a lost engine's replacement may wait to be placed and started; past it that attempt
    fails (it counts as one of runtime.max_engine_restarts) and the next one is placed as 'replace'
    places it. A node counts as lost once Ray marks it dead (its health check: the head's
    RAY_health_check_period_ms and RAY_health_check_failure_threshold)."""


class BaseRuntimeConfig(_Section):
    """Fields every actor backend has; `backend` selects the model that adds its own."""

    backend: str = "local"
    """Actor backend: 'local' spawns one OS process per actor; 'ray' makes every actor a Ray actor
    (extra `nonstop[ray]`)."""
    num_engines: int = Field(1, ge=1)
    """Engine actors; a least-loaded dispatcher spreads the prompts over them and every one receives
    each published version."""
    start_timeout_s: float = Field(180.0, gt=0.0)
    """Longest an actor may take to start (imports and model load)."""
    call_timeout_s: float = Field(600.0, gt=0.0)
    """Longest one actor call may take before the run fails with a clear message."""
    heartbeat_interval_s: float = Field(5.0, gt=0.0)
    """How often the orchestrator pings each engine."""
    heartbeat_timeout_s: float = Field(30.0, gt=0.0)
    """An engine that does not answer a ping within this time is declared hung, killed and restarted."""
    max_engine_restarts: int | None = Field(None, ge=0)
    """Engine crashes or hangs survived per run (each restart re-queues the prompts it held); one more ends
    the run. None: 3. With transport.kind 'broadcast' the trainer rebuilds its group with the replacement."""


class LocalRuntimeConfig(BaseRuntimeConfig):
    """One OS process per actor on this machine."""

    backend: Literal["local"] = "local"
    pin_cpus: CpuPools | None = None
    """Pin each role's actor processes (engines, trainer ranks, scorers) to its own CPUs, disjoint
    sets such as {engine: '0', trainer: '1'}: pools as separate as GPUs, so a pool's idle time is
    real (config/cpus.py). None: actors run on any CPU."""


class RayRuntimeConfig(BaseRuntimeConfig):
    """Every actor a Ray actor, on a private local cluster or a running one."""

    backend: Literal["ray"] = "ray"
    ray_address: str | None = None
    """Address of a running Ray cluster ('auto', 'host:port' or 'ray://host:port');
    None starts a private local cluster."""
    ray_num_cpus: int | None = Field(None, ge=1)
    """CPUs of the private local Ray cluster; None: all of this machine's."""
    ray_num_gpus: int | None = Field(None, ge=0)
    """GPUs of the private local Ray cluster; None: Ray detects them."""
    ray_engine: RayActorResources = RayActorResources()
    """Ray resources of each engine actor."""
    ray_trainer: RayActorResources = RayActorResources()
    """Ray resources of each trainer rank actor."""
    max_engines: int | None = Field(None, ge=1)
    """Engines the run may grow to as nodes join: the run starts with runtime.num_engines, and each
    engine beyond them is asked of Ray at start and joins the pool once a node with room for it
    (runtime.ray_engine's resources) is there: it receives the current weights, then serves. Needs
    transport.kind 'broadcast' or 'files'. None: runtime.num_engines (no growth)."""
    node_loss: NodeLossConfig = NodeLossConfig()
    """What happens to the engines of a node that leaves the cluster."""


RuntimeConfig = Annotated[
    Union[Annotated[LocalRuntimeConfig, Tag("local")], Annotated[RayRuntimeConfig, Tag("ray")]],
    Discriminator(TagOf("backend", "local")),
]
"""The runtime section: one model per `backend`, each holding only its own fields."""


def device_path_of(transport: BaseTransportConfig) -> str:
    """The transport's GPU-to-GPU setting; the files transport always goes through the host."""
    return transport.device_path if isinstance(transport, (ShmTransportConfig, BroadcastTransportConfig)) else "host"
