"""Data parallelism and ZeRO as rewrites of the per-rank joint graph.

Each rank runs the joint graph on its slice of the batch (the graph was captured with the local
batch shape). The rewrites make the gradients those of the global batch:

    DP (ZeRO-0):  g = all_reduce_sum(g_local / n)            every rank holds all of g
    ZeRO-1/2/3:   g_i = reduce_scatter_sum(g_local / n)_i   rank i holds rows i of g
                  W = all_gather(W_i)                        before W is used

The 1/n costs nothing: the loss's seed gradient is scaled by 1/n, and every gradient, linear in
the seed, comes out divided.

A parameter whose first dimension does not divide by n keeps DP treatment (replicated, its
gradient all-reduced). Collectives are bucketed as DDP does (the first bucket 1 MiB, so that
communication starts early in the backward, the others about 25 MiB, in the order the backward
produces the gradients): a bucket's reduction is issued right after its last gradient
is computed, so it overlaps the rest of the backward; a whole gradient's (DP) is waited for at
the end of the step, a sharded one's (ZeRO-2/3) when the next bucket is issued, so that only
one unreduced bucket is alive beside the one being filled.
For a reduce-scatter bucket each gradient is viewed as [n, numel/n] and the views concatenated
along dim 1, so rank i's part of the bucket is exactly its rows of every gradient (on gloo the
bucket is all-reduced and rank i keeps row i: see ``reduce_scatter``). ZeRO-3
gathers one block's weights at a time (as ``fully_shard`` on each transformer block does), once
for the forward and again for the backward, so whole weights need not live across the step;
the next block's gather is issued when the current block starts computing (prefetch one block
ahead). ZeRO-1 and 2 gather the same way but once per step, keeping the whole weights for the
backward (their memory differs in what the optimizer and gradients keep, not in the graph);
ZeRO-3 without resharding after the forward (``CommPlan.reshard_after_forward`` False, FSDP's
reshard_after_forward=False) gathers once per micro-batch and keeps the whole weights to the
backward, as ZeRO-1/2 do within a step.
Every inserted node carries ``meta["autopar"]``: the plan decision that put it there.
"""

from __future__ import annotations

import torch
from torch import fx

from passes.token_count import WEIGHTS_LOSS
from vocab.plan_types import LOSS, AxisGroup, CommPlan, DataParallelPlan, GraphSignature

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

# The default bucket sizes are the plan's (`vocab.plan_types.CommPlan`: DDP's bucket_cap_mb and
# first bucket).
BUCKET_BYTES = CommPlan().bucket_bytes
FIRST_BUCKET_BYTES = CommPlan().first_bucket_bytes


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
    signature: GraphSignature,
    shapes: dict[str, tuple[int, ...]],
    plan: DataParallelPlan,
    group: AxisGroup,
    sync: str = "reduce",
    partial: int = 1,
    groups: dict[str, AxisGroup] | None = None,
) -> None:
    """Rewrite ``gm`` in place for data parallelism over ``group`` (the "dp" mesh axis).

    signature: the graph's inputs and outputs (parameters, the loss's seed gradient, which
    output is which gradient and the loss; the loss is averaged over the group as well);
    shapes: each parameter's shape as this graph sees it (TP-local); plan: the ZeRO stage, the
    weights it shards (their dim 0 must divide by the group size) and the bucketing.
    plan.comm.reduce_scatter: ZeRO reduces gradients with reduce-scatter; False reduces them
    with an all-reduce and keeps the rank's rows, the faster way on gloo (its reduce-scatter is
    slower than an all-reduce of the same tensor, 38 vs 31 ms for 17 MB on 4 ranks of the dev
    box, and its issue call copied the input synchronously, up to 100 ms inside a training
    step).
    sync, for gradient accumulation without a reduction per micro-batch (DDP's ``no_sync``):
    "reduce" (default) reduces this graph's gradients and loss; "none" leaves them local (the
    graph of the first micro-batches); "accumulated" adds one input per gradient and one for
    the loss (placeholders with ``meta["accumulates"]`` = the parameter name, or `LOSS`), the
    local sums of the earlier micro-batches, before reducing (the last micro-batch's graph).
    partial: the group's ranks come in sets of ``partial`` that share one slice of the batch
    and hold partial sums of its gradients (context parallelism's dp x cp group: each cp
    rank's sum over its positions, the loss whole on each): the seed is scaled by
    partial / n (the mean over the n / partial slices), the loss averaged over all n ranks.
    groups: parameters whose gradients are reduced (and, under ZeRO, whose rows are sharded)
    over another group than ``group``: expert parallelism's owners' groups, the dp/ep ranks
    that store the same experts, each of which holds the sum over its ep group's tokens (the
    seed's 1/n scaling is the same: the owners' sum is the mean over all n ranks' slices); a
    group of one rank needs no collective.
    """
    if sync not in ("reduce", "none", "accumulated"):
        raise ValueError(f"sync must be 'reduce', 'none' or 'accumulated', got {sync!r}")
    params = signature.placeholder_of("param")
    seed = next(iter(signature.placeholder_of("tangent").values()))
    grads, loss_index = signature.grad_index, signature.loss_index
    zero, n, group_name = plan.zero, group.size, group.name
    if partial < 1 or n % partial:
        raise ValueError(f"partial={partial} must divide the group's {n} ranks")
    slices = n // partial  # slices of the batch the group's gradients average over
    reduce_scatter = plan.comm.reduce_scatter
    groups = dict(groups or {})
    solo = {name for name, g in groups.items() if g.size == 1}  # whole on their only owner

    def group_of(name: str) -> AxisGroup:
        return groups.get(name, group)

    for name in plan.sharded:
        if not shardable(shapes[name], group_of(name).size):
            raise ValueError(f"the plan shards {name} {tuple(shapes[name])} over {group_of(name).size} "
                             f"data-parallel ranks but its dim 0 does not divide by {group_of(name).size}")
    graph = gm.graph
    nodes = {node.name: node for node in graph.nodes}
    before = set(graph.nodes)
    output = next(node for node in graph.nodes if node.op == "output")
    sharded = set(plan.sharded) - solo
    accumulated = _accumulator_inputs(graph, grads, loss_index, output) if sync == "accumulated" else {}

    last_input = [node for node in graph.nodes if node.op == "placeholder"][-1]
    with graph.inserting_after(last_input):
        scaled = _node(graph, aten.mul.Tensor, (nodes[seed], 1.0 / slices),
                       f"DP: seed gradient / {slices}, so that the summed gradients are the mean"
                       + (f" (the {n} ranks hold {slices} slices' partial sums over cp)" if partial > 1 else ""))
    # the backward reads the scaled seed; the reported loss's weight stays (averaged below)
    nodes[seed].replace_all_uses_with(
        scaled, delete_user_cb=lambda user: user is not scaled and not user.meta.get(WEIGHTS_LOSS))
    outs = list(output.args[0])

    # weights: the graph input becomes rank i's rows; gather them before use
    order = sorted(sharded, key=lambda p: list(params).index(p))
    shards = {p: nodes[params[p]] for p in order}
    reshard = zero == 3 and plan.comm.reshard_after_forward
    if reshard:
        _unshare_weight_views(graph, shards.values())
    if zero:
        _gather_per_block(graph, order, shards, group_of, zero, plan.comm)
    for name in order:
        nodes[params[name]].meta["autopar"] = f"ZeRO-{zero}: rank's rows of {name}"

    if sync == "none":  # a micro-batch before the last: gradients and loss stay local
        _name_group(graph, before, partial, n)
        graph.lint()
        gm.recompile()
        return
    # gradients: averaged over the group, scattered by rows where the weight is sharded
    present = {name: outs[index] for name, index in grads.items() if outs[index] is not None}
    for name, acc in accumulated.items():  # add the earlier micro-batches' sums first
        if name == LOSS:
            with graph.inserting_before(output):
                outs[loss_index] = _node(graph, aten.add.Tensor, (outs[loss_index], acc))
            continue
        with graph.inserting_after(present[name]):
            total = _node(graph, aten.add.Tensor, (present[name], acc))
        total.meta["val"] = present[name].meta["val"]
        present[name] = total
    for name in solo & set(present):  # already the sum over the only owner's ep group
        outs[grads[name]] = present.pop(name)
    buckets = _buckets(graph, present, sharded, plan.comm, group_of)
    order = {node: i for i, node in enumerate(graph.nodes)}
    lasts = [max((present[name] for name in b), key=order.__getitem__) for b in buckets]
    for k, bucket in enumerate(buckets):
        # a sharded bucket's whole, unreduced buffer is freed at its wait: wait for it when the
        # next bucket is issued (one in flight, as FSDP does), or ZeRO-2/3 would hold every
        # gradient whole until the end of the step; a whole (DP) gradient is kept anyway
        later = [lasts[j] for j in range(k + 1, len(buckets)) if order[lasts[j]] > order[lasts[k]]]
        wait_at = later[0].next if bucket[0] in sharded and later else output
        g = group_of(bucket[0])
        reduced = _reduce_bucket(graph, bucket, present, sharded, zero, g.size, g.name, wait_at, g.rank,
                                 reduce_scatter)
        for name, value in reduced.items():
            outs[grads[name]] = value
    with graph.inserting_before(output):
        loss = _collective(
            graph, c10d.all_reduce.default, (outs[loss_index], "sum", group_name),
            "DP: the global loss for reporting (mean of the ranks' losses)", outs[loss_index],
        )
        outs[loss_index] = graph.call_function(torch.ops.aten.div.Tensor, (loss, n))
    output.args = (tuple(outs),)
    _name_group(graph, before, partial, n)
    graph.lint()
    gm.recompile()


def _name_group(graph: fx.Graph, before: set, partial: int, n: int) -> None:
    """Under cp (``partial`` > 1) the collectives this pass inserted say their group: the
    dp x cp ranks."""
    if partial == 1:
        return
    for node in graph.nodes:
        if node not in before and "autopar" in node.meta and "c10d" in str(node.target):
            node.meta["autopar"] += f" (over the {n} dp x cp ranks)"


def _accumulator_inputs(graph: fx.Graph, grads: dict[str, int], loss_index: int,
                        output: fx.Node) -> dict[str, fx.Node]:
    """One new graph input per gradient output and one for the loss, after the other inputs."""
    outs = output.args[0]
    at = [node for node in graph.nodes if node.op == "placeholder"][-1]
    made: dict[str, fx.Node] = {}
    for name, index in [*grads.items(), (LOSS, loss_index)]:
        if outs[index] is None:
            continue
        with graph.inserting_after(at):
            at = graph.placeholder(f"accumulated_{len(made)}")
        at.meta["val"] = outs[index].meta.get("val")
        at.meta["accumulates"] = name
        at.meta["autopar"] = f"gradient accumulation: the earlier micro-batches' sum for {name}"
        made[name] = at
    return made


def _buckets(graph: fx.Graph, grads: dict[str, fx.Node], sharded: set[str],
             comm: CommPlan, group_of=None) -> list[list[str]]:
    """Gradients in the order the backward produces them, cut into buckets of one kind
    (all-reduce or reduce-scatter), process group (``group_of(name)``) and dtype of at most comm.first_bucket_bytes for the first
    of a kind, comm.bucket_bytes for the others (a gradient larger than that is a bucket of its
    own)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    names = sorted(grads, key=lambda name: order[grads[name]])
    buckets: list[list[str]] = []
    open_by_kind: dict[tuple, tuple[list[str], int]] = {}
    opened: set[tuple] = set()  # kinds whose first bucket is closed
    for name in names:
        val = grads[name].meta["val"]
        kind = (name in sharded, val.dtype, group_of(name).name if group_of else "")
        size = val.numel() * val.element_size()
        bucket, used = open_by_kind.get(kind, ([], 0))
        cap = comm.bucket_bytes if kind in opened else comm.first_bucket_bytes
        if bucket and used + size > cap:
            bucket, used = [], 0
            opened.add(kind)
        if not bucket:
            buckets.append(bucket)
        bucket.append(name)
        open_by_kind[kind] = (bucket, used + size)
    return buckets


def _gather_per_block(graph: fx.Graph, order: list[str], shards: dict[str, fx.Node], group_of,
                      zero: int, comm: CommPlan) -> None:
    """One gather per block (and process group: ``group_of(name)``), block k+1's issued as
    block k starts computing. ZeRO-3 gathers again for the backward (the whole weights are
    dropped after each use) unless it keeps the forward's (``comm.reshard_after_forward``
    False), as ZeRO-1/2 do."""
    reshard = zero == 3 and comm.reshard_after_forward
    phases = ("forward", "backward") if reshard else ("forward and backward",)
    block_of = {name: (*key, group_of(name)) for name, key in
                gather_groups({name: shards[name].meta["val"] for name in order}, comm.bucket_bytes).items()}
    for phase in phases:
        users_by_block: dict[tuple, dict[str, list[fx.Node]]] = {}
        for name in order:
            users = [u for u in shards[name].users if phase not in ("forward", "backward")
                     or _is_backward(u) == (phase == "backward")]
            if users:
                users_by_block.setdefault(block_of[name], {})[name] = users
        position = {node: i for i, node in enumerate(graph.nodes)}
        firsts = {block: min((u for us in users.values() for u in us), key=position.__getitem__)
                  for block, users in users_by_block.items()}
        blocks = sorted(users_by_block, key=lambda b: position[firsts[b]])
        for k, block in enumerate(blocks):
            users = users_by_block[block]
            # issued while the comm.prefetch_blocks blocks before it compute (prefetch)
            issue_at = firsts[blocks[max(0, k - comm.prefetch_blocks)]]
            g = block[2]
            _gather_bucket(graph, list(users), shards, users, issue_at, firsts[block], g.size, g.name,
                           f"ZeRO-{zero}: gather {block[0]} for the {phase}")


# ops that only re-view (or cast) a weight: the forward's t(W) that the backward reads again
_WEIGHT_VIEWS = {aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
                 aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                 aten.unsqueeze.default, aten.alias.default, aten.detach.default, aten._to_copy.default}


def _unshare_weight_views(graph: fx.Graph, weights) -> None:
    """Give the backward its own views of each weight (ZeRO-3).

    AOTAutograd's backward reads the forward's ``t(W)`` (the linear's transpose) for the input
    gradient: left so, the forward's gathered whole weight would live until the backward, and
    every block's whole weights would be alive at the end of the forward. The view chain is
    copied into the backward, before its first backward reader, so the backward's reads come
    from the backward's own gather of W and the forward's copy dies after the forward.
    """
    # the readers are nodes of the graph as it came (copies read copies): one position map
    position = {node: i for i, node in enumerate(graph.nodes)}
    for weight in weights:
        chain = [u for u in weight.users if u.target in _WEIGHT_VIEWS and not _is_backward(u)]
        while chain:
            view = chain.pop()
            chain.extend(u for u in view.users if u.target in _WEIGHT_VIEWS and not _is_backward(u))
            readers = [u for u in view.users if _is_backward(u)]
            if not readers:
                continue
            first = min(readers, key=position.__getitem__)
            path = [view]  # view <- ... <- weight, the ops to replay
            while path[-1].args[0] is not weight:
                path.append(path[-1].args[0])
            env = {weight: weight}
            with graph.inserting_before(first):
                for node in reversed(path):
                    copy = graph.node_copy(node, lambda a, env=env: env.get(a, a))
                    copy.meta = {**node.meta, "partitioner_tag": "is_backward"}
                    env[node] = copy
            for reader in readers:
                reader.replace_input_with(view, env[view])


def gather_groups(weights: dict[str, torch.Tensor],
                  bucket_bytes: int = BUCKET_BYTES) -> dict[str, tuple[str, torch.dtype]]:
    """The group each weight is gathered with (ZeRO): its block and dtype (a concatenation must
    not promote). Outside the blocks each module is its own group: the embedding is read at the
    start of the forward and the head at its end, so one group would keep both whole (2 GB for
    a 128k vocabulary at 4096 wide, in bf16) through the whole forward. A model without numbered
    blocks is cut into pieces of at most bucket_bytes in parameter order instead: one group
    would gather the whole model at once."""
    if any(_block_of(name) for name in weights):
        return {name: (f"block {_block_of(name)}'s weights" if _block_of(name)
                       else f"{name.rpartition('.')[0] or name} (outside the blocks)", w.dtype)
                for name, w in weights.items()}
    groups, piece, used = {}, 0, 0
    for name, w in weights.items():
        size = w.numel() * w.element_size()
        if used and used + size > bucket_bytes:
            piece, used = piece + 1, 0
        used += size
        groups[name] = (f"bucket {piece} of the weights", w.dtype)
    return groups


def _block_of(name: str) -> str:
    """The repeated block a parameter belongs to ("layers.3" for "layers.3.attn.q_proj.weight"),
    "" for the weights outside any block (embeddings, final norm, head)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ""


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _names(bucket: list[str]) -> str:
    return ", ".join(bucket) if len(bucket) <= 3 else f"{bucket[0]} ... {bucket[-1]} ({len(bucket)} tensors)"


def _gather_bucket(graph: fx.Graph, bucket: list[str], shards: dict[str, fx.Node],
                   consumers: dict[str, list[fx.Node]], issue_at: fx.Node, wait_at: fx.Node, n: int,
                   group_name: str, reason: str) -> None:
    """One all-gather of the bucket's shards, issued before ``issue_at`` and waited before
    ``wait_at``; rank i's part is its rows of each weight. ``consumers`` of each shard read the
    whole weight instead."""
    with graph.inserting_before(issue_at):
        flats = [_node(graph, aten.view.default, (shards[name], [-1])) for name in bucket]
        flat = _node(graph, aten.cat.default, (flats, 0)) if len(flats) > 1 else flats[0]
        issued = _node(graph, c10d.all_gather_into_tensor.default, (flat, n, group_name), reason)
    with graph.inserting_before(wait_at):
        done = _node(graph, c10d.wait_tensor.default, (issued,), reason)
        rows = _node(graph, aten.view.default, (done, [n, -1]))
        offset = 0
        for name in bucket:
            val = shards[name].meta["val"]  # the whole weight: the graph was captured with it
            numel = val.numel() // n
            piece = _node(graph, aten.slice.Tensor, (rows, 1, offset, offset + numel))
            full = _node(graph, aten.reshape.default, (piece, list(val.shape)))
            offset += numel
            for user in consumers[name]:
                user.replace_input_with(shards[name], full)


def _reduce_bucket(graph: fx.Graph, bucket: list[str], grads: dict[str, fx.Node], sharded: set[str],
                   zero: int, n: int, group_name: str, wait_at: fx.Node, rank: int,
                   reduce_scatter: bool) -> dict[str, fx.Node]:
    """One collective for the bucket, issued after its last gradient, waited before ``wait_at``."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    last = max((grads[name] for name in bucket), key=order.__getitem__)
    scatter = bucket[0] in sharded
    vals = {name: grads[name].meta["val"] for name in bucket}
    numels = [vals[name].numel() // (n if scatter else 1) for name in bucket]
    what = _names(bucket)
    with graph.inserting_before(last.next):  # in order, right after the last gradient
        if scatter:  # [n, numel/n] per gradient, side by side: rank i's slice is its rows of each
            flats = [_node(graph, aten.view.default, (grads[name], [n, -1])) for name in bucket]
            flat = _node(graph, aten.cat.default, (flats, 1))
            flat = _node(graph, aten.view.default, (flat, [-1]))
            if reduce_scatter:
                issued = _node(graph, c10d.reduce_scatter_tensor.default, (flat, "sum", n, group_name),
                               f"ZeRO-{zero}: reduce-scatter the gradients of {what} (one bucket)")
            else:
                issued = _node(graph, c10d.all_reduce_.default, (flat, "sum", group_name),
                               f"ZeRO-{zero}: reduce the gradients of {what} (one bucket; all-reduce, "
                               "then keep this rank's rows: faster than reduce-scatter on gloo)")
        else:
            flats = [_node(graph, aten.view.default, (grads[name], [-1])) for name in bucket]
            # the concatenation is a fresh buffer: reduce it in place (no copy); a lone gradient
            # may be a view of a tensor the graph still reads: reduce a copy
            inplace = len(flats) > 1
            flat = _node(graph, aten.cat.default, (flats, 0)) if inplace else flats[0]
            op = c10d.all_reduce_.default if inplace else c10d.all_reduce.default
            issued = _node(graph, op, (flat, "sum", group_name),
                           f"DP: all-reduce the gradients of {what} (one bucket)")
    with graph.inserting_before(wait_at):  # as late as allowed: the backward overlaps it
        done = _node(graph, c10d.wait_tensor.default, (issued,), issued.meta["autopar"])
        if scatter and not reduce_scatter:  # the whole bucket, [n, rows of each]: keep ours
            # (a copy, so that the whole bucket is freed: ZeRO-2/3 keep 1/n of the gradients)
            rows = _node(graph, aten.select.int, (_node(graph, aten.view.default, (done, [n, -1])), 0, rank))
            done = _node(graph, aten.clone.default, (rows,))
        out, offset = {}, 0
        for name, numel in zip(bucket, numels):
            piece = _node(graph, aten.slice.Tensor, (done, 0, offset, offset + numel))
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
