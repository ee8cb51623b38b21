"""The tensor-parallel pass on a fake 4-rank world: the traced graph has local shapes and
exactly the collectives the TP recipe implies (Megatron's two per block and direction, the
SP gathers), each labelled with the decision behind it."""

import warnings

import pytest
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.strategies.tp_recipe import find_tp_recipe
from passes.tensor_parallel import apply_tensor_parallel, parse_placement
from runtime.mesh import fake_world


def _traced(name: str, sp: bool, tp: int = 4):
    model = models.build(name, seed=0)
    graph = capture(model, models.example_inputs(name, batch=4, seq=16))
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = {}
    for p in graph.param_names:
        dim = recipe.param_shard_dim(p)
        placements[p] = Shard(dim) if dim is not None else Replicate()
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    with fake_world(tp), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        result = apply_tensor_parallel(
            graph.gm, [(i.kind, i.name) for i in graph.inputs],
            [tuple(n.meta["val"].shape) for n in holders], placements, mesh, sp,
            {o.index: o.name for o in graph.outputs if o.kind == "grad"},
            next(o.index for o in graph.outputs if o.kind == "loss"))
    collectives = [n for n in result.gm.graph.nodes
                   if str(n.target).startswith("_c10d_functional.") and "wait_tensor" not in str(n.target)]
    return graph, recipe, result, collectives, caught


def _kinds(collectives, word: str) -> int:
    return sum(word in n.meta.get("autopar", "") for n in collectives)


def test_tp_collectives_are_the_recipes():
    graph, recipe, result, collectives, _ = _traced("tiny-llama", sp=False)
    reduces = sum(e.kind == "reduce" for e in recipe.events)
    assert _kinds(collectives, "all-reduce the partial sums") == reduces  # 2 per block and pass
    assert _kinds(collectives, "parallel cross-entropy") == 3  # max, sum of exp, target logit
    assert len(collectives) == reduces + 3
    assert not any("DTensor redistributes" in n.meta["autopar"] for n in collectives)
    # local shapes: a column-parallel weight holds a quarter of the rows
    col = next(p for p, r in recipe.roles.items() if r == "col")
    assert result.local_shapes[col][0] * 4 == graph.param_shapes[col][0]


def test_moe_reductions_are_no_more_than_the_recipes():
    # expert outputs are concatenated as partial sums and reduced once, not per expert
    _, recipe, _, collectives, _ = _traced("tiny-mixtral", sp=False)
    reduces = sum(e.kind == "reduce" for e in recipe.events)
    assert 0 < _kinds(collectives, "all-reduce the partial sums") <= reduces
    assert all(n.meta.get("autopar") for n in collectives)


def test_sp_turns_reductions_into_reduce_scatters_and_gathers():
    _, recipe, _, collectives, _ = _traced("tiny-llama", sp=True)
    reduces = sum(e.kind == "reduce" for e in recipe.events)
    gathers = sum(e.kind == "gather" for e in recipe.events)
    assert _kinds(collectives, "reduce-scatter onto the sequence") == reduces
    assert _kinds(collectives, "all-gather the sequence") == gathers
    assert not any("all-reduce the partial sums" in n.meta["autopar"] for n in collectives)
    # with the sequence split, the replicated norm weights' gradients are partial sums
    assert _kinds(collectives, "all-reduce the gradient of") == 5


def test_fused_qkv_falls_back_loudly():
    # GPT-2's fused qkv projection column-sharded cannot be split into q, k, v on the shards
    _, _, result, _, caught = _traced("tiny-gpt2", sp=False)
    assert result.fallback_ops == ["aten.view.default"]
    assert any("runs replicated on every TP rank" in str(w.message) for w in caught)


def test_parse_placement():
    assert parse_placement("Shard(1)") == Shard(1)
    assert parse_placement("Replicate()") == Replicate()
    with pytest.raises(ValueError, match="not executable"):
        parse_placement("Partial()")
