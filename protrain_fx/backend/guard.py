"""`Guarded`: what Dynamo runs for one training graph. Its out-of-memory errors name the plan or, under
on_oom="replan", re-plan the graph from its stored profile (the table in runtime/oom.py); under replan="on" it
re-plans the graph once from what its first steps measured, or puts the `replan` option's plans in force in turn
(runtime/replan.py). Either way the graph is compiled again through the backend (backend/compiler.py), with no new
profile."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from protrain_fx.backend.record import RUNTIME_ATTR, device_of
from protrain_fx.planner.cost import CostModel
from protrain_fx.planner.plan import Plan
from protrain_fx.planner.search import NoPlanFits
from protrain_fx.runtime.chunks.common import FROZEN_OUT_ATTR, unfrozen_param_error, unfrozen_since_compile_error
from protrain_fx.runtime.oom import Replanning, device_state, first_line, plan_summary
from protrain_fx.runtime.replan import REPLAN_FILE, ClosedLoop, moves_chunks

if TYPE_CHECKING:
    from protrain_fx.backend.compiler import ProTrainBackend

log = logging.getLogger(__name__)


class Guarded:
    """What Dynamo runs for one training graph: the compiled graph, whose out-of-memory errors name the plan
    or, under on_oom="replan", re-plan it (the table in runtime/oom.py), and which re-plans it once from what its
    first steps measured, under replan="on" (runtime/replan.py)."""

    def __init__(self, backend: ProTrainBackend, gm: fx.GraphModule, example_inputs: Sequence[Any], record):
        self.backend, self.gm, self.record = backend, gm, record
        self.device = device_of(example_inputs)
        self.replanning = Replanning(backend.config, self.device)
        replan = backend.config.replan
        turns = [dict(t) for t in replan] if isinstance(replan, tuple) else None
        self.loop = ClosedLoop(self.device, turns) if replan != "off" else None
        self.switching: tuple[Plan, CostModel] | None = None  # the plan and cost model the compile puts in force
        reason = getattr(gm, "compile_subgraph_reason", None)
        self.graph_break = reason is not None and reason.graph_break
        # where each input comes from (capture.py reads it), which Dynamo deletes once the graph is compiled
        self.graphargs = {n: n.meta["grapharg"] for n in gm.graph.find_nodes(op="placeholder") if "grapharg" in n.meta}
        # a graph with symbolic sizes is not compiled again outside Dynamo: that would fix its sizes to the call's
        self.symbolic = any(isinstance(x, torch.SymInt) for x in example_inputs)
        self.compiled = backend.compile(gm, example_inputs, record, self)
        # parameters frozen when the graph was compiled: torch 2.11 runs it again after one is unfrozen (newer
        # versions compile anew), computing no gradient for it, so a call with one unfrozen is refused
        self.frozen = {e.index: e.name for e in record.param_map.values() if not example_inputs[e.index].requires_grad}

    def __call__(self, *args):
        for i, name in self.frozen.items():
            if args[i].requires_grad:
                raise (
                    unfrozen_param_error(name)
                    if FROZEN_OUT_ATTR in args[i].__dict__
                    else unfrozen_since_compile_error(name)
                )
        if self.replanning.due:  # (a backward ran out of memory)
            self._recompile(args, "backward", "", "(in the last step)")
        if self.loop is not None and self.loop.due(self.record.monitor):
            self._close_loop(args)
        while True:
            try:
                return self.compiled(*args)
            except torch.OutOfMemoryError as error:
                state, cause = device_state(self.device), first_line(error)
            # (out of the except block: the failed forward's tensors went with its frames)
            self._abandon()
            if not self._replan():
                raise self._error("forward", state, cause)
            self._recompile(args, "forward", state, cause)

    def backward(self, compiled, gm: fx.GraphModule):
        """The compiled backward (boxed), losing its step instead of failing when it runs out of memory under
        on_oom="replan": its outputs are then all None (the parameters' gradients live in chunks)."""
        n_outputs = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])

        def run(args: list) -> list:
            try:
                return compiled(args)
            except torch.OutOfMemoryError as error:
                state, cause = device_state(self.device), first_line(error)
            args.clear()  # the saved activations
            self._abandon()
            manager = self._manager()
            started = manager.updates_started() if manager is not None else []
            replanned = self._replan()
            if not replanned or manager is None or started:
                why = (
                    "re-planned for the next step, but this step's weights were partly updated already ("
                    f"chunks {started} had started): resume from the last checkpoint"
                    if started
                    else "re-planned for the next step, but only protrain_fx.optim.AdamW can skip this lost step: "
                    "call optimizer.zero_grad() and go on"
                )
                raise self._error("backward", state, cause, why=why if replanned else "")
            manager.lose_step()
            log.warning(
                "graph %d: the backward ran out of GPU memory; this step is lost (the optimizer step skips it) and "
                "the graph is re-planned before its next forward",
                self.record.index,
            )
            return [None] * n_outputs

        run._boxed_call = True
        return run

    def _replan(self) -> bool:
        """Lower the capacity for a re-plan before the next forward; False when that is not possible (a graph with
        symbolic sizes, planned for the largest it will see, is not re-planned out of memory)."""
        if self.symbolic or not self.replanning.lower(self.record.capacity):
            return False
        self.replanning.due = True
        return True

    def _manager(self):
        """The model's ChunkManager, None when the graph is not chunked."""
        return self.record.manager() if self.record.manager is not None else None

    def _abandon(self) -> None:
        manager = self._manager()
        if manager is not None:
            manager.abandon_step()
        if self.record.swap is not None:
            self.record.swap.abandon()

    def _error(self, where: str, state: str, cause: str, *, why: str = "") -> torch.OutOfMemoryError:
        record = self.record
        return self.replanning.error(where, record.index, record.plan, record.capacity, state, cause, why=why)

    def _recompile(self, args: Sequence[Any], where: str, state: str, cause: str) -> None:
        """The graph again, planned under the lowered capacity from its profile (not profiled again); with the
        model's chunks as built, only the activation fields change. `where`, `state`, `cause`: of the out-of-memory
        error that asked for it, for the error if no plan fits."""
        self.replanning.due = False
        try:
            self._compile_again(args)
        except NoPlanFits as error:
            why = f"re-planned under {self.replanning.config.gpu_memory_bytes} bytes, where {error}"
            raise self._error(where, state, cause, why=why) from None
        log.warning("graph %d re-planned:\n%s", self.record.index, self.record.plan)

    def _close_loop(self, args: Sequence[Any]) -> None:
        """The closed loop (runtime/replan.py): where the calibrated search's plan is enough faster, or a plan is
        due in turn, the model's chunks placed again for it where its chunk fields differ, and the graph compiled
        again with it."""
        record, manager = self.record, self._manager()
        switch = self.loop.decide(record, manager, self._chunks_may_move(manager))
        if switch is None:
            if self.loop.done:
                self._decided()
            return
        before, plan, started = record.plan, switch[0], time.perf_counter()
        if self.symbolic:  # (compiled again outside Dynamo, its sizes would become this call's)
            log.warning(
                "graph %d has symbolic sizes and keeps its plan; the closed loop would switch %s\nto: %s",
                record.index,
                self.loop.reason,
                plan_summary(plan),
            )
            self.loop.switched = False
            self._decided()
            return
        if manager is not None and moves_chunks(plan, manager):
            if not manager.placement.place_again(
                plan.n_persist, plan.n_buffer, plan.host_grad_slots, plan.device_grad_slots, plan.n_device_shard
            ):
                log.warning(
                    "graph %d: no room to place the chunks for the plan %s; kept", record.index, self.loop.reason
                )
                self.loop.not_placed()
                self._decided()
                return
        placed = time.perf_counter()
        self.switching = switch
        try:
            self._compile_again(args)
        finally:
            self.switching = None
        compiled = time.perf_counter()
        self.loop.note_switch(placed_s=placed - started, compiled_s=compiled - placed)
        self._decided()
        log.warning(
            "graph %d re-planned %s (chunks placed in %.1f s, forward compiled in %.1f s)\nbefore: %s\nafter:  %s\n%s",
            record.index,
            self.loop.reason,
            placed - started,
            compiled - placed,
            plan_summary(before),
            plan_summary(record.plan),
            record.plan,
        )

    def _chunks_may_move(self, manager) -> bool:
        """Whether a re-plan may place the model's chunks again: this graph is the only compiled graph reading them,
        and ends in no graph break (the other graphs, and the Python after a break, read them where they are)."""
        return manager is not None and not self.graph_break and manager.outside.graphs_reading == {self.record.key}

    def _decided(self) -> None:
        """The loop's decision to the dump (replan.json) and to the plan cache (backend/cache.py), for the next run
        to start with."""
        if self.record.dumper is not None:
            self.record.dumper.write_json(REPLAN_FILE, self.loop.to_json())
        decision = self.loop.decision()
        if decision is not None and self.record.cache is not None:
            calibration, switched = decision
            self.record.cache.keep_loop(calibration, self.record.plan if switched else None)

    def _compile_again(self, args: Sequence[Any]) -> None:
        """The graph compiled again from its stored profile (its swap space and monitor made anew)."""
        record = self.record
        model = record.model() if record.model is not None else None
        if model is not None:  # its swap space and monitor go (the ops hold them weakly: the model keeps them)
            old = [o for o in (record.swap, record.monitor) if o is not None]
            kept = [o for o in model.__dict__.get(RUNTIME_ATTR, []) if all(o is not x for x in old)]
            model.__dict__[RUNTIME_ATTR] = kept
        record.swap = record.monitor = self.compiled = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        for node, grapharg in self.graphargs.items():
            node.meta.setdefault("grapharg", grapharg)
        self.compiled = self.backend.compile(self.gm, args, record, self)
