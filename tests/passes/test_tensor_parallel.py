"""The tensor-parallel pass on a fake 4-rank world: the traced graph has local shapes and
exactly the collectives the TP recipe implies (Megatron's two per block and direction, the
SP gathers), each labelled with the decision behind it."""

import warnings

import pytest
from torch.distributed.device_mesh import init_device_mesh

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.strategies.tp_recipe import find_tp_recipe
from passes.tensor_parallel import apply_tensor_parallel
from runtime.mesh import fake_world
from vocab.plan_types import AxisPlacement, GraphSignature, TensorParallelPlan


def _placements(graph, recipe) -> dict[str, AxisPlacement]:
    """The recipe's TP placements, as the planner writes them: fused projections per part."""
    placements = {}
    for p in graph.param_names:
        dim = recipe.param_shard_dim(p)
        placements[p] = (AxisPlacement.shard(dim, recipe.fused_parts.get(p, 1)) if dim is not None
                         else AxisPlacement.replicate())
    return placements


def _traced(name: str, sp: bool, tp: int = 4):
    model = models.build(name, seed=0)
    graph = capture(model, models.example_inputs(name, batch=4, seq=16))
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = _placements(graph, recipe)
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    signature = GraphSignature(
        inputs=[(i.kind, i.name) for i in graph.inputs], placeholders=[n.name for n in holders],
        grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
        loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))
    with fake_world(tp), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        result = apply_tensor_parallel(
            graph.gm, signature, [tuple(n.meta["val"].shape) for n in holders],
            TensorParallelPlan(placements, sequence_parallel=sp), mesh)
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


def test_fused_qkv_is_found_and_split_per_part():
    # GPT-2's qkv(x).view(b, s, 3, heads, head_dim): weight and bias split per part (q, k, v)
    model = models.build("tiny-gpt2", seed=0)
    graph = capture(model, models.example_inputs("tiny-gpt2", batch=4, seq=16))
    recipe = find_tp_recipe(graph, analyze(graph))
    fused = {f"layers.{i}.attn.qkv.{w}" for i in range(2) for w in ("weight", "bias")}
    assert recipe.fused_parts == dict.fromkeys(fused, 3)
    heads = model.config.n_heads
    assert recipe.fused_heads == dict.fromkeys(fused, heads)
    assert recipe.divides(heads) and not recipe.divides(2 * heads)
    # attention runs sharded by heads, as it is priced: no fallback
    attention = [n for n in graph.gm.graph.nodes if "scaled_dot_product" in str(n.target)]
    assert attention and all(recipe.state[n.name] == "S" for n in attention)
    assert recipe.fallback_ops == set()
    assert _placements(graph, recipe)["layers.0.attn.qkv.weight"] == AxisPlacement.shard(0, 3)
    for name in ("tiny-llama", "tiny-mixtral"):  # separate q, k, v projections: nothing fused
        g = capture(models.build(name, seed=0), models.example_inputs(name, batch=2, seq=8))
        assert find_tp_recipe(g, analyze(g)).fused_parts == {}


@pytest.mark.parametrize("tp,sp", [(2, False), (4, False), (2, True), (4, True)])
def test_fused_qkv_runs_split_by_heads(tp, sp):
    graph, recipe, result, collectives, caught = _traced("tiny-gpt2", sp=sp, tp=tp)
    assert result.fallback_ops == []
    assert not [str(w.message) for w in caught]
    reduces = sum(e.kind == "reduce" for e in recipe.events)
    assert not any("DTensor redistributes" in n.meta["autopar"] for n in collectives)
    if sp:
        gathers = sum(e.kind == "gather" for e in recipe.events)
        assert _kinds(collectives, "reduce-scatter onto the sequence") == reduces
        assert _kinds(collectives, "all-gather the sequence") == gathers
        assert not any("all-reduce the partial sums of view" in n.meta["autopar"] for n in collectives)
    else:
        assert _kinds(collectives, "all-reduce the partial sums") == reduces
        assert _kinds(collectives, "parallel cross-entropy") == 3
        assert len(collectives) == reduces + 3
    h = graph.param_shapes["layers.0.attn.qkv.weight"][1]
    assert result.local_shapes["layers.0.attn.qkv.weight"] == (3 * h // tp, h)
    assert result.local_shapes["layers.0.attn.qkv.bias"] == (3 * h // tp,)


def test_placements_round_trip_their_spelling():
    for p in (AxisPlacement.shard(1), AxisPlacement.replicate(), AxisPlacement.shard(0, 3)):
        assert AxisPlacement.parse(str(p)) == p
    with pytest.raises(ValueError, match="Partial"):
        AxisPlacement.parse("Partial()")
