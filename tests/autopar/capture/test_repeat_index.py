"""Repeated blocks are proven alike, not assumed: a block whose forward computes with its own
index (every 4th of six alike blocks skips its MLP) is not given its neighbour's computation.
The capture traces the whole stack and says so in ``capture_note``; the graph is the full
trace node for node and its loss and gradients are the eager model's. A block that only stores
its index (HF's ``layer_idx``, handed to a cache training does not have) still repeats."""

from __future__ import annotations

import functools

import torch
from torch import fx, nn

from autopar.capture.joint import capture

whole = functools.partial(capture, repeat_blocks=False)


class IndexedBlock(nn.Module):
    """x + mlp(norm(x)), the MLP skipped where ``skip(index)`` says (computed in forward)."""

    def __init__(self, index: int, skip=None) -> None:
        super().__init__()
        self.layer_idx = index
        self.skip = skip
        self.norm = nn.LayerNorm(16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skip is not None and self.skip(self.layer_idx):
            return x
        return x + self.mlp(self.norm(x))


def every_fourth(index: int) -> bool:
    return index % 4 == 3


class IndexedStack(nn.Module):
    def __init__(self, skip=None, layers: int = 6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(IndexedBlock(i, skip) for i in range(layers))
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(self.head(x), y)


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 4, generator=g)


def _rows(graph) -> list[tuple]:
    nodes = list(graph.gm.graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    return [(n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])),
             n.meta.get("module")) for n in nodes]


def test_block_reading_its_index_is_traced_whole():
    model, (x, y) = IndexedStack(every_fourth), _batch()
    graph = capture(model, (x, y))
    assert graph.capture_note.startswith("traced all 6 blocks of layers")
    assert "layer_idx" in graph.capture_note
    assert _rows(graph) == _rows(whole(model, (x, y)))
    loss, grads = graph.run(dict(model.named_parameters()), x, y)
    model(x, y).backward()
    assert torch.allclose(loss, model(x, y).detach())
    for name, p in model.named_parameters():
        if p.grad is None:  # block 3 is skipped: no gradient on one device either
            assert name.startswith("layers.3.") and grads.get(name) is None, name
        else:
            assert torch.allclose(grads[name], p.grad, rtol=1e-5, atol=1e-6), name
    # the attributes are given back as they were
    assert [type(b.layer_idx) for b in model.layers] == [int] * 6


def test_stored_index_still_repeats():
    model, batch = IndexedStack(None), _batch()
    graph = capture(model, batch)
    assert graph.capture_note.startswith("traced 4 of the 6 blocks of layers")
    assert _rows(graph) == _rows(whole(model, batch))
