"""The TP ILP as a class (`TPRoleILP`): the thin entry solves the same problem, weights of
alike blocks share one decision, and unlike layers of a bare Sequential do not."""

import dataclasses
import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar import capture, models
from autopar.analysis.graph import analyze
from autopar.strategies.tp_ilp import TPRoleILP, solve_tp_roles
from autopar.strategies.tp_recipe import COL, ROW, _Propagation, find_tp_recipe
from cost import Cluster


def _graph(model, inputs, loss_fn=None):
    graph = capture(model, inputs, loss_fn=loss_fn)
    analysis = analyze(graph)
    return graph, analysis, find_tp_recipe(graph, analysis)


class _Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class _Stack(nn.Module):
    """Alike blocks in a ModuleList, a head: the weights tie across ``blocks.*``."""

    def __init__(self, depth, width=32):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _stack(depth):
    x, y = torch.randn(4, 16, 32), torch.randint(0, 8, (4, 16))
    return _graph(_Stack(depth), (x, y), lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))


@pytest.mark.parametrize("sp", [True, False])
def test_thin_entry_and_class_solve_the_same_problem(sp):
    graph, analysis, recipe = _stack(2)
    cluster = Cluster("h100")
    a = solve_tp_roles(graph, analysis, cluster, 4, sp=sp, base=recipe)
    b = TPRoleILP(graph, analysis, cluster, 4, sp=sp, base=recipe).build().solve()
    assert a.status == b.status == "optimal"
    assert a.roles == b.roles
    assert (a.variables, a.constraints) == (b.variables, b.constraints)
    assert a.objective_s == pytest.approx(b.objective_s, rel=1e-12)
    assert a.objective_s == pytest.approx(a.compute_s + a.comm_s, rel=1e-9)


def test_alike_blocks_share_roles_and_the_size_does_not_grow_with_depth():
    cluster = Cluster("h100")
    results = {}
    for depth in (2, 4):
        graph, analysis, recipe = _stack(depth)
        results[depth] = r = solve_tp_roles(graph, analysis, cluster, 4, base=recipe)
        ups = {r.roles[f"blocks.{i}.up.weight"] for i in range(depth)}
        downs = {r.roles[f"blocks.{i}.down.weight"] for i in range(depth)}
        assert len(ups) == len(downs) == 1
    assert results[2].variables == results[4].variables
    assert results[2].constraints == results[4].constraints


def test_a_bare_sequential_keeps_its_unlike_layers_apart():
    """``0.weight`` and ``2.weight`` of Sequential(Linear, GELU, Linear) are different layers:
    each is its own group, so Megatron's column-then-row is a point the ILP can price, and its
    optimum is no worse than that point."""
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    x, y = torch.randn(4, 16, 32), torch.randn(4, 16, 32)
    graph, analysis, recipe = _graph(model, (x, y), F.mse_loss)
    cluster = Cluster("h100")
    assert set(TPRoleILP(graph, analysis, cluster, 4, sp=False, base=recipe).build().groups) == {"0.weight", "2.weight"}
    best = solve_tp_roles(graph, analysis, cluster, 4, sp=False, base=recipe)
    megatron = solve_tp_roles(graph, analysis, cluster, 4, sp=False, base=recipe,
                              fixed={"0.weight": COL, "2.weight": ROW})
    assert (megatron.roles["0.weight"], megatron.roles["2.weight"]) == (COL, ROW)
    assert best.objective_s <= megatron.objective_s * (1 + 1e-9)


def test_zoo_llama_blocks_tie_and_megatron_is_found():
    cfg = dataclasses.replace(models.config("tiny-llama"), n_layers=2)
    model = models.build(cfg, device="meta")
    graph, analysis, recipe = _graph(model, models.example_inputs(cfg, batch=2, seq=16, device="meta"))
    ilp = TPRoleILP(graph, analysis, Cluster("h100"), 2, head_dim=cfg.head_dim, base=recipe).build()
    assert all(".0." not in g and ".1." not in g for g in ilp.groups)
    r = ilp.solve()
    assert r.roles["layers.0.attn.o_proj.weight"] == r.roles["layers.1.attn.o_proj.weight"]


@pytest.mark.parametrize("cls", [TPRoleILP, _Propagation])
def test_no_method_of_the_ilp_or_the_recipe_is_long(cls):
    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        assert len(inspect.getsource(fn).splitlines()) <= 60, name
