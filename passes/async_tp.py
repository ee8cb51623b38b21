"""Async TP: the forward's sequence-parallel all-gathers cut into chunks, each chunk's matmuls
running while the next chunk is on the wire.

Under SP a column-parallel matmul reads the whole sequence, gathered over the tp ranks, and
nothing can run while it is gathered:

    G = gather_d(x)                 x [.., s, ..] this rank's s = S / tp positions (dim d)
    Y_i = view(G, [N, h]) @ W_i     every forward matmul reading G (q, k, v; gate, up)

Cut x into k chunks along d, x = [x_0 .. x_{k-1}], and gather each on its own, all k issued
at once (in order, on every rank alike):

    G_c = gather_d(x_c)             [.., tp s/k, ..]: chunk c of every rank, in rank order
    Y_i,c = view(G_c, [N/k, h]) @ W_i

Y_i,c is computed once G_c has arrived, while G_c+1 .. G_k-1 are still in flight: only the
first chunk's gather waits with nothing to do (the cost model hides the SP gather behind its
matmuls). Position j s + c s/k + t of the whole sequence is position j s/k + t of G_c, so G
and every Y_i are put back in one gather's order by stacking the chunks on a new dim before d
and swapping it with the ranks' dim:

    [.., k, tp, s/k, ..] -> [.., tp, k, s/k, ..] -> [.., S, ..]

The same rows are multiplied by the same weights, each output row a whole dot product as
before; G itself (read again by the backward's weight-gradient matmuls) is rebuilt from the
chunks without communication. A gather is left whole where its shape or users are not in
this form (still correct, unchunked); the plan's `CommPlan.sp_gather_chunks` says k.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from passes.fake_nodes import call_node
from passes.overlap import is_barrier
from passes.recompute import is_backward

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
SP_GATHER = "TP+SP: all-gather the sequence"  # the TP pass's reason on its SP gathers


@dataclass
class AsyncTpReport:
    """What `chunk_sequence_gathers` did: per SP gather it cut (its name), the chunks and the
    matmuls fed chunk by chunk; the gathers left whole, with why."""

    chunked: dict[str, tuple[int, int]] = field(default_factory=dict)
    left: dict[str, str] = field(default_factory=dict)


@dataclass
class _Gather:
    issue: fx.Node  # all_gather_into_tensor(x, tp, group)
    wait: fx.Node
    whole: fx.Node  # G: the wait itself (d = 0), or cat(split(wait), d)
    views: list[fx.Node]  # G's parts to drop with it (split, getitems, cat)
    dim: int
    matmuls: list[tuple[fx.Node, fx.Node]]  # (view of G as [N, h], the mm / addmm reading it)
    first: fx.Node  # the first of those matmuls: the chunks' matmuls run in its place
    late: list[fx.Node]  # the other matmuls' operands made after it (moved before it)


def chunk_sequence_gathers(gm: fx.GraphModule, chunks: int) -> AsyncTpReport:
    """Cut every forward SP all-gather of ``gm`` that feeds matmuls into ``chunks`` gathers
    (fewer where the local sequence does not divide), in place (the module docstring)."""
    report = AsyncTpReport()
    if chunks < 2:
        return report
    for issue in [n for n in gm.graph.nodes if _is_sp_gather(n)]:
        found = _match(issue)
        if isinstance(found, str):
            report.left[issue.name] = found
            continue
        local = int(issue.args[0].meta["val"].shape[found.dim])
        k = _divisor(local, chunks)
        if k < 2:
            report.left[issue.name] = f"its {local} local positions do not split"
            continue
        _rewrite(gm.graph, found, k)
        report.chunked[issue.name] = (k, len(found.matmuls))
    gm.graph.lint()
    gm.recompile()
    return report


def _is_sp_gather(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is c10d.all_gather_into_tensor.default
            and str(node.meta.get("autopar", "")).startswith(SP_GATHER) and not is_backward(node))


def _match(issue: fx.Node) -> _Gather | str:
    """The gather's form, or why it is left whole."""
    waits = list(issue.users)
    if len(waits) != 1 or waits[0].target is not c10d.wait_tensor.default:
        return "its result is read before its wait"
    wait, x = waits[0], issue.args[0]
    whole, views, dim = wait, [], 0
    users = list(wait.users)
    if len(users) == 1 and users[0].target in (aten.split.Tensor, aten.chunk.default):
        split = users[0]
        items = list(split.users)
        cats = {u for i in items for u in i.users}
        if not all(i.target is operator.getitem for i in items) or len(cats) != 1:
            return "its pieces are read apart"
        cat = cats.pop()
        if cat.target is not aten.cat.default or len(cat.args) < 2 or len(cat.args[0]) != issue.args[1]:
            return "its pieces are not joined by one cat"
        dim = cat.args[1] % x.meta["val"].dim()
        whole, views = cat, [split, *items, cat]
    if dim == x.meta["val"].dim() - 1:
        return "it gathers the features, not the sequence"
    matmuls = []
    val = whole.meta["val"]
    rows = [val.numel() // val.shape[-1], val.shape[-1]]
    for view in whole.users:
        if (view.target not in (aten.view.default, aten._unsafe_view.default) or is_backward(view)
                or list(view.meta["val"].shape) != rows):
            continue
        for mm in view.users:
            position = {aten.mm.default: 0, aten.addmm.default: 1}.get(mm.target)
            if position is not None and mm.args[position] is view and not is_backward(mm):
                matmuls.append((view, mm))
    if not matmuls:
        return "no forward matmul reads it"
    order = {n: i for i, n in enumerate(issue.graph.nodes)}
    first = min((mm for _, mm in matmuls), key=order.__getitem__)
    fed = {v for v, _ in matmuls}
    early = [u for u in whole.users if order[u] < order[first] and u not in fed]
    if early:
        return f"{early[0]} reads it before its first matmul"
    late = _late_inputs([a for _, mm in matmuls for a in mm.args if a not in fed], first, order)
    unsafe = [n for n in late if is_barrier(n)]  # it may not run earlier
    if unsafe:
        return f"a matmul's operand {unsafe[0]} is made after the first matmul and cannot move"
    return _Gather(issue, wait, whole, views, dim, matmuls, first, late)


def _late_inputs(needed: list, first: fx.Node, order: dict[fx.Node, int]) -> list[fx.Node]:
    """The nodes among ``needed`` and their producers that come after ``first``, in order."""
    late: set[fx.Node] = set()
    stack = [a for a in needed if isinstance(a, fx.Node)]
    while stack:
        a = stack.pop()
        if order[a] > order[first] and a not in late:
            late.add(a)
            stack.extend(a.all_input_nodes)
    return sorted(late, key=order.__getitem__)


def _divisor(n: int, most: int) -> int:
    return next(k for k in range(min(most, n), 0, -1) if n % k == 0)


def _rewrite(graph: fx.Graph, g: _Gather, k: int) -> None:
    x, tp, group = g.issue.args
    xval = x.meta["val"]
    step = xval.shape[g.dim] // k
    meta = {key: v for key, v in g.issue.meta.items() if key not in ("val", "autopar")}
    reason = f"TP+SP, async TP: sequence chunk {{}} of {k} of {x}, its matmuls running while the next is gathered"

    def node(op, args, why=None):
        return call_node(graph, op, args, meta, why)

    with graph.inserting_before(g.issue):  # every chunk issued where the whole gather was
        issues = []
        for c in range(k):
            part = node(aten.slice.Tensor, (x, g.dim, c * step, (c + 1) * step))
            part = node(aten.clone.default, (part,)) if g.dim else part
            issues.append(node(c10d.all_gather_into_tensor.default, (part, tp, group), reason.format(c)))
    for n in g.late:  # the later matmuls' weights, made before the first matmul
        g.first.prepend(n)
    pieces, outputs = [], {mm: [] for _, mm in g.matmuls}
    with graph.inserting_before(g.first):  # chunk c's matmuls right after its wait
        for c, issued in enumerate(issues):
            gathered = node(c10d.wait_tensor.default, (issued,), reason.format(c))
            if g.dim:
                split = node(aten.split.Tensor, (gathered, xval.shape[0]))
                gathered = node(aten.cat.default, ([node(operator.getitem, (split, j)) for j in range(tp)], g.dim))
            pieces.append(gathered)
            shape = list(gathered.meta["val"].shape)
            flat = node(aten.view.default, (gathered, [gathered.meta["val"].numel() // shape[-1], shape[-1]]))
            for view, mm in g.matmuls:
                out = node(mm.target, tuple(flat if a is view else a for a in mm.args))
                outputs[mm].append(node(aten.view.default, (out, [*shape[:-1], out.meta["val"].shape[-1]])))
        for _, mm in g.matmuls:
            joined = _join(node, outputs[mm], g.dim, k, tp)
            mm.replace_all_uses_with(node(aten.view.default, (joined, list(mm.meta["val"].shape))))
        mms = {mm for _, mm in g.matmuls}
        views = list(dict.fromkeys(v for v, _ in g.matmuls))
        others = {v: [u for u in v.users if u not in mms] for v in views}
        if any(others.values()) or len(g.whole.users) > len(views):
            # the backward reads G again (its weight gradients): rebuilt from the chunks,
            # without communication, and the views it read remade on the rebuilt G
            rebuilt = _join(node, pieces, g.dim, k, tp)
            for view in views:
                if others[view]:
                    remade = node(view.target, (rebuilt, *view.args[1:]))
                    for user in others[view]:
                        user.replace_input_with(view, remade)
            for user in [u for u in g.whole.users if u not in views]:
                user.replace_input_with(g.whole, rebuilt)
    for mm in mms:
        graph.erase_node(mm)
    for view in views:
        graph.erase_node(view)
    for n in [*reversed(g.views), g.wait, g.issue]:
        graph.erase_node(n)


def _join(node, parts: list[fx.Node], dim: int, k: int, tp: int) -> fx.Node:
    """The chunks [.., tp s/k, ..] (chunk c of every rank) as one gather's [.., S, ..]."""
    shape = list(parts[0].meta["val"].shape)
    stacked = node(aten.stack.default, (parts, dim))
    split = node(aten.view.default, (stacked, [*shape[:dim], k, tp, shape[dim] // tp, *shape[dim + 1:]]))
    order = list(range(len(shape) + 2))
    order[dim], order[dim + 1] = dim + 1, dim
    swapped = node(aten.permute.default, (split, order))
    return node(aten.reshape.default, (swapped, [*shape[:dim], shape[dim] * k, *shape[dim + 1:]]))
