"""Megatron tensor parallelism, found on the joint graph rather than written into the model.

Every value of the training step is in one of three states on the TP axis:

    R  replicated (or, with sequence parallelism, sharded on the sequence)
    S  sharded across the TP ranks (heads, FFN columns, vocabulary)
    P  partial: each rank holds a summand; a reduction makes it R

The rules are Megatron's (Shoeybi et al. 2019), applied to aten nodes in graph order:

    Y = X W,   X in R  ->  W column-parallel, W = [W1 .. Wt],   Y = [X W1 .. X Wt]  in S
    Y = X W,   X in S  ->  W row-parallel,    W = [W1; .. ; Wt], Y = sum_i X_i W_i   in P
    embedding(W, ids) with W sharded on the vocabulary                          -> P
    element-wise/attention ops on S stay S; linear ops (add, view, cast) on P stay P;
    any other use of a P value first reduces it (an all-reduce, or a reduce-scatter under SP).

The backward follows from the same rules: the gradient of a column-parallel input is a P (an
all-reduce in backward), the gradient of a row-parallel input an S. A weight keeps the role of
its first use, which is in the forward. Selection ops (top-k, argmax) gather their S input,
which keeps MoE routers replicated in effect; MoE experts' grouped matmuls
(`passes.grouped_matmul`, weights [E, in, out]) take column and row roles as linear layers do,
every expert alike. An S input may only enter an op that DTensor's
strategies (or `strategies`' own rules) can run sharded; other ops gather it and run
replicated, with a warning naming the op. The result is layout-independent: the degree t
only scales what this module finds.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch

from autopar.analysis.graph import GraphAnalysis
from autopar.capture.joint import TrainingGraph
from autopar.strategies.dtensor import FACTORY_LIKE, admits_sharding, warn_unknown
from passes.grouped_matmul import is_grouped, is_grouped_backward, is_grouped_forward

aten = torch.ops.aten

_PARAM_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default}
# Ops that map partial sums to partial sums (sum_i f(x_i) = f(sum_i x_i)).
_LINEAR = {
    aten.add.Tensor, aten.sub.Tensor, aten.view.default, aten._unsafe_view.default,
    aten.reshape.default, aten.transpose.int, aten.t.default, aten.permute.default,
    aten.clone.default, aten._to_copy.default, aten.neg.default, aten.expand.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.sum.dim_IntList, aten.slice.Tensor,
    aten.select.int, aten.alias.default, aten.detach.default, operator.getitem,
}
# Ops through which a weight stays "the weight" (no new data).
_WEIGHT_PASSTHROUGH = {
    aten.t.default, aten.transpose.int, aten.permute.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default, aten.clone.default,
    aten.detach.default, aten.alias.default, aten.expand.default, aten.unsqueeze.default,
}
_SELECTION = {aten.topk.default, aten.argmax.default, aten.max.dim, aten.sort.default}
_EMBED_BWD = {aten.embedding_dense_backward.default}

COL, ROW, VOCAB, REPLICATED = "col", "row", "vocab", "replicated"

# transformers' grouped backward under a weight role: the states of (dX, dW) (see
# `passes.grouped_matmul`: a column weight's dX is a partial sum, a row weight's is sharded)
_GROUPED_BACKWARD_STATES = {COL: ("P", "S"), ROW: ("S", "S")}


@dataclass(frozen=True)
class TPEvent:
    """A TP collective implied by the recipe: ``kind`` on the value of node ``node``.

    kind "reduce": a P value is reduced (all-reduce; reduce-scatter under SP).
    kind "gather": an R activation enters a column-parallel matmul (an all-gather under SP only).
    """

    node: str
    kind: str
    nbytes: int
    batch_dependent: bool
    forward: bool = True
    always: bool = False  # needed with or without SP (an S value gathered for a replicated use)


@dataclass
class TPRecipe:
    """The TP decisions for one graph: value states, weight roles and implied collectives."""

    state: dict[str, str]  # node -> "R" | "S" | "P"
    roles: dict[str, str]  # parameter name -> col | row | vocab | replicated
    sharded_matmul: set[str]  # matmul nodes whose work splits t ways (S or P outputs)
    column_matmul: set[str] = field(default_factory=set)  # forward X W with X in R (col layers)
    weight_grad_matmul: set[str] = field(default_factory=set)  # backward dW = dY^T X (sharded)
    events: list[TPEvent] = field(default_factory=list)
    weight_of: dict[str, str] = field(default_factory=dict)  # node -> parameter it reads as weight
    batch_dependent: dict[str, bool] = field(default_factory=dict)
    fallback_ops: set[str] = field(default_factory=set)  # ops with no strategy: replicated
    # fused projections (GPT-2's q, k, v in one weight): parameter -> parts, split per part
    fused_parts: dict[str, int] = field(default_factory=dict)
    fused_heads: dict[str, int] = field(default_factory=dict)  # parameter -> heads per part
    # weights a matmul reads as stored, [in, out] (transformers' Conv1D in GPT-2), not
    # through a transpose as nn.Linear's [out, in]: their column / row dims swap
    in_out: set[str] = field(default_factory=set)
    # MoE experts' weights [E, ...] of grouped matmuls: their TP dims are one further in
    grouped: set[str] = field(default_factory=set)

    def divides(self, tp: int) -> bool:
        """Whether every fused projection's heads split ``tp`` ways (q, k, v by heads)."""
        return all(heads % tp == 0 for heads in self.fused_heads.values())

    def param_shard_dim(self, name: str) -> int | None:
        """Tensor dim a parameter is sharded on over TP (None: replicated).

        nn.Linear weights are [out, in]: column-parallel shards dim 0, row-parallel dim 1
        (swapped for weights stored [in, out], see ``in_out``); embeddings [vocab, h] shard
        dim 0; biases of column layers dim 0.
        """
        role = self.roles.get(name, REPLICATED)
        if role == VOCAB:
            return 0
        if role in (COL, ROW):
            return int((role == ROW) != (name in self.in_out)) + int(name in self.grouped)
        return None


def find_tp_recipe(
    graph: TrainingGraph, analysis: GraphAnalysis, roles: dict[str, str] | None = None
) -> TPRecipe:
    """Propagate R/S/P states through the joint graph and collect the TP collectives.

    ``roles`` fixes the role of some weights (col, row, vocab or replicated), as the ILP of
    `tp_ilp` chooses them; the others take Megatron's role from their first use.
    """
    kinds = {i.node: i for i in graph.inputs}
    state: dict[str, str] = {}
    weight_of: dict[str, str] = {}
    flipped: dict[str, bool] = {}  # weight-derived node -> reached through an odd number of transposes
    in_out: set[str] = set()
    batch_dep: dict[str, bool] = {}
    forced = dict(roles or {})
    roles = {}
    bias_of_col: set[str] = set()
    sharded_mm: set[str] = set()
    events: list[TPEvent] = []
    gathered: set[str] = set()

    col_mm: set[str] = set()
    wgrad_mm: set[str] = set()
    embed_sharded: dict = {}
    fallback_ops: set[str] = set()
    grouped: set[str] = set()
    outputs_of: dict[str, tuple[str, ...]] = {}  # multi-output node -> each output's state

    def forward(node) -> bool:
        return analysis.nodes[node.name].phase == "forward"

    def reduce(node) -> None:
        if state.get(node.name) == "P":
            events.append(TPEvent(node.name, "reduce", analysis.nodes[node.name].nbytes,
                                  batch_dep.get(node.name, False), forward(node)))
            state[node.name] = "R"

    for node in graph.gm.graph.nodes:
        if node.op == "placeholder":
            spec = kinds.get(node.name)
            if spec is not None and spec.kind in ("param", "buffer"):
                weight_of[node.name] = spec.name
            state[node.name] = "R"
            batch_dep[node.name] = spec is not None and spec.kind in ("input", "tangent", "zero_tangent")
            continue
        if node.op != "call_function":
            continue
        ins = node.all_input_nodes
        batch_dep[node.name] = any(batch_dep.get(i.name, False) for i in ins)
        target = node.target
        if target in _WEIGHT_PASSTHROUGH and len(ins) == 1 and ins[0].name in weight_of:
            weight_of[node.name] = weight_of[ins[0].name]
            flipped[node.name] = flipped.get(ins[0].name, False) != _transposes(node)
            state[node.name] = "R"
            continue
        if is_grouped_backward(node):  # (X, W, offs, dY) -> (dX, dW)
            x, w, _, dy = node.args[:4]
            reduce(dy)
            role = roles.get(weight_of.get(w.name, ""), REPLICATED)
            outputs_of[node.name] = _GROUPED_BACKWARD_STATES.get(role, ("R", "R"))
            state[node.name] = "S" if role in (COL, ROW) else "R"
            if role in (COL, ROW):
                sharded_mm.add(node.name)
                wgrad_mm.add(node.name)
            for i in (x, dy):  # a replicated expert weight needs its inputs whole
                if role not in (COL, ROW) and state.get(i.name) == "S" and batch_dep.get(i.name):
                    events.append(TPEvent(i.name, "gather", analysis.nodes[i.name].nbytes, True,
                                          False, True))
            continue
        if target is operator.getitem and ins and ins[0].name in outputs_of:
            state[node.name] = outputs_of[ins[0].name][node.args[1]]
            continue
        if target in _PARAM_MATMULS or is_grouped_forward(node):
            operands = list(node.args[1:3]) if target == aten.addmm.default else list(node.args[:2])
            weights = [a for a in operands if isinstance(a, torch.fx.Node) and a.name in weight_of]
            if len(weights) == 1:
                w = weights[0]
                x = operands[1] if operands[0] is w else operands[0]
                reduce(x)
                param = weight_of[w.name]
                if is_grouped_forward(node):
                    grouped.add(param)
                if forward(node) and param not in roles and getattr(w.meta.get("val"), "ndim", 0) in (2, 3):
                    # x @ W' reads W' as [in, out]: W is stored so unless a transpose made W'
                    stored_in_out = (operands[1] is w) != flipped.get(w.name, False)
                    if stored_in_out:
                        in_out.add(param)
                x_state = state[x.name]
                # one output feature (Qwen2-MoE's shared-expert gate, [1, h]) cannot split over
                # columns: replicated, or its sharded output would flip every later layer's roles
                single = (param not in forced and param not in roles and x_state == "R"
                          and node.meta["val"].shape[-1] == 1)
                if forced.get(param) == REPLICATED or single:
                    roles[param] = REPLICATED
                    if x_state == "S":  # a replicated weight needs its whole input
                        events.append(TPEvent(x.name, "gather", analysis.nodes[x.name].nbytes,
                                              batch_dep.get(x.name, False), forward(node), True))
                    state[node.name] = "R"
                    continue
                # forcing a role changes how the forward meets the weight; the backward's matmuls
                # with it follow from the forward's states (as for Megatron's own roles)
                if forced.get(param) == COL and x_state == "S" and forward(node):
                    events.append(TPEvent(x.name, "gather", analysis.nodes[x.name].nbytes,
                                          batch_dep.get(x.name, False), forward(node), True))
                    x_state = "R"
                elif forced.get(param) == ROW and x_state == "R" and forward(node):
                    x_state = "S"  # a row-parallel weight slices a replicated input locally
                if param in forced:
                    roles[param] = forced[param]
                if param not in roles:
                    roles[param] = COL if x_state == "R" else ROW
                    if roles[param] == COL and target == aten.addmm.default:
                        bias = node.args[0]
                        if isinstance(bias, torch.fx.Node) and bias.name in weight_of:
                            bias_of_col.add(weight_of[bias.name])
                root = analysis.nodes[x.name].storage  # q, k, v share one gathered input
                if x_state == "R" and root not in gathered and batch_dep.get(x.name, False):
                    gathered.add(root)
                    events.append(TPEvent(x.name, "gather", analysis.nodes[x.name].nbytes, True,
                                          forward(node)))
                state[node.name] = "S" if x_state == "R" else "P"
                sharded_mm.add(node.name)
                if x_state == "R" and forward(node):
                    col_mm.add(node.name)
                continue
        if target == aten.embedding.default:
            w, ids = node.args[0], node.args[1]
            if w.name in weight_of and batch_dep.get(ids.name, False):
                roles.setdefault(weight_of[w.name], forced.get(weight_of[w.name], VOCAB))
                sharded = roles[weight_of[w.name]] in (VOCAB, COL)
                embed_sharded[node.meta.get("seq_nr")] = sharded
                state[node.name] = "P" if sharded else "R"
                continue
            embed_sharded[node.meta.get("seq_nr")] = False  # a position table: replicated
        if target in _EMBED_BWD:
            # the gradient of the table its forward looked up: sharded if the table is
            sharded = embed_sharded.get(node.meta.get("seq_nr"), True)
            state[node.name] = "S" if sharded else "R"
            continue
        in_states = [state.get(i.name, "R") for i in ins]
        if "P" in in_states:
            scalar_scale = target in (aten.mul.Tensor, aten.div.Tensor) and len(ins) == 1
            if scalar_scale or (target in _LINEAR and all(s == "P" for s in in_states)):
                state[node.name] = "P"
                continue
            for i in ins:
                reduce(i)
            in_states = [state.get(i.name, "R") for i in ins]
        if target in _SELECTION and "S" in in_states:
            # gather the small routing scores: routers stay replicated in effect
            state[node.name] = "R"
            continue
        if target in FACTORY_LIKE:
            state[node.name] = "R"  # reads only the dtype and device of its input
            continue
        if "S" in in_states:
            # aten's grouped weight gradient X^T dY keeps W's split (`passes.grouped_matmul`)
            allowed = True if is_grouped(node) else admits_sharding(node)
            if not allowed:  # no strategy keeps a sharded input: gather it, run replicated
                if allowed is None:
                    warn_unknown(node)
                    fallback_ops.add(str(target))
                for i, st in zip(ins, in_states):
                    if st == "S" and batch_dep.get(i.name):
                        events.append(TPEvent(i.name, "gather", analysis.nodes[i.name].nbytes, True,
                                              forward(node), True))
                state[node.name] = "R"
                continue
        state[node.name] = "S" if "S" in in_states else "R"
        if (target in _PARAM_MATMULS or is_grouped(node)) and state[node.name] == "S" and not forward(node):
            wgrad_mm.add(node.name)
    for name in bias_of_col:
        roles[name] = COL
    for spec in graph.inputs:
        if spec.kind == "param":
            roles.setdefault(spec.name, REPLICATED)
    # weight-derived nodes (casts, transposes of weights) follow their weight's sharding
    for node_name, param in weight_of.items():
        if roles.get(param, REPLICATED) != REPLICATED:
            state[node_name] = "S"
    parts, heads = _fused_projections(graph, col_mm, weight_of)
    return TPRecipe(state, roles, sharded_mm, col_mm, wgrad_mm, events, weight_of, batch_dep,
                    fallback_ops, parts, heads, in_out, grouped)


def _transposes(node) -> bool:
    """Whether a weight pass-through op swaps a 2-D weight's two dims."""
    if node.target in (aten.t.default, aten.transpose.int):
        return True
    if node.target == aten.permute.default:
        return list(node.args[1]) == [1, 0]
    return False


# Ops that keep a matmul's output features as they are (same values, maybe a new batch shape).
_FEATURE_PASSTHROUGH = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._to_copy.default,
    aten.clone.default, aten.alias.default, aten.detach.default,
}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def _fused_projections(graph: TrainingGraph, col_mm: set[str], weight_of: dict[str, str]):
    """Column-parallel weights whose output is cut into equal parts along the features.

    GPT-2's ``qkv(x).view(b, s, 3, heads, head_dim)`` (or a ``split``/``chunk`` into equal
    parts): a plain Shard(0) of the weight would give rank 0 all of q and half of k, so the
    weight (and its bias) is split per part, and each rank computes its own heads of q, k and v.
    Returns (parameter -> parts, parameter -> heads per part; 0 where a split names no heads).
    """
    parts: dict[str, int] = {}
    heads: dict[str, int] = {}
    for node in graph.gm.graph.nodes:
        if node.name not in col_mm:
            continue
        found = _feature_split(node)
        if found is None:
            continue
        for param in _projection_params(node, weight_of):
            parts[param], heads[param] = found
    return parts, heads


def _projection_params(node, weight_of: dict[str, str]) -> list[str]:
    """The weight of a column-parallel matmul, and its bias (addmm's first operand)."""
    operands = list(node.args[:3]) if node.target == aten.addmm.default else list(node.args[:2])
    return [weight_of[a.name] for a in operands if isinstance(a, torch.fx.Node) and a.name in weight_of]


def _feature_split(mm) -> tuple[int, int] | None:
    """(parts, heads) if the output features of ``mm`` are split into parts > 1 downstream."""
    features = mm.meta["val"].shape[-1]
    frontier = [mm]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            val = user.meta.get("val")
            if user.target in _SPLITS and _split_dim(user, node) == node.meta["val"].ndim - 1:
                sizes = [v.shape[-1] for v in val]
                if len(sizes) > 1 and len(set(sizes)) == 1:
                    return len(sizes), 0
            if user.target not in _FEATURE_PASSTHROUGH or not isinstance(val, torch.Tensor):
                continue
            trailing = _trailing_factors(tuple(val.shape), features)
            if trailing == (features,):
                frontier.append(user)  # same features: a new batch shape or a cast
            elif user.target in _VIEWS and trailing and len(trailing) >= 3 and trailing[0] > 1:
                return trailing[0], trailing[1]  # (parts, heads, head_dim)
    return None


def _split_dim(node, source) -> int:
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    return dim % source.meta["val"].ndim


def _trailing_factors(shape: tuple[int, ...], features: int) -> tuple[int, ...] | None:
    """The last dims of ``shape`` whose product is ``features`` (None if none is exactly)."""
    product = 1
    for i in range(len(shape) - 1, -1, -1):
        product *= shape[i]
        if product == features:
            return shape[i:]
        if product > features:
            return None
    return None
