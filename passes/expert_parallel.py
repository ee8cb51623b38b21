"""Expert parallelism as a rewrite of the per-rank joint graph: each rank runs E/n experts.

The capture (`autopar.capture.experts`) writes a list of E alike experts as one grouped
computation on stacked values, the experts along dim 0, its nodes tagged in ``meta``
(``expert_group``: the list and E; ``expert_role``: "fwd" / "bwd" for the template's own ops,
"w<k>" for the stacked parameter k; ``expert_result``: "y", "dx", "dw<k>" on its results):

    Y = f(X, W)  (X [E, ...] the experts' inputs, W_k = stack_e W_e,k, Y [E, ...]; f is the
    expert vmapped over dim 0: row e of Y reads row e of X and of every W_k only)
    dX, dW = f's backward(dY)

The ep ranks are n consecutive data-parallel ranks; rank r of the group owns the m = E/n
experts [r m, (r+1) m) and stores only their parameters (the graph's inputs of the other
experts' parameters, and their gradient outputs, are removed). With equal chunks of m rows,
``all_to_all`` sends chunk j of dim 0 to rank j and stacks what rank r receives by source rank,
so the rewrite keeps f's shapes (the grouped graph itself is not touched; its batch rows are
(source rank i, local expert e)):

    X_r = all_to_all(X)            X_r[i m + e] = X on rank i, row r m + e
    W_r,k = repeat_n(stack_e W_{r m + e, k})          (the local experts' weights, n times)
    Y = all_to_all(f(X_r, W_r))    Y[j m + e] on rank i = expert j m + e on rank i's rows
    dX = all_to_all(dX_r),  dX_r, dW_r = f's backward(all_to_all(dY))
    dW_{r m + e, k} = sum_i dW_r,k[i m + e]           (the local experts' only)

Each expert row sees exactly the tokens it saw without expert parallelism (one rank's at a
time), so any row-wise expert computes as before. The local gradient of expert r m + e is the
sum over the tokens of the rank's ep group; the ranks that store the same experts are the
owners' group: with dp data-parallel ranks in dp order d = 0 .. dp-1 (`runtime.mesh`: dp index
d of a ("dp", "tp") mesh), the ep groups are {g n .. g n + n - 1} and the owners of ep rank j
are {g n + j : g = 0 .. dp/n - 1}, dp/n ranks (`runtime.mesh.expert_mesh`'s "dp" axis). Their
sum (the data-parallel pass, over that group: the seed is scaled by 1/dp as for every
gradient) is expert's gradient of the global batch, as one device computes it; ZeRO shards the
local experts over the same dp/n ranks.

Every added collective carries ``meta["autopar"]``: the decision behind it.
"""

from __future__ import annotations

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


@dataclass
class ExpertRewrite:
    """What the pass did on this rank: the lists rewritten, the placeholders (node names) of
    the parameters of the experts this rank stores (read by the grouped computation) and of
    those it dropped (another rank's experts: no longer graph inputs; their gradient outputs are
    None)."""

    paths: list[str]
    local: list[str]
    dropped: list[str]


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


def has_grouped_lists(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` holds a list of experts the capture grouped (`autopar.capture.experts`)."""
    return any(GROUP in n.meta for n in gm.graph.nodes)


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


def apply_expert_parallel(gm: fx.GraphModule, group: AxisGroup) -> ExpertRewrite:
    """Rewrite ``gm`` in place so this rank runs and stores its experts of every grouped list,
    on the tokens of the ``group``'s ranks (see the module docstring). `ExpertParallelError`
    where the graph has no grouped experts, a list's E does not divide by the group's size, or
    the grouped computation is not in the form the capture writes (each stacked weight a stack
    of one graph input per expert)."""
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
    done = ExpertRewrite([], [], [])
    for inst in instances:
        local, dropped = _rewrite(gm.graph, inst, group)
        done.paths.append(inst.path)
        done.local += local
        done.dropped += dropped
    gm.graph.lint()
    gm.recompile()
    return done


def _rewrite(graph: fx.Graph, inst: _Instance, group: AxisGroup) -> tuple[list[str], list[str]]:
    """One list's grouped computation run on this rank's experts (the module docstring's rules);
    returns the placeholder names of the experts' parameters kept and dropped."""
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
    local_w, stored = {}, {}
    for k, w in inst.weights.items():
        stored[k] = _stored_parts(w, inst.path, E)
        with graph.inserting_before(first_reader(w, body)):
            mine = _node(graph, aten.stack.default, ([s.read for s in stored[k][r * m:r * m + m]],), fwd_meta,
                         f"{words}: their weights (the only experts this rank stores)")
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
    output = next(node for node in graph.nodes if node.op == "output")
    for k in inst.weights:
        dw = inst.results[f"dw{k}"]
        with graph.inserting_before(dw.next):
            local = _local_grad(graph, dw, n, m, bwd_meta, f"{words}: their weights' gradients "
                                "(summed over the group's tokens)")
        _to_local_rows(graph, dw, local, r * m, m, body | _chain(local), output, inst.path)
    return _drop_others(graph, inst, stored, r, m)


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


@dataclass
class _Stored:
    """One expert's part of a stacked weight: the node the stack reads, the graph input it
    reads (a parameter), and the same-shape views between them, nearest the stack first."""

    read: fx.Node
    placeholder: fx.Node
    views: list[fx.Node]


# ops that only re-view a tensor whole (a DTensor trace views each parameter's local tensor)
_WHOLE_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.detach.default)


def _stored(read: fx.Node) -> _Stored | None:
    """``read`` as one parameter's part of a stack, or None where it is anything else."""
    node, views = read, []
    while node.op == "call_function" and node.target in _WHOLE_VIEWS and len(node.users) == 1 \
            and isinstance(node.args[0], fx.Node) \
            and node.args[0].meta["val"].shape == node.meta["val"].shape:
        views.append(node)
        node = node.args[0]
    if node.op != "placeholder" or len(node.users) != 1 or (not views and len(read.users) != 1):
        return None
    return _Stored(read, node, views)


def _stored_parts(w: fx.Node, path: str, E: int) -> list[_Stored]:
    """The E graph inputs (one per expert) the stacked weight ``w`` is made of."""
    parts = list(w.args[0]) if w.op == "call_function" and w.target is aten.stack.default else []
    found = [_stored(p) for p in parts]
    if len(parts) != E or any(f is None for f in found) or w.args[1:] not in ((), (0,)):
        raise ExpertParallelError(
            f"{path}: a stacked weight of the grouped experts is not a stack of one parameter per "
            "expert read nowhere else, so the ranks cannot each store only their experts: use ep=1 "
            "for this model")
    return found


def _local_grad(graph: fx.Graph, dw: fx.Node, n: int, m: int, meta: dict, reason: str) -> fx.Node:
    """[m, ...]: the local experts' gradients, ``dw``'s rows (source rank i, expert e) summed
    over the source ranks."""
    rest = list(dw.meta["val"].shape)[1:]
    op = aten.view.default if dw.meta["val"].is_contiguous() else aten.reshape.default
    rows = _node(graph, op, (dw, [n, m, *rest]), meta)
    return _node(graph, aten.sum.dim_IntList, (rows, [0]), meta, reason)


def _to_local_rows(graph: fx.Graph, dw: fx.Node, local: fx.Node, first: int, m: int,
                   keep: set[fx.Node], output: fx.Node, path: str) -> None:
    """The readers of the whole [E, ...] gradient ``dw`` read the local [m, ...] one: expert
    e's row ``dw[e]`` is ``local[e - first]`` for the local experts; another rank's expert's
    row (a gradient output) is dropped from the outputs (None). A contiguous copy of ``dw``
    (the capture's, for a gradient not dense as its parameter) becomes a copy of ``local``."""
    for user in [u for u in dw.users if u not in keep]:
        if user.target is aten.clone.default:
            user.replace_input_with(dw, local)
            user.meta["val"] = local.meta["val"]
            _to_local_rows(graph, user, user, first, m, set(), output, path)
        elif user.target is aten.select.int and user.args[1] == 0:
            e = user.args[2]
            if first <= e < first + m:
                user.args = (local, 0, e - first)
                continue
            if set(user.users) != {output}:
                raise ExpertParallelError(f"{path}: the gradient of another rank's expert {e} is read "
                                          "inside the step: use ep=1 for this model")
            output.args = (tuple(None if o is user else o for o in output.args[0]),)
            graph.erase_node(user)
        else:
            raise ExpertParallelError(f"{path}: the experts' stacked gradient is read by {user.target}, "
                                      "not per expert: use ep=1 for this model")


def _drop_others(graph: fx.Graph, inst: _Instance, stored: dict[int, list[fx.Node]], r: int,
                 m: int) -> tuple[list[str], list[str]]:
    """Remove the whole stacks and the other ranks' experts' parameter inputs (read by nothing
    now); returns the placeholder names kept and dropped."""
    kept, dropped = [], []
    for k, w in inst.weights.items():
        if not w.users:
            graph.erase_node(w)
        for e, s in enumerate(stored[k]):
            p = s.placeholder
            if r * m <= e < r * m + m:
                kept.append(p.name)
            elif not s.read.users:
                for view in s.views:
                    graph.erase_node(view)
                dropped.append(p.name)
                graph.erase_node(p)
            else:
                raise ExpertParallelError(f"{inst.path}: expert {e}'s parameter {p.name} is read outside "
                                          "the grouped experts: use ep=1 for this model")
    return kept, dropped


def _reroute(old: fx.Node, new: fx.Node, only: set[fx.Node] | None, keep: set[fx.Node] = frozenset()) -> None:
    """Users of ``old`` read ``new``: those in ``only``, or (``only`` None) all but ``keep``."""
    for user in list(old.users):
        if (user in only) if only is not None else (user not in keep):
            user.replace_input_with(old, new)
