"""Capturing a deep stack from four traced blocks gives the graph a full trace gives.

The comparison is node for node: op, arguments (by position), shape, dtype and strides, module
label, autograd sequence number (relative) and forward/backward tag, plus every input, output,
parameter shape and tie. Node names may differ (the tracer numbers nodes it later removes).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from plain_models import Block
from torch import fx, nn

from autopar import models
from autopar.capture.joint import capture
from autopar.capture.repeat import capture_repeated, find_stack

whole = functools.partial(capture, repeat_blocks=False)  # the full trace


def _signature(graph) -> list[tuple]:
    nodes = list(graph.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    base = min(n.meta["seq_nr"] for n in nodes if "seq_nr" in n.meta)
    rows = []
    for n in nodes:
        args = fx.node.map_arg((n.args, n.kwargs), lambda a: ("node", index[a]))
        val = n.meta.get("val")
        val = (tuple(val.shape), val.dtype, val.stride()) if isinstance(val, torch.Tensor) else None
        seq = n.meta["seq_nr"] - base if "seq_nr" in n.meta else None
        rows.append((n.op, str(n.target), repr(args), val, n.meta.get("module"), seq,
                     n.meta.get("partitioner_tag")))
    return rows


def assert_same_graph(model: nn.Module, inputs, loss_fn=None) -> None:
    repeated, note = capture_repeated(model, inputs, whole, loss_fn=loss_fn)
    assert repeated is not None, note
    assert repeated.capture_note.startswith("traced 4 of the")
    full = whole(model, inputs, loss_fn=loss_fn)
    assert repeated.inputs == full.inputs
    assert repeated.outputs == full.outputs
    assert (repeated.param_shapes, repeated.param_dtypes, repeated.aliases) == \
        (full.param_shapes, full.param_dtypes, full.aliases)
    a, b = _signature(repeated), _signature(full)
    assert len(a) == len(b)
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert first is None, (first, a[first], b[first])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-mixtral"])
def test_zoo_stack_repeats_exactly(name):
    cfg = dataclasses.replace(models.config(name), n_layers=7)
    assert_same_graph(models.build(cfg, device="meta"), models.example_inputs(cfg, batch=2, seq=16))


class PlainStack(nn.Module):
    """Our own model: a Sequential of alike MLP blocks, a head, MSE (or an auxiliary sum)."""

    def __init__(self, blocks: list[nn.Module], aux: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(32, 8)
        self.aux = aux

    def forward(self, x, y):
        if not self.aux:
            return nn.functional.mse_loss(self.head(self.blocks(x)), y)
        extra = 0.0
        for block in self.blocks:  # a value outside the stack reads every block
            x = block(x)
            extra = extra + x.pow(2).mean()
        return nn.functional.mse_loss(self.head(x), y) + 0.1 * extra


def _plain_batch():
    return torch.randn(4, 8, 32), torch.randn(4, 8, 8)


def test_plain_stack_repeats_exactly():
    torch.manual_seed(0)
    assert_same_graph(PlainStack([Block(32, 64) for _ in range(6)]), _plain_batch())


def test_only_four_blocks_are_traced():
    torch.manual_seed(0)
    model = PlainStack([Block(32, 64) for _ in range(9)])
    calls = [0] * 9
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    graph = capture(model, _plain_batch())
    assert [c > 0 for c in calls] == [True, True, True] + [False] * 5 + [True]
    assert graph.param_names == [n for n, _ in model.named_parameters()]
    assert list(model.blocks) and len(model.blocks) == 9  # the model is given back whole


def test_blocks_that_do_not_repeat_are_traced_whole():
    torch.manual_seed(0)
    unequal = PlainStack([Block(32, 64 * (1 + i % 2)) for i in range(6)])
    assert find_stack(unequal) is None
    aux = PlainStack([Block(32, 64) for _ in range(6)], aux=True)
    graph, note = capture_repeated(aux, _plain_batch(), whole)
    assert graph is None and "do not repeat" in note
    # the full trace runs instead, and the step is the eager one
    x, y = _plain_batch()
    graph = capture(aux, (x, y))
    loss, grads = graph.run(dict(aux.named_parameters()), x, y)
    aux(x, y).backward()
    assert torch.allclose(loss, aux(x, y).detach())
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6) for n, p in aux.named_parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "gemma"] + [
    pytest.param(f, marks=pytest.mark.slow) for f in ("qwen2", "qwen3", "phi3", "mistral", "qwen2-moe")])
def test_transformers_stack_repeats_exactly(family):
    hf_tiny = pytest.importorskip("hf_tiny")
    assert_same_graph(hf_tiny.build(family, layers=6), hf_tiny.batch(2, 16))


class _NormBlock(nn.Module):
    """A block with running statistics (buffers the forward updates) and a loss outside."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc = nn.Linear(h, h)
        self.bn = nn.BatchNorm1d(h)

    def forward(self, x):
        y = self.bn(self.fc(x).flatten(0, 1)).view_as(x)
        return x + torch.relu(y)


class _Trunk(nn.Module):
    def __init__(self, blocks: int = 6, h: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_NormBlock(h) for _ in range(blocks))
        self.out = nn.Linear(h, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def test_buffers_updated_in_blocks_and_a_loss_fn_repeat_exactly():
    torch.manual_seed(0)
    model = _Trunk()
    x, y = torch.randn(4, 8, 16), torch.randn(4, 8, 4)
    loss_fn = nn.functional.mse_loss
    assert_same_graph(model, (x, y), loss_fn=loss_fn)
    graph = capture(model, (x, y), loss_fn=loss_fn)
    assert graph.capture_note.startswith("traced 4 of the 6")
    assert sum(o.kind == "buffer" for o in graph.outputs) == 6 * 3  # mean, var, batch count
    # the step runs like eager, the running statistics of every block updated
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    loss, grads = graph.run(dict(model.named_parameters()), x, y, buffers=buffers)
    eager = loss_fn(model(x), y)
    eager.backward()
    assert torch.allclose(loss, eager.detach(), rtol=1e-5)
    assert all(torch.allclose(grads[n], p.grad, rtol=1e-5, atol=1e-6) for n, p in model.named_parameters())
    assert all(torch.allclose(buffers[n], b) for n, b in model.named_buffers())
