"""The pipeline split: the stages' forward and backward graphs, run one after another in one
process (`runtime.pipeline.run_sequential`), give the loss and every gradient of the joint graph
(fp32, rtol 1e-5), for any cut of the blocks, on the zoo and on a plain-PyTorch model; the
channels carry only what must cross (the residual stream and its gradient); a tied weight is
held by both its stages; a cut that cannot run is an error, never a wrong graph."""

import copy
import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from plain_models import Block
from torch import nn

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from cost.stages import node_stages
from passes.pipeline_split import PipelineSplitError, split_backward, split_pipeline
from passes.recompute import apply_recompute, values_to_recompute
from passes.token_count import weight_loss_by_seed
from runtime.pipeline import StageFeeds, run_sequential
from vocab.plan_types import GraphSignature


class PlainNet(nn.Module):
    """A model of our own: an input projection, unequal blocks (every other one twice as wide),
    a BatchNorm whose statistics the forward updates, and a regression loss."""

    def __init__(self, hidden: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, hidden)
        self.layers = nn.ModuleList(Block(hidden, 2 * hidden * (1 + i % 2)) for i in range(layers))
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return nn.functional.mse_loss(self.out(self.bn(h)).squeeze(-1), y)


def _zoo(family: str, layers: int):
    cfg = dataclasses.replace(models.config(f"tiny-{family}"), n_layers=layers)
    return models.build(cfg, seed=1), models.example_inputs(cfg, batch=2, seq=8)


def _plain(layers: int):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    return PlainNet(layers=layers), (torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen))


def _graph(model, inputs, recompute: str = "none"):
    graph = capture(model, inputs)
    analysis = analyze(graph)
    sig = GraphSignature(
        inputs=[(i.kind, i.name) for i in graph.inputs],
        placeholders=[n.name for n in graph.gm.graph.nodes if n.op == "placeholder"],
        grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
        loss_index=next(o.index for o in graph.outputs if o.kind == "loss"),
        buffer_index={o.name: o.index for o in graph.outputs if o.kind == "buffer"})
    if recompute != "none":
        layers = {name: info.layer for name, info in analysis.nodes.items()}
        apply_recompute(graph.gm, values_to_recompute(graph.gm, layers, recompute))
        analysis = analyze(graph)
    weight_loss_by_seed(graph.gm, sig)
    return graph, analysis, sig


def _split(graph, analysis, sig, stages):
    order = [(n.name, info.phase == "backward", info.layer) for n, info in
             zip(graph.gm.graph.nodes, analysis.nodes.values())]
    # nodes the loss weighting added come after the analysis: on the last stage
    stage = node_stages(order, analysis.blocks.count, stages)
    stage.update({n.name: len(stages) - 1 for n in graph.gm.graph.nodes if n.name not in stage})
    return split_pipeline(graph.gm, sig, stage, len(stages))


def _check(model, inputs, stages, recompute="none", zero_bubble=False):
    ref = copy.deepcopy(model)
    graph, analysis, sig = _graph(model, inputs, recompute)
    split = _split(graph, analysis, sig, stages)
    if zero_bubble:
        for stage in split.stages:
            stage.weight_split = split_backward(stage)
    params = {n: p.detach() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    loss, grads = run_sequential(split, StageFeeds(params, buffers, inputs, torch.tensor(1.0)),
                                 zero_bubble=zero_bubble)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    assert torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert set(grads) == {n for n, p in ref.named_parameters() if p.grad is not None}
    for n, p in ref.named_parameters():
        assert torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6), n
    for n, b in ref.named_buffers():  # BatchNorm's statistics, updated by the stage that runs it
        assert torch.allclose(buffers[n].float(), b.float(), rtol=1e-5, atol=1e-6), n
    # every parameter is held by a stage; a stage holds what its graphs read
    held = [set(s.params) for s in split.stages]
    assert set().union(*held) == set(params)
    return split


def _cuts(layers: int, pp: int, draw) -> list[tuple[int, int]]:
    bounds = sorted(draw(st.lists(st.integers(1, layers - 1), min_size=pp - 1, max_size=pp - 1,
                                  unique=True)))
    edges = [0, *bounds, layers]
    return [(edges[k], edges[k + 1] - 1) for k in range(pp)]


# 12 (model, cut, mode) cases: each captures a model and runs its stages against the joint graph
@settings(derandomize=True, max_examples=12, deadline=None)
@given(data=st.data(), family=st.sampled_from(["llama", "gpt2", "mixtral", "plain"]),
       layers=st.integers(2, 4), recompute=st.sampled_from(["none", "full"]), zero_bubble=st.booleans())
def test_stages_in_sequence_equal_the_joint_graph(data, family, layers, recompute, zero_bubble):
    """... and with each backward in zero-bubble's two halves (input, then weight gradients)."""
    pp = data.draw(st.integers(2, layers))
    stages = _cuts(layers, pp, data.draw)
    model, inputs = _plain(layers) if family == "plain" else _zoo(family, layers)
    _check(model, inputs, stages, recompute, zero_bubble)


def test_zero_bubble_input_half_holds_no_weight_gradient_matmul():
    """The input half computes what the previous stage waits for; every weight gradient's
    matmul is left to the weight half (the bubble filler)."""
    model, inputs = _zoo("llama", 2)
    split = _check(model, inputs, [(0, 0), (1, 1)], zero_bubble=True)
    last = split.stages[1].weight_split
    mms = lambda gm: sum(n.target is torch.ops.aten.mm.default for n in gm.graph.nodes)  # noqa: E731
    # block 1: 7 weight matmuls; the input half runs their input-gradient mm, the weight half
    # their weight-gradient mm (and the head's), each exactly once
    assert mms(last.input_grad) == 7 + 1 and mms(last.weight_grad) == 7 + 1
    assert last.n_stash > 0
    first = split.stages[0].weight_split  # sends nothing back: all of it is weight half
    assert mms(first.input_grad) == 0


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_channels_carry_the_residual_stream_only(family):
    model, inputs = _zoo(family, 4)
    split = _check(model, inputs, [(0, 0), (1, 2), (3, 3)])
    hidden = models.config(f"tiny-{family}").hidden
    for channel, slots in zip(split.channels, split.grad_slots):
        # rotary tables, masks and the labels are computed where they are read, not sent
        assert len(channel) == 1 and list(slots) == [0]
    for stage in split.stages[1:]:
        recv = [n for n in stage.forward.graph.nodes if n.op == "placeholder"][0]
        assert tuple(recv.meta["val"].shape) == (2, 8, hidden)
    assert split.shared == {}


def test_tied_embedding_is_held_by_the_first_and_last_stage():
    model, inputs = _zoo("gpt2", 3)
    split = _check(model, inputs, [(0, 0), (1, 1), (2, 2)])
    assert split.shared == {"embed.weight": [0, 2]}
    assert "embed.weight" not in split.stages[1].params
    # each holder returns its part of the gradient: the lookup's and the head's
    assert all("embed.weight" in split.stages[s].grads for s in (0, 2))


def test_a_cut_that_cannot_run_is_refused():
    model, inputs = _zoo("llama", 2)
    graph, analysis, sig = _graph(model, inputs)
    order = [(n.name, info.phase == "backward", info.layer)
             for n, info in zip(graph.gm.graph.nodes, analysis.nodes.values())]
    stage = node_stages(order, 2, [(0, 0), (1, 1)])
    stage = {n.name: stage.get(n.name, 1) for n in graph.gm.graph.nodes}
    loss = list(graph.gm.graph.nodes)[-1].args[0][sig.loss_index]
    with pytest.raises(PipelineSplitError, match="loss"):  # the loss before the last stage
        split_pipeline(graph.gm, sig, {**stage, **{n: 0 for n in _ancestors(loss)}}, 2)
    # block 1's backward put on stage 0: it would read its forward's values from stage 1
    early = {name: 0 for name, info in analysis.nodes.items() if info.phase == "backward" and info.layer == 1}
    with pytest.raises(PipelineSplitError, match="reads .* stage 1"):
        split_pipeline(graph.gm, sig, {**stage, **early}, 2)


def _ancestors(node):
    out, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n.op == "call_function" and n.name not in out:
            out.add(n.name)
            todo.extend(n.all_input_nodes)
    return out


HF_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "mixtral", "qwen2-moe")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_transformers_models_split_into_stages(family):
    import hf_tiny

    model = hf_tiny.build(family)
    split = _check(model, hf_tiny.batch(size=2, seq=8), [(0, 0), (1, 1)], zero_bubble=family == "llama")
    assert len(split.channels[0]) == 1  # the hidden states; masks and rotary tables are copied
