"""MoE experts under TP: transformers' grouped matmuls priced as matmuls and sharded like
Megatron's MLP (the gated up projection column-parallel per part, the down projection
row-parallel), every expert alike. The executed shards are checked by test_hf_parity."""

import pytest
import torch

from autopar import capture
from autopar.analysis.graph import analyze
from autopar.strategies.tp_ilp import solve_tp_roles
from autopar.strategies.tp_recipe import COL, ROW, find_tp_recipe
from cost import Cluster
from passes.grouped_matmul import is_grouped_backward, is_grouped_forward

hf_tiny = pytest.importorskip("hf_tiny")

MOE = ("mixtral", "qwen2-moe")


def _captured(family):
    graph = capture(hf_tiny.build(family), hf_tiny.batch(size=4))
    return graph, analyze(graph)


@pytest.mark.parametrize("family", MOE)
def test_grouped_matmuls_count_their_flops(family):
    graph, analysis = _captured(family)
    forward = [n for n in graph.gm.graph.nodes if is_grouped_forward(n)]
    backward = [n for n in graph.gm.graph.nodes if is_grouped_backward(n)]
    assert len(forward) == len(backward) == 4  # up and down, 2 layers
    for n in forward:
        x, w = (a.meta["val"] for a in n.args[:2])
        assert analysis.nodes[n.name].flops == 2.0 * x.shape[0] * x.shape[1] * w.shape[2]
        assert analysis.nodes[n.name].is_matmul
    for n in backward:  # dX and dW: twice the forward
        x, w = (a.meta["val"] for a in n.args[:2])
        assert analysis.nodes[n.name].flops == 4.0 * x.shape[0] * x.shape[1] * w.shape[2]


@pytest.mark.parametrize("family", MOE)
def test_experts_take_megatron_roles(family):
    graph, analysis = _captured(family)
    recipe = find_tp_recipe(graph, analysis)
    experts = {n: r for n, r in recipe.roles.items() if ".experts." in n and "shared" not in n}
    assert experts and not recipe.fallback_ops
    for name, role in experts.items():
        if name.endswith("gate_up_proj"):  # [E, 2 ffn, hidden]: per part (gate, up) on dim 1
            assert (role, recipe.param_shard_dim(name), recipe.fused_parts.get(name)) == (COL, 1, 2)
        else:  # down_proj [E, hidden, ffn]: on ffn
            assert (role, recipe.param_shard_dim(name)) == (ROW, 2), name
    # their work splits over TP, forward and backward
    grouped = [n.name for n in graph.gm.graph.nodes if is_grouped_forward(n) or is_grouped_backward(n)]
    assert set(grouped) <= recipe.sharded_matmul


def test_ilp_may_shard_the_experts():
    graph, analysis = _captured("mixtral")
    result = solve_tp_roles(graph, analysis, Cluster("h100", nodes=1), tp=2)
    experts = {r for n, r in result.roles.items() if ".experts." in n}
    assert experts == {COL, ROW}, result.roles
    # and a forced replicated expert weight is feasible too (the ILP prices both)
    forced = solve_tp_roles(graph, analysis, Cluster("h100", nodes=1), tp=2,
                            fixed={"model.model.layers.*.mlp.experts.down_proj": "replicated"})
    assert forced.roles["model.model.layers.0.mlp.experts.down_proj"] == "replicated"
    assert torch.isfinite(torch.tensor(forced.objective_s))
