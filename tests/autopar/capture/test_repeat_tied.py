"""A tensor tied with a block the shortened stack does not trace (blocks 3 and 4 of six; block 3
of five with block 1) is seen on the whole model: the stack is traced whole, the graph is the full trace (one input,
the alias recorded) and the step's loss and gradients are the eager model's, the tied
gradient summed over both uses."""

from __future__ import annotations

import dataclasses
import functools

import torch
from plain_models import Block
from torch import nn

from autopar import models
from autopar.capture.joint import capture

whole = functools.partial(capture, repeat_blocks=False)


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(Block(16, 32) for _ in range(6))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x), y)


def _check_traced_whole(model: nn.Module, inputs, tied: str, canonical: str) -> None:
    graph = capture(model, inputs)
    assert "tied across blocks" in graph.capture_note, graph.capture_note
    full = whole(model, inputs)
    assert graph.inputs == full.inputs and graph.outputs == full.outputs
    assert graph.aliases == full.aliases == {tied: canonical}
    assert len(graph.gm.graph.nodes) == len(full.gm.graph.nodes)
    loss, grads = graph.run(dict(model.named_parameters()), *inputs)
    model.zero_grad()
    eager = model(*inputs)
    eager.backward()
    torch.testing.assert_close(loss, eager.detach(), rtol=1e-5, atol=0)
    params = dict(model.named_parameters())  # tied names appear once, under the canonical one
    assert set(grads) == set(params)
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_plain_stack_tied_between_two_untraced_blocks_is_traced_whole():
    model = _Stack()
    model.blocks[4].fc1.weight = model.blocks[3].fc1.weight
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 4, generator=g))
    _check_traced_whole(model, inputs, "blocks.4.fc1.weight", "blocks.3.fc1.weight")


def test_zoo_stack_tied_with_an_untraced_block_is_traced_whole():
    cfg = dataclasses.replace(models.config("tiny-llama"), n_layers=5)
    model = models.build(cfg, seed=1)
    model.layers[3].mlp.up_proj.weight = model.layers[1].mlp.up_proj.weight
    inputs = models.example_inputs(cfg, batch=2, seq=8)
    _check_traced_whole(model, inputs, "layers.3.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight")
