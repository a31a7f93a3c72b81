"""Per-block activation swapping: saved tensors of swapped blocks go to host slots after their last forward use
and come back before their first backward use (runtime/swap.py, passes/activations.py).

Tolerance: bitwise (CPU, fp32, eager executor): a swapped tensor comes back with the same bytes, and the
ops that read it are unchanged. On the CPU the copies go CPU to CPU through the same slots and ops. On a GPU under
bf16 autocast: helpers.BF16_RTOL.
"""

import copy

import models
import pytest
import torch
from helpers import BF16_RTOL, UNCHANGED, eager_and_protrain, saved_activation_bytes, train, train_against_autocast

import protrain_fx
from protrain_fx.planner.cost import swap_interval
from protrain_fx.profiler.hardware import hardware_profile

LAYOUTS = {
    "all-swap": {"n_swap": 3},
    "mix": {"n_swap": 1, "n_checkpoint": 2},
    "odd-list": {"block_modes": ["checkpoint", "swap", "none"]},
}


def _compiled(kind, options, **kw):
    ref = models.build(kind, layers=3, **kw)
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", **options})
    return ref, model, backend, torch.compile(model, backend=backend, dynamic=False)


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
@pytest.mark.parametrize("kind", ["toy", "llama", "opt"])
def test_swapped_training_equals_eager_with_dropout(kind, layout):
    ref, model, backend, compiled = _compiled(kind, {"plan": LAYOUTS[layout]}, dropout=0.1)
    assert train(compiled, kind, 3) == train(ref, kind, 3)
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)
    record = next(g for g in backend.graphs if g.param_map)
    assert record.swap is not None and record.swap.slots


def test_swap_with_offloaded_chunks_and_inductor():
    """Swapped activations next to offloaded chunks, through inductor (the ops are fallback kernels there):
    the inductor tolerance of the other tests, losses 1e-4. With every toy block swapped, inductor hoisted the
    gathers above the releases that free their buffers until gathers waited for release tokens. A LLaMA's swapped
    block beside offloaded chunks: test_swapped_views_through_inductor_under_autocast."""
    ref = models.build("toy", layers=2)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    options = {"plan": {"n_persist": 1, "n_buffer": 3, "n_swap": 2}}
    compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend(options), dynamic=False)
    expected = train(ref, "toy", 3, opt=ref_opt)
    assert train(compiled, "toy", 3, opt=opt) == pytest.approx(expected, rel=1e-4)


def test_swapped_views_through_inductor_under_autocast():
    """Under bf16 autocast the attention saves transposed views, which inductor lays out its own way unless told
    not to: the host slots keep the graph's layout whatever the compiler hands over (runtime/ops.py `swap_out`),
    where inductor's check of the op's output strides failed before. The first of two blocks swapped, beside
    offloaded chunks; the bf16 tolerance of the GPU tests. (Two blocks: inductor's compile time grows with the
    kernels of the graph.)"""
    ref = models.build("llama", layers=2)
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
    backend = protrain_fx.ProTrainBackend({"plan": {"n_persist": 1, "n_buffer": 3, "n_swap": 1}})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    expected = train(ref, "llama", 2, opt=ref_opt, autocast=torch.bfloat16)
    losses = train(compiled, "llama", 2, opt=opt, autocast=torch.bfloat16)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=2e-2, atol=1e-3)
    (record,) = [g for g in backend.graphs if g.param_map]
    assert record.swap is not None and record.swap.slots and record.plan.n_persist == 1


def _saved_outside_swap(kind, plan):
    """Activation bytes the forward keeps for backward outside the host swap slots, and the graph record."""
    _, model, backend, compiled = _compiled(kind, {"plan": plan})
    batch = models.batch(kind)
    compiled(**batch)
    record = backend.graphs[0]
    exclude = [record.swap.arena] if record.swap is not None else []
    return saved_activation_bytes(compiled, model, batch, exclude), record


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_swapped_block_keeps_nothing_on_the_device(kind):
    full, plain = _saved_outside_swap(kind, {})
    middle, record = _saved_outside_swap(kind, {"block_modes": ["none", "swap", "none"]})
    assert middle == full - plain.profile.blocks[1].saved_bytes
    slots = record.swap.slots
    # the arena holds exactly the swapped tensors (64-byte aligned), allocated once
    assert record.swap.arena.numel() == sum(-(-s.numel() * s.element_size() // 64) * 64 for s in slots)
    assert sum(s.numel() * s.element_size() for s in slots) >= plain.profile.blocks[1].saved_bytes


def test_swap_passes_rewrite_only_swapped_blocks():
    _, _, backend, compiled = _compiled("toy", {"plan": {"block_modes": ["none", "swap", "none"]}})
    compiled(**models.batch("toy")).backward()
    record = backend.graphs[0]
    fw, bw = record.forward, record.backward
    outs = [n for n in fw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)]
    ins = bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_in.default)
    prefetches = bw.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_prefetch.default)
    assert len(outs) == len(ins) == len(record.swap.slots) > 0 and 0 < len(prefetches) <= len(ins)
    assert {record.block_map.block[n.args[2].name] for n in outs} == {1}
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    for n in ins:  # each swap_in comes before every reader and after its prefetch
        assert all(order[u] > order[n] for u in n.users)
    for p in prefetches:  # each prefetch comes before the swap_ins of its slots
        assert all(any(order[p] < order[n] and slot == n.args[1] for n in ins) for slot in p.args[1])
    _, _, plain, compiled_plain = _compiled("toy", {})
    compiled_plain(**models.batch("toy")).backward()
    for gm in (plain.graphs[0].forward, plain.graphs[0].backward):
        assert not any("swap" in str(n.target) for n in gm.graph.nodes)


def test_a_prefetch_at_the_backwards_start_follows_a_tensor_input(monkeypatch):
    """The last block's tensors are prefetched where the backward starts, after its inputs: after the last one that
    is a tensor, as the op takes one (on CUDA the recompute's RNG generators are the backward's last inputs; here a
    generator input is put there for the swap passes to see, and taken out after them)."""
    from protrain_fx.backend import stages as stages_module
    from protrain_fx.passes import pipeline

    def add_generator(gm, ctx):
        if ctx.stage == "backward":
            last = list(gm.graph.find_nodes(op="placeholder"))[-1]
            with gm.graph.inserting_after(last):
                gm.graph.placeholder("rng_generator").meta["val"] = torch.Generator()
        return gm

    def drop_generator(gm, ctx):
        for n in gm.graph.find_nodes(op="placeholder"):
            if n.name == "rng_generator":
                gm.graph.erase_node(n)  # (fails if a pass made it an argument)
        gm.recompile()
        return gm

    passes = list(pipeline.GRAPH_PASSES)
    at = passes.index(pipeline.swap_in_pass)
    passes[at : at + 1] = [add_generator, pipeline.swap_in_pass, drop_generator]
    monkeypatch.setattr(stages_module, "GRAPH_PASSES", tuple(passes))
    ref, _, backend, compiled = _compiled("toy", {"plan": {"block_modes": ["none", "none", "swap"]}})
    assert train(compiled, "toy", 2) == train(ref, "toy", 2)
    prefetch = backend.graphs[0].backward.graph.find_nodes(
        op="call_function", target=torch.ops.protrain.swap_prefetch.default
    )
    assert [isinstance(p.args[2].meta["val"], torch.Tensor) for p in prefetch] == [True]


def _prefetch_blocks(record):
    """For each swap prefetch in the backward: (block of its tensors, block whose first node it follows)."""
    swapped_block = {}
    for n in record.forward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default):
        swapped_block[n.args[1]] = record.block_map.block[n.args[2].name]
    prefetches = record.backward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_prefetch.default)
    return [({swapped_block[s] for s in p.args[1]}, record.block_map.block.get(p.args[2].name)) for p in prefetches]


@pytest.mark.parametrize("interval", [1, 2])
def test_prefetch_runs_the_swap_interval_ahead(interval):
    """Block 0's tensors are prefetched, all in one op, when the backward reaches block `interval`; the forward
    settles them when it reaches that block."""
    plan = {"block_modes": ["swap", "none", "none"], "swap_interval": interval}
    ref, _, backend, compiled = _compiled("toy", {"plan": plan})
    assert train(compiled, "toy", 2) == train(ref, "toy", 2)
    record = backend.graphs[0]
    assert record.plan.swap_interval == interval
    assert _prefetch_blocks(record) == [({0}, interval)]
    # the forward frees block 0's device tensors `interval` blocks later, once their copies are done (a tensor
    # block `interval` still reads is swapped out later, and settled at the forward's end)
    fw = record.forward.graph
    settle, *at_end = fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_settle.default)
    order = {n: i for i, n in enumerate(fw.nodes)}
    before = {
        n.args[1]
        for n in fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
        if order[n] < order[settle]
    }
    assert record.block_map.block[settle.args[4].name] == interval and set(settle.args[1]) == before
    assert len(before) >= len(record.swap.slots) // 2
    outs = fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
    assert all(order[s] > max(order[n] for n in outs) for s in at_end)  # after the forward's last swap_out


@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_every_swapped_tensor_is_read_until_its_copy_is_settled(layout):
    """A swapped tensor's copy to the host may still run on a side stream after `swap_out`: its device memory must
    not go to another value before the settle that waits for the copy. Inductor plans a graph's memory itself
    and reuses a buffer right after its last reader, so the settle must read every swapped tensor, after its
    swap_out and once."""
    _, _, backend, compiled = _compiled("llama", {"plan": LAYOUTS[layout]})
    compiled(**models.batch("llama")).loss.backward()
    fw = backend.graphs[0].forward.graph
    order = {n: i for i, n in enumerate(fw.nodes)}
    settled = {}
    for settle in fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_settle.default):
        _, slots, copies, sources, _ = settle.args
        assert [c.args[1] for c in copies] == slots and [c.args[2] for c in copies] == sources
        for slot, copy_node in zip(slots, copies):
            assert slot not in settled and order[copy_node] < order[settle], f"{settle.name}: slot {slot}"
            settled[slot] = settle
    outs = fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
    assert sorted(settled) == sorted(n.args[1] for n in outs) and outs
    for n in outs:  # nothing but the swap_out and its settle reads the tensor after the swap_out
        source = n.args[2]
        assert max((u for u in source.users if u.op != "output"), key=order.__getitem__) is settled[n.args[1]]


@pytest.mark.parametrize("kind", ["toy", "llama"])
def test_swapped_tensors_come_back_with_the_strides_the_backward_was_built_for(kind, monkeypatch):
    """A saved tensor need not be contiguous (a transposed view, heads split from a fused projection). Its host
    slot keeps its strides where it is dense, and its stride order where it is not (`torch.empty_like`), and
    `swap_in` gives back a device tensor of those strides: what the graphs' metadata, from which the compiler
    builds the backward, says it gets."""
    from protrain_fx.runtime.swap import SwapSpace

    returned = []
    swap_in = SwapSpace.swap_in
    monkeypatch.setattr(SwapSpace, "swap_in", lambda self, slot: returned.append(swap_in(self, slot)) or returned[-1])
    _, _, backend, compiled = _compiled(kind, {"plan": {"n_swap": 3}})
    models.loss_of(kind, compiled(**models.batch(kind))).backward()
    record = next(g for g in backend.graphs if g.swap is not None)
    outs = record.forward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
    for n in outs:
        saved, slot = n.args[2].meta["val"], record.swap.slots[n.args[1]]
        assert slot.stride() == n.meta["val"].stride() == torch.empty_like(saved, device="meta").stride(), n.name
    assert any(not record.swap.slots[n.args[1]].is_contiguous() for n in outs)  # (some are not contiguous)
    backs = record.backward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_in.default)
    assert sorted(t.stride() for t in returned) == sorted(n.meta["val"].stride() for n in backs) and backs


def test_measured_swap_interval():
    """Unforced, the interval comes from the profile and this machine's measured copy rate."""
    _, _, backend, compiled = _compiled("toy", {"plan": {"n_swap": 1}})
    compiled(**models.batch("toy")).backward()
    record = backend.graphs[0]
    costs, hardware = record.costs, hardware_profile(torch.device("cpu"))
    expected = swap_interval(costs.block_saved, costs.block_fwd_s, hardware, uploads_share_link=False)
    assert record.plan.swap_interval == expected >= 1


def test_swap_interval_formula():
    """ceil(max over blocks of copy time / forward time), at the contended rate when chunks upload meanwhile."""
    saved, forward_s = (2.5e9, 1e9), (1.0, 2.0)
    hardware = hardware_profile(torch.device("cpu"))
    hardware = type(hardware)(**{**hardware.__dict__, "d2h_bytes_per_s": 1e9, "d2h_concurrent_bytes_per_s": 0.5e9})
    assert swap_interval(saved, forward_s, hardware, uploads_share_link=False) == 3  # 2.5 s copy, 1 s compute
    assert swap_interval(saved, forward_s, hardware, uploads_share_link=True) == 5


def test_prefetch_waits_for_memory(monkeypatch):
    """With no room under the budget, nothing is prefetched early: each tensor comes back at its swap_in, and
    training is unchanged."""
    make = protrain_fx.backend.stages.SwapSpace  # a device with no room under the budget
    monkeypatch.setattr(
        protrain_fx.backend.stages, "SwapSpace", lambda device, **kw: make(device, **{**kw, "budget_bytes": 1})
    )
    plan = {"n_swap": 2, "n_checkpoint": 0, "n_selective": 0}
    ref, _, backend, compiled = _compiled("toy", {"plan": plan}, dropout=0.1)
    assert train(compiled, "toy", 3) == train(ref, "toy", 3)
    space = next(g for g in backend.graphs if g.param_map).swap
    assert space.budget_bytes == 1 and space.deferred == 2 * 3  # two blocks, three steps
    monkeypatch.undo()
    _, _, roomy, compiled = _compiled("toy", {"plan": {"n_swap": 2}})
    train(compiled, "toy", 3)
    assert roomy.graphs[0].swap.deferred == 0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _ReturnsSaved(torch.nn.Module):
    """Blocks whose last output is both returned to the user and saved for the backward (by the head's matmul)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).sum(), x


def test_output_that_is_also_saved_stays_on_the_device():
    """A tensor the forward both returns and saves is swapped for the backward, and the user still gets it on the
    device, equal to eager's (a swap of the user's output once failed the pass)."""
    torch.manual_seed(0)
    ref = _ReturnsSaved()
    model = copy.deepcopy(ref)
    backend = protrain_fx.ProTrainBackend({"executor": "eager", "plan": {"n_swap": 2}})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    x = torch.randn(4, 8)
    (loss, hidden), (ref_loss, ref_hidden) = compiled(x), ref(x)
    loss.backward()
    ref_loss.backward()
    assert hidden.device == x.device and torch.equal(hidden, ref_hidden)
    assert backend.graphs[0].swap is not None
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [{"n_swap": 2}, {"n_swap": 1, "n_checkpoint": 2}])
def test_swapped_bf16_parity(plan):
    """Swapped blocks through inductor on the GPU (copies on their own streams, pinned host slots), bf16
    autocast, dropout on: the bf16 tolerance."""
    (eager_losses, _), (losses, _), backend = eager_and_protrain(
        "llama", steps=5, options={"plan": plan}, device="cuda", autocast=torch.bfloat16, layers=4, dropout=0.1
    )
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(eager_losses), rtol=BF16_RTOL, atol=1e-3)
    record = backend.graphs[0]
    assert record.swap is not None and record.swap.arena.is_pinned()


@pytest.mark.gpu
@pytest.mark.parametrize("room", [True, False], ids=["prefetched", "deferred"])
def test_swap_next_to_offloaded_chunks(room, monkeypatch):
    """Swapped blocks with offloaded chunks: swap prefetches queue behind the chunk uploads on the copy link; with
    no memory budget left, every block comes back at its first use instead. bf16 chunks against eager autocast."""
    if not room:
        make = protrain_fx.backend.stages.SwapSpace
        monkeypatch.setattr(
            protrain_fx.backend.stages, "SwapSpace", lambda device, **kw: make(device, **{**kw, "budget_bytes": 1})
        )
    ref = models.build("llama", layers=4).cuda()
    model = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-3)
    options = {"plan": {"n_persist": 1, "n_buffer": 3, "n_swap": 2, "n_checkpoint": 1, "n_selective": 0}}
    backend = protrain_fx.ProTrainBackend(options)
    compiled = torch.compile(model, backend=backend, dynamic=False)
    train_against_autocast(ref, ref_opt, compiled, opt)
    space = backend.graphs[0].swap
    assert space._uploads is not None
    if not room:  # (with room, how many prefetch depends on the predicted peak, the budget)
        assert space.deferred > 0


@pytest.mark.gpu
def test_swapped_activations_are_not_overwritten_while_copied():
    """Activations large enough that their copies to the host outlast the kernels after them (32 MiB each: batch 8,
    sequence 1024, hidden 1024, float32): inductor must not hand a swapped tensor's memory to a later kernel while
    its copy may still read it. The gradients of the all-swapped plan equal those of the plan without swapping up
    to fusion differences (1.5e-6 of the norm on an H200; in bfloat16 both are 1.4% from a float32 reference, too
    coarse to see a tensor overwritten in part)."""
    model = models.big_llama(hidden=1024, layers=4).float()
    ids = torch.randint(0, 32000, (8, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    grads = {}
    for name, plan in (("plain", UNCHANGED["plan"]), ("swapped", {"n_swap": 4, "n_checkpoint": 0})):
        m = copy.deepcopy(model)
        backend = protrain_fx.ProTrainBackend({"plan": plan})
        compiled = torch.compile(m, backend=backend, dynamic=False)
        for _ in range(2):  # the second step runs as compiled, with no profile in between
            m.zero_grad(set_to_none=True)
            compiled(input_ids=ids, labels=ids).loss.backward()
        grads[name] = [p.grad.float() for p in m.parameters()]
        assert (backend.graphs[0].swap is not None) == (name == "swapped")
    for (name, _), a, b in zip(model.named_parameters(), grads["plain"], grads["swapped"]):
        assert (b - a).norm() <= 1e-4 * a.norm(), name


@pytest.mark.gpu
def test_a_tensor_laid_out_unlike_its_slot_goes_to_pinned_memory():
    """A saved tensor that is not dense (the keys split from a fused query-key-value projection) has a slot of its
    stride order; `copy_` between the two layouts would stage it through pageable host memory, a copy that blocks
    the host at a tenth of the link's rate. `swap_out` copies it to the slot's layout on the device first: only
    pinned copies run, and the values come back."""
    from torch.profiler import ProfilerActivity, profile

    from protrain_fx.runtime.swap import SwapSpace
    from protrain_fx.shapes import dense_order

    qkv = torch.randn(2, 64, 8, 3 * 32, device="cuda").transpose(1, 2)  # (batch, heads, sequence, 3 x head dim)
    keys = qkv.split(32, dim=-1)[1]
    assert not keys.is_contiguous() and torch.empty_like(keys).stride() != keys.stride()
    space = SwapSpace(torch.device("cuda"))
    space.allocate([torch.empty_like(keys, device="meta")])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        space.swap_out(0, keys, dense_order(keys))
        space.settle([0])
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name]
    assert copies and not [c for c in copies if "Pageable" in c], copies
    assert torch.equal(space.slots[0], keys.cpu())
    assert torch.equal(space.swap_in(0), keys)


def _reads(graph, roots, node) -> bool:
    """`node` reads one of `roots`, directly or not."""
    reached = set(roots)
    for n in graph.nodes:
        if n not in reached and any(a in reached for a in n.all_input_nodes):
            reached.add(n)
    return node in reached


def test_swap_ops_follow_the_data_not_a_weights_cast():
    """The settle follows a node of block b + swap_interval that block b's output flows into, the prefetch and
    each swap_in one the output gradient flows into. A bf16 model under inductor casts its norms' weights to
    fp32 first in each block, reading only a parameter, and a swap_in reads only its placeholder: the compiler
    may schedule such nodes anywhere, and a copy back started there would bring the block back long before the
    backward needs it, at its peak."""
    model = models.build("toy", layers=2).to(torch.bfloat16)
    backend = protrain_fx.ProTrainBackend({"plan": {"block_modes": ["swap", "none"], "swap_interval": 1}})
    train(torch.compile(model, backend=backend, dynamic=False), "toy", 1)
    record = backend.graphs[0]
    block_of = record.block_map.block
    fw, bw = record.forward.graph, record.backward.graph
    settle, *_ = fw.find_nodes(op="call_function", target=torch.ops.protrain.swap_settle.default)
    (prefetch,) = bw.find_nodes(op="call_function", target=torch.ops.protrain.swap_prefetch.default)
    assert block_of[settle.args[4].name] == 1 and block_of[prefetch.args[2].name] == 1
    assert _reads(fw, {n for n in fw.nodes if block_of.get(n.name) == 0}, settle.args[4]), settle.args[4].format_node()
    tangents = {n for n in bw.find_nodes(op="placeholder") if n.name.startswith("tangents")}
    assert _reads(bw, tangents, prefetch.args[2]), prefetch.args[2].format_node()
    ins = bw.find_nodes(op="call_function", target=torch.ops.protrain.swap_in.default)
    assert all(_reads(bw, tangents, after) for n in ins for after in n.args[3]) and any(n.args[3] for n in ins)


@pytest.mark.parametrize("interval", [1, 2])
def test_a_tensor_a_block_beyond_the_prefetch_reads_stays_on_the_device(interval):
    """GPT-NeoX under SDPA makes its attention mask in its first block, and every block's backward reads it. Swapped
    with the first block, it would come back where the backward starts (block 2) and stay there, where the memory
    model counts it gone: with the prefetch at block 1 it stays on the device instead, priced as kept
    (`kept_from_swap`); with the prefetch at block 2 it is swapped with the rest. Training is eager's, bitwise."""
    plan = {"block_modes": ["swap", "none", "none"], "swap_interval": interval}
    ref, _, backend, compiled = _compiled("gpt_neox", {"plan": plan})
    assert train(compiled, "gpt_neox", 2) == train(ref, "gpt_neox", 2)
    record = backend.graphs[0]
    costs, profiled = record.costs, [n for n in record.profile.nodes if n.graph == "forward" and n.block == 0]
    later = {n.name for n in profiled if n.needed_from_block == 2}  # (the profile's graphs: as partitioned first)
    later_bytes = sum(n.saved_bytes for n in profiled if n.name in later)
    assert later and later_bytes > 0
    outs = record.forward.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
    swapped = {n.args[2].name for n in outs}
    assert swapped and (not later & swapped if interval == 1 else later <= swapped)
    kept = later_bytes if interval == 1 else 0
    assert costs.kept_from_swap(0) == kept and costs.saving(0, "swap") == costs.block_saved[0] - kept


def test_a_value_saved_twice_stays_on_the_device():
    """A forward may hand one value to two of the backward's inputs: the swap pass keeps it on the device (it
    raised a KeyError on its own swap_out, a user of the value the second time), and swaps the value saved once."""
    import types

    from torch.fx.experimental.proxy_tensor import make_fx

    from protrain_fx.capture import BlockMap
    from protrain_fx.config import ProTrainConfig
    from protrain_fx.passes.activations import swap_out_pass
    from protrain_fx.passes.contract import PassContext

    def forward(x, w, v):
        h = torch.mm(x, w)
        y = torch.relu(h)
        return torch.mm(y, v), h, h, y  # the user's output, then what the backward saves: h twice, y once

    gm = make_fx(forward, tracing_mode="fake")(*(torch.randn(4, 4) for _ in range(3)))
    names = [n.name for n in gm.graph.nodes if n.op == "call_function"]  # mm, relu (block 0), mm_1 (block 1)
    ctx = PassContext(
        config=ProTrainConfig(),
        plan=types.SimpleNamespace(block_modes=["swap", "none"], swap_interval=1),
        record=types.SimpleNamespace(
            block_map=BlockMap((), dict.fromkeys(names, "block"), dict(zip(names, [0, 0, 1])))
        ),
        swap=types.SimpleNamespace(handle=0),
        saved=frozenset({"mm", "mm_again", "relu"}),  # (the backward's inputs: two are the forward's mm)
        stage="forward",
    )
    gm = swap_out_pass(gm, ctx)
    swapped = [
        n.args[2].name for n in gm.graph.find_nodes(op="call_function", target=torch.ops.protrain.swap_out.default)
    ]
    outputs = [n.name for n in next(iter(gm.graph.find_nodes(op="output"))).args[0]]
    assert swapped == ["relu"] and outputs[1:3] == ["mm", "mm"], (swapped, outputs)
