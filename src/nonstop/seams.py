"""The seams: every typing.Protocol of nonstop and the classes that implement it.

A Protocol is only enforced where an implementation meets a variable or parameter of the
Protocol's type. Some implementations are only ever built by name at run time (an actor class
handed to a backend, a source opened by a factory that returns the Protocol); the assignments
below make mypy (`make typecheck`) check each of them against its Protocol all the same.
Nothing here runs: the block exists for the type checker only, so optional extras (Ray, peft)
are not imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nonstop import runtime, scorer
    from nonstop.dispatch import EnginePool, RankGroup
    from nonstop.engine.core import Engine, TorchEngine
    from nonstop.engine.runner import KVRunner, Runner
    from nonstop.engine.updates import WeightSource as EngineWeightSource
    from nonstop.lora import MergedAdapters
    from nonstop.runtime.local import LocalActor, LocalBackend
    from nonstop.runtime.ray import RayActor, RayBackend
    from nonstop.runtime.restart import RestartingActor
    from nonstop.serve.client import GenerationClient, HttpClient, InProcessClient
    from nonstop.transport.base import ModelParameters, WeightSink, WeightSource, WeightTarget
    from nonstop.transport.broadcast import BroadcastSink, BroadcastSource
    from nonstop.transport.files import FilesSink, FilesSource
    from nonstop.transport.names import PerExpertParameters
    from nonstop.transport.shm import ShmSink, ShmSource

    # Actor runtime: backends, and every handle the orchestrator calls through.
    backends: list[type[runtime.ActorBackend]] = [LocalBackend, RayBackend]
    handles: list[type[runtime.ActorHandle]] = [LocalActor, RayActor, RestartingActor, EnginePool, RankGroup]

    # Weight transport: trainer end, engine end (the transport's and the engine's own view), target.
    sinks: list[type[WeightSink]] = [ShmSink, BroadcastSink, FilesSink]
    sources: list[type[WeightSource]] = [ShmSource, BroadcastSource, FilesSource]
    engine_sources: list[type[EngineWeightSource]] = [ShmSource, BroadcastSource, FilesSource]
    targets: list[type[WeightTarget]] = [ModelParameters, MergedAdapters, PerExpertParameters]

    # Engine: the in-process engine and the model runner its scheduler drives.
    engines: list[type[Engine]] = [TorchEngine]
    runners: list[type[Runner]] = [KVRunner]

    # Scoring, and the clients of a served engine.
    scorers: list[type[scorer.Scorer]] = [scorer.FunctionScorer]
    clients: list[type[GenerationClient]] = [InProcessClient, HttpClient]
