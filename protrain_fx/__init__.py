"""protrain_fx: ProTrain automatic memory management for LLM training, as a torch.compile backend.

model = torch.compile(model, backend="protrain")            # the backend is found by entry point
model = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}))  # inspectable
"""

from protrain_fx.backend import GraphRecord, ProTrainBackend, protrain
from protrain_fx.config import ProTrainConfig
from protrain_fx.planner.plan import Plan

__all__ = ["GraphRecord", "Plan", "ProTrainBackend", "ProTrainConfig", "protrain"]
