"""What inductor makes of a graph (profiler/fusion.py): library kernels, views, and fused regions with the bytes
their kernels move and the intermediates they never allocate."""

import json

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from protrain_fx.profiler.fusion import EXTERN, FUSED, VIEW, describe, kernel_classes, rebuild


def f(x, w):
    y = x * 2
    z = y + 1  # {mul, add}: one kernel before the matmul, y never leaves it
    m = z @ w.t()
    return torch.relu(m)  # after the matmul: a kernel of its own


def test_regions_between_library_kernels():
    x, w = torch.randn(16, 8), torch.randn(4, 8)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    kernels = kernel_classes(gm.graph)
    by_target = {str(n.target): kernels[n.name] for n in gm.graph.nodes if n.name in kernels}
    nbytes = 16 * 8 * 4
    assert by_target["aten.mm.default"].kind == EXTERN and by_target["aten.t.default"].kind == VIEW
    assert kernels["mul"].kind == kernels["add"].kind == kernels["relu"].kind == FUSED
    assert kernels["mul"].fused_bytes == 0  # the region's bytes are on its last node
    assert kernels["add"].fused_bytes == 2 * nbytes  # reads x, writes z (the matmul reads it)
    assert kernels["relu"].fused_bytes == 2 * 16 * 4 * 4  # reads m, writes the output
    # y lives from mul to add in the op-by-op run, never under fusion
    assert kernels["mul"].unfused_bytes == kernels["add"].unfused_bytes == nbytes
    assert kernels["mm"].unfused_bytes == kernels["relu"].unfused_bytes == 0


def softmax(x):
    e = torch.exp(x)
    return e / e.sum(-1, keepdim=True)  # e read by a reduction and by the division


def test_cheap_value_read_twice_is_recomputed_on_the_gpu_and_stored_on_the_cpu():
    """Inductor stores a value read by several nodes only when computing it is costly (ir.py:
    should_realize_on_reuse): on the GPU exp(x) reads one buffer and is recomputed in the sum and the division;
    on the CPU exp is a heavy op and is written out."""
    gm = make_fx(softmax, tracing_mode="fake")(torch.randn(16, 8))
    nbytes = 16 * 8 * 4
    gpu, cpu = kernel_classes(gm.graph), kernel_classes(gm.graph, cpu=True)
    assert gpu["exp"].unfused_bytes == nbytes  # credited: never allocated under inductor
    assert gpu["div"].fused_bytes == 2 * nbytes  # reads x, writes the output
    assert cpu["exp"].unfused_bytes == 0  # not credited: it exists under inductor too
    assert cpu["div"].fused_bytes == 3 * nbytes  # reads x, writes e and the output
    assert cpu["div"].unfused_bytes == gpu["sum_1"].unfused_bytes - nbytes == 16 * 4  # the row sums stay inside


def wide(x, a, b, c, d):
    y = x * a + b * c + d  # reads five buffers
    return y.sum(-1, keepdim=True) * y


def test_costly_value_read_twice_is_stored():
    """A value read twice whose expression reads more than inductor's realize_reads_threshold (4) buffers is
    written out, on every device."""
    gm = make_fx(wide, tracing_mode="fake")(*(torch.randn(16, 8) for _ in range(5)))
    for kernels in (kernel_classes(gm.graph), kernel_classes(gm.graph, cpu=True)):
        assert kernels["sum_1"].unfused_bytes == 16 * 4  # the sums only: y is written, its terms died inside
        assert kernels["mul_2"].fused_bytes == 7 * 16 * 8 * 4  # reads 5, writes y and the output


def log_softmax_of_cast(logits):
    return torch.log_softmax(logits.float(), -1)


def test_cast_logits_are_never_stored():
    """The loss's upcast of the bf16 logits (read by the max and the subtraction of a log-softmax) is recomputed:
    its fp32 copy, twice the logits' size, is not allocated under inductor."""
    gm = make_fx(log_softmax_of_cast, tracing_mode="fake")(torch.randn(16, 96, dtype=torch.bfloat16))
    (cast,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten._to_copy.default]
    for kernels in (kernel_classes(gm.graph), kernel_classes(gm.graph, cpu=True)):
        assert kernels[cast.name].unfused_bytes >= 16 * 96 * 4


def loss_backward(logits, target, grad):
    logp = torch.log_softmax(logits.float(), -1)
    return torch.autograd.grad(torch.nn.functional.nll_loss(logp, target), logits, grad)[0]


def test_ops_inductor_decomposes_are_fused():
    """Log-softmax and the nll loss (forward and backward) have no kernel of their own under inductor: it
    decomposes them into ops it fuses, so their fp32 intermediates are never allocated."""
    logits, target = torch.randn(16, 32, dtype=torch.bfloat16, requires_grad=True), torch.randint(0, 32, (16,))
    gm = make_fx(loss_backward, tracing_mode="fake")(logits, target, torch.tensor(1.0))
    kernels = kernel_classes(gm.graph)
    aten = torch.ops.aten
    decomposed = {
        aten._log_softmax.default,
        aten.nll_loss_forward.default,
        aten.nll_loss_backward.default,
        aten._log_softmax_backward_data.default,
    }
    found = [n for n in gm.graph.nodes if n.target in decomposed]
    assert len(found) == 4, [n.target for n in found]
    assert all(kernels[n.name].kind == FUSED for n in found), {n.name: kernels[n.name] for n in found}
    assert kernels[next(n.name for n in found if n.target is aten.nll_loss_backward.default)].unfused_bytes > 0


def loss_backward_reading_saved_logits(logits, tangent):
    grad = torch.softmax(logits.float(), -1).to(torch.bfloat16)  # the saved logits' last read in the profile
    return grad + tangent  # the fused kernel writes this while still reading the logits


def test_fused_kernel_holds_what_the_profile_freed_inside_its_region():
    """The profile frees the logits after their last read, the cast; inductor's one kernel for the region reads
    them until it writes its output, so the model counts them until the region's end (negative unfused bytes
    there). A parameter-like input (`primals_*`) is held by the model anyway and is not counted again."""
    args = torch.randn(16, 96, dtype=torch.bfloat16), torch.randn(16, 96, dtype=torch.bfloat16)
    gm = make_fx(loss_backward_reading_saved_logits, tracing_mode="fake")(*args)
    for ph, name in zip(gm.graph.find_nodes(op="placeholder"), ("logits", "tangents_1")):
        ph.name = name  # as in AOTAutograd's backward: a saved activation, and an output gradient
    gm.recompile()
    kernels = kernel_classes(gm.graph)
    add = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.add.Tensor)
    cast_out = 16 * 96 * 2
    assert kernels[add.name].unfused_bytes == cast_out - 16 * 96 * 2  # the bf16 cast (inside) less the logits
    gm.graph.find_nodes(op="placeholder")[0].name = "primals_1"
    assert kernel_classes(gm.graph)[add.name].unfused_bytes == cast_out


def test_described_graph_with_a_higher_order_op_is_rebuilt():
    """A dump describes the graphs as profiled (graphs.json): a higher-order operator (on CUDA inductor wraps a
    recomputed kernel in graphsafe_run_with_rng_state) is named and found again, an unknown callable stands in."""
    x, w = torch.randn(16, 8), torch.randn(4, 8)
    gm = make_fx(f, tracing_mode="fake")(x, w)
    hop = torch.ops.higher_order.graphsafe_run_with_rng_state
    relu = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.relu.default)

    class Opaque:  # a callable object with a __name__ (as fx needs) but no __qualname__
        __name__ = "opaque"

        def __call__(self, *args):
            return args

    with gm.graph.inserting_before(gm.graph.output_node()):
        wrapped = gm.graph.call_function(hop, (torch.ops.aten.relu.default, relu))
        opaque = gm.graph.call_function(Opaque(), (wrapped,))
    wrapped.meta["val"], opaque.meta["val"] = relu.meta["val"], relu.meta["val"]
    described = describe(gm.graph)
    again = rebuild(json.loads(json.dumps(described)))
    targets = {n.name: n.target for n in again.nodes}
    assert targets[wrapped.name] is hop
    assert callable(targets[opaque.name]) and targets[opaque.name] is not opaque.target
    assert describe(again) == described
    assert kernel_classes(again) == kernel_classes(gm.graph)
