"""Data parallelism and ZeRO as rewrites of the per-rank joint graph.

Each rank runs the joint graph on its slice of the batch (the graph was captured with the local
batch shape). The rewrites make the gradients those of the global batch:

    DP (ZeRO-0):  g = all_reduce_sum(g_local) / n            every rank holds all of g
    ZeRO-1/2/3:   g_i = reduce_scatter_sum(g_local)_i / n   rank i holds rows i of g
                  W = all_gather(W_i)                        before W is used

A parameter whose first dimension does not divide by n keeps DP treatment (replicated, its
gradient all-reduced). Collectives are bucketed as DDP does (about 25 MB each, in the order the
backward produces the gradients): a bucket's reduction is issued right after its last gradient
is computed and waited for only at the end of the step, so it overlaps the rest of the backward.
For a reduce-scatter bucket each gradient is viewed as [n, numel/n] and the views concatenated
along dim 1, so rank i's part of the bucket is exactly its rows of every gradient. ZeRO-3 gathers a weight once for the forward and again right before the
backward's first use, so the full weight need not live across the step; ZeRO-1 and 2 gather
once per step (their memory differs in what the optimizer and gradients keep, not in the graph).
Every inserted node carries ``meta["autopar"]``: the plan decision that put it there.
"""

from __future__ import annotations

import torch
from torch import fx

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

# DDP's default bucket_cap_mb (torch.nn.parallel.DistributedDataParallel docs): large enough to
# amortise a collective's latency, small enough to start reducing early in the backward.
BUCKET_BYTES = 25 * 2**20


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
    order = sorted(sharded, key=lambda p: list(params).index(p))
    if zero in (1, 2):  # whole weights live through the step anyway: gather in buckets, up front
        for bucket in _gather_buckets(order, {p: nodes[params[p]] for p in order}):
            _gather_bucket(graph, bucket, {p: nodes[params[p]] for p in bucket}, zero, n, group_name)
    for name in order if zero == 3 else []:
        shard = nodes[params[name]]
        users = list(shard.users)
        forward_users = [u for u in users if u.meta.get("partitioner_tag") != "is_backward"]
        backward_users = [u for u in users if u.meta.get("partitioner_tag") == "is_backward"]
        groups = [(forward_users + backward_users, "forward and backward")]
        if forward_users and backward_users:
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
    for name in order:
        nodes[params[name]].meta["autopar"] = f"ZeRO-{zero}: rank's rows of {name}"

    # gradients: averaged over the group, scattered by rows where the weight is sharded
    present = {name: outs[index] for name, index in grads.items() if outs[index] is not None}
    for bucket in _buckets(graph, present, sharded):
        reduced = _reduce_bucket(graph, bucket, present, sharded, zero, n, group_name, output)
        for name, value in reduced.items():
            outs[grads[name]] = value
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


def _buckets(graph: fx.Graph, grads: dict[str, fx.Node], sharded: set[str]) -> list[list[str]]:
    """Gradients in the order the backward produces them, cut into buckets of one kind
    (all-reduce or reduce-scatter) and dtype of at most BUCKET_BYTES."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    names = sorted(grads, key=lambda name: order[grads[name]])
    buckets: list[list[str]] = []
    open_by_kind: dict[tuple, tuple[list[str], int]] = {}
    for name in names:
        val = grads[name].meta["val"]
        kind = (name in sharded, val.dtype)
        size = val.numel() * val.element_size()
        bucket, used = open_by_kind.get(kind, ([], 0))
        if bucket and used + size > BUCKET_BYTES:
            bucket, used = [], 0
        if not bucket:
            buckets.append(bucket)
        bucket.append(name)
        open_by_kind[kind] = (bucket, used + size)
    return buckets


def _gather_buckets(names: list[str], shards: dict[str, fx.Node]) -> list[list[str]]:
    buckets: list[list[str]] = []
    used = 0
    for name in names:
        val = shards[name].meta["val"]  # whole weight; the bucket holds it once gathered
        size = val.numel() * val.element_size()
        if not buckets or used + size > BUCKET_BYTES or \
                shards[buckets[-1][0]].meta["val"].dtype != val.dtype:
            buckets.append([])
            used = 0
        buckets[-1].append(name)
        used += size
    return buckets


def _gather_bucket(graph: fx.Graph, bucket: list[str], shards: dict[str, fx.Node], zero: int, n: int,
                   group_name: str) -> None:
    """ZeRO-1/2: one all-gather of the bucket's shards; rank i's part is its rows of each."""
    users = [u for name in bucket for u in shards[name].users]
    order = {node: i for i, node in enumerate(graph.nodes)}
    first = min(users, key=order.__getitem__)
    what = ", ".join(bucket) if len(bucket) <= 3 else f"{bucket[0]} ... {bucket[-1]} ({len(bucket)} tensors)"
    reason = f"ZeRO-{zero}: gather the weights {what} (one bucket)"
    with graph.inserting_before(first):
        flats = [_node(graph, aten.view.default, (shards[name], [-1])) for name in bucket]
        flat = _node(graph, aten.cat.default, (flats, 0)) if len(flats) > 1 else flats[0]
        issued = _node(graph, c10d.all_gather_into_tensor.default, (flat, n, group_name), reason)
        done = _node(graph, c10d.wait_tensor.default, (issued,), reason)
        rows = _node(graph, aten.view.default, (done, [n, -1]))
        offset = 0
        for name in bucket:
            val = shards[name].meta["val"]  # the whole weight: the graph was captured with it
            numel = val.numel() // n
            piece = _node(graph, aten.slice.Tensor, (rows, 1, offset, offset + numel))
            full = _node(graph, aten.reshape.default, (piece, list(val.shape)))
            offset += numel
            for user in list(shards[name].users):
                if user not in flats:
                    user.replace_input_with(shards[name], full)


def _reduce_bucket(graph: fx.Graph, bucket: list[str], grads: dict[str, fx.Node], sharded: set[str],
                   zero: int, n: int, group_name: str, output: fx.Node) -> dict[str, fx.Node]:
    """One collective for the bucket, issued after its last gradient, waited at the end."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    last = max((grads[name] for name in bucket), key=order.__getitem__)
    scatter = bucket[0] in sharded
    vals = {name: grads[name].meta["val"] for name in bucket}
    numels = [vals[name].numel() // (n if scatter else 1) for name in bucket]
    what = ", ".join(bucket) if len(bucket) <= 3 else f"{bucket[0]} ... {bucket[-1]} ({len(bucket)} tensors)"
    with graph.inserting_before(last.next):  # in order, right after the last gradient
        if scatter:  # [n, numel/n] per gradient, side by side: rank i's slice is its rows of each
            flats = [_node(graph, aten.view.default, (grads[name], [n, -1])) for name in bucket]
            flat = _node(graph, aten.cat.default, (flats, 1))
            flat = _node(graph, aten.view.default, (flat, [-1]))
            issued = _node(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", n, group_name),
                           f"ZeRO-{zero}: reduce-scatter the gradients of {what} (one bucket)")
        else:
            flats = [_node(graph, aten.view.default, (grads[name], [-1])) for name in bucket]
            flat = _node(graph, aten.cat.default, (flats, 0)) if len(flats) > 1 else flats[0]
            issued = _node(graph, c10d.all_reduce.default, (flat, "sum", group_name),
                           f"DP: all-reduce the gradients of {what} (one bucket)")
    with graph.inserting_before(output):  # wait as late as possible: the backward overlaps it
        done = _node(graph, c10d.wait_tensor.default, (issued,), issued.meta["autopar"])
        mean = _node(graph, aten.div.Tensor, (done, n), f"DP: average over {n} ranks")
        out, offset = {}, 0
        for name, numel in zip(bucket, numels):
            piece = _node(graph, aten.slice.Tensor, (mean, 0, offset, offset + numel))
            shape = list(vals[name].shape)
            if scatter:
                shape[0] //= n
            out[name] = _node(graph, aten.view.default, (piece, shape))
            offset += numel
    return out


def _node(graph: fx.Graph, op, args: tuple, reason: str | None = None) -> fx.Node:
    node = graph.call_function(op, args)
    if reason:
        node.meta["autopar"] = reason
    return node


def _position(graph: fx.Graph, node: fx.Node) -> int:
    for i, candidate in enumerate(graph.nodes):
        if candidate is node:
            return i
    raise ValueError(f"{node} is not in the graph")
