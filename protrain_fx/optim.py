"""Optimizers for models trained through the protrain backend: `protrain_fx.optim.AdamW`."""

from protrain_fx.runtime.optim import AdamW

__all__ = ["AdamW"]
