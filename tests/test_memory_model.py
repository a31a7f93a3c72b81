"""The peak-memory model (planner/memory_model.py) against measurement on the CPU.

Measured: the graphs as rewritten for the plan (recompute, swap ops), run once by the profiler's memory tracker
on the compile's real inputs; the activation peak is its peak above the inputs. Predicted: the cost model's
activation peak for the plan's block modes, from the profile of the unrewritten graphs.

Bound, checkpointed plans on the toy model, tiny GPT-2 and LLaMA: from 2% under to 10% over (measured on
torch 2.13: +0% to +6.1%). Known misses, not asserted here: OPT with every block checkpointed is under-predicted
by 29% (the recompute of its first backward block peaks higher than the profile's backward there), and
swapped plans are off by -9% to +19% on the CPU, where the host slots are the same memory as the device's.
"""

import models
import pytest
import torch
from helpers import CapturingBackend

from protrain_fx.profiler.interpreter import profile_iteration


def _measured_and_predicted(kind: str, plan: dict) -> tuple[int, int]:
    model = models.build(kind, layers=4)
    backend = CapturingBackend({"executor": "eager", "plan": plan})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    models.loss_of(kind, compiled(**models.batch(kind))).backward()
    record = backend.graphs[0]
    run = profile_iteration(record.forward, record.backward, backend.inputs, record.block_map)
    return run.peak_bytes - run.baseline_bytes, record.costs.activation_peak(record.plan.block_modes)


@pytest.mark.parametrize("kind", ["toy", "gpt2", "llama"])
def test_peak_of_checkpointed_plans_within_bound(kind):
    errors = {}
    for n_checkpoint in (0, 1, 4):  # (2 of the 4 blocks: the error of all 4 on each model, torch 2.13)
        measured, predicted = _measured_and_predicted(kind, {"n_swap": 0, "n_checkpoint": n_checkpoint})
        errors[n_checkpoint] = (predicted - measured) / measured
    assert errors[0] == 0  # no block optimized: the profile itself
    assert all(-0.02 <= e <= 0.10 for e in errors.values()), errors
