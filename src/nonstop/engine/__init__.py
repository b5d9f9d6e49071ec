"""Generation side: the Engine protocol, the built-in torch engine and its actor worker.

Nothing in this package imports the trainer: requests and samples are `nonstop.types`, settings
come from `nonstop.config`, and weights arrive through the engine end of `nonstop.transport`.
"""

from nonstop.engine.core import Engine, TorchEngine, WeightSource

__all__ = ["Engine", "TorchEngine", "WeightSource"]
