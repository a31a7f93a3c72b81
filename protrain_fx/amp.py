"""protrain_fx.amp.GradScaler: dynamic loss scaling for float16 models in chunks (defined in runtime/optim.py)."""

from protrain_fx.runtime.optim import GradScaler

__all__ = ["GradScaler"]
