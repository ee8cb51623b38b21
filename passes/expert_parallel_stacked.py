"""Expert parallelism for experts stored stacked (transformers' MoE blocks): each rank stores
and runs E/n experts, the tokens dispatched by all-gather and combined by reduce-scatter.

transformers' Mixtral, Qwen2-MoE and DeepSeek-style blocks keep an expert's weights as row e
of one parameter (``experts.gate_up_proj`` [E, 2f, h], ``experts.down_proj`` [E, h, f]) and run
them as grouped matmuls (`passes.grouped_matmul`) on the routed rows sorted by expert:

    X [T, h] (T = tokens x top-k, rows of expert e at offs[e-1]:offs[e]),  offs [E]
    Y = g(X, W, offs)         g: grouped matmuls and row-wise ops between them
    dX, dW = g's backward(dY)

Every op of g reads a row and its expert's weights only, so g computes on any set of rows
sorted by expert, given their offsets. With the ep ranks the n consecutive data-parallel ranks
of one group (`passes.expert_parallel`), rank r owning experts [r m, (r+1) m), m = E/n, and
storing only their rows of every stacked weight:

    X_all = all_gather(X)                                   [n T, h]: every group rank's rows
    e_all = all_gather(expert of each row)                  (from offs: e = #{offs <= row})
    k = e_all - r m where r m <= e_all < (r+1) m, else m    (m: another rank's expert)
    order = stable argsort(k);  X_r = X_all[order];  offs_r = #{k <= j}, j < m
    Y_r = g(X_r, W_r, offs_r), zero beyond offs_r[-1]       (rows of other ranks' experts)
    Y = reduce_scatter(unsort(Y_r))                          [T, h]

Each row of X_all is computed by exactly one rank (its expert's owner) and is zero on the
others, so the reduce-scatter's sum returns each rank its own rows' results exactly. The
backward is the same with dY: dY_r = all_gather(dY)[order], dX = reduce_scatter(unsort(dX_r)),
and dW_r [m, ...] is the local experts' gradient over the group's tokens; the owners' group
(`runtime.mesh.expert_mesh`'s "dp" axis) sums it as for grouped expert lists.

This is Megatron-Core's "allgather" token dispatcher: a rank receives the group's n T rows (an
all-to-all would send each row only to its expert's rank, but with data-dependent counts, a
host synchronisation and shapes no graph holds), and the grouped matmuls compute only the rows
of the rank's experts. Every added collective carries ``meta["autopar"]``: the decision behind
it.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass, field

import torch
from torch import fx
from torch._guards import detect_fake_mode

from passes.fake_nodes import call_node, fake_value
from passes.grouped_matmul import (
    is_grouped,
    is_grouped_forward,
    is_grouped_weight_grad,
)
from vocab.plan_types import AxisGroup

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

# ops that only re-view a weight between its parameter and the grouped matmul that reads it
_WEIGHT_VIEWS = (aten.transpose.int, aten.permute.default, aten.view.default, aten._unsafe_view.default,
                 aten.alias.default, aten.detach.default, aten.t.default)


class StackedExpertError(ValueError):
    """The stacked experts cannot be placed over the ep ranks: the message names why and the fix."""


@dataclass
class StackedRewrite:
    """What the pass did on this rank: per stacked parameter (placeholder name), its E experts;
    the rank stores rows [r E/n, (r+1) E/n) of each."""

    experts: dict[str, int]


@dataclass
class _Layer:
    """One MoE layer's grouped computation: its offsets, regions and boundary values."""

    offs: fx.Node
    fwd: list[fx.Node]
    bwd: list[fx.Node]
    weights: dict[fx.Node, list[fx.Node]]  # stacked parameter -> its views read by the matmuls
    x: fx.Node
    y: fx.Node
    dy: fx.Node
    dx: fx.Node
    dws: list[fx.Node]


def has_stacked_experts(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` runs experts as grouped matmuls over a stacked parameter."""
    return any(is_grouped_forward(n) for n in gm.graph.nodes)


@dataclass
class StackedExperts:
    """What the rewrite will do to a captured graph, for the cost model: per MoE layer its
    forward result's node and the bytes of its routed rows in and out (X and Y, one rank's
    step: what the dispatch gathers and the combine reduce-scatters, again for the gradients
    in the backward); the nodes computing on the ep group's rows (``rows``: the routed input
    and every node of the layers, ep times their rows under ep), the forward values among them
    (``saved``) and the grouped matmuls (``grouped``: they compute only the rank's experts'
    rows); the routed rows T of one layer (tokens x top-k); and the stacked parameters
    (placeholder name -> E)."""

    io: list[tuple[str, int]] = field(default_factory=list)
    rows: set[str] = field(default_factory=set)
    saved: set[str] = field(default_factory=set)
    grouped: set[str] = field(default_factory=set)
    routed: int = 0
    params: dict[str, int] = field(default_factory=dict)


def stacked_experts(gm: fx.GraphModule) -> StackedExperts:
    """`StackedExperts` of ``gm`` (empty without grouped experts); `StackedExpertError` where
    a layer is not in the form the rewrite runs."""
    found = StackedExperts()
    for layer in _layers(gm, "expert parallelism"):
        x, y = layer.x.meta["val"], layer.y.meta["val"]
        found.io.append((layer.y.name, x.numel() * x.element_size() + y.numel() * y.element_size()))
        found.saved |= {layer.x.name, *(n.name for n in layer.fwd)}
        found.rows |= found.saved | {n.name for n in layer.bwd}
        found.grouped |= {n.name for n in layer.fwd + layer.bwd if is_grouped(n)}
        found.routed = max(found.routed, int(x.shape[0]))
        found.params.update({w.name: int(w.meta["val"].shape[0]) for w in layer.weights})
    return found


def _weight_source(node: fx.Node) -> tuple[fx.Node | None, list[fx.Node]]:
    """The placeholder a grouped matmul's weight argument views, and the views on the way."""
    views = []
    while node.op == "call_function" and node.target in _WEIGHT_VIEWS:
        views.append(node)
        node = node.args[0]
    return (node, views) if node.op == "placeholder" else (None, views)


def _offsets(node: fx.Node) -> fx.Node:
    offs = node.args[2] if len(node.args) > 2 else node.kwargs.get("offs")
    if not isinstance(offs, fx.Node):
        raise StackedExpertError(f"{node.name}: a grouped matmul without offsets")
    return offs


def _between(ops: list[fx.Node]) -> set[fx.Node]:
    """``ops`` and every node on a path from one of them to another (the row-wise ops)."""
    down = _reach(ops, lambda n: n.users)
    up = _reach(ops, lambda n: n.all_input_nodes)
    return set(ops) | (down & up)


def _reach(start: list[fx.Node], step) -> set[fx.Node]:
    """Every node reached from ``start`` by repeated ``step`` (users, or inputs)."""
    seen: set[fx.Node] = set()
    todo = list(start)
    while todo:
        for nxt in step(todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _layers(gm: fx.GraphModule, where: str) -> list[_Layer]:
    by_offs: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_grouped(n):
            by_offs.setdefault(_offsets(n), []).append(n)
    return [_layer(offs, ops, where) for offs, ops in by_offs.items()]


def _weight_arg(node: fx.Node) -> fx.Node | None:
    """The stacked weight a grouped matmul reads (None: aten's weight gradient X^T dY)."""
    return None if is_grouped_weight_grad(node) else node.args[1]


def _entry_views(region: set[fx.Node], skip: set[fx.Node]) -> tuple[set[fx.Node], set[fx.Node]]:
    """What ``region`` reads from outside it (but ``skip``), through views read only by the
    region (aten's backward reads dY^T): (the values read, the views on the way)."""
    roots, views = set(), set()
    for a in {a for n in region for a in n.all_input_nodes} - region - skip:
        while (a.op == "call_function" and a.target in _WEIGHT_VIEWS and a not in skip
               and all(u in region or u in views for u in a.users)):
            views.add(a)
            a = a.args[0]
        roots.add(a)
    return roots - region - views, views


def _layer(offs: fx.Node, ops: list[fx.Node], where: str) -> _Layer:
    """One layer's regions and boundary values, checked to be the form the rewrite keeps exact."""
    def refuse(why: str) -> StackedExpertError:
        return StackedExpertError(f"{where}: the grouped experts reading {offs.name} {why}, so their "
                                  "tokens cannot be dispatched over the ep ranks: use ep=1 for this model")

    fwd_ops = [n for n in ops if is_grouped_forward(n) and n.meta.get("partitioner_tag") != "is_backward"]
    bwd_ops = [n for n in ops if n not in fwd_ops]
    if not fwd_ops or not bwd_ops:
        raise refuse("have no forward or no backward")
    weights: dict[fx.Node, list[fx.Node]] = {}
    for n in ops:
        if _weight_arg(n) is None:
            continue
        param, views = _weight_source(_weight_arg(n))
        if param is None:
            raise refuse("read a weight that is no stacked parameter")
        weights.setdefault(param, []).extend(views)
    known = {v for vs in weights.values() for v in vs} | set(weights) | {offs}
    fwd = _between(fwd_ops)
    xs, views = _entry_views(fwd, known)
    fwd |= views
    if len(xs) != 1:
        raise refuse(f"read {len(xs)} row inputs in the forward, not one")
    (x,) = xs
    bwd = _between(bwd_ops) | {u for n in bwd_ops for u in n.users if u.target is operator.getitem}
    dys, views = _entry_views(bwd, known | fwd | {x})
    bwd |= views
    dys -= fwd | {x}
    if len(dys) != 1:
        raise refuse(f"read {len(dys)} gradients in the backward, not one")
    (dy,) = dys
    ys = [n for n in fwd if any(u not in fwd and u not in bwd for u in n.users)]
    if len(ys) != 1:
        raise refuse(f"leave {len(ys)} forward results, not one")
    leaving = [n for n in bwd if any(u not in bwd for u in n.users)]
    rows = x.meta["val"].shape[0]
    dws = [n for n in leaving if n.meta["val"].dim() == 3]
    dxs = [n for n in leaving if n not in dws and n.meta["val"].shape[0] == rows]
    if len(dxs) != 1 or len(dws) + 1 != len(leaving) or len(dws) != len(weights):
        raise refuse("leave other backward results than the input's and the weights' gradients")
    order = {n: i for i, n in enumerate(offs.graph.nodes)}
    return _Layer(offs, sorted(fwd, key=order.__getitem__), sorted(bwd, key=order.__getitem__), weights,
                  x, ys[0], dy, dxs[0], dws)


def _collective(graph: fx.Graph, op, args: tuple, meta: dict, reason: str, compute: bool = True) -> fx.Node:
    issued = call_node(graph, op, args, meta, reason, compute=compute)
    return call_node(graph, c10d.wait_tensor.default, (issued,), meta, reason, compute=compute)


def apply_stacked_expert_parallel(gm: fx.GraphModule, group: AxisGroup) -> StackedRewrite:
    """Rewrite ``gm`` in place so this rank runs its E/n experts of every stacked MoE layer on
    the tokens of the ``group``'s ranks (the module docstring's rules); its stacked expert
    parameters become their rows [r m, (r+1) m) (placeholders and gradient outputs alike).
    `StackedExpertError` where an E does not split over the group, or the grouped computation
    is not in the form the rewrite keeps exact."""
    layers = _layers(gm, "expert parallelism")
    if not layers:
        raise StackedExpertError("expert parallelism: the graph has no grouped experts")
    experts = {}
    for layer in layers:
        for param in layer.weights:
            E = int(param.meta["val"].shape[0])
            if E % group.size:
                raise StackedExpertError(f"{param.name} holds {E} experts, which do not split over "
                                         f"ep={group.size} ranks: use an ep that divides {E}")
            experts[param.name] = E
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    with detect_fake_mode(vals) or contextlib.nullcontext():  # new values (arange) fake too
        _rewrite_all(gm, layers, experts, group)
    gm.graph.lint()
    gm.recompile()
    return StackedRewrite(experts)


def _rewrite_all(gm: fx.GraphModule, layers: list[_Layer], experts: dict[str, int], group: AxisGroup) -> None:
    """Every layer rewritten, then every value downstream of a changed one recomputed."""
    changed = set()
    for node in gm.graph.nodes:  # each stacked parameter's placeholder holds its m local rows
        if node.op == "placeholder" and node.name in experts:
            val = node.meta["val"]
            node.meta["val"] = val.new_empty((val.shape[0] // group.size, *val.shape[1:]))
            changed.add(node)
    for layer in layers:
        changed |= _rewrite(gm.graph, layer, experts[next(iter(layer.weights)).name], group)
    _repropagate(gm.graph, changed)


def _rewrite(graph: fx.Graph, layer: _Layer, E: int, group: AxisGroup) -> set[fx.Node]:
    """One layer's dispatch and combine (the module docstring); returns the nodes whose values
    changed shape or are new (for `_repropagate`)."""
    n, r = group.size, group.rank
    m = E // n
    first = layer.fwd[0]
    meta = {k: first.meta[k] for k in ("module", "seq_nr") if k in first.meta}
    fwd_meta = {**meta, "partitioner_tag": "is_forward"}
    bwd_meta = {**meta, "partitioner_tag": "is_backward"}
    words = f"EP over {n} ranks: experts {r * m}..{r * m + m - 1} of {meta.get('module', 'a MoE layer')} here"
    x, offs = layer.x, layer.offs
    T, device = x.meta["val"].shape[0], x.meta["val"].device

    with graph.inserting_before(first):
        rows = call_node(graph, aten.arange.default, (T,), fwd_meta, kwargs={"device": device})
        ids = call_node(graph, aten.bucketize.Tensor, (rows, offs), fwd_meta, kwargs={"right": True})
        x_all = _collective(graph, c10d.all_gather_into_tensor.default, (x, n, group.name), fwd_meta,
                            f"{words}: gather the group's routed tokens")
        ids_all = _collective(graph, c10d.all_gather_into_tensor.default, (ids, n, group.name), fwd_meta,
                              f"{words}: gather the group's tokens' experts")
        local = call_node(graph, aten.sub.Tensor, (ids_all, r * m), fwd_meta)
        mine = call_node(graph, aten.logical_and.default,
                     (call_node(graph, aten.ge.Scalar, (local, 0), fwd_meta),
                      call_node(graph, aten.lt.Scalar, (local, m), fwd_meta)), fwd_meta)
        other = call_node(graph, aten.full_like.default, (local, m), fwd_meta)
        key = call_node(graph, aten.where.self, (mine, local, other), fwd_meta)
        ordered = call_node(graph, aten.sort.stable, (key,), fwd_meta, kwargs={"stable": True})
        key_sorted = call_node(graph, operator.getitem, (ordered, 0), fwd_meta)
        order = call_node(graph, operator.getitem, (ordered, 1), fwd_meta)
        x_here = call_node(graph, aten.index.Tensor, (x_all, [order]), fwd_meta)
        experts = call_node(graph, aten.arange.default, (m,), fwd_meta, kwargs={"device": device})
        offs_here = call_node(graph, aten.searchsorted.Tensor, (key_sorted, experts), fwd_meta,
                          kwargs={"out_int32": offs.meta["val"].dtype == torch.int32, "right": True})
        all_rows = call_node(graph, aten.arange.default, (n * T,), fwd_meta, kwargs={"device": device})
        last = call_node(graph, aten.select.int, (offs_here, 0, m - 1), fwd_meta)
        valid = call_node(graph, aten.unsqueeze.default, (call_node(graph, aten.lt.Tensor, (all_rows, last), fwd_meta), 1),
                      fwd_meta)
    with graph.inserting_before(layer.bwd[0]):
        dy_all = _collective(graph, c10d.all_gather_into_tensor.default, (layer.dy, n, group.name), bwd_meta,
                             f"{words}: gather the group's results' gradients")
        dy_here = call_node(graph, aten.index.Tensor, (dy_all, [order]), bwd_meta)
    region = set(layer.fwd) | set(layer.bwd)
    for node in region:
        node.replace_input_with(x, x_here)
        node.replace_input_with(offs, offs_here)
        node.replace_input_with(layer.dy, dy_here)

    def combine(value: fx.Node, node_meta: dict, what: str) -> list[fx.Node]:
        """Rows of other ranks' experts zeroed, unsorted, summed back to their ranks."""
        with graph.inserting_before(value.next):
            zero = call_node(graph, aten.zeros_like.default, (value,), node_meta, compute=False)
            kept = call_node(graph, aten.where.self, (valid, value, zero), node_meta, compute=False)
            unsorted = call_node(graph, aten.index_put.default, (zero, [order], kept), node_meta, compute=False)
            back = _collective(graph, c10d.reduce_scatter_tensor.default, (unsorted, "sum", n, group.name),
                               node_meta, f"{words}: {what}", compute=False)
        for user in list(value.users):
            if user not in region and user not in (zero, kept):
                user.replace_input_with(value, back)
        return [zero, kept, unsorted, back.args[0], back]

    added = combine(layer.y, fwd_meta, "return the results to their tokens' ranks")
    added += combine(layer.dx, bwd_meta, "return the inputs' gradients to their tokens' ranks")
    return {x_here, offs_here, dy_here, *added}


def _repropagate(graph: fx.Graph, changed: set[fx.Node]) -> None:
    """Recompute, in graph order, the fake value of every node reading a changed one (a new
    node, or one whose value changed shape); a node whose value keeps its shape stops it. A
    view to an explicit size (a DTensor trace views values whole) keeps its trailing dims and
    takes dim 0 from its input's rows."""
    for node in graph.nodes:
        if node.op != "call_function" or not any(a in changed for a in node.all_input_nodes):
            continue
        old = node.meta.get("val")
        if node.target in _SIZED_VIEWS:
            _local_size(node)
        fake_value(node)
        if node in changed or _shape(old) != _shape(node.meta["val"]):
            changed.add(node)


# views to an explicit size (args: the value, the size)
_SIZED_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _local_size(node: fx.Node) -> None:
    """``node``'s explicit size, dim 0 inferred from its input where the input's rows changed
    (the E/n local experts of a stacked value, or the group's n T routed rows)."""
    val, size = node.args[0].meta["val"], list(node.args[1])
    rest = 1
    for d in size[1:]:
        rest *= d
    if size and size[0] != -1 and rest and size[0] * rest != val.numel() and val.numel() % rest == 0:
        node.args = (node.args[0], [val.numel() // rest, *size[1:]], *node.args[2:])


def _shape(val):
    if isinstance(val, (tuple, list)):
        return tuple(_shape(v) for v in val)
    return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else val
