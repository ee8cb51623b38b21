"""The loss output is weighted by its seed; the mean nll a loss is, found in the graph."""

import torch
from torch import nn

from autopar import models
from autopar.capture.joint import capture
from passes.token_count import mean_loss_node, weight_loss_by_seed
from vocab.plan_types import GraphSignature


def _signature(graph) -> GraphSignature:
    holders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    kinds = {i.node: (i.kind, i.name) for i in graph.inputs}
    return GraphSignature(inputs=[kinds[h] for h in holders], placeholders=holders, grad_index={},
                          loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))


def test_finds_the_mean_nll_of_the_zoo_loss():
    ids, labels = models.example_inputs("tiny-llama", batch=2, seq=8)
    graph = capture(models.build("tiny-llama"), (ids, labels))
    nll = mean_loss_node(graph.gm, _signature(graph).loss_index)
    assert nll is not None and nll.target == torch.ops.aten.nll_loss_forward.default


class _Summed(nn.Module):
    """A loss that is a sum over tokens: every piece already weighs by its tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.proj(x), y, reduction="sum")


class _Mixed(_Summed):
    def forward(self, x, y):  # a mean plus another term: not a token mean
        return nn.functional.cross_entropy(self.proj(x), y) + self.proj.weight.square().sum()


def test_no_mean_nll_where_the_loss_is_no_token_mean():
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    for model in (_Summed(), _Mixed()):
        graph = capture(model, (x, y))
        assert mean_loss_node(graph.gm, _signature(graph).loss_index) is None


def test_weighted_loss_is_loss_times_seed():
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    model = _Summed()
    graph = capture(model, (x, y))
    params = {k: v.detach() for k, v in model.named_parameters()}
    loss, grads = graph.run(params, x, y)
    weight_loss_by_seed(graph.gm, _signature(graph))
    by_node = {i.node: params[i.name] if i.kind == "param" else (x, y)[int(i.name[5:])]
               for i in graph.inputs if i.kind in ("param", "input")}
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    args = [by_node.get(n.name, torch.tensor(0.25)) for n in holders]  # the seed: 0.25
    out = graph.gm(*args)
    li = next(o.index for o in graph.outputs if o.kind == "loss")
    gi = next(o.index for o in graph.outputs if o.kind == "grad")
    assert torch.allclose(out[li], 0.25 * loss)  # weighted as the gradients are
    assert torch.allclose(out[gi], 0.25 * grads[graph.outputs[gi].name])
