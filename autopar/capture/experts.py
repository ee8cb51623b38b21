"""Capture a loop over E alike experts as one grouped computation, in time independent of E.

A mixture-of-experts layer written in plain PyTorch runs its experts in a Python loop,

    outs = [expert(x_e) for e, expert in enumerate(self.experts)]

and a trace records every expert's ops, forward and backward: the capture (and everything
that reads the graph afterwards) grows with E. Here, while the step is traced, each expert of
a `ModuleList` of alike experts (same class, same parameter names, shapes and dtypes, equal
attributes; `repeat._alike`) is called as one opaque op, ``autopar::expert_call(x_e, W_e)``,
and its gradient as ``autopar::expert_call_backward``. After the trace the E calls of a list
are replaced by the grouped form of the same function, traced once with `torch.func.vmap`:

    X = stack_e(x_e)  [E, ...],  W_k = stack_e(W_e,k)  [E, ...]      (each parameter k)
    Y = vmap(expert)(X, W)   ->  y_e = Y[e]
    dX, dW = vmap(expert)'s backward(dY = stack_e(dy_e))   ->  dx_e = dX[e],  dW_e,k = dW_k[e]

which computes exactly what the loop computes (expert e on its own rows with its own
weights; batched matmuls in place of E matmuls). The graph then holds the experts' work once
per list, its nodes tagged ``meta["expert_group"] = (list path, E)``; the parameters and
their gradients stay one graph input and output per expert, as the optimizer sees them.

It applies only where that is proven: the calls of one list take one tensor each, of one
shape, are all made, once each, and none reads another's result (a stack of blocks called in
sequence is not a group: the trace is abandoned at the second block). Anything else
(`NotGroupable`) makes the caller trace the model as it is.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import operator
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, fx, nn

from autopar.capture.repeat import _alike, _equal

# a module (no inputs) -> its joint forward+backward graph: (gm, inputs, outputs)
JointTracer = Callable[[nn.Module], tuple]

META = "expert_group"  # node meta: (the experts' list path, E) on the grouped nodes
# node meta on the grouped nodes: "fwd" / "bwd" (the template's own ops), "w<k>" (the stacked
# parameter k), and on the template's results a tuple of "y" (the forward's), "dx", "dw<k>"
ROLE = "expert_role"
RESULT = "expert_result"

_aten = torch.ops.aten


class NotGroupable(Exception):
    """The experts' calls do not form one grouped computation; trace them as they are.
    ``path``: the list at fault (None: any)."""

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


_EXCLUDED: set[str] = set()  # lists found not to be groups during this capture (by path)


@dataclass
class ExpertList:
    """One candidate list: its path, modules, parameter names, and what the trace saw."""

    path: str
    experts: list[nn.Module]
    names: list[str]
    outputs: list[Tensor] = field(default_factory=list)  # each call's result (kept alive)
    result: dict[tuple, tuple] = field(default_factory=dict)  # input (shape, stride, dtype) -> result's


_LISTS: dict[int, ExpertList] = {}  # key -> list, while a capture traces with stubs


@torch.library.custom_op("autopar::expert_call", mutates_args=())
def _expert_call(x: Tensor, params: list[Tensor], key: int, index: int) -> Tensor:
    """Expert ``index`` of list ``key`` on ``x`` (only ever traced, never run)."""
    raise RuntimeError("autopar::expert_call is a tracing placeholder; it is never executed")


@_expert_call.register_fake
def _expert_call_fake(x: Tensor, params: list[Tensor], key: int, index: int) -> Tensor:
    group = _LISTS[key]
    shape_key = (tuple(x.shape), x.stride(), x.dtype)
    known = group.result.get(shape_key)
    if known is not None:  # alike experts: one expert's result has every expert's shape
        return x.new_empty_strided(*known[:2], dtype=known[2])
    out = _run_expert(x, params, key, index)
    group.result[shape_key] = (tuple(out.shape), out.stride(), out.dtype)
    return out


def _run_expert(x: Tensor, params: list[Tensor], key: int, index: int) -> Tensor:
    expert = _LISTS[key].experts[index]
    stub = expert.__dict__.pop("forward", None)  # run the expert's own forward
    try:
        with torch.no_grad():
            return torch.func.functional_call(expert, dict(zip(_LISTS[key].names, params)), (x,))
    finally:
        if stub is not None:
            expert.forward = stub


@torch.library.custom_op("autopar::expert_call_backward", mutates_args=())
def _expert_call_backward(x: Tensor, params: list[Tensor], grad: Tensor, key: int,
                          index: int) -> list[Tensor]:
    """[dx, *dparams] of `_expert_call` (only ever traced, never run)."""
    raise RuntimeError("autopar::expert_call_backward is a tracing placeholder; it is never executed")


@_expert_call_backward.register_fake
def _expert_call_backward_fake(x, params, grad, key, index):
    return [torch.empty_like(x)] + [torch.empty_like(p) for p in params]


def _setup(ctx, inputs, output) -> None:
    x, params, key, index = inputs
    ctx.save_for_backward(x, *params)
    ctx.key, ctx.index = key, index


def _backward(ctx, grad):
    x, *params = ctx.saved_tensors
    grads = torch.ops.autopar.expert_call_backward(x, params, grad, ctx.key, ctx.index)
    return grads[0], list(grads[1:]), None, None


_expert_call.register_autograd(_backward, setup_context=_setup)


# Below this many experts tracing each costs little, and the per-expert graph keeps what the
# grouped form does not have yet: each expert's Megatron TP shards and its FP8 casts.
MIN_EXPERTS = 16


def find_expert_lists(model: nn.Module, min_experts: int = MIN_EXPERTS) -> list[ExpertList]:
    """The model's `ModuleList`s of at least ``min_experts`` (at least 2) alike modules with
    trainable parameters and no buffers (candidates: whether the forward runs them as a group
    is seen while tracing). Expert parallelism groups every list (``min_experts`` 2): its pass
    rewrites the grouped computation."""
    found = []
    for path, module in model.named_modules():
        if type(module) is not nn.ModuleList or len(module) < max(2, min_experts) or path in _EXCLUDED:
            continue
        experts = list(module)
        first = experts[0]
        params = list(first.named_parameters())
        if not params or any(not p.requires_grad for _, p in params) or list(first.buffers()):
            continue
        if len({id(p) for m in experts for p in m.parameters()}) != len(params) * len(experts):
            continue  # a tensor shared between experts
        if _hooked(experts) or any(not _private_alike(first, m) for m in experts[1:]):
            continue  # the template (expert 0's code) would not be what each expert runs
        if all(_alike(first, m, -1, -1) for m in experts[1:]):
            found.append(ExpertList(path, experts, [n for n, _ in params]))
    return found


# nn.Module's own bookkeeping, not state a forward reads (hooks are refused by `_hooked`)
_MODULE_INTERNALS = frozenset(vars(nn.Linear(1, 1))) - {"in_features", "out_features", "training"}


def _hooked(experts: list[nn.Module]) -> bool:
    """Any hook that the grouped computation would run other than the trace did: on an expert
    or its submodules, global module hooks, or an instance ``forward`` replacing the class's."""
    from torch.nn.modules import module as torch_module

    if any(getattr(torch_module, name) for name in (
            "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
            "_global_backward_pre_hooks")):
        return True
    for expert in experts:
        for m in expert.modules():
            if "forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks \
                    or m._backward_hooks or m._backward_pre_hooks:
                return True
    return False


def _private_alike(a: nn.Module, b: nn.Module) -> bool:
    """The underscore attributes of every submodule equal (`_alike` compares the public ones):
    a private scale or activation differing between experts is refused, not templated."""
    for ma, mb in zip(a.modules(), b.modules()):
        va = {k: v for k, v in vars(ma).items() if k.startswith("_") and k not in _MODULE_INTERNALS}
        vb = {k: v for k, v in vars(mb).items() if k.startswith("_") and k not in _MODULE_INTERNALS}
        if va.keys() != vb.keys() or not all(_equal(v, vb[k]) for k, v in va.items()):
            return False
    return True


@contextlib.contextmanager
def screening(lists: list[ExpertList]) -> Iterator[None]:
    """Watch a plain forward (the capture's preflight) and drop from ``lists``, in place, each
    list whose modules are not all called once on one tensor, or that runs them in sequence
    (a module's input is the result of another: a stack of blocks)."""
    from torch.nn.modules.module import (
        register_module_forward_hook,
        register_module_forward_pre_hook,
    )

    owner = {id(m): (g, i) for g in lists for i, m in enumerate(g.experts)}
    calls: dict[str, list[int]] = {g.path: [] for g in lists}
    seen: dict[str, list[object]] = {g.path: [] for g in lists}
    bad: set[str] = set()

    def enter(module, args):
        found = owner.get(id(module))
        if found is not None:
            group, index = found
            calls[group.path].append(index)
            if len(args) != 1 or not isinstance(args[0], Tensor) or any(args[0] is o for o in seen[group.path]):
                bad.add(group.path)

    def leave(module, args, output):
        found = owner.get(id(module))
        if found is not None:
            seen[found[0].path].append(output)

    handles = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    lists[:] = [g for g in lists if g.path not in bad and sorted(calls[g.path]) == list(range(len(g.experts)))]


class _Sequential(NotGroupable):
    """An expert's input is another expert's output: the list is a stack, not a group."""


@contextlib.contextmanager
def expert_stubs(lists: list[ExpertList]) -> Iterator[None]:
    """While tracing, each listed expert called on one tensor becomes ``autopar::expert_call``."""
    saved = []
    try:
        for key, group in enumerate(lists):
            _LISTS[key] = group
            group.outputs = []
            for index, expert in enumerate(group.experts):
                saved.append(expert)
                expert.forward = functools.partial(_stub_forward, expert, key, index, type(expert).forward)
        yield
    finally:
        for expert in saved:
            expert.__dict__.pop("forward", None)
        _LISTS.clear()


def _stub_forward(expert: nn.Module, key: int, index: int, original, *args, **kwargs):
    group = _LISTS[key]
    if kwargs or len(args) != 1 or not isinstance(args[0], Tensor):
        return original(expert, *args, **kwargs)
    if any(args[0] is out for out in group.outputs):
        raise _Sequential(f"{group.path} is run in sequence", group.path)
    params = [p for _, p in expert.named_parameters()]
    out = torch.ops.autopar.expert_call(args[0], params, key, index)
    group.outputs.append(out)
    return out


@contextlib.contextmanager
def excluding(exc: BaseException, lists: list[ExpertList]) -> Iterator[None]:
    """Leave out, while the caller traces again, the list ``exc`` found not to be a group (every
    listed one when ``exc`` names none: an error of the stubbed trace itself)."""
    found = exc
    while found is not None and not isinstance(found, NotGroupable):
        found = found.__cause__ or found.__context__
    paths = {found.path} if found is not None and found.path is not None else {g.path for g in lists}
    fresh = paths - _EXCLUDED
    _EXCLUDED.update(fresh)
    try:
        yield
    finally:
        _EXCLUDED.difference_update(fresh)


def _is(node: fx.Node, op) -> bool:
    return node.op == "call_function" and node.target == op


def _call_op():
    return torch.ops.autopar.expert_call.default


def _backward_op():
    return torch.ops.autopar.expert_call_backward.default


class _Grouped(nn.Module):
    """vmap of one expert over E: parameters p0.. stacked [E, ...] and the input ``x`` [E, ...]
    (a parameter too, so the joint export returns its gradient)."""

    def __init__(self, template: nn.Module, names: list[str], params, x) -> None:
        super().__init__()
        self._template = (template,)  # a tuple: not registered, its own tensors stay out
        self.names = names
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta")))
        self.x = nn.Parameter(torch.empty(x.shape, dtype=x.dtype, device="meta"))

    def forward(self) -> Tensor:
        template, names = self._template[0], self.names

        def one(x, *ps):
            return torch.func.functional_call(template, dict(zip(names, ps)), (x,))

        return torch.func.vmap(one)(self.x, *(getattr(self, f"p{i}") for i in range(len(names))))


def _grouped_joint(group: ExpertList, x_val: Tensor, param_vals: list[Tensor], trace: JointTracer):
    """The joint graph of `_Grouped` for E experts: (gm, inputs, outputs), as ``trace`` (the
    capture's own joint tracer, passed in: this module sits below `autopar.capture.joint`)
    makes it."""
    E = len(group.experts)
    stacked = [torch.empty((E, *p.shape), dtype=p.dtype, device="meta") for p in param_vals]
    xs = torch.empty((E, *x_val.shape), dtype=x_val.dtype, device="meta")
    root = _Grouped(group.experts[0], group.names, stacked, xs)
    try:
        return trace(root)
    except Exception as exc:  # vmap cannot batch the expert (randomness, data-dependent code)
        raise NotGroupable(f"{group.path}: the experts do not batch with vmap ({type(exc).__name__}: {exc})", group.path) from exc


def _ancestors(nodes: list[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    todo = list(nodes)
    while todo:
        n = todo.pop()
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return seen


def _add(graph: fx.Graph, op, args: tuple, meta: dict, kwargs: dict | None = None) -> fx.Node:
    """A call node with ``meta`` and its value computed on the arguments' fake values."""
    node = graph.call_function(op, args, kwargs or {})
    node.meta.update(meta)
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    node.meta["val"] = op(*vals, **(kwargs or {}))
    return node


def group_experts(gm: fx.GraphModule, lists: list[ExpertList], trace: JointTracer) -> list[tuple[str, int]]:
    """Replace each list's E expert calls (forward and backward) in ``gm`` with the grouped
    computation, traced by ``trace`` (a module -> its joint graph, (gm, inputs, outputs));
    returns the (path, E) of each list grouped. `NotGroupable` where the calls do
    not form one group (see the module docstring), or where rewriting them fails."""
    try:
        return _group_experts(gm, lists, trace)
    except NotGroupable:
        raise
    except Exception as exc:  # a layout the checks missed: tracing the experts one by one is right
        raise NotGroupable(f"grouping the experts failed: {exc!r}") from exc


def _group_experts(gm: fx.GraphModule, lists: list[ExpertList], trace: JointTracer) -> list[tuple[str, int]]:
    calls: dict[int, dict[int, fx.Node]] = {}
    backs: dict[int, dict[int, fx.Node]] = {}
    for n in gm.graph.nodes:
        for op, table in ((_call_op(), calls), (_backward_op(), backs)):
            if _is(n, op):
                key, index = n.args[-2], n.args[-1]
                if index in table.setdefault(key, {}):
                    raise NotGroupable(f"{lists[key].path}.{index} is called more than once", lists[key].path)
                table[key][index] = n
    done = []
    for key in sorted(calls):
        group = lists[key]
        E = len(group.experts)
        fwd, bwd = calls[key], backs.get(key, {})
        if len(fwd) != E or len(bwd) != E:
            raise NotGroupable(f"{group.path}: {len(fwd)} of {E} experts called ({len(bwd)} differentiated)", group.path)
        fwd_nodes = [fwd[e] for e in range(E)]
        bwd_nodes = [bwd[e] for e in range(E)]
        xs = [c.args[0] for c in fwd_nodes]
        sig = {(tuple(x.meta["val"].shape), x.meta["val"].dtype) for x in xs}
        if len(sig) != 1 or not xs[0].meta["val"].is_floating_point():
            raise NotGroupable(f"{group.path}: the experts' inputs differ in shape or dtype ({sorted(map(str, sig))})", group.path)
        for c, b in zip(fwd_nodes, bwd_nodes):
            if b.args[0] is not c.args[0] or list(b.args[1]) != list(c.args[1]):
                raise NotGroupable(f"{group.path}: a backward call reads other tensors than its forward", group.path)
        if _ancestors(xs) & set(fwd_nodes) or _ancestors([b.args[2] for b in bwd_nodes]) & set(bwd_nodes):
            raise NotGroupable(f"{group.path}: an expert reads another expert's result", group.path)
        param_vals = [p.meta["val"] for p in fwd_nodes[0].args[1]]
        # one template per list: two lists alike in shapes may differ in what their experts
        # compute (an attribute, an activation), which only each list's own trace shows
        template = _grouped_joint(group, xs[0].meta["val"], param_vals, trace)
        _splice(gm.graph, group, fwd_nodes, bwd_nodes, template)
        done.append((group.path, E))
    _stable_toposort(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return done


def _splice(graph: fx.Graph, group: ExpertList, fwd: list[fx.Node], bwd: list[fx.Node], template) -> None:
    """Write the template's forward after the last forward call and its backward after the last
    backward call, reading the stacked inputs; each call's uses read its slice."""
    tgm, tin, tout = template
    E = len(fwd)
    order = {n: i for i, n in enumerate(graph.nodes)}
    # labelled as every expert's module ("experts.*"): what reads the labels sees expert work
    base = {"module": f"{group.path}.*", "seq_nr": fwd[0].meta.get("seq_nr"), META: (group.path, E)}
    base = {k: v for k, v in base.items() if v is not None}
    tnodes = list(tgm.graph.nodes)
    spec = {i.node: i for i in tin}
    holders = {n: spec[n.name] for n in tnodes if n.op == "placeholder"}
    t_out = next(n for n in tnodes if n.op == "output").args[0]
    env: dict[fx.Node, fx.Node] = {}

    def copy(n: fx.Node, tag: str) -> None:
        node = graph.node_copy(n, lambda a: env[a])
        node.meta.update(base)
        node.meta["partitioner_tag"] = tag
        node.meta[ROLE] = "fwd" if tag == "is_forward" else "bwd"
        env[n] = node

    def result(node: fx.Node, role: str) -> None:
        if node.meta.get(ROLE) not in ("fwd", "bwd"):  # a template input returned as it is
            return
        node.meta[RESULT] = (*node.meta.get(RESULT, ()), role)

    backward = {n for n in tnodes if n.meta.get("partitioner_tag") == "is_backward"}
    fwd_meta = {**base, "partitioner_tag": "is_forward"}
    with graph.inserting_after(max(fwd, key=order.get)):
        for n in tnodes:  # placeholders: the stacked parameters and inputs
            s = holders.get(n)
            if s is None or s.kind == "tangent":
                continue
            if s.kind != "param":
                raise NotGroupable(f"{group.path}: the grouped expert has an input {s.name}", group.path)
            parts = [c.args[0] for c in fwd] if s.name == "x" else [c.args[1][int(s.name[1:])] for c in fwd]
            env[n] = _stacked(graph, parts, fwd_meta)
            if s.name != "x":
                env[n].meta[ROLE] = f"w{s.name[1:]}"
        for n in tnodes:
            if n.op == "call_function" and n not in backward:
                copy(n, "is_forward")
        y = env[t_out[next(o.index for o in tout if o.kind == "loss")]]
        result(y, "y")
        _unstack(graph, fwd, y, fwd_meta)
    bwd_meta = {**base, "partitioner_tag": "is_backward"}
    with graph.inserting_after(max(bwd, key=order.get)):
        tangent = next(n for n, s in holders.items() if s.kind == "tangent")
        env[tangent] = _stacked(graph, [b.args[2] for b in bwd], bwd_meta)
        for n in tnodes:
            if n in backward and n.op == "call_function":
                copy(n, "is_backward")
        grads = {o.name: env[t_out[o.index]] for o in tout if o.kind == "grad"}
        whole = [grads["x"]] + [grads[f"p{k}"] for k in range(len(group.names))]
        for k, value in enumerate(whole):
            result(value, "dx" if k == 0 else f"dw{k - 1}")
        slots: list[list[fx.Node | None]] = [[None] * E for _ in whole]
        for e, b in enumerate(bwd):
            for user in b.users:
                if not (_is(user, operator.getitem) and isinstance(user.args[1], int)):
                    raise NotGroupable(f"{group.path}: an expert's gradients are read as a list", group.path)
                slots[user.args[1]][e] = user
        for k, parts in enumerate(slots):
            if any(p is not None for p in parts):
                value = whole[k]
                if k and not value.meta["val"].is_contiguous():  # a parameter's gradient, dense as its own
                    value = _add(graph, _aten.clone.default, (value,), bwd_meta,
                                 {"memory_format": torch.contiguous_format})
                _unstack(graph, parts, value, bwd_meta)
    fed = {c.args[0] for c in fwd} | {b.args[2] for b in bwd}
    for n in [m for parts in slots for m in parts if m is not None] + bwd + fwd:
        graph.erase_node(n)
    for n in fed:  # the slices the calls alone read
        if n.op == "call_function" and not n.users and (_is(n, operator.getitem) or _is(n, _aten.select.int)):
            source = n.args[0]
            graph.erase_node(n)
            if not source.users and _is(source, _aten.unbind.int):
                graph.erase_node(source)


def _stacked(graph: fx.Graph, parts: list[fx.Node], meta: dict) -> fx.Node:
    """stack(parts) along a new dim 0; the tensor ``A`` itself where the parts are its slices
    ``A.unbind(0)`` or ``A.select(0, e)`` in order (what a loop over ``A``'s rows traces to), a
    broadcast view where they are one tensor."""
    first = parts[0]
    if all(p is first for p in parts):  # every expert reads the same tensor: a broadcast view
        shape = [len(parts), *first.meta["val"].shape]
        return _add(graph, _aten.expand.default, (_add(graph, _aten.unsqueeze.default, (first, 0), meta), shape), meta)
    if _is(first, operator.getitem):
        source = first.args[0]
        if _is(source, _aten.unbind.int) and source.args[1:] in ((), (0,)) and \
                len(source.meta["val"]) == len(parts) and \
                all(_is(p, operator.getitem) and p.args == (source, e) for e, p in enumerate(parts)):
            return source.args[0]
    elif _is(first, _aten.select.int) and isinstance(first.args[0], fx.Node):
        source = first.args[0]
        if source.meta["val"].shape[0] == len(parts) and \
                all(_is(p, _aten.select.int) and p.args == (source, 0, e) for e, p in enumerate(parts)):
            return source
    return _add(graph, _aten.stack.default, (parts,), meta)


def _unstack(graph: fx.Graph, parts: list[fx.Node | None], whole: fx.Node, meta: dict) -> None:
    """Each part's uses read ``whole[e]``; a ``stack(parts)`` of all, in order, reads ``whole``
    (a ``cat(parts)``, its rows)."""
    users = {u for p in parts if p is not None for u in p.users}
    if len(users) == 1 and all(p is not None and len(p.users) == 1 for p in parts):
        (user,) = users
        joined = (_is(user, _aten.stack.default) or _is(user, _aten.cat.default)) and \
            list(user.args[0]) == parts and user.args[1:] in ((), (0,)) and not user.kwargs
        if joined and _is(user, _aten.stack.default):
            user.replace_all_uses_with(whole)
            graph.erase_node(user)
            return
        if joined and whole.meta["val"].is_contiguous():  # cat on dim 0: the rows of all, in order
            flat = _add(graph, _aten.view.default, (whole, list(user.meta["val"].shape)), meta)
            user.replace_all_uses_with(flat)
            graph.erase_node(user)
            return
    for e, p in enumerate(parts):
        if p is not None and p.users:
            p.replace_all_uses_with(_add(graph, _aten.select.int, (whole, 0, e), meta))


def _stable_toposort(graph: fx.Graph) -> None:
    """Order the nodes so each follows its inputs, otherwise keeping their order."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    waiting = {n: len(set(n.all_input_nodes)) for n in nodes}
    ready = [index[n] for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    out_node = nodes[-1]
    placed = 0
    while ready:
        n = nodes[heapq.heappop(ready)]
        if n is not out_node:
            out_node.prepend(n)
        placed += 1
        for user in n.users:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, index[user])
    if placed != len(nodes):
        raise NotGroupable("the grouped graph has a cycle")


def grouped_note(grouped: list[tuple[str, int]], note: str = "") -> str:
    """``note`` with a line on the lists traced as groups."""
    if not grouped:
        return note
    counts = sorted({E for _, E in grouped})
    line = (f"traced {len(grouped)} list(s) of experts ({', '.join(map(str, counts))} experts) "
            "once each as a grouped computation")
    return f"{note}; {line}" if note else line
