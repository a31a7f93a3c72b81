"""The entry: `protrain` (the registered backend) and `ProTrainBackend`, which check a Dynamo graph, wrap it for its
run (backend/guard.py, backend/run.py) and compile it with the executor the options name: inductor's `compile_fx`
with our partitioner as its `custom_partitioner_fn`, or AOTAutograd with our partitioner and the FX graphs run as
they are (eager)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from protrain_fx.backend.guard import Guarded
from protrain_fx.backend.inference import InferencePasses
from protrain_fx.backend.partition import Partitioner
from protrain_fx.backend.phases import phase_done
from protrain_fx.backend.record import GraphCompile, GraphRecord
from protrain_fx.backend.run import ChunkedRun, lent_at_break
from protrain_fx.capture import check_inputs
from protrain_fx.config import ProTrainConfig
from protrain_fx.runtime.adopt import pass_through_ddp
from protrain_fx.runtime.chunks import MANAGER_ATTR
from protrain_fx.runtime.ops import register_inductor_lowering

log = logging.getLogger(__name__)

MIN_TORCH = (2, 11)


def check_torch_version(version: str = torch.__version__) -> None:
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    if (major, minor) < MIN_TORCH:
        raise RuntimeError(f"protrain needs torch >= {'.'.join(map(str, MIN_TORCH))}, found {version}; upgrade torch")


class ProTrainBackend:
    """A torch.compile backend object: `torch.compile(model, backend=ProTrainBackend(options))`.

    `backend="protrain"` makes one per graph; passing an instance keeps every graph's `GraphRecord` in
    `.graphs`, in compile order, for inspection after the fact.
    """

    def __init__(self, options: dict[str, Any] | ProTrainConfig | None = None, *, explain: bool = False):
        self.config = ProTrainConfig.from_options(options)
        self.graphs: list[GraphRecord] = []
        self.explain = explain  # plan only (protrain_fx.explain): no chunks built, graphs left as they are

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]):
        check_torch_version()
        check_inputs(gm, example_inputs)
        pass_through_ddp([x for x in example_inputs if isinstance(x, nn.Parameter)])
        record = GraphRecord(index=len(self.graphs))
        self.graphs.append(record)
        if self.explain:
            return self.compile(gm, example_inputs, record)
        lend = lent_at_break(gm, example_inputs)
        if not torch.is_grad_enabled():
            compiled = self.compile(gm, example_inputs, record)
        else:
            compiled = Guarded(self, gm, example_inputs, record)
        return ChunkedRun(compiled, record, example_inputs, lend) if record.manager is not None or lend else compiled

    def compile(self, gm: fx.GraphModule, example_inputs: Sequence[Any], record: GraphRecord, guard=None):
        """Compile one Dynamo graph: our stages run in AOTAutograd's partitioner. `guard`: the graph's `Guarded`
        (out-of-memory handling), whose config is ours with the capacity of its last re-plan."""
        config = guard.replanning.config if guard is not None else self.config
        compiling = GraphCompile(config, record, gm, list(example_inputs), explain=self.explain, guard=guard)
        partitioner = Partitioner(compiling)
        manager = None if torch.is_grad_enabled() else _offloaded_manager(example_inputs)
        inference = InferencePasses(config, record, gm, list(example_inputs), manager) if manager else None
        log.info(
            "compiling graph %d (%d nodes) with the %s executor", record.index, len(gm.graph.nodes), config.executor
        )
        try:
            if config.executor == "inductor":
                from torch._functorch import config as functorch_config
                from torch._inductor.compile_fx import compile_fx

                register_inductor_lowering()
                # AOTAutograd's cache stays off: a hit would skip the partitioner, and with it the chunks and the
                # runtime objects the rewritten graphs name. Inductor's FX graph cache keys the graphs it compiles,
                # which come rewritten (the plan and those objects' handles in them): a relaunch that rewrites
                # them alike skips inductor's code generation (Partitioner.__reduce__ gives the rest of the key)
                patches = {"custom_partitioner_fn": partitioner}
                inner = functools.partial(_inductor_inner_compile, inference, guard, record.index, self.explain)
                with functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False):
                    compiled = compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
                if compiling.partitioned is not None:  # (a training graph: its partitioner ran)
                    phase_done(record.index, "forward", time.perf_counter() - compiling.partitioned)
                return compiled
            eager = make_boxed_compiler(lambda g, _: g)
            more = {"inference_compiler": make_boxed_compiler(lambda g, _: inference(g))} if inference else {}
            if guard is not None:
                more["bw_compiler"] = lambda g, _: guard.backward(make_boxed_func(g), g)
            compiler = aot_autograd(**{"fw_compiler": eager, "bw_compiler": eager, "partition_fn": partitioner, **more})
            return compiler(gm, example_inputs)
        finally:  # (inductor's config cache keeps the last partitioner: it must not keep a dropped model's chunks)
            partitioner.forget()
            if inference is not None:
                inference.forget()


def _offloaded_manager(example_inputs: Sequence[Any]):
    """The ChunkManager of a graph's parameters when some of them are offloaded (they hold no values)."""
    for x in example_inputs:
        manager = x.__dict__.get(MANAGER_ATTR) if isinstance(x, nn.Parameter) else None
        if manager is not None and not manager.is_persistent(x):
            return manager
    return None


def _inductor_inner_compile(
    inference: InferencePasses | None, guard, index: int, explain: bool, gm: fx.GraphModule, example_inputs, **kwargs
):
    """Inductor's per-graph compile, with the inference graph rewritten first (training graphs come rewritten
    by the partitioner) and the backward under the graph's out-of-memory guard (its compile's time logged: it
    runs at the first backward). To explain, the graphs inductor decomposed and our partitioner planned run as
    they are: no kernels are generated for the one forward that planning needs."""
    from torch._inductor.compile_fx import compile_fx_inner

    if explain:
        return make_boxed_func(gm)
    if kwargs.get("is_inference") and inference is not None:
        gm = inference(gm)
    start = time.perf_counter()
    compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    if not kwargs.get("is_backward"):
        return compiled
    phase_done(index, "backward", time.perf_counter() - start)
    return guard.backward(compiled, gm) if guard is not None else compiled


def make_boxed_compiler(compile_fn):
    def compiler(gm: fx.GraphModule, example_inputs):
        return make_boxed_func(compile_fn(gm, example_inputs))

    return compiler


def protrain(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None, **_: Any):
    """The registered backend: `torch.compile(model, backend="protrain", options={...})`."""
    return ProTrainBackend(options)(gm, example_inputs)
