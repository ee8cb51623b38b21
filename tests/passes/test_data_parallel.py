"""The data-parallel pass alone, on 2 gloo ranks: the graph it writes gives every rank the
gradients of the global batch (its rows under ZeRO), whichever collective reduces them."""

from __future__ import annotations

import copy

import pytest
import torch

from runtime.launch import spawn


def _run_pass_worker(rank: int, world: int, zero: int) -> list[str]:
    import torch.distributed as dist

    from autopar import models
    from autopar.capture.joint import capture
    from passes.data_parallel import apply_data_parallel, shardable
    from vocab.plan_types import AxisGroup, CommPlan, DataParallelPlan, GraphSignature

    model = models.build("tiny-llama", seed=0)
    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    expected = capture(model, batch).run(dict(model.named_parameters()), *batch)[1]
    local = tuple(x.chunk(world)[rank] for x in batch)
    graph = capture(model, local)
    holders = {i.node: i for i in graph.inputs}
    grads = {o.name: o.index for o in graph.outputs if o.kind == "grad"}
    signature = GraphSignature(inputs=[(i.kind, i.name) for i in graph.inputs],
                               placeholders=[i.node for i in graph.inputs], grad_index=grads,
                               loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))
    sharded = frozenset(n for n, s in graph.param_shapes.items() if zero and shardable(s, world))
    group = AxisGroup(dist.group.WORLD.group_name, world, rank)
    weights = dict(model.named_parameters())
    problems = []
    for reduce_scatter in (True, False):
        gm = copy.deepcopy(graph.gm)
        plan = DataParallelPlan(zero, sharded, CommPlan(reduce_scatter=reduce_scatter))
        apply_data_parallel(gm, signature, dict(graph.param_shapes), plan, group)
        args = []
        for node in gm.graph.nodes:
            if node.op != "placeholder":
                continue
            item = holders[node.name]
            if item.kind == "param":
                w = weights[item.name].detach()
                args.append(w.chunk(world)[rank] if item.name in sharded else w)
            elif item.kind == "input":
                args.append(local[int(item.name[len("input"):])])
            else:
                args.append(torch.ones(()))
        with torch.no_grad():
            out = gm(*args)
        if zero and not sharded:
            problems.append("nothing sharded")
        for name, index in grads.items():
            want = expected[name].chunk(world)[rank] if name in sharded else expected[name]
            if not torch.allclose(out[index], want, rtol=1e-5, atol=1e-6):
                problems.append(f"reduce_scatter={reduce_scatter}: gradient of {name}")
    return problems


@pytest.mark.parametrize("zero", [0, 2, 3])
def test_pass_gives_the_global_batch_gradients(zero):
    for problems in spawn(_run_pass_worker, 2, args=(zero,), timeout_s=240):
        assert problems == []


def test_gather_groups_follow_blocks_or_cut_a_flat_model_into_buckets():
    from passes.data_parallel import BUCKET_BYTES, gather_groups

    blocks = {"embed.weight": torch.empty(8, 4), "head.weight": torch.empty(8, 4),
              "layers.0.q.weight": torch.empty(4, 4),
              "layers.0.norm.weight": torch.empty(4, dtype=torch.float64), "layers.1.q.weight": torch.empty(4, 4)}
    groups = gather_groups(blocks)
    assert groups["embed.weight"][0] == "embed (outside the blocks)"  # not with the head
    assert groups["layers.0.q.weight"] == ("block layers.0's weights", torch.float32)
    assert groups["layers.0.norm.weight"] != groups["layers.0.q.weight"]  # another dtype
    assert groups["layers.1.q.weight"][0] == "block layers.1's weights"
    assert groups["head.weight"][0] == "head (outside the blocks)"
    rows = BUCKET_BYTES // (4 * 1024)  # one bucket's worth of float32 rows of 1024
    flat = {"enc.weight": torch.empty(rows // 2, 1024, device="meta"), "mid.weight": torch.empty(8, 1024),
            "dec.weight": torch.empty(rows, 1024, device="meta")}
    assert [g[0] for g in gather_groups(flat).values()] == ["bucket 0 of the weights"] * 2 + ["bucket 1 of the weights"]


def test_zero3_backward_reads_only_its_own_gather():
    """ZeRO-3 drops a block's whole weights after the forward: no backward op may read the
    forward's gathered weight, directly or through a view of it (the linear's t(W) that
    AOTAutograd shares with the backward), or every block's weights stay whole until then."""
    from autopar import models
    from autopar.capture.joint import capture
    from passes.data_parallel import apply_data_parallel
    from vocab.plan_types import AxisGroup, CommPlan, DataParallelPlan, GraphSignature

    model = models.build("tiny-llama", device="meta")
    graph = capture(model, models.example_inputs("tiny-llama", batch=2, seq=16, device="meta"))
    signature = GraphSignature(inputs=[(i.kind, i.name) for i in graph.inputs],
                               placeholders=[i.node for i in graph.inputs],
                               grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
                               loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))
    gm = copy.deepcopy(graph.gm)
    plan = DataParallelPlan(3, frozenset(graph.param_shapes), CommPlan())
    apply_data_parallel(gm, signature, dict(graph.param_shapes), plan, AxisGroup("g", 2, 0))
    passive = {torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
               torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.slice.Tensor,
               torch.ops.aten._to_copy.default,
               torch.ops.aten.alias.default, torch.ops.aten.detach.default}
    forward_gathers = [n for n in gm.graph.nodes if n.target == torch.ops._c10d_functional.wait_tensor.default
                       and "for the forward" in n.meta.get("autopar", "")]
    assert forward_gathers
    for gathered in forward_gathers:
        frontier, readers = [gathered], []
        while frontier:
            for user in frontier.pop().users:
                (frontier if user.target in passive and user.meta.get("partitioner_tag") != "is_backward"
                 else readers).append(user)
        late = [r.name for r in readers if r.meta.get("partitioner_tag") == "is_backward"]
        assert late == [], f"{gathered.meta['autopar']}: read by the backward at {late}"
