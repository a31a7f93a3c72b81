"""protrain_fx: ProTrain automatic memory management for LLM training, as a torch.compile backend.

model = torch.compile(model, backend="protrain")            # the backend is found by entry point
model = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}))  # inspectable
"""

from protrain_fx import amp, optim
from protrain_fx.backend import GraphRecord, ProTrainBackend, protrain
from protrain_fx.config import ProTrainConfig
from protrain_fx.explain import explain, plan_of
from protrain_fx.metrics import StepMetrics
from protrain_fx.planner.plan import Plan
from protrain_fx.runtime.adopt import no_sync, prepare
from protrain_fx.runtime.clip import clip_grad_norm_
from protrain_fx.runtime.state import full_state_dict, load_state_dict, state_dict

__all__ = [
    "clip_grad_norm_",
    "GraphRecord",
    "no_sync",
    "amp",
    "explain",
    "Plan",
    "ProTrainBackend",
    "ProTrainConfig",
    "StepMetrics",
    "full_state_dict",
    "load_state_dict",
    "state_dict",
    "optim",
    "plan_of",
    "prepare",
    "protrain",
]
