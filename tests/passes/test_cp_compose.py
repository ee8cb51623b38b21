"""The context-parallel pass composed with the others, traced for one rank of a fake world (no
processes): after the TP pass (cp x tp on a (cp, tp) mesh) attention is ring attention on the
rank's heads and nothing gathers the sequence (TP's all-reduces, its vocabulary-parallel
embedding and loss run on the rank's tokens); with ``reduce_grads=False`` the gradients leave
as partial sums (no all-reduce over cp), for the DP pass to reduce over dp x cp; the DP pass
scales the seed for the slices, not the ranks. The runs themselves: tests/runtime/
test_cp_compose_parity.py."""

from __future__ import annotations

import operator
from collections import Counter

import pytest
import torch
from cp_models import GqaLM, gqa_batch
from torch.distributed.device_mesh import init_device_mesh

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.execution.rewrite import _signature, captured_signature
from autopar.strategies.tp_recipe import find_tp_recipe
from passes.context_parallel import apply_context_parallel
from passes.data_parallel import apply_data_parallel
from passes.fp8 import RECIPES, SCALE_TAG, apply_fp8, group_of, weight_matmuls
from passes.tensor_parallel import apply_tensor_parallel
from runtime import ring_attention  # noqa: F401  (registers the ring ops)
from runtime.mesh import fake_world
from vocab.layout import Layout, unsupported_decisions
from vocab.plan_types import AxisGroup, AxisPlacement, DataParallelPlan, TensorParallelPlan


def _model(name: str):
    if name == "gqa-lm":
        return GqaLM(seed=1), gqa_batch()
    return models.build(name, seed=0), models.example_inputs(name, batch=4, seq=16)


def _holders(gm) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in gm.graph.nodes if n.op == "placeholder"]


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("name", ["tiny-llama", "gqa-lm"])
def test_cp_after_tp_runs_ring_attention_without_sequence_gathers(name):
    model, batch = _model(name)
    graph = capture(model, batch)
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = {p: (AxisPlacement.shard(recipe.param_shard_dim(p), recipe.fused_parts.get(p, 1))
                      if recipe.param_shard_dim(p) is not None else AxisPlacement.replicate())
                  for p in graph.param_names}
    sig = captured_signature(graph)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        tp = apply_tensor_parallel(graph.gm, sig, _holders(graph.gm), TensorParallelPlan(placements), mesh["tp"])
        out = apply_context_parallel(tp.gm, sig, _holders(tp.gm), mesh["cp"], reduce_grads=False)
    ops = _ops(out.gm)
    assert ops["autopar.ring_attention.default"] == 2 and ops["autopar.ring_attention_backward.default"] == 2
    assert out.gathered == [] and not any("all_gather" in op for op in ops), out.gathered
    # the heads are TP-local: the ring's q is [b, heads / tp, s / cp, d]
    ring = next(n for n in out.gm.graph.nodes if str(n.target) == "autopar.ring_attention.default")
    attention = next(n for n in graph.gm.graph.nodes if "flash_attention" in str(n.target))
    heads = attention.args[0].meta["val"].shape[1]
    assert ring.args[0].meta["val"].shape[1] == heads // 2
    assert ring.args[0].meta["val"].shape[2] == batch[0].shape[1] // 2


def _tp_plan(graph, sp: bool) -> TensorParallelPlan:
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = {p: (AxisPlacement.shard(recipe.param_shard_dim(p), recipe.fused_parts.get(p, 1))
                      if recipe.param_shard_dim(p) is not None else AxisPlacement.replicate())
                  for p in graph.param_names}
    return TensorParallelPlan(placements, sequence_parallel=sp)


def _group(node) -> str | None:
    return next((a for a in reversed(node.args) if isinstance(a, str)), None)


@pytest.mark.parametrize("name", ["tiny-llama", "gqa-lm"])
def test_cp_after_tp_sp_gathers_the_rank_sequence_over_tp(name):
    """cp2 x tp2+SP: SP's all-gathers and reduce-scatters stay TP's (on the tp group, as many as
    TP alone traces), each moving the rank's block of its CP rank's sequence, S / (cp tp)
    positions, and gathering the CP rank's S / cp (the ring's local sequence); nothing is
    gathered over cp, and cp's group carries only the ring and the loss's sums."""
    model, batch = _model(name)
    graph = capture(model, batch)
    sig = captured_signature(graph)
    b, seq = batch[0].shape
    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        tp_group, cp_group = mesh["tp"].get_group().group_name, mesh["cp"].get_group().group_name
        tp = apply_tensor_parallel(graph.gm, sig, _holders(graph.gm), _tp_plan(graph, sp=True), mesh["tp"])
        out = apply_context_parallel(tp.gm, sig, _holders(tp.gm), mesh["cp"], reduce_grads=False)
    assert out.gathered == []
    ops, tp_ops = _ops(out.gm), _ops(tp.gm)
    gather, scatter = "_c10d_functional.all_gather_into_tensor.default", "_c10d_functional.reduce_scatter_tensor.default"
    assert ops[gather] == tp_ops[gather] > 0 and ops[scatter] == tp_ops[scatter] > 0
    on_cp = Counter(str(n.target) for n in out.gm.graph.nodes if _group(n) == cp_group)
    assert set(on_cp) <= {"_c10d_functional.all_reduce.default", "autopar.ring_attention.default",
                          "autopar.ring_attention_backward.default"}, on_cp
    assert on_cp["autopar.ring_attention.default"] == 2
    sp_gathers = [n for n in out.gm.graph.nodes if str(n.target) == gather]
    assert all(_group(n) == tp_group and n.meta["autopar"].startswith("TP+SP") for n in sp_gathers)
    for node in sp_gathers:  # [b, S / (cp tp), h] gathered over tp into [tp b, S / (cp tp), h]
        assert tuple(node.args[0].meta["val"].shape[:2]) == (b, seq // 4), node
        assert tuple(node.meta["val"].shape[:2]) == (2 * b, seq // 4), node
    for node in out.gm.graph.nodes:
        if str(node.target) == scatter and "(SP)" in node.meta.get("autopar", ""):
            assert _group(node) == tp_group and tuple(node.meta["val"].shape[:2]) == (b, seq // 4), node
    ring = next(n for n in out.gm.graph.nodes if str(n.target) == "autopar.ring_attention.default")
    assert ring.args[0].meta["val"].shape[2] == seq // 2  # the CP rank's whole local sequence


def test_sp_blocks_are_blocks_of_the_cp_ranks_chunks():
    """The SP split and concatenation on CP rank 1 of 2 (chunks 1 and 2 of 4): TP's 2 blocks
    are chunk 1 and chunk 2 (positions 4..7 and 8..11 of 16), and put back side by side they are
    the rank's sequence in the ring's order."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from passes.cp_balance import zigzag_shards
    from passes.cp_sequence_parallel import sp_cat, sp_split

    x = torch.arange(16.0).view(1, 16, 1)
    graph = torch.fx.Graph()
    value = graph.placeholder("x")
    split = graph.call_function(torch.ops.aten.split.Tensor, (value, 8, 1))
    parts = [graph.call_function(operator.getitem, (split, j)) for j in range(2)]
    cat = graph.call_function(torch.ops.aten.cat.default, (parts, 1))
    cat.meta["val"] = x
    with fake_world(4, rank=2):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))["cp"]
        with zigzag_shards(mesh):
            whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            rank = whole.redistribute(mesh, [Shard(1)])
            blocks = sp_split(split, rank, 2)
            again = sp_cat(cat, list(blocks))
    assert [b.to_local().flatten().tolist() for b in blocks] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert all(tuple(b.shape) == (1, 8, 1) for b in blocks)
    assert again.to_local().flatten().tolist() == list(range(4, 12)) and tuple(again.shape) == (1, 16, 1)


def test_partial_gradients_and_the_dp_x_cp_seed():
    """reduce_grads=False: no all-reduce of a gradient over cp (only the loss's sums); the DP
    pass over 4 ranks holding 2 slices' partial sums scales the seed by 1/2, not 1/4."""
    model, batch = _model("tiny-llama")
    graph = capture(model, batch)
    sig = captured_signature(graph)
    with fake_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
        whole = apply_context_parallel(graph.gm, sig, _holders(graph.gm), mesh)
        graph = capture(model, batch)
        partial = apply_context_parallel(graph.gm, sig, _holders(graph.gm), mesh, reduce_grads=False)
    reduce = "_c10d_functional.all_reduce.default"
    assert _ops(whole.gm)[reduce] == len(sig.grad_index) + 2
    assert _ops(partial.gm)[reduce] == 2  # the loss's token sum and count
    shapes = dict(graph.param_shapes)
    sig = _signature(partial.gm, sig.inputs, sig.grad_index, sig.loss_index, sig.buffer_index)
    apply_data_parallel(partial.gm, sig, shapes, DataParallelPlan(zero=0, sharded=frozenset()),
                        AxisGroup("fake", 4, 0), partial=2)
    seeds = [n for n in partial.gm.graph.nodes if n.target is torch.ops.aten.mul.Tensor
             and "seed gradient" in n.meta.get("autopar", "")]
    assert [n.args[1] for n in seeds] == [0.5]
    reasons = [n.meta["autopar"] for n in partial.gm.graph.nodes
               if "c10d" in str(n.target) and "DP:" in n.meta.get("autopar", "")]
    assert reasons and all("over the 4 dp x cp ranks" in r for r in reasons)
    with pytest.raises(ValueError, match="partial=3 must divide"):
        apply_data_parallel(graph.gm, sig, shapes, DataParallelPlan(zero=0, sharded=frozenset()),
                            AxisGroup("fake", 4, 0), partial=3)


def test_what_cp_runs_with_and_what_it_refuses():
    assert unsupported_decisions(Layout(cp=2, zero=3)) == []
    assert unsupported_decisions(Layout(cp=2, tp=2, dp=2, zero=1)) == []
    assert unsupported_decisions(Layout(cp=2, tp=2, sp=True)) == []
    assert unsupported_decisions(Layout(cp=2, tp=2, dp=2, sp=True, zero=3)) == []
    assert unsupported_decisions(Layout(cp=2, pp=2, grad_accum=2)) == []
    assert unsupported_decisions(Layout(cp=2, pp=2, zero=1, grad_accum=2)) == []
    (words,) = unsupported_decisions(Layout(cp=2, pp=2, zero=2, grad_accum=2))  # as without cp
    assert "ZeRO-2 inside a pipeline" in words
    assert unsupported_decisions(Layout(cp=2, dp=2, fp8="all", fp8_recipe="rowwise")) == []
    assert unsupported_decisions(Layout(cp=2, tp=2, sp=True, precision="fp8")) == []


@pytest.mark.parametrize("recipe, tp", [("rowwise", 1), ("rowwise", 2)])
def test_cp_runs_fp8_matmuls_on_the_rank_tokens(recipe, tp):
    """Every weight matmul in FP8 under cp (after TP where tp=2): nothing gathered (the pass
    refuses a collective on FP8 data: gloo cannot move it), the weight gradients (tokens along
    K, a `_StridedShard` over cp) partial sums, and each amax over tokens all-reduced (max)
    over cp before its scale, exactly those."""
    model, batch = _model("tiny-llama")
    graph = capture(model, batch)
    sig = captured_signature(graph)
    apply_fp8(graph.gm, sig, sorted({group_of(w) for w in weight_matmuls(graph.gm, sig)}), RECIPES[recipe])
    over_tokens = sum(1 for n in graph.gm.graph.nodes if n.meta.get("custom", {}).get(SCALE_TAG, {}).get("over_tokens"))
    tp_recipe = find_tp_recipe(graph, analyze(graph))
    placements = {p: (AxisPlacement.shard(d) if (d := tp_recipe.param_shard_dim(p)) is not None
                      else AxisPlacement.replicate()) for p in graph.param_names}
    with fake_world(2 * tp):
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("cp", "tp"))
        gm = graph.gm
        if tp > 1:
            gm = apply_tensor_parallel(gm, sig, _holders(gm), TensorParallelPlan(placements), mesh["tp"]).gm
        out = apply_context_parallel(gm, sig, _holders(gm), mesh["cp"], reduce_grads=False)
        cp_group = mesh["cp"].get_group().group_name
    ops = _ops(out.gm)
    assert not any("all_gather" in op or "all_to_all" in op for op in ops), ops
    assert ops["aten._scaled_mm.default"] == _ops(graph.gm)["aten._scaled_mm.default"] > 0
    maxes = [n for n in out.gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default
             and n.args[1:3] == ("max", cp_group)]
    assert over_tokens and len(maxes) == over_tokens
    assert all("over the CP ranks (an FP8 scale)" in n.meta["autopar"] for n in maxes)


def test_dp_cp_mesh_of_a_pipeline():
    """The ("dp", "pp", "cp", "tp") mesh's dp x cp flattening: rank (d, p, c, t) on dp row
    d * cp + c of the ("dp", "pp", "tp") mesh, its pipeline and TP coordinates kept."""
    from runtime.mesh import dp_cp_mesh

    with fake_world(16, rank=0):
        mesh = init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp", "pp", "cp", "tp"))
        flat = dp_cp_mesh(mesh)
        assert flat.mesh_dim_names == ("dp", "pp", "tp") and tuple(flat.shape) == (4, 2, 2)
        for d, p, c, t in ((0, 0, 1, 0), (1, 1, 0, 1), (1, 0, 1, 1)):
            assert int(flat.mesh[d * 2 + c, p, t]) == int(mesh.mesh[d, p, c, t])
        assert dp_cp_mesh(mesh) is flat
        with pytest.raises(ValueError, match="dp_cp_mesh needs"):
            dp_cp_mesh(mesh["dp", "pp", "tp"])
