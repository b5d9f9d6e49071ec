"""The root of every error nonstop raises on purpose, and the roots of the areas that lack one.

`except NonstopError` catches what nonstop means to tell a user (a refused config, a dead actor, a
failed transfer) and lets a bug, a plain `TypeError` say, keep its traceback: the command line
prints one line for the first and nothing for the second. Each area has one root below it:

- `ConfigError` (config/root.py; `DeviceError` and vLLM's `VllmSetupError` are config errors);
- `CheckpointError` (checkpoint.py), `ModelFetchError` (models/gguf.py);
- `ObserveError`: `ReportError`, `TrackingError`;
- `TransportError` (transport/base.py; `RoundAbandoned` ends a broadcast round early);
- `EngineError`: `UnsupportedModel`, `RequestError`;
- `TrainerError`: `NumericalError`, `RouteShapeError`;
- `ActorError`: `ActorDied`, `ActorCallError` (runtime/);
- `ScoringError`: `RewardError`, `CallFailed`;
- `DatasetError` (tasks/data.py);
- `ServeError`: the server cannot start, `BadRequest`, `ServerError` (serve/);
- `EnvError` (envs/base.py);
- `RunError`: `RunFailed`, `RunInterrupted`, `NoLearningSignal`, `EpisodeError`, `VerifyError`
  (orchestrator/).

A concrete error also keeps the built-in base its callers catch (`ConfigError` is a `ValueError`,
`TransportError` a `RuntimeError`). The roots defined here have none, so they combine with either.
"""

from __future__ import annotations


class NonstopError(Exception):
    """An error nonstop raises on purpose; the message says what went wrong and, where it can, what to do."""


class ObserveError(NonstopError):
    """Spans, records and their readers (observe/): a report or a tracker cannot be made."""


class EngineError(NonstopError):
    """The built-in engine (engine/): a model it cannot run, a request it cannot serve."""


class TrainerError(NonstopError):
    """The trainer (trainer/): a step it cannot take."""


class ActorError(NonstopError):
    """An actor of the runtime (runtime/): it died, or raised while serving a call."""


class ScoringError(NonstopError):
    """The scoring stage (scoring/): a reward that cannot be resolved or that failed."""


class ServeError(NonstopError):
    """The HTTP API (serve/): the server cannot start (address in use, port out of range), refused
    a request, or answered one with an error; the message says which."""


class RunError(NonstopError):
    """The flow of a run (orchestrator/): it cannot go on, was stopped, or cannot be verified."""


class RunInterrupted(RunError, RuntimeError):
    """The user stopped the run (Ctrl-C, SIGTERM); the message names the checkpoint written and
    how to resume. Here, not beside the checkpoint code that raises it, so the command line catches
    it without loading the pipeline."""
