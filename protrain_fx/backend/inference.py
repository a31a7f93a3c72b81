"""The inference graphs of a model with offloaded chunks (`InferencePasses`): the forward chunk passes, no profile
and no plan."""

from __future__ import annotations

import logging
import weakref

from torch import fx

from protrain_fx.backend.record import PLANS_ATTR, GraphRecord
from protrain_fx.backend.stages import pin_to_frame_modules
from protrain_fx.capture import build_param_map, find_frame_roots
from protrain_fx.config import ProTrainConfig
from protrain_fx.debug.dump import Dumper
from protrain_fx.passes.pipeline import INFERENCE_PASSES, PassContext, run_passes
from protrain_fx.runtime.adopt import check_params_managed

log = logging.getLogger(__name__)


class InferencePasses:
    """The graph AOTAutograd compiles for inference (under no_grad, or inference mode, it runs no partitioner) of
    a model with offloaded chunks: the forward chunk passes, so it reads those parameters through gather and
    release. Nothing is profiled or planned: the chunks are the model's, and no activation is kept for a
    backward."""

    def __init__(self, config: ProTrainConfig, record: GraphRecord, dynamo_gm, example_inputs: list, manager):
        self.config, self.record, self.dynamo_gm = config, record, dynamo_gm
        self.example_inputs, self.manager = example_inputs, manager

    def forget(self) -> None:
        """Drop the graph and its inputs (the model's parameters among them) once the compile is done."""
        self.dynamo_gm = self.example_inputs = self.record = self.manager = None

    def __call__(self, gm: fx.GraphModule) -> fx.GraphModule:
        record = self.record
        assert record is not None, f"the inference passes of {gm} ran after its compile was done"
        roots = find_frame_roots(self.dynamo_gm, self.example_inputs)
        pin_to_frame_modules(self.dynamo_gm, roots)
        record.param_map = build_param_map(self.dynamo_gm, self.example_inputs, gm, roots)
        check_params_managed(self.manager, record.param_map, self.example_inputs)
        self.manager.outside.note_read_by_graph(
            (self.example_inputs[e.index] for e in record.param_map.values()), record.key
        )
        plans = roots.model.__dict__.get(PLANS_ATTR) if roots.model is not None else None
        record.plan = plans[-1][1] if plans else None  # (the training plan in force, for plan_of and the dump)
        dumper = Dumper(self.config.dump_dir) if self.config.dump_dir else None
        ctx = PassContext(
            config=self.config,
            plan=record.plan,
            record=record,
            dumper=dumper,
            manager=self.manager,
            example_inputs=self.example_inputs,
        )
        record.forward = run_passes(gm, ctx, INFERENCE_PASSES, stage="forward")
        record.manager = weakref.ref(self.manager)
        log.info("graph %d: an inference graph, its offloaded chunks gathered as used", record.index)
        return record.forward
