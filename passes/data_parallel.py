"""Data parallelism and ZeRO as rewrites of the per-rank joint graph.

Each rank runs the joint graph on its slice of the batch (the graph was captured with the local
batch shape). The rewrites make the gradients those of the global batch:

    DP (ZeRO-0):  g = all_reduce_sum(g_local) / n            every rank holds all of g
    ZeRO-1/2/3:   g_i = reduce_scatter_sum(g_local)_i / n   rank i holds rows i of g
                  W = all_gather(W_i)                        before W is used

A parameter whose first dimension does not divide by n keeps DP treatment (replicated, its
gradient all-reduced). ZeRO-3 gathers a weight once for the forward and again right before the
backward's first use, so the full weight need not live across the step; ZeRO-1 and 2 gather
once per step (their memory differs in what the optimizer and gradients keep, not in the graph).
Every inserted node carries ``meta["autopar"]``: the plan decision that put it there.
"""

from __future__ import annotations

import torch
from torch import fx

c10d = torch.ops._c10d_functional


def _collective(graph: fx.Graph, op, args: tuple, reason: str, like: fx.Node) -> fx.Node:
    """Insert ``wait_tensor(op(*args))`` after the current insertion point."""
    issued = graph.call_function(op, args)
    issued.meta["autopar"] = reason
    issued.meta["val"] = like.meta.get("val")
    done = graph.call_function(c10d.wait_tensor.default, (issued,))
    done.meta["autopar"] = reason
    done.meta["val"] = like.meta.get("val")
    return done


def shardable(shape: tuple[int, ...], n: int) -> bool:
    """ZeRO shards dim 0 evenly: it must divide by the group size."""
    return len(shape) >= 1 and shape[0] % n == 0


def apply_data_parallel(
    gm: fx.GraphModule,
    params: dict[str, str],
    grads: dict[str, int],
    loss_index: int,
    shapes: dict[str, tuple[int, ...]],
    zero: int,
    group_size: int,
    group_name: str,
) -> set[str]:
    """Rewrite ``gm`` in place for data parallelism over a group of ``group_size`` ranks.

    params: parameter name -> placeholder node name; grads: parameter name -> output index;
    loss_index: output index of the (local) loss, averaged over the group as well.
    Returns the names of the parameters that are sharded (ZeRO >= 1 and divisible).
    """
    graph = gm.graph
    n = group_size
    nodes = {node.name: node for node in graph.nodes}
    output = next(node for node in graph.nodes if node.op == "output")
    outs = list(output.args[0])
    sharded = {p for p in params if zero >= 1 and shardable(shapes[p], n)}

    # weights: the graph input becomes rank i's rows; gather them before use
    for name in sorted(sharded, key=lambda p: list(params).index(p)):
        shard = nodes[params[name]]
        users = list(shard.users)
        forward_users = [u for u in users if u.meta.get("partitioner_tag") != "is_backward"]
        backward_users = [u for u in users if u.meta.get("partitioner_tag") == "is_backward"]
        groups = [(forward_users + backward_users, "forward and backward")]
        if zero == 3 and forward_users and backward_users:
            groups = [(forward_users, "forward"), (backward_users, "backward")]
        for consumers, when in groups:
            first = min(consumers, key=lambda u: _position(graph, u))
            with graph.inserting_before(first):
                full = _collective(
                    graph, c10d.all_gather_into_tensor.default, (shard, n, group_name),
                    f"ZeRO-{zero}: gather {name} for the {when}", shard,
                )
            for user in consumers:
                user.replace_input_with(shard, full)
        shard.meta["autopar"] = f"ZeRO-{zero}: rank's rows of {name}"

    # gradients: averaged over the group, scattered by rows where the weight is sharded
    for name, index in grads.items():
        grad = outs[index]
        if grad is None:
            continue
        with graph.inserting_before(output):
            if name in sharded:
                reduced = _collective(
                    graph, c10d.reduce_scatter_tensor.default, (grad, "sum", n, group_name),
                    f"ZeRO-{zero}: reduce-scatter the gradient of {name}", grad,
                )
            else:
                reduced = _collective(
                    graph, c10d.all_reduce.default, (grad, "sum", group_name),
                    f"DP: all-reduce the gradient of {name}", grad,
                )
            mean = graph.call_function(torch.ops.aten.div.Tensor, (reduced, n))
            mean.meta["autopar"] = f"DP: average over {n} ranks"
        outs[index] = mean
    with graph.inserting_before(output):
        loss = _collective(
            graph, c10d.all_reduce.default, (outs[loss_index], "sum", group_name),
            "DP: the global loss for reporting (mean of the ranks' losses)", outs[loss_index],
        )
        outs[loss_index] = graph.call_function(torch.ops.aten.div.Tensor, (loss, n))
    output.args = (tuple(outs),)
    graph.lint()
    gm.recompile()
    return sharded


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, candidate in enumerate(graph.nodes):
        if candidate is node:
            return i
    raise ValueError(f"{node} is not in the graph")
