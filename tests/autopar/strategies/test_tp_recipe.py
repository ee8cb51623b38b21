"""The Megatron recipe found on the graph, and the ILP that generalises it."""

import dataclasses

import pytest
import torch

from autopar import capture, models
from autopar.analysis.graph import analyze
from autopar.strategies.tp_ilp import group_of, solve_tp_roles
from autopar.strategies.tp_recipe import COL, REPLICATED, ROW, VOCAB, find_tp_recipe
from cost import Cluster


def small(name, layers=2, **changes):
    return dataclasses.replace(models.config(name), n_layers=layers, **changes)


def _recipe(name, **changes):
    cfg = small(name, **changes)
    model = models.build(cfg, device="meta")
    graph = capture(model, models.example_inputs(cfg, batch=2, seq=16, device="meta"))
    analysis = analyze(graph)
    return cfg, graph, analysis, find_tp_recipe(graph, analysis)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_megatron_roles_and_two_reductions_per_block_each_way(name):
    _, graph, analysis, recipe = _recipe(name)
    roles = {group_of(p): r for p, r in recipe.roles.items()}
    if name == "tiny-llama":
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert roles[f"layers.*.attn.{proj}.weight"] == COL
        assert roles["layers.*.attn.o_proj.weight"] == ROW
        assert roles["layers.*.mlp.gate_proj.weight"] == roles["layers.*.mlp.up_proj.weight"] == COL
        assert roles["layers.*.mlp.down_proj.weight"] == ROW
        assert roles["lm_head.weight"] == COL
    else:
        assert roles["layers.*.attn.qkv.weight"] == roles["layers.*.attn.qkv.bias"] == COL
        assert roles["layers.*.mlp.proj.weight"] == ROW
        assert roles["pos_embed.weight"] == REPLICATED
    assert roles["embed.weight"] == VOCAB
    assert roles["layers.*.attn_norm.weight"] == REPLICATED
    per_block = {}
    for e in recipe.events:
        layer = analysis.nodes[e.node].layer
        if layer is not None:
            per_block.setdefault((layer, e.kind, e.forward), 0)
            per_block[(layer, e.kind, e.forward)] += 1
    for layer in (0, 1):
        # attention and MLP: one reduction out of each row layer (forward), one out of each
        # column layer's input gradient (backward); one SP gather into each column group
        assert per_block[(layer, "reduce", True)] == 2
        assert per_block[(layer, "gather", True)] == 2


def test_ilp_reproduces_megatron_where_heads_divide():
    cfg, graph, analysis, recipe = _recipe("llama3-8b", layers=2)
    result = solve_tp_roles(graph, analysis, Cluster("h100"), 8, head_dim=cfg.head_dim, base=recipe)
    assert result.status == "optimal"
    # every weight the ILP decides takes Megatron's role (norm weights are not decided: no matmul)
    assert result.roles and all(recipe.roles[p] == r for p, r in result.roles.items())


def test_ilp_does_not_split_grouped_kv_heads():
    # llama3-70b has 8 K/V heads: at tp=16 Megatron's column split of K and V is impossible
    cfg, graph, analysis, recipe = _recipe("llama3-70b", layers=2)
    result = solve_tp_roles(graph, analysis, Cluster("h100", nodes=2), 16, head_dim=cfg.head_dim, base=recipe)
    roles = {group_of(p): r for p, r in result.roles.items()}
    assert roles["layers.*.attn.q_proj.weight"] == COL  # 64 query heads split 16 ways
    assert roles["layers.*.attn.k_proj.weight"] != COL
    assert roles["layers.*.attn.v_proj.weight"] != COL
    assert roles["layers.*.mlp.down_proj.weight"] == ROW
    # the forced roles propagate to a consistent recipe
    forced = find_tp_recipe(graph, analysis, result.roles)
    assert all(forced.roles[p] == r for p, r in result.roles.items())


def test_forced_replicated_weight_is_not_sharded():
    _, graph, analysis, recipe = _recipe("tiny-llama")
    roles = {p: REPLICATED for p in recipe.roles}
    forced = find_tp_recipe(graph, analysis, roles)
    assert all(r == REPLICATED for r in forced.roles.values())
    assert not forced.sharded_matmul
    assert not [e for e in forced.events if e.kind == "reduce"]


def test_moe_router_is_not_left_sharded_into_topk():
    _, graph, analysis, recipe = _recipe("tiny-mixtral")
    topk = [n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.topk.default]
    assert topk and all(recipe.state[n.name] == "R" for n in topk)
