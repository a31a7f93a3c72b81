"""protrain_fx: ProTrain automatic memory management for LLM training, as a torch.compile backend.

model = torch.compile(model, backend="protrain")            # found by entry point, or registered on import
model = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}))  # inspectable
"""

import torch

from protrain_fx import amp, optim
from protrain_fx.backend import GraphRecord, ProTrainBackend, protrain
from protrain_fx.config import ProTrainConfig
from protrain_fx.explain import explain, manager_of, plan_of
from protrain_fx.metrics import StepMetrics
from protrain_fx.planner.plan import Plan
from protrain_fx.runtime.adopt import no_sync, prepare
from protrain_fx.runtime.clip import clip_grad_norm_
from protrain_fx.runtime.pretrained import from_pretrained
from protrain_fx.runtime.state import full_state_dict, load_state_dict, state_dict
from protrain_fx.whatif import WhatIf, what_if

__all__ = [
    "clip_grad_norm_",
    "GraphRecord",
    "no_sync",
    "amp",
    "explain",
    "from_pretrained",
    "Plan",
    "ProTrainBackend",
    "ProTrainConfig",
    "StepMetrics",
    "full_state_dict",
    "load_state_dict",
    "manager_of",
    "state_dict",
    "optim",
    "plan_of",
    "prepare",
    "protrain",
    "what_if",
    "WhatIf",
]


def _register_backend() -> None:
    """`backend="protrain"` also where the package's entry point is not installed (a source checkout on the
    path): torch finds installed entry points itself."""
    if "protrain" not in torch._dynamo.list_backends(exclude_tags=()):
        torch._dynamo.register_backend(protrain, name="protrain")


_register_backend()
