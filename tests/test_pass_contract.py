"""The pass contract (passes/contract.py): every pass of the pipelines declares what it rewrites, requires and
provides; a pipeline built in a wrong order or on a context without a field a pass requires fails when it is built,
naming the pass and the field or tag; and a pass that reads a field it does not declare fails as it runs."""

import pytest
import torch
from torch import fx

from protrain_fx.config import ProTrainConfig
from protrain_fx.passes import pipeline
from protrain_fx.passes.activations import SWAP, swap_in_pass, swap_out_pass
from protrain_fx.passes.chunks import RELEASES, TAG, chunk_gather_pass, chunk_tag_pass, grad_reduce_pass
from protrain_fx.passes.contract import (
    BACKWARD,
    CARRIED,
    FORWARD,
    INFERENCE,
    JOINT,
    PassContext,
    PipelineError,
    check_order,
    contract_of,
    graph_pass,
)
from protrain_fx.passes.pipeline import GRAPH_PASSES, INFERENCE_PASSES, JOINT_PASSES, run_passes

TRAINING = [(FORWARD, FORWARD), (BACKWARD, BACKWARD)]


def _graph() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.relu, (x,)))
    return fx.GraphModule(torch.nn.Module(), graph)


def _ctx() -> PassContext:
    return PassContext(config=ProTrainConfig(), plan=None, record=None)


def test_every_pass_of_the_pipelines_declares_fields_its_contexts_carry():
    for passes in (JOINT_PASSES, GRAPH_PASSES, INFERENCE_PASSES):
        for pass_fn in passes:
            contract = contract_of(pass_fn)
            assert contract is not None, pass_fn.__name__
            assert contract.graphs and contract.requires <= CARRIED[BACKWARD], pass_fn.__name__
    assert contract_of(chunk_gather_pass).requires_tags == {TAG} and contract_of(chunk_tag_pass).provides == {TAG}


def test_a_pass_before_the_one_that_tags_what_it_reads_fails_at_build():
    with pytest.raises(PipelineError) as raised:
        check_order((chunk_gather_pass, chunk_tag_pass), runs_on=TRAINING)
    message = str(raised.value)
    assert "'chunk_gather_pass'" in message and f"'{TAG}' on the forward graph" in message
    assert "no pass before it provides (passes before it: no passes)" in message
    with pytest.raises(PipelineError, match=f"'grad_reduce_pass' requires the tag '{RELEASES}' on the backward"):
        check_order((chunk_tag_pass, grad_reduce_pass, chunk_gather_pass), runs_on=TRAINING)


def test_tags_of_the_forward_and_of_the_joint_graph_reach_the_passes_after():
    """swap_in_pass reads the forward's swap tags: before swap_out_pass in the list it still runs after it (the
    forward's passes all run first); without it, it fails. The recompute tags come from the joint passes."""
    check_order((swap_in_pass, swap_out_pass), runs_on=TRAINING)
    with pytest.raises(PipelineError, match=f"'swap_in_pass' requires the tag '{SWAP}' on the forward graph"):
        check_order((swap_in_pass,), runs_on=TRAINING)
    order = pipeline.recompute_order_pass
    check_order((order,), runs_on=TRAINING, after=JOINT_PASSES)
    with pytest.raises(PipelineError, match="'recompute_order_pass' requires the tag"):
        check_order((order,), runs_on=TRAINING)


def test_a_context_without_a_field_a_pass_requires_fails_at_build():
    with pytest.raises(PipelineError) as raised:
        check_order((swap_out_pass,), runs_on=[(FORWARD, INFERENCE)])
    message = str(raised.value)
    assert "pass 'swap_out_pass' requires the context fields 'needed_from', 'plan', 'saved', 'swap'" in message
    assert "on the forward graph, which the inference context does not carry" in message
    fields = "fields 'forward_outputs', 'forward_placeholders' on the backward graph"
    with pytest.raises(PipelineError, match=f"'grad_reduce_pass' requires the context {fields}"):
        check_order((chunk_tag_pass, chunk_gather_pass, grad_reduce_pass), runs_on=[(BACKWARD, FORWARD)])


def test_undeclared_passes_and_unknown_fields_are_refused():
    def untyped(gm, ctx):
        return gm

    with pytest.raises(PipelineError, match="'untyped' declares no contract"):
        check_order((untyped,), runs_on=TRAINING)
    with pytest.raises(TypeError, match="pass 'misspelt_pass' requires \\['manger'\\]"):

        @graph_pass(graphs=(FORWARD,), requires=("manger",))
        def misspelt_pass(gm, ctx):
            return gm

    with pytest.raises(TypeError, match="rewrites \\['inference'\\]"):

        @graph_pass(graphs=(INFERENCE,))
        def inference_pass(gm, ctx):
            return gm


def test_a_pass_reading_a_field_it_does_not_require_fails_as_it_runs():
    @graph_pass(graphs=(JOINT,), requires=("plan",))
    def reads_the_manager_pass(gm, ctx):
        assert ctx.manager is None
        return gm

    @graph_pass(graphs=(JOINT,), requires=("plan", "manager"))
    def declares_the_manager_pass(gm, ctx):
        assert ctx.manager is None and ctx.plan is None and ctx.stage == "joint"
        return gm

    gm = _graph()
    assert run_passes(gm, _ctx(), [declares_the_manager_pass], stage="joint") is gm
    with pytest.raises(RuntimeError) as raised:
        run_passes(gm, _ctx(), [declares_the_manager_pass, reads_the_manager_pass], stage="joint")
    message = str(raised.value)
    assert "'reads_the_manager_pass' failed on the joint graph (after ['declares_the_manager_pass'])" in message
    assert "reads ctx.manager, which it does not require" in message
