"""TP graphs traced in a fake world, for the pass tests that reorder or cut their collectives:
a plain-PyTorch gated MLP (two losses) and zoo models, their placements, a rank's inputs."""

import functools

import torch
from torch import fx, nn

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.strategies.tp_recipe import find_tp_recipe
from vocab.plan_types import AxisPlacement, GraphSignature


class GatedMLP(nn.Module):
    """Plain PyTorch: two gated MLP blocks (column-parallel gate and up, row-parallel down) on
    [b, s, h] inputs, a regression loss and a second, auxiliary loss on the mean activation."""

    def __init__(self, hidden: int = 32, inner: int = 64, blocks: int = 2) -> None:
        super().__init__()
        self.gate = nn.ModuleList(nn.Linear(hidden, inner, bias=False) for _ in range(blocks))
        self.up = nn.ModuleList(nn.Linear(hidden, inner, bias=False) for _ in range(blocks))
        self.down = nn.ModuleList(nn.Linear(inner, hidden, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for gate, up, down in zip(self.gate, self.up, self.down):
            x = x + down(nn.functional.silu(gate(x)) * up(x))
        return nn.functional.mse_loss(x, target) + 0.1 * x.pow(2).mean()


def signature(graph) -> GraphSignature:
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    return GraphSignature(
        inputs=[(i.kind, i.name) for i in graph.inputs], placeholders=[n.name for n in holders],
        grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
        loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))


@functools.cache  # one capture for both SP settings
def zoo_case(name: str):
    model = models.build(name, seed=0)
    batch = models.example_inputs(name, batch=2, seq=16)
    graph = capture(model, batch)
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = {}
    for p in graph.param_names:
        dim = recipe.param_shard_dim(p)
        placements[p] = (AxisPlacement.shard(dim, recipe.fused_parts.get(p, 1)) if dim is not None
                         else AxisPlacement.replicate())
    return model, batch, graph, placements


def plain_case():
    torch.manual_seed(0)
    model = GatedMLP()
    batch = (torch.randn(2, 8, 32), torch.randn(2, 8, 32))
    graph = capture(model, batch)
    placements = {p: AxisPlacement.shard(1 if p.startswith("down") else 0) for p in graph.param_names}
    return model, batch, graph, placements


def local_args(graph, gm: fx.GraphModule, model: nn.Module, batch, tp: int) -> list[torch.Tensor]:
    """Rank 0's inputs of the TP graph: its shards of the parameters, the batch, the seeds."""
    params = dict(model.named_parameters())
    values = iter(batch)
    args = []
    for inp, holder in zip(graph.inputs, [n for n in gm.graph.nodes if n.op == "placeholder"]):
        kind, name = inp.kind, inp.name
        shape = tuple(holder.meta["val"].shape)
        if kind == "param":
            whole = params[name].detach()
            dims = [d for d, (a, b) in enumerate(zip(shape, whole.shape)) if a != b]
            args.append(whole.narrow(dims[0], 0, shape[dims[0]]).clone() if dims else whole.clone())
        elif kind == "input":
            args.append(next(values))
        else:
            args.append(torch.ones(shape, dtype=holder.meta["val"].dtype))
    return args
