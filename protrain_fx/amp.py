"""protrain_fx.amp.GradScaler: dynamic loss scaling for float16 models in chunks (defined in runtime/scaler.py)."""

from protrain_fx.runtime.scaler import GradScaler

__all__ = ["GradScaler"]
