"""Pipeline split: one rank's joint training graph cut into a forward and a backward graph per
pipeline stage.

Every node of the joint graph gets a stage from the caller (``node_stage``: the plan's cut of
the blocks, and `cost.stages.effective_layers` for the nodes between blocks, so a node runs on
the stage whose price it is). Stage s then runs two graphs:

- F_s, its forward: the forward nodes of s, on the parameters s holds, the user inputs and the
  values received from stage s-1 (channel C_{s-1}). It returns the values sent to stage s+1
  (C_s), the values its backward reads ("saved"), the loss (last stage only) and the new values
  of the buffers the forward updates.
- B_s, its backward: the backward nodes of s, on the saved values, the loss's seed gradient and
  the gradient channel from stage s+1 (one slot per value of C_s). It returns one value per slot
  of C_{s-1} (sent to stage s-1) and the gradients of the parameters s holds.

Channels. C_s holds every forward value made on a stage <= s and read on a stage > s, in graph
order (a value read two stages on is passed through the middle one unchanged). The gradient
channel from s+1 to s carries every backward value made on a stage > s and read on a stage <= s,
each in a slot of C_s of its shape and dtype: for a transformer, the residual stream's gradient
in the residual stream's slot. (torch.distributed.pipelining sends one gradient per received
value; an unused slot travels as zeros.)

Free nodes. A node that reads only data (user inputs, buffers, the seed: rotary tables, masks,
position ids, the label shift, the seed's expansions in the loss's backward) or only parameters
(a weight's view or transpose), never both, and is neither random, nor a collective, nor in
place, is copied into every stage that reads it rather than sent: a few cheap ops, the channels
carry only activations and their gradients, and a stage holds the parameters its nodes read.

Shared parameters (a tied embedding and head on the first and the last stage): each stage that
reads the parameter holds a copy and returns its part of the gradient (the terms of the
gradient's sum made on that stage); the runtime adds the parts over those stages after the
step, as Megatron all-reduces the tied embedding's gradient between its first and last stage.

Anything else (a forward value read by an earlier stage, a backward value read by a later one,
the loss before the last stage, a gradient with no slot of its shape) is a
`PipelineSplitError` naming the value: a cut that cannot run is refused, never run wrong.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx

from passes.recompute import is_backward, is_collective, is_random, mutates
from vocab.plan_types import BackwardSplit, GraphSignature, PipelineGraphs, StageGraphs, StageInput

aten = torch.ops.aten


class PipelineSplitError(ValueError):
    """The graph cannot be cut into pipeline stages as planned (names the value and the stages)."""


# the name a stage's "buffer update" takes when it is one of the forward's other outputs
# (runtime/pipeline.py spells it too: the layers do not import each other)
OUTPUT = "autopar.output:"


def split_pipeline(gm: fx.GraphModule, signature: GraphSignature, node_stage: Mapping[str, int],
                   pp: int, others: Sequence[int] = ()) -> PipelineGraphs:
    """Cut ``gm`` (a joint graph: loss, gradients, buffer updates) into ``pp`` stages.

    ``node_stage``: the stage of every call_function node (free nodes may be absent: they go
    wherever they are read). ``others``: output indices of the forward's other values (logits
    beside the loss): the stage that makes each returns it among its buffer updates, named
    ``OUTPUT`` + its position in ``others`` (a free value: the last stage).
    Raises `PipelineSplitError` for a cut that cannot run.
    """
    nodes = list(gm.graph.nodes)
    holders = [n for n in nodes if n.op == "placeholder"]
    leaf = {n.name: StageInput(kind, name) for n, (kind, name) in zip(holders, signature.inputs)}
    outs = list(nodes[-1].args[0])
    free = _free_nodes(nodes, leaf)
    backward = _backward_nodes(nodes)
    stage = _stages(nodes, free, node_stage, pp)
    loss = outs[signature.loss_index]
    if not isinstance(loss, fx.Node) or stage.get(loss.name, pp - 1) != pp - 1:
        raise PipelineSplitError(f"the loss ({loss}) is computed on stage {stage.get(loss.name)}, "
                                 f"not on the last stage {pp - 1}: cut the blocks so the head and "
                                 "the loss come last")
    by_name = {n.name: n for n in nodes}
    buffer_out = _buffer_outputs(outs, signature, leaf, by_name, stage, others, pp)
    need = _stage_needs(stage, buffer_out, free, by_name, pp)

    # a stage holds the parameters its nodes read; a gradient sums one part per holder
    params = {n.name: leaf[n.name].name for n in holders if leaf[n.name].kind == "param"}
    readers: dict[str, set[int]] = {p: set() for p in params.values()}
    for s in range(pp):
        for name in need[s]:
            for i in by_name[name].all_input_nodes:
                if i.name in params:
                    readers[params[i.name]].add(s)
    grad_terms, dropped = _gradient_parts(outs, signature, readers, stage)
    shared = {p: sorted(s) for p, s in readers.items() if len(s) > 1}
    for s in range(pp):
        need[s] -= dropped

    channels, grad_slots = _channels(nodes, need, stage, backward, dropped, pp)
    stages = [_stage_graphs(gm, s, pp, nodes, need[s], backward, leaf, channels, grad_slots,
                            loss if s == pp - 1 else None, buffer_out[s],
                            {p: grad_terms[p] for p in grad_terms if s in grad_terms[p]}, readers)
              for s in range(pp)]
    return PipelineGraphs(stages, channels, grad_slots, shared)


def _stages(nodes: list[fx.Node], free: set[str], node_stage: Mapping[str, int], pp: int) -> dict[str, int]:
    """The stage of every call_function node but the free ones, checked to be one of ``pp``."""
    stage: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_function" and n.name not in free:
            if n.name not in node_stage:
                raise PipelineSplitError(f"node {n.name} ({n.target}) has no pipeline stage")
            stage[n.name] = int(node_stage[n.name])
            if not 0 <= stage[n.name] < pp:
                raise PipelineSplitError(f"node {n.name} is given stage {stage[n.name]} of {pp}")
    return stage


def _buffer_outputs(outs: list, signature: GraphSignature, leaf: Mapping[str, StageInput],
                    by_name: Mapping[str, fx.Node], stage: dict[str, int], others: Sequence[int],
                    pp: int) -> dict[int, list[tuple[str, fx.Node]]]:
    """Per stage, the buffer updates and other forward outputs it returns: a buffer's new value
    on the stage that makes it, or (a free update, a step counter) the first stage that reads
    the buffer; another output on the stage that makes it (a free one: the last)."""
    buffer_out: dict[int, list[tuple[str, fx.Node]]] = {s: [] for s in range(pp)}
    buffer_nodes = {leaf_in.name: name for name, leaf_in in leaf.items() if leaf_in.kind == "buffer"}
    for name, index in signature.buffer_index.items():
        value = outs[index]
        users = by_name[buffer_nodes[name]].users if name in buffer_nodes else {}
        s = stage.get(value.name, min((stage[u.name] for u in users if u.name in stage), default=0))
        buffer_out[s].append((name, value))
    for k, index in enumerate(others):
        value = outs[index]
        if isinstance(value, fx.Node):
            buffer_out[stage.get(value.name, pp - 1)].append((f"{OUTPUT}{k}", value))
    return buffer_out


def _stage_needs(stage: dict[str, int], buffer_out: dict[int, list[tuple[str, fx.Node]]],
                 free: set[str], by_name: Mapping[str, fx.Node], pp: int) -> dict[int, set[str]]:
    """What each stage runs: its own nodes, its buffer updates and the free nodes they read."""
    need: dict[int, set[str]] = {s: set() for s in range(pp)}
    for name, s in stage.items():
        need[s].add(name)
    for s in range(pp):
        need[s].update(v.name for _, v in buffer_out[s] if v.op == "call_function")
        todo = list(need[s])
        while todo:
            for i in by_name[todo.pop()].all_input_nodes:
                if i.name in free and i.op != "placeholder" and i.name not in need[s]:
                    need[s].add(i.name)
                    todo.append(i.name)
    return need


def _channels(nodes: list[fx.Node], need: dict[int, set[str]], stage: dict[str, int],
              backward: set[str], dropped: set[str], pp: int) -> tuple[list[list[str]], list[dict[int, str]]]:
    """The values crossing each cut: the forward channel C_k (values made on a stage <= k and
    read on a later one, in graph order) and the gradient slots from k+1 back to k. Raises
    `PipelineSplitError` for a value that would cross a cut the wrong way."""
    by_name = {n.name: n for n in nodes}
    fwd_need: dict[int, set[str]] = {s: set() for s in range(pp)}
    bwd_need: dict[int, set[str]] = {s: set() for s in range(pp)}
    for s in range(pp):
        for name in need[s]:
            for i in by_name[name].all_input_nodes:
                if i.op == "placeholder" or i.name in need[s]:
                    continue
                if i.name in dropped:
                    raise PipelineSplitError(f"{name} reads {i.name}, a sum split over stages")
                a = stage[i.name]
                if i.name not in backward and a < s:
                    fwd_need[s].add(i.name)
                elif i.name in backward and a > s:
                    bwd_need[s].add(i.name)
                else:
                    raise PipelineSplitError(
                        f"{name} ({'backward' if name in backward else 'forward'}, stage "
                        f"{s}) reads {i.name} ({'backward' if i.name in backward else 'forward'}, stage "
                        f"{a}): a pipeline sends forward values on and gradients back, nothing else")
    order = {n.name: k for k, n in enumerate(nodes)}
    channels = [sorted((v for t in range(k + 1, pp) for v in fwd_need[t] if stage[v] <= k),
                       key=order.get) for k in range(pp - 1)]
    channels = [list(dict.fromkeys(c)) for c in channels]
    grad_slots = []
    for k in range(pp - 1):
        back = sorted({d for t in range(k + 1) for d in bwd_need[t] if stage[d] > k}, key=order.get)
        grad_slots.append(_assign_slots(back, channels[k], by_name, k))
    return channels, grad_slots


def _backward_nodes(nodes: list[fx.Node]) -> set[str]:
    """The backward's nodes: AOTAutograd's tag, or (a node a pass added untagged, a
    collective's wait) reading a backward value."""
    out: set[str] = set()
    for n in nodes:
        if n.op == "call_function" and (is_backward(n) or any(i.name in out for i in n.all_input_nodes)):
            out.add(n.name)
    return out


def _free_nodes(nodes: list[fx.Node], leaf: Mapping[str, StageInput]) -> set[str]:
    """Nodes any stage may compute for itself (module docstring): deterministic, pure, no
    collective, and reading either only data (user inputs, buffers, seeds) or only parameters
    (a weight's view or transpose), never both (an embedding lookup is an activation)."""
    reads: dict[str, set[str]] = {}
    free: set[str] = set()
    for n in nodes:
        if n.op == "placeholder":
            reads[n.name] = {"param" if leaf[n.name].kind == "param" else "data"}
            free.add(n.name)
        elif n.op == "get_attr":
            reads[n.name] = set()
            free.add(n.name)
        elif n.op == "call_function":
            reads[n.name] = set().union(*(reads.get(i.name, {"param", "data"}) for i in n.all_input_nodes))
            if (len(reads[n.name]) < 2 and not is_random(n) and not is_collective(n)
                    and not mutates(n) and all(i.name in free for i in n.all_input_nodes)):
                free.add(n.name)
    return free


def _gradient_parts(outs: list, signature: GraphSignature, readers: dict[str, set[int]],
                    stage: dict[str, int]) -> tuple[dict[str, dict[int, list[fx.Node]]], set[str]]:
    """Per parameter: stage -> the terms of its gradient made there; and the sums split over
    stages (nodes no stage runs). A parameter read on one stage has one term, its gradient."""
    parts: dict[str, dict[int, list[fx.Node]]] = {}
    dropped: set[str] = set()
    for p, index in signature.grad_index.items():
        g = outs[index]
        holders = readers.get(p) or {0}
        if not isinstance(g, fx.Node):
            parts[p] = {min(holders): []}
            continue
        terms = [g]
        if len(holders) > 1:  # a shared parameter: its gradient sums one term per holder
            terms = _sum_terms(g, stage, dropped)
        by_stage: dict[int, list[fx.Node]] = {}
        for t in terms:
            s = stage.get(t.name)
            if s not in holders:
                raise PipelineSplitError(
                    f"the gradient of {p} is made on stage {s} ({t.name}) but {p} is read on "
                    f"stages {sorted(holders)}: cut the blocks elsewhere")
            by_stage.setdefault(s, []).append(t)
        parts[p] = {s: by_stage.get(s, []) for s in holders}
    return parts, dropped


def _sum_terms(g: fx.Node, stage: dict[str, int], dropped: set[str]) -> list[fx.Node]:
    """The terms of ``g`` read as a tree of additions, split down to where each addition's
    terms are made on one stage (the additions split are added to ``dropped``)."""
    if not (g.target is aten.add.Tensor and len(g.args) == 2 and not g.kwargs
            and all(isinstance(a, fx.Node) and a.name in stage for a in g.args)):
        return [g]
    terms = _sum_terms(g.args[0], stage, dropped) + _sum_terms(g.args[1], stage, dropped)
    if len({stage[t.name] for t in terms}) == 1:
        return [g]
    dropped.add(g.name)
    return terms


def _assign_slots(values: list[str], channel: list[str], by_name: Mapping[str, fx.Node],
                  cut: int) -> dict[int, str]:
    """Give each backward value crossing cut ``cut`` a slot of the forward channel of its shape
    and dtype (the residual stream's gradient: the residual stream's slot)."""
    def kind(name: str):
        val = by_name[name].meta.get("val")
        return (tuple(val.shape), val.dtype) if isinstance(val, torch.Tensor) else None

    free_slots = [j for j, v in enumerate(channel) if kind(v) is not None and kind(v)[1].is_floating_point]
    out: dict[int, str] = {}
    for d in values:
        match = next((j for j in free_slots if kind(channel[j]) == kind(d)), None)
        if match is None:
            raise PipelineSplitError(
                f"the backward sends {d} {kind(d)} from stage {cut + 1} to stage {cut}, but no "
                f"forward value crossing that cut has its shape: channel {[(v, kind(v)) for v in channel]}")
        free_slots.remove(match)
        out[match] = d
    return out


def _stage_graphs(gm: fx.GraphModule, s: int, pp: int, nodes: list[fx.Node], need: set[str],
                  backward: set[str], leaf: Mapping[str, StageInput], channels: list[list[str]],
                  grad_slots: list[dict[int, str]], loss: fx.Node | None,
                  buffers: list[tuple[str, fx.Node]], grads: dict[str, dict[int, list[fx.Node]]],
                  readers: dict[str, set[int]]) -> StageGraphs:
    fwd_nodes = [n for n in nodes if n.name in need and n.name not in backward]
    bwd_nodes = [n for n in nodes if n.name in need and n.name in backward]

    # forward: received values, then the leaves its nodes read
    fg = fx.Graph()
    env: dict[str, fx.Node] = {}
    inputs: list[StageInput] = []
    by_name = {n.name: n for n in nodes}
    for k, v in enumerate(channels[s - 1] if s > 0 else []):
        env[v] = _from_wire(fg, _placeholder(fg, by_name[v], f"recv_{v}"), _order(by_name[v]))
        inputs.append(StageInput("recv", v, k))
    _add_leaves(fg, fwd_nodes, leaf, env, inputs)
    for n in fwd_nodes:
        env[n.name] = fg.node_copy(n, lambda a: env[a.name])
    sends = [_to_wire(fg, env[v], _order(by_name[v])) for v in (channels[s] if s < pp - 1 else [])]
    fwd_values = set(env)
    saved = [v for v in _read_by(bwd_nodes) if v in fwd_values and leaf.get(v) is None]
    saved_nodes = [env[v] for v in saved]
    tail = ([env[loss.name]] if loss is not None else []) + [env[v.name] for _, v in buffers]
    fg.output(tuple(sends + saved_nodes + tail))
    forward = fx.GraphModule(gm, fg)

    # backward: gradient slots of this stage's channel, the saved values, then the leaves
    bg = fx.Graph()
    benv: dict[str, fx.Node] = {}
    binputs: list[StageInput] = []
    for j, d in sorted((grad_slots[s] if s < pp - 1 else {}).items()):
        benv[d] = _from_wire(bg, _placeholder(bg, by_name[d], f"grad_{d}"), _order(by_name[channels[s][j]]))
        binputs.append(StageInput("grad", d, j))
    for k, v in enumerate(saved):
        benv[v] = _placeholder(bg, by_name[v], f"saved_{v}")
        binputs.append(StageInput("saved", v, k))
    _add_leaves(bg, bwd_nodes, leaf, benv, binputs)
    for n in bwd_nodes:
        benv[n.name] = bg.node_copy(n, lambda a: benv[a.name])
    prev = grad_slots[s - 1] if s > 0 else {}
    n_grad_sends = len(channels[s - 1]) if s > 0 else 0
    grad_sends = [_to_wire(bg, benv[prev[j]], _order(by_name[channels[s - 1][j]])) if j in prev else None
                  for j in range(n_grad_sends)]
    names = sorted(grads)
    grad_nodes = []
    for p in names:
        terms = [benv[t.name] for t in grads[p][s]]
        total = terms[0] if terms else None
        for t in terms[1:]:
            total = bg.call_function(aten.add.Tensor, (total, t))
            total.meta["val"] = terms[0].meta.get("val")
        grad_nodes.append(total)
    bg.output(tuple(grad_sends + grad_nodes))
    backward = fx.GraphModule(gm, bg)
    for g in (forward, backward):
        g.graph.lint()
        g.recompile()
    held = sorted(p for p, r in readers.items() if s in r or (not r and s == 0))
    return StageGraphs(s, forward, inputs, len(sends), len(saved), loss is not None,
                       [name for name, _ in buffers], backward, binputs, n_grad_sends, names, held)


def _memory_order(val) -> list[int] | None:
    """The dims of ``val`` outermost first in memory where ``val`` is a dense tensor laid out
    in another order than its shape's (a conv's transposed [b, h, s] view of [b, s, h]); None
    where contiguous."""
    if not isinstance(val, torch.Tensor) or val.is_contiguous():
        return None
    order = sorted(range(val.ndim), key=lambda d: -val.stride(d))
    expected = 1
    for d in reversed(order):
        if val.shape[d] != 1 and val.stride(d) != expected:
            return None  # not a permuted dense layout: sent as a contiguous copy
        expected *= val.shape[d]
    return order


def _order(node: fx.Node) -> list[int] | None:
    return _memory_order(node.meta.get("val"))


def _to_wire(graph: fx.Graph, node: fx.Node, order: list[int] | None) -> fx.Node:
    """What a stage sends for ``node``: point-to-point sends move contiguous buffers only, so a
    value laid out in ``order`` travels permuted into that order (a contiguous copy of it)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or (order is None and val.is_contiguous()):
        return node
    if order is not None:
        node = graph.call_function(aten.permute.default, (node, order))
        node.meta["val"] = val = val.permute(order)
    copy = graph.call_function(aten.clone.default, (node,), {"memory_format": torch.contiguous_format})
    copy.meta["val"] = val.contiguous()
    return copy


def _from_wire(graph: fx.Graph, holder: fx.Node, order: list[int] | None) -> fx.Node:
    """A received value (``holder``, sent by :func:`_to_wire`) back in its shape and layout:
    the receiving stage's views were traced on that layout."""
    if order is None:
        return holder
    val = holder.meta["val"]
    holder.meta["val"] = val.permute(order).contiguous()
    inverse = sorted(range(len(order)), key=order.__getitem__)
    node = graph.call_function(aten.permute.default, (holder, inverse))
    node.meta["val"] = val
    return node


def _read_by(graph_nodes: list[fx.Node]) -> list[str]:
    """Names of the values ``graph_nodes`` read that they do not make, in first-read order."""
    made = {n.name for n in graph_nodes}
    out: dict[str, None] = {}
    for n in graph_nodes:
        for i in n.all_input_nodes:
            if i.name not in made:
                out[i.name] = None
    return list(out)


def _add_leaves(graph: fx.Graph, graph_nodes: list[fx.Node], leaf: Mapping[str, StageInput],
                env: dict[str, fx.Node], inputs: list[StageInput]) -> None:
    """Placeholders for the joint graph's leaves (parameters, inputs, seeds) ``graph_nodes`` read."""
    read = {i.name: i for n in graph_nodes for i in n.all_input_nodes}
    for name in _read_by(graph_nodes):
        if name in leaf and name not in env:
            env[name] = _placeholder(graph, read[name], name)
            inputs.append(leaf[name])


def _placeholder(graph: fx.Graph, source: fx.Node, name: str) -> fx.Node:
    node = graph.placeholder(name)
    for key in ("val", "tensor_meta"):
        if key in source.meta:
            node.meta[key] = source.meta[key]
    return node



def split_backward(stage: StageGraphs) -> BackwardSplit:
    """Cut ``stage``'s backward into its input-gradient part (every node the gradient slots sent
    back depend on) and its weight-gradient part (the rest of what the parameter gradients
    need), as zero-bubble schedules run them (Qi et al. 2023): the values the weight part reads
    from the input part are stashed in between. The first stage sends nothing back: all of its
    backward is weight part."""
    gm = stage.backward
    nodes = list(gm.graph.nodes)
    holders = [n for n in nodes if n.op == "placeholder"]
    source = dict(zip((h.name for h in holders), stage.backward_inputs))
    outs = list(nodes[-1].args[0])
    sends, grads = outs[:stage.n_grad_sends], outs[stage.n_grad_sends:]
    first = _ancestors([s for s in sends if isinstance(s, fx.Node)])
    made_first = {n.name for n in nodes if n.name in first and n.op == "call_function"}
    # the weight part: what the gradients read, down to the input part's values (stashed)
    second = _ancestors([g for g in grads if isinstance(g, fx.Node)], stop=made_first)
    stash = [n for n in nodes if n.name in second and n.name in made_first]

    def build(members: set[str], outputs: list, extra: list[fx.Node]) -> tuple[fx.GraphModule, list[StageInput]]:
        graph, env, inputs = fx.Graph(), {}, []
        for k, node in enumerate(extra):
            env[node.name] = _placeholder(graph, node, f"stash_{node.name}")
            inputs.append(StageInput("stash", node.name, k))
        for h in holders:
            if h.name in members and h.name not in env:
                env[h.name] = _placeholder(graph, h, h.name)
                inputs.append(source[h.name])
        for n in nodes:
            if n.op == "call_function" and n.name in members and n.name not in env:
                env[n.name] = graph.node_copy(n, lambda a: env[a.name])
        graph.output(tuple(env[o.name] if isinstance(o, fx.Node) else None for o in outputs))
        out = fx.GraphModule(gm, graph)
        out.graph.lint()
        out.recompile()
        return out, inputs

    input_grad, input_inputs = build(first, sends + stash, [])
    weight_grad, weight_inputs = build(second, grads, stash)
    return BackwardSplit(input_grad, input_inputs, len(stash), weight_grad, weight_inputs)


def _ancestors(roots: list[fx.Node], stop: set[str] = frozenset()) -> set[str]:
    """Names of ``roots`` and every node (placeholders included) they read, transitively; a
    node in ``stop`` is included but not read through."""
    out: set[str] = set()
    todo = list(roots)
    while todo:
        n = todo.pop()
        if n.name not in out:
            out.add(n.name)
            if n.name not in stop:
                todo.extend(n.all_input_nodes)
    return out


def weight_half_reads(gm: fx.GraphModule, layers: Mapping[str, int]) -> list[str]:
    """The values zero-bubble stashes from a backward's input half for its weight half, on the
    whole joint graph before any cut (what `split_backward` would stash at every cut between
    blocks): the input half is everything the gradients that cross a block boundary backward
    depend on (``layers``: each node's block, as `cost.stages.effective_layers` gives them);
    the stash is what of it the rest of the parameter gradients read."""
    nodes = list(gm.graph.nodes)
    backward = _backward_nodes(nodes)
    crossing = [n for n in nodes if n.name in backward
                and any(u.name in backward and layers.get(u.name, 0) < layers.get(n.name, 0)
                        for u in n.users)]
    first = {name for name in _ancestors(crossing) if name in backward}
    outs = [o for o in nodes[-1].args[0] if isinstance(o, fx.Node)]
    second = _ancestors([o for o in outs if o.name in backward and o.name not in first], stop=first)
    return [n.name for n in nodes if n.name in first and n.name in second]
