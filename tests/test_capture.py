"""Parameter and block maps, built from the graphs alone, and the model found from the compiled frame."""

import gc

import models
import pytest
import torch
from torch import nn

import protrain_fx
from protrain_fx import capture
from protrain_fx.capture import BETWEEN, BLOCK, POST, PRE, find_block_families, qualified_name


def compile_once(kind, **model_kw):
    model = models.build(kind, **model_kw)
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(model, backend=backend, dynamic=False)
    models.loss_of(kind, compiled(**models.batch(kind))).backward()
    return model, backend


@pytest.mark.parametrize(
    "source, name",
    [
        (
            "L['args'][0]._modules['model']._modules['layers']._modules['0']._parameters['weight']",
            "model.layers.0.weight",
        ),
        ("L['self']._modules['model']._modules['embed_tokens']._parameters['weight']", "model.embed_tokens.weight"),
        ("L['self'].blocks.0.mlp", "blocks.0.mlp"),
        ("L['self'].transformer.h[1]", "transformer.h.1"),
        # a submodule Dynamo reaches through the module's `__dict__` (Swin's layers)
        (
            "L['self']._modules['blocks']._modules['0'].__dict__['_modules']['norm']._parameters['weight']",
            "blocks.0.norm.weight",
        ),
    ],
)
def test_qualified_name(source, name):
    assert qualified_name(source) == name


@pytest.mark.parametrize("kind, layers", [("toy", 3), ("gpt2", 2), ("opt", 3), ("llama", 2), ("mistral", 4)])
def test_block_map_finds_every_block(kind, layers):
    _, backend = compile_once(kind, layers=layers)
    block_map = backend.graphs[0].block_map
    assert block_map.n_blocks == layers
    regions = set(block_map.region.values())
    assert {PRE, BLOCK, POST} <= regions
    assert block_map.blocks_in_graph == list(range(layers))


def test_block_map_covers_backward_in_reverse_order():
    _, backend = compile_once("toy", layers=3)
    record = backend.graphs[0]
    # (the nodes the passes add, e.g. the monitor's end mark, are in no block)
    bw_blocks = [record.block_map.block.get(n.name) for n in record.backward.graph.nodes if n.op == "call_function"]
    seen = [b for i, b in enumerate(bw_blocks) if b is not None and (i == 0 or bw_blocks[i - 1] != b)]
    assert sorted(set(seen), reverse=True) == [b for i, b in enumerate(seen) if b not in seen[:i]]
    assert set(seen) == {0, 1, 2}


def test_param_map_names_order_and_tied_weight():
    model, backend = compile_once("toy", layers=2)
    pmap = backend.graphs[0].param_map
    names = [e.name for e in pmap.values()]
    # the head is tied to the embedding: one parameter, one entry
    expected = {n for n, _ in model.named_parameters()}
    assert set(names) == expected and len(names) == len(expected)
    by_name = {e.name: e for e in pmap.values()}
    assert by_name["embed.weight"].first_use_index < by_name["blocks.0.qkv.weight"].first_use_index
    assert by_name["blocks.0.mlp.2.weight"].first_use_index < by_name["blocks.1.qkv.weight"].first_use_index
    assert by_name["blocks.1.qkv.weight"].shape == (96, 32)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "opt", "swin"])
def test_param_map_matches_named_parameters(kind):
    model, backend = compile_once(kind)
    names = {e.name for g in backend.graphs for e in g.param_map.values()}
    assert names == {n for n, _ in model.named_parameters()}


def test_graph_rooted_inside_a_block():
    """A graph can start inside a decoder layer: each layer compiled on its own, or a graph break inside the layers
    (OPT on torch 2.11 compiles each layer as its own graph, with the layer as `L['self']`). Sources are relative
    to the layer; the model is found among the modules being called, and names and blocks come from it."""
    model = models.build("llama", layers=3)
    layer = model.model.layers[1]
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    layer.compile(backend=backend, dynamic=False)
    models.loss_of("llama", model(**models.batch("llama"))).backward()
    record = backend.graphs[0]
    assert [f.parent for f in record.block_map.families] == ["model.layers"] and record.block_map.n_blocks == 3
    assert record.block_map.blocks_in_graph == [1]
    names = {e.name for e in record.param_map.values()}
    assert names == {f"model.layers.1.{n}" for n, _ in layer.named_parameters()}


# the model a compiled function reads from its module's globals (set by the test that compiles it)
GLOBAL_MODEL: nn.Module | None = None


def _calls_the_global_model(batch):
    return GLOBAL_MODEL(**batch)


def test_a_compiled_function_finds_the_model_it_calls(monkeypatch):
    """A compiled function that calls the model, read from its module's globals (`G['GLOBAL_MODEL']`) or from its
    closure: the graph's parameters are named in that model, its blocks found, and it trains in chunks."""
    monkeypatch.setitem(globals(), "GLOBAL_MODEL", models.build("toy"))
    in_closure = models.build("toy")
    for model, step in (
        (GLOBAL_MODEL, _calls_the_global_model),
        (in_closure, lambda batch: in_closure(**batch)),
    ):
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
        backend = protrain_fx.ProTrainBackend({"executor": "eager"})
        compiled = torch.compile(step, backend=backend, dynamic=False)
        for i in range(2):
            compiled(models.batch("toy", seed=i)).backward()
            opt.step()
            opt.zero_grad()
        record = backend.graphs[0]
        assert {e.name for e in record.param_map.values()} == {n for n, _ in model.named_parameters()}
        assert record.block_map.n_blocks == 3
        assert protrain_fx.manager_of(model) is not None
        torch._dynamo.reset()


def test_the_garbage_collector_is_not_asked(monkeypatch):
    """Capture finds the model, and a model another optimizer steps is told of, without reading the objects the
    garbage collector tracks (a cost that grows with the process)."""

    def refused(*args):
        raise AssertionError("the garbage collector was asked")

    monkeypatch.setattr(gc, "get_objects", refused)
    monkeypatch.setattr(gc, "get_referrers", refused)
    for adamw in (protrain_fx.optim.AdamW, torch.optim.AdamW):
        model = models.build("toy")
        opt = adamw(model.parameters(), lr=1e-2)
        backend = protrain_fx.ProTrainBackend({"executor": "eager"})
        models.loss_of("toy", torch.compile(model, backend=backend, dynamic=False)(**models.batch("toy"))).backward()
        opt.step()
        assert {e.name for e in backend.graphs[0].param_map.values()} == {n for n, _ in model.named_parameters()}
        assert (protrain_fx.manager_of(model) is not None) == (adamw is protrain_fx.optim.AdamW)
        torch._dynamo.reset()


def _train_a_model_frozen_out_of_gc() -> None:
    """In a process of its own (gc.freeze() is process state): a model built before gc.freeze(), out of the
    collector's view, trains in chunks as eager PyTorch does (fp32 on the CPU: bitwise)."""
    import copy

    from helpers import OFFLOADED, train

    ref = models.build("toy")
    model = copy.deepcopy(ref)
    gc.collect()
    gc.freeze()
    try:
        opt = protrain_fx.optim.AdamW(model.parameters(), lr=1e-2)
        compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager", "plan": OFFLOADED}))
        losses = train(compiled, "toy", 3, opt=opt)
    finally:
        gc.unfreeze()
    assert losses == train(ref, "toy", 3, opt=torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True))
    manager = protrain_fx.manager_of(model)
    assert manager is not None and manager.layout.n_chunk > 1 and manager.n_persist == 1


def test_a_model_frozen_out_of_gc_trains():
    from spawn import in_a_process

    assert in_a_process(_train_a_model_frozen_out_of_gc) == 0


def test_parameters_no_module_holds_are_refused():
    """Parameters trained in chunks reach the graph with no module holding them (a compiled function given them
    as arguments): a ValueError says to compile the model instead."""
    weight = nn.Parameter(torch.randn(8, 8))
    optimizer = protrain_fx.optim.AdamW([weight], lr=1e-2)
    compiled = torch.compile(lambda w, x: (x @ w).sum(), backend=protrain_fx.ProTrainBackend({"executor": "eager"}))
    with pytest.raises(Exception, match=r"no module holding the compiled graph's parameters.*compile the model"):
        compiled(weight, torch.randn(4, 8)).backward()
        optimizer.step()
    torch._dynamo.reset()


class Layer(nn.Module):
    def __init__(self, dim=8, experts=0):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim)) for _ in range(experts))

    def forward(self, x):
        return x + torch.tanh(self.proj(x)) + sum((e(x) for e in self.experts), torch.zeros_like(x))


class Tower(nn.Module):
    def __init__(self, layers, experts=0):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.layers = nn.ModuleList(Layer(experts=experts) for _ in range(layers))
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class TwoTowers(nn.Module):
    """A text tower registered first, a vision tower run first, a head after both."""

    def __init__(self, experts=0):
        super().__init__()
        self.text = Tower(3, experts)
        self.vision = Tower(2, experts)
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.text(self.vision(x))).sum()


def test_every_outermost_block_list_is_found():
    """Every list of repeated blocks is found, in registration order; lists inside a block (an MoE block's experts)
    are not; a type named in `_no_split_modules` wins over the other lists."""
    found = find_block_families(TwoTowers(experts=4))
    assert [(f.parent, f.type_name, f.n_blocks, f.first) for f in found] == [
        ("text.layers", "Layer", 3, 0),
        ("vision.layers", "Layer", 2, 3),
    ]
    named = TwoTowers(experts=4)
    named._no_split_modules = ["Sequential"]  # (as if the experts were the blocks)
    assert [f.parent for f in find_block_families(named)][:2] == ["text.layers.0.experts", "text.layers.1.experts"]
    assert find_block_families(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == ()


def test_blocks_are_numbered_in_execution_order():
    """The vision tower runs first: its blocks are 0-1 and the text tower's 2-4, whatever the registration order;
    the text tower's embedding, between the lists, is in region `between`."""
    model = TwoTowers()
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    torch.compile(model, backend=backend, dynamic=False)(torch.randn(2, 4, 8)).backward()
    block_map = backend.graphs[0].block_map
    assert [(f.parent, f.first) for f in block_map.families] == [("vision.layers", 0), ("text.layers", 2)]
    assert block_map.blocks_in_graph == [0, 1, 2, 3, 4] and block_map.n_blocks == 5
    forward = [n for n in backend.graphs[0].forward.graph.nodes if n.name in block_map.block]
    blocks = [block_map.block[n.name] for n in forward]
    assert [blocks.index(b) for b in range(5)] == sorted(blocks.index(b) for b in range(5))  # run in index order
    regions = [block_map.region[n.name] for n in forward if n.op == "call_function" and n.name in block_map.region]
    outside = [r for r in regions if r != BLOCK]
    assert regions[0] == PRE and outside[-1] == POST
    assert outside == sorted(outside, key=[PRE, BETWEEN, POST].index)  # the vision norm and the text embedding
    assert block_map.outside[BETWEEN] > 0 and block_map.n_outside == sum(block_map.outside.values())


def test_a_graph_mostly_outside_its_block_lists_is_warned_of(caplog, monkeypatch):
    """Where more than OUTSIDE_WARN_SHARE of what a graph runs is in no block (here one small expert per layer
    named as the block type: 35% of the nodes outside, against 19% with the layers as blocks; the share lowered
    to 25% for these small towers), a warning says so."""
    monkeypatch.setattr(capture, "OUTSIDE_WARN_SHARE", 0.25)
    named = TwoTowers(experts=1)
    named._no_split_modules = ["Sequential"]
    for model, warned in ((TwoTowers(), False), (named, True)):
        caplog.clear()
        with caplog.at_level("INFO", logger="protrain_fx.capture"):
            compiled = torch.compile(model, backend=protrain_fx.ProTrainBackend({"executor": "eager"}), dynamic=False)
            compiled(torch.randn(2, 4, 8)).backward()
        assert ("more than 25% of the graph is in no block" in caplog.text) == warned
        assert "graph nodes outside them" in caplog.text
