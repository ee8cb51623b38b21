"""Expert parallelism as a rewrite of the per-rank joint graph: each rank runs E/n experts.

The capture (`autopar.capture.experts`) writes a list of E alike experts as one grouped
computation on stacked values, the experts along dim 0, its nodes tagged in ``meta``
(``expert_group``: the list and E; ``expert_role``: "fwd" / "bwd" for the template's own ops,
"w<k>" for the stacked parameter k; ``expert_result``: "y", "dx", "dw<k>" on its results):

    Y = f(X, W)  (X [E, ...] the experts' inputs, W_k = stack_e W_e,k, Y [E, ...]; f is the
    expert vmapped over dim 0: row e of Y reads row e of X and of every W_k only)
    dX, dW = f's backward(dY)

The ep ranks are n consecutive data-parallel ranks; rank r of the group owns the m = E/n
experts [r m, (r+1) m). With equal chunks of m rows, ``all_to_all`` sends chunk j of dim 0 to
rank j and stacks what rank r receives by source rank, so the rewrite keeps f's shapes (the
grouped graph itself is not touched; its batch rows are (source rank i, local expert e)):

    X_r = all_to_all(X)            X_r[i m + e] = X on rank i, row r m + e
    W_r,k[i m + e] = W_{r m + e, k}                   (the local experts' weights, n times)
    Y = all_to_all(f(X_r, W_r))    Y[j m + e] on rank i = expert j m + e on rank i's rows
    dX = all_to_all(dX_r),  dX_r, dW_r = f's backward(all_to_all(dY))
    dW_{r m + e, k} = sum_i dW_r,k[i m + e];  0 for the experts of the other ranks

Each expert row sees exactly the tokens it saw without expert parallelism (one rank's at a
time), so any row-wise expert computes as before. Parameters stay whole on every rank (their
storage is replicated; ZeRO shards them as any parameter): an expert's gradient is the sum
over its owners in every ep group of the tokens they received, zero on the other ranks, and
the data-parallel reduction (a sum over all dp ranks, the seed scaled by 1/dp) yields each
expert's gradient of the global batch on every rank, as one device computes it.

Every added collective carries ``meta["autopar"]``: the decision behind it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from vocab.plan_types import AxisGroup

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

GROUP = "expert_group"
ROLE = "expert_role"
RESULT = "expert_result"


class ExpertParallelError(ValueError):
    """The graph's experts cannot be placed over the ep ranks: the message names why and the fix."""


@dataclass
class _Instance:
    """One list's grouped computation in the graph."""

    path: str
    experts: int
    fwd: list[fx.Node]
    bwd: list[fx.Node]
    weights: dict[int, fx.Node]  # k -> stack of the experts' parameter k
    results: dict[str, fx.Node]  # "y", "dx", "dw<k>" -> node


def expert_groups(grid: Sequence[Sequence[int]], ep: int, rank: int) -> tuple[object, AxisGroup]:
    """Create the ep process groups: each row of ``grid`` (one data-parallel group's global
    ranks, in dp order) cut into consecutive runs of ``ep`` ranks. Every rank creates every
    group, in the same order (``torch.distributed.new_group``'s rule); returns (this rank's
    group, its `AxisGroup`)."""
    import torch.distributed as dist

    mine = None
    for row in grid:
        for start in range(0, len(row), ep):
            ranks = [int(r) for r in row[start:start + ep]]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine = (group, AxisGroup(group.group_name, ep, ranks.index(rank)))
    if mine is None:
        raise ExpertParallelError(f"rank {rank} is in no ep group of {[list(r) for r in grid]}")
    return mine


def _instances(gm: fx.GraphModule) -> list[_Instance]:
    found: dict[str, _Instance] = {}
    for n in gm.graph.nodes:
        tag = n.meta.get(GROUP)
        if tag is None:
            continue
        inst = found.setdefault(tag[0], _Instance(tag[0], tag[1], [], [], {}, {}))
        role = n.meta.get(ROLE)
        if role == "fwd":
            inst.fwd.append(n)
        elif role == "bwd":
            inst.bwd.append(n)
        elif isinstance(role, str) and role.startswith("w"):
            inst.weights[int(role[1:])] = n
        for what in n.meta.get(RESULT, ()):
            inst.results[what] = n
    return list(found.values())


def _external(body: list[fx.Node], inside: set[fx.Node]) -> set[fx.Node]:
    return {a for n in body for a in n.all_input_nodes if a not in inside}


def _node(graph: fx.Graph, op, args: tuple, meta: dict, reason: str | None = None,
          kwargs: dict | None = None, val=None) -> fx.Node:
    """A call node with ``meta``, its fake value computed on its arguments' (or ``val``)."""
    node = graph.call_function(op, args, kwargs or {})
    node.meta.update(meta)
    if reason:
        node.meta["autopar"] = reason
    if val is None:
        vals = fx.node.map_arg(args, lambda a: a.meta["val"])
        val = op(*vals, **(kwargs or {}))
    node.meta["val"] = val
    return node


def _all_to_all(graph: fx.Graph, value: fx.Node, group: AxisGroup, meta: dict, reason: str) -> fx.Node:
    """``all_to_all_single`` of ``value`` in equal chunks of dim 0 over ``group``, waited for."""
    val = value.meta["val"]
    if not val.is_contiguous():  # the collective sends the rows as they lie in memory
        value = _node(graph, aten.clone.default, (value,), meta,
                      kwargs={"memory_format": torch.contiguous_format})
        val = value.meta["val"]
    chunk = val.shape[0] // group.size
    splits = [chunk] * group.size
    issued = _node(graph, c10d.all_to_all_single.default, (value, splits, splits, group.name), meta,
                   reason, val=torch.empty_like(val))
    return _node(graph, c10d.wait_tensor.default, (issued,), meta, reason, val=issued.meta["val"])


def apply_expert_parallel(gm: fx.GraphModule, group: AxisGroup) -> list[str]:
    """Rewrite ``gm`` in place so this rank runs its experts of every grouped list on the tokens
    of the ``group``'s ranks (see the module docstring); returns the lists rewritten.
    `ExpertParallelError` where the graph has no grouped experts, a list's E does not divide by
    the group's size, or the grouped computation is not in the form the capture writes."""
    instances = _instances(gm)
    if not instances:
        raise ExpertParallelError(
            "expert parallelism needs the model's experts captured as one grouped computation, and "
            "this graph has none: experts must be a torch.nn.ModuleList of alike modules (same "
            "class, parameter shapes and attributes, no hooks), each called once per step on one "
            "tensor of one shape (see autopar.capture.experts); transformers' MoE blocks that "
            "store the experts' weights stacked in one parameter are not supported under ep yet.\n"
            "  fix: use ep=1 (data parallelism and ZeRO shard such a model), or write the experts "
            "as a ModuleList")
    for inst in instances:
        _rewrite(gm.graph, inst, group)
    gm.graph.lint()
    gm.recompile()
    return [inst.path for inst in instances]


def _rewrite(graph: fx.Graph, inst: _Instance, group: AxisGroup) -> None:
    """One list's grouped computation run on this rank's experts (the module docstring's rules)."""
    n, r, E = group.size, group.rank, inst.experts
    if E % n:
        raise ExpertParallelError(
            f"{inst.path} has {E} experts, which do not split over ep={n} ranks: use an ep that "
            f"divides {E}")
    m = E // n
    missing = [w for w in ("y", "dx") if w not in inst.results] + \
        [f"dw{k}" for k in inst.weights if f"dw{k}" not in inst.results]
    if missing or not inst.fwd or not inst.bwd or not inst.weights:
        raise ExpertParallelError(
            f"{inst.path}: the grouped experts' graph lacks {missing or 'its forward or backward'} "
            "(an expert that returns its input or a parameter unchanged): use ep=1 for this model")
    fwd_set, bwd_set = set(inst.fwd), set(inst.bwd)
    weights = set(inst.weights.values())
    xs = _external(inst.fwd, fwd_set) - weights
    if len(xs) != 1:
        raise ExpertParallelError(f"{inst.path}: the grouped forward reads {len(xs)} inputs besides "
                                  "its weights, not one: use ep=1 for this model")
    (x,) = xs
    dys = _external(inst.bwd, bwd_set | fwd_set) - weights - {x}
    if len(dys) != 1:
        raise ExpertParallelError(f"{inst.path}: the grouped backward reads {len(dys)} gradients, not "
                                  "one: use ep=1 for this model")
    (dy,) = dys
    body = fwd_set | bwd_set
    first = inst.fwd[0]  # the graph's first (nodes are listed in order)
    meta = {k: first.meta[k] for k in ("module", GROUP, "seq_nr") if k in first.meta}
    fwd_meta = {**meta, "partitioner_tag": "is_forward"}
    bwd_meta = {**meta, "partitioner_tag": "is_backward"}
    words = f"EP over {n} ranks: {inst.path}'s experts {r * m}..{r * m + m - 1} on this rank"

    order = {node: i for i, node in enumerate(graph.nodes)}

    def first_reader(value: fx.Node, among: set[fx.Node]) -> fx.Node:
        return min((u for u in value.users if u in among), key=order.__getitem__)

    # forward: this rank's experts' rows of every group rank, and their weights n times
    with graph.inserting_before(first_reader(x, body)):
        x_here = _all_to_all(graph, x, group, fwd_meta, f"{words}: dispatch their tokens")
    local_w = {}
    for k, w in inst.weights.items():
        # every rank reads every expert's weights (the stack as it was): ZeRO gathers a block's
        # weights with one collective, which must carry the same tensors on every rank
        with graph.inserting_before(first_reader(w, body)):
            mine = _node(graph, aten.slice.Tensor, (w, 0, r * m, r * m + m), fwd_meta,
                         f"{words}: their weights")
            reps = [n] + [1] * (w.meta["val"].dim() - 1)
            local_w[k] = _node(graph, aten.repeat.default, (mine, reps), fwd_meta)
    _reroute(x, x_here, body)
    for k, w in inst.weights.items():
        _reroute(w, local_w[k], body)
    y = inst.results["y"]
    with graph.inserting_before(y.next):
        y_back = _all_to_all(graph, y, group, fwd_meta, f"{words}: combine their results")
    _reroute(y, y_back, None, keep=body | _chain(y_back))

    # backward: the results' gradients to their experts, the inputs' gradients back
    with graph.inserting_before(first_reader(dy, bwd_set)):
        dy_here = _all_to_all(graph, dy, group, bwd_meta, f"{words}: dispatch their results' gradients")
    _reroute(dy, dy_here, bwd_set)
    dx = inst.results["dx"]
    with graph.inserting_before(dx.next):
        dx_back = _all_to_all(graph, dx, group, bwd_meta, f"{words}: return their inputs' gradients")
    _reroute(dx, dx_back, None, keep=body | _chain(dx_back))
    for k in inst.weights:
        dw = inst.results[f"dw{k}"]
        with graph.inserting_before(dw.next):
            whole = _weight_grad(graph, dw, n, r, m, bwd_meta, f"{words}: their weights' gradients "
                                 "(summed over the group's tokens; 0 for the other ranks' experts)")
        _reroute(dw, whole, None, keep=body | _chain(whole))


def _chain(node: fx.Node) -> set[fx.Node]:
    """``node`` and the nodes the rewrite added to compute it (back to the template's)."""
    out, todo = set(), [node]
    while todo:
        a = todo.pop()
        if a in out or a.meta.get(ROLE) in ("fwd", "bwd"):
            continue
        out.add(a)
        todo.extend(a.all_input_nodes)
    return out


def _weight_grad(graph: fx.Graph, dw: fx.Node, n: int, r: int, m: int, meta: dict, reason: str) -> fx.Node:
    """[E, ...]: the local experts' gradients (``dw``'s rows summed over the source ranks) at
    rows r m .. r m + m - 1, zeros elsewhere."""
    shape = list(dw.meta["val"].shape)
    rest = shape[1:]
    rows = _node(graph, aten.view.default, (dw, [n, m, *rest]), meta) if dw.meta["val"].is_contiguous() \
        else _node(graph, aten.reshape.default, (dw, [n, m, *rest]), meta)
    local = _node(graph, aten.sum.dim_IntList, (rows, [0]), meta, reason)
    parts = []
    if r:
        parts.append(_node(graph, aten.new_zeros.default, (local, [r * m, *rest]), meta))
    parts.append(local)
    if r < n - 1:
        parts.append(_node(graph, aten.new_zeros.default, (local, [(n - 1 - r) * m, *rest]), meta))
    return _node(graph, aten.cat.default, (parts,), meta, reason) if len(parts) > 1 else local


def _reroute(old: fx.Node, new: fx.Node, only: set[fx.Node] | None, keep: set[fx.Node] = frozenset()) -> None:
    """Users of ``old`` read ``new``: those in ``only``, or (``only`` None) all but ``keep``."""
    for user in list(old.users):
        if (user in only) if only is not None else (user not in keep):
            user.replace_input_with(old, new)
