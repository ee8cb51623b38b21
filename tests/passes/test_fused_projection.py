"""GPT-2's fused qkv projection under tensor parallelism, on 2 gloo ranks: the weight and bias
split per part (rank r holds [q_r; k_r; v_r]), attention on each rank's own heads, and the
traced per-rank graph gives the single-device loss and gradients."""

from __future__ import annotations

import pytest

from runtime.launch import spawn


def _local_shard(data, place, n: int, rank: int):
    """Rank ``rank``'s part of ``data``, as the runtime builds it (per part when strided)."""
    import torch

    if not place.is_shard:
        return data
    parts = data.chunk(place.split_factor, dim=place.dim)
    return torch.cat([part.chunk(n, dim=place.dim)[rank] for part in parts], dim=place.dim)


def _whole(shards, place):
    """Inverse of `_local_shard` over all ranks' shards: the global tensor."""
    import torch

    if not place.is_shard:
        return shards[0]
    k = place.split_factor
    per_rank = [s.chunk(k, dim=place.dim) for s in shards]  # rank r: [part_0 r, .., part_k-1 r]
    parts = [torch.cat([pieces[j] for pieces in per_rank], dim=place.dim) for j in range(k)]
    return torch.cat(parts, dim=place.dim)


def _parity_worker(rank: int, world: int, sp: bool) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from autopar import models
    from autopar.analysis.graph import analyze
    from autopar.capture.joint import capture
    from autopar.strategies.tp_recipe import find_tp_recipe
    from passes.tensor_parallel import apply_tensor_parallel
    from vocab.plan_types import AxisPlacement, GraphSignature, TensorParallelPlan

    model = models.build("tiny-gpt2", seed=0)
    batch = models.example_inputs("tiny-gpt2", batch=2, seq=16)
    graph = capture(model, batch)
    weights = {n: p.detach() for n, p in model.named_parameters()}
    loss, expected = graph.run(weights, *batch)
    recipe = find_tp_recipe(graph, analyze(graph))
    placements = {}
    for name in graph.param_names:
        dim = recipe.param_shard_dim(name)
        placements[name] = (AxisPlacement.shard(dim, recipe.fused_parts.get(name, 1))
                            if dim is not None else AxisPlacement.replicate())
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    grads = {o.name: o.index for o in graph.outputs if o.kind == "grad"}
    loss_index = next(o.index for o in graph.outputs if o.kind == "loss")
    signature = GraphSignature(inputs=[(i.kind, i.name) for i in graph.inputs],
                               placeholders=[n.name for n in holders], grad_index=grads,
                               loss_index=loss_index)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    result = apply_tensor_parallel(graph.gm, signature, [tuple(n.meta["val"].shape) for n in holders],
                                   TensorParallelPlan(placements, sequence_parallel=sp), mesh)
    problems = [f"fallback {op}" for op in result.fallback_ops]
    args = []
    for (kind, name), node in zip(signature.inputs, holders):
        if kind == "param":
            args.append(_local_shard(weights[name], placements[name], world, rank).contiguous())
        elif kind == "input":
            args.append(batch[int(name[len("input"):])])
        else:  # the loss's seed gradient
            args.append(torch.ones(tuple(node.meta["val"].shape)))
    with torch.no_grad():
        out = result.gm(*args)
    if not torch.allclose(out[loss_index], loss, rtol=1e-5, atol=1e-6):
        problems.append(f"loss {out[loss_index].item()} != {loss.item()}")
    for name, index in grads.items():
        local = out[index].contiguous()
        if tuple(local.shape) != result.local_shapes[name]:
            problems.append(f"gradient of {name}: local shape {tuple(local.shape)}")
            continue
        shards = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(shards, local)
        if not torch.allclose(_whole(shards, placements[name]), expected[name], rtol=1e-5, atol=1e-6):
            problems.append(f"gradient of {name} ({placements[name]})")
    if "layers.0.attn.qkv.weight" not in recipe.fused_parts:
        problems.append("qkv not found fused")
    return problems


@pytest.mark.parametrize("sp", [False, True])
def test_fused_qkv_matches_one_device(sp):
    for problems in spawn(_parity_worker, 2, args=(sp,), timeout_s=120):
        assert problems == []


def test_local_shard_round_trips():
    import torch

    from vocab.plan_types import AxisPlacement

    data = torch.arange(24.0).view(12, 2)
    for place in (AxisPlacement.shard(0, 3), AxisPlacement.shard(0), AxisPlacement.replicate()):
        shards = [_local_shard(data, place, 2, r) for r in range(2)]
        assert torch.equal(_whole(shards, place), data)
    # rank 1 of a [q; k; v] split per part holds the second half of each of q, k and v
    assert _local_shard(data, AxisPlacement.shard(0, 3), 2, 1)[:, 0].tolist() == [4, 6, 12, 14, 20, 22]
