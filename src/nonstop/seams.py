"""The seams: every typing.Protocol of nonstop and the classes that implement it.

A Protocol is only enforced where an implementation meets a variable or parameter of the
Protocol's type. Some implementations are only ever built by name at run time (an actor class
handed to a backend, a receiver opened by a factory that returns the Protocol); the assignments
below make mypy (`make typecheck`) check each of them against its Protocol all the same.
Nothing here runs: the block exists for the type checker only, so optional extras (Ray, peft)
are not imported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nonstop import clients, runtime
    from nonstop.engine.aio import AsyncEngine
    from nonstop.engine.core import Engine, TorchEngine
    from nonstop.engine.runner import KVRunner, Runner
    from nonstop.engine.vllm.engine import VllmEngineWorker
    from nonstop.engine.worker import EngineWorker
    from nonstop.envs.base import Environment, MultiAgentEnvironment, SingleAgent, TurnEngine
    from nonstop.envs.calculator import Calculator
    from nonstop.envs.guess import GuessNumber
    from nonstop.envs.http import ClientEngine
    from nonstop.envs.nim import Nim, NimVsScripted
    from nonstop.lora import MergedAdapters
    from nonstop.orchestrator.dispatch import EnginePool, RankGroup
    from nonstop.orchestrator.modes.api_agents.mode import AgentsMode
    from nonstop.orchestrator.modes.environment.mode import EnvMode
    from nonstop.orchestrator.modes.own_policies.mode import OwnPoliciesMode
    from nonstop.orchestrator.modes.single_turn import TaskMode
    from nonstop.orchestrator.run import RunMode
    from nonstop.orchestrator.step_observers import (
        Checkpoints,
        Doctoring,
        Evaluation,
        Flops,
        Records,
        StepObserver,
        Timing,
    )
    from nonstop.runtime.actor_clients import (
        EngineActor,
        EngineService,
        RewardModelActor,
        RewardModelService,
        RewardWorkerActor,
        RewardWorkerService,
        TeacherActor,
        TeacherService,
        TrainerActor,
    )
    from nonstop.runtime.local import LocalActor, LocalBackend
    from nonstop.runtime.ray import RayActor, RayBackend
    from nonstop.runtime.restart import RestartingEngine
    from nonstop.scoring.base import ScoreComponent, Scorer
    from nonstop.scoring.pool import RewardModelPool, RewardWorker, RewardWorkerPool, TeacherPool
    from nonstop.scoring.reward_model import RewardModelWorker
    from nonstop.scoring.runners import AutoRunner, LoopRunner, ProcessRunner, ThreadRunner
    from nonstop.scoring.runners import Runner as RewardRunner
    from nonstop.scoring.stage import FunctionComponent, ScoringStage
    from nonstop.scoring.teacher import TeacherWorker
    from nonstop.serve.client import GenerationClient, HttpClient, InProcessClient
    from nonstop.serve.protocol import ServedEngine
    from nonstop.transport.base import ModelParameters, WeightPublisher, WeightReceiver, WeightTarget
    from nonstop.transport.broadcast import BroadcastPublisher
    from nonstop.transport.broadcast_receiver import BroadcastReceiver
    from nonstop.transport.files import FilesPublisher, FilesReceiver
    from nonstop.transport.names import PerExpertParameters
    from nonstop.transport.shm import ShmPublisher, ShmReceiver

    # Actor runtime: the backends and the single-actor handles they return.
    backends: list[type[runtime.ActorBackend]] = [LocalBackend, RayBackend]
    handles: list[type[runtime.ActorHandle]] = [LocalActor, RayActor]

    # Role clients: one actor, a replaceable actor, several actors.
    engine_clients: list[type[clients.EngineClient]] = [EngineActor, RestartingEngine, EnginePool]
    trainer_clients: list[type[clients.TrainerClient]] = [TrainerActor, RankGroup]

    # Weight transport: trainer end, engine end, and what a version is written into.
    publishers: list[type[WeightPublisher]] = [ShmPublisher, BroadcastPublisher, FilesPublisher]
    receivers: list[type[WeightReceiver]] = [ShmReceiver, BroadcastReceiver, FilesReceiver]
    targets: list[type[WeightTarget]] = [ModelParameters, MergedAdapters, PerExpertParameters]

    # Engine actors: the object each engine process serves (engine.kind builtin / vllm).
    engine_services: list[type[EngineService]] = [EngineWorker, VllmEngineWorker]

    # Engine: the in-process engine and the model runner its scheduler drives.
    engines: list[type[Engine]] = [TorchEngine]
    runners: list[type[Runner]] = [KVRunner]

    # Scoring, and the clients of a served engine.
    scorers: list[type[Scorer]] = [ScoringStage]
    components: list[type[ScoreComponent]] = [FunctionComponent]
    reward_runners: list[type[RewardRunner]] = [LoopRunner, ThreadRunner, ProcessRunner, AutoRunner]

    # Scoring actors: their clients (one actor; replaceable actors) and the object each actor serves.
    reward_model_clients: list[type[clients.RewardModelClient]] = [RewardModelActor, RewardModelPool]
    teacher_clients: list[type[clients.TeacherClient]] = [TeacherActor, TeacherPool]
    reward_worker_clients: list[type[clients.RewardWorkerClient]] = [RewardWorkerActor, RewardWorkerPool]
    reward_model_services: list[type[RewardModelService]] = [RewardModelWorker]
    teacher_services: list[type[TeacherService]] = [TeacherWorker]
    reward_worker_services: list[type[RewardWorkerService]] = [RewardWorker]
    generation_clients: list[type[GenerationClient]] = [InProcessClient, HttpClient]
    served_engines: list[type[ServedEngine]] = [AsyncEngine, VllmEngineWorker]

    # Environments (one agent; several roles) and the engines an episode runs its turns on.
    environments: list[type[Environment]] = [GuessNumber, Calculator, NimVsScripted]
    multi_agent: list[type[MultiAgentEnvironment]] = [SingleAgent, Nim]
    turn_engines: list[type[TurnEngine]] = [EnginePool, RestartingEngine, EngineActor, AsyncEngine, ClientEngine]

    # A run's mode (where its groups come from, chosen once in build.py) and its learning loop's step observers.
    run_modes: list[type[RunMode]] = [TaskMode, EnvMode, OwnPoliciesMode, AgentsMode]
    step_observers: list[type[StepObserver]] = [Timing, Flops, Records, Doctoring, Evaluation, Checkpoints]
