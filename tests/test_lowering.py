"""The backend's inductor lowerings of the protrain ops (runtime/ops.py `register_inductor_lowering`)."""

import torch
from torch._inductor import lowering
from torch._library.custom_ops import CustomOpDef

from protrain_fx.runtime import ops


def test_every_protrain_op_is_lowered_before_inductor_meets_it(monkeypatch):
    """No protrain op is left to inductor's implicit fallback, whose log message (formatted even with the log off
    on torch 2.11) prints the op's arguments' IR as a tree: exponential where the IR shares subexpressions, which
    stalled a GPT-NeoX compile. Checked from a lowering table without them, as a fresh process has it."""
    protrain_ops = [v._opoverload for v in vars(ops).values() if isinstance(v, CustomOpDef)]
    assert len(protrain_ops) == len(list(torch.ops.protrain)) >= 12
    for op in protrain_ops:  # (absent during the test, and afterwards as before it)
        monkeypatch.setitem(lowering.lowerings, op, None)
        monkeypatch.delitem(lowering.lowerings, op)
    ops.register_inductor_lowering()
    assert [op for op in protrain_ops if op not in lowering.lowerings] == []
