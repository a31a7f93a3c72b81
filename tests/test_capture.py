"""Parameter and block maps, built from the graphs alone."""

import models
import pytest
import torch

import protrain_fx
from protrain_fx.capture import BLOCK, POST, PRE, qualified_name


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
    bw_blocks = [record.block_map.block[n.name] for n in record.backward.graph.nodes if n.op == "call_function"]
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


@pytest.mark.parametrize("kind", ["gpt2", "llama", "opt"])
def test_param_map_matches_named_parameters(kind):
    model, backend = compile_once(kind)
    names = {e.name for g in backend.graphs for e in g.param_map.values()}
    assert names == {n for n, _ in model.named_parameters()}


def test_graph_rooted_inside_a_block():
    """A graph break can make a decoder layer its own graph (OPT on torch 2.11): compiling one layer alone
    gives the same situation. Sources are relative to the layer; names and block come from the model."""
    model = models.build("llama", layers=3)
    layer = model.model.layers[1]
    backend = protrain_fx.ProTrainBackend({"executor": "eager"})
    compiled = torch.compile(layer, backend=backend, dynamic=False)
    hidden = torch.randn(2, 16, 32, requires_grad=True)
    cos_sin = model.model.rotary_emb(hidden, torch.arange(16)[None])
    compiled(hidden, position_embeddings=cos_sin)[0].sum().backward()
    record = backend.graphs[0]
    assert record.block_map.family.parent == "model.layers" and record.block_map.n_blocks == 3
    assert record.block_map.blocks_in_graph == [1]
    names = {e.name for e in record.param_map.values()}
    assert names == {f"model.layers.1.{n}" for n, _ in layer.named_parameters()}
