"""Generation side: the Engine protocol, the built-in torch engine and its actor worker.

Nothing in this package imports the trainer; it speaks `nonstop.types` only.
"""

from nonstop.engine.core import Engine, TorchEngine, WeightSource

__all__ = ["Engine", "TorchEngine", "WeightSource"]
