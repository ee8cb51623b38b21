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
    graph: TrainingGraph, analysis: GraphAnalysis, roles: dict[str, str] | None = None,
    admits: dict[str, bool | None] | None = None,
) -> TPRecipe:
    """Propagate R/S/P states through the joint graph and collect the TP collectives.

    ``roles`` fixes the role of some weights (col, row, vocab or replicated), as the ILP of
    `tp_ilp` chooses them; the others take Megatron's role from their first use. ``admits``:
    node name -> `admits_sharding` of that node of this graph, filled as it is asked (what the
    recipes of one graph under different roles share; it depends on the node alone).
    """
    return _Propagation(graph, analysis, roles, admits).run()


class _Propagation:
    """One pass of the module docstring's rules over the graph in order: each node's state
    (R, S or P) from its inputs', the weights' roles, and the collectives where a rule needs
    one. A method per kind of node; each returns whether it settled the node."""

    def __init__(self, graph: TrainingGraph, analysis: GraphAnalysis, roles: dict[str, str] | None,
                 admits: dict[str, bool | None] | None = None):
        self.graph, self.analysis = graph, analysis
        self.admits = admits if admits is not None else {}
        self.kinds = {i.node: i for i in graph.inputs}
        self.state: dict[str, str] = {}
        self.weight_of: dict[str, str] = {}
        self.flipped: dict[str, bool] = {}  # weight-derived node -> reached through an odd number of transposes
        self.in_out: set[str] = set()
        self.batch_dep: dict[str, bool] = {}
        self.forced = dict(roles or {})
        self.roles: dict[str, str] = {}
        self.bias_of_col: set[str] = set()
        self.sharded_mm: set[str] = set()
        self.events: list[TPEvent] = []
        self.gathered: set[str] = set()
        self.col_mm: set[str] = set()
        self.wgrad_mm: set[str] = set()
        self.embed_sharded: dict = {}
        self.fallback_ops: set[str] = set()
        self.grouped: set[str] = set()
        self.outputs_of: dict[str, tuple[str, ...]] = {}  # multi-output node -> each output's state

    def run(self) -> TPRecipe:
        """Visit every node in graph order, then settle the roles and weight-derived states."""
        steps = (self._weight_passthrough, self._grouped_backward, self._getitem, self._param_matmul,
                 self._embedding, self._embedding_backward)
        for node in self.graph.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
                continue
            if node.op != "call_function":
                continue
            self.batch_dep[node.name] = any(self.batch_dep.get(i.name, False) for i in node.all_input_nodes)
            if not any(step(node) for step in steps):
                self._other(node)
        return self._finish()

    def forward(self, node) -> bool:
        return self.analysis.nodes[node.name].phase == "forward"

    def nbytes(self, node) -> int:
        return self.analysis.nodes[node.name].nbytes

    def reduce(self, node) -> None:
        """A partial value reduced where a rule needs it whole."""
        if self.state.get(node.name) == "P":
            self.events.append(TPEvent(node.name, "reduce", self.nbytes(node),
                                       self.batch_dep.get(node.name, False), self.forward(node)))
            self.state[node.name] = "R"

    def gather(self, node, batch_dependent: bool, forward: bool, replicated_use: bool = False) -> None:
        """A value gathered: into a column matmul (an SP gather), or, ``replicated_use``, a
        sharded value for a use that needs it whole (with or without SP)."""
        self.events.append(TPEvent(node.name, "gather", self.nbytes(node), batch_dependent, forward,
                                   replicated_use))

    def _placeholder(self, node) -> None:
        spec = self.kinds.get(node.name)
        if spec is not None and spec.kind in ("param", "buffer"):
            self.weight_of[node.name] = spec.name
        self.state[node.name] = "R"
        self.batch_dep[node.name] = spec is not None and spec.kind in ("input", "tangent", "zero_tangent")

    def _weight_passthrough(self, node) -> bool:
        """A view or cast of a weight: it follows its weight."""
        ins = node.all_input_nodes
        if not (node.target in _WEIGHT_PASSTHROUGH and len(ins) == 1 and ins[0].name in self.weight_of):
            return False
        self.weight_of[node.name] = self.weight_of[ins[0].name]
        self.flipped[node.name] = self.flipped.get(ins[0].name, False) != _transposes(node)
        self.state[node.name] = "R"
        return True

    def _grouped_backward(self, node) -> bool:
        """The experts' grouped backward (X, W, offs, dY) -> (dX, dW)."""
        if not is_grouped_backward(node):
            return False
        x, w, _, dy = node.args[:4]
        self.reduce(dy)
        role = self.roles.get(self.weight_of.get(w.name, ""), REPLICATED)
        self.outputs_of[node.name] = _GROUPED_BACKWARD_STATES.get(role, ("R", "R"))
        self.state[node.name] = "S" if role in (COL, ROW) else "R"
        if role in (COL, ROW):
            self.sharded_mm.add(node.name)
            self.wgrad_mm.add(node.name)
        for i in (x, dy):  # a replicated expert weight needs its inputs whole
            if role not in (COL, ROW) and self.state.get(i.name) == "S" and self.batch_dep.get(i.name):
                self.gather(i, True, False, True)
        return True

    def _getitem(self, node) -> bool:
        """One output of a multi-output node: its own state."""
        ins = node.all_input_nodes
        if not (node.target is operator.getitem and ins and ins[0].name in self.outputs_of):
            return False
        self.state[node.name] = self.outputs_of[ins[0].name][node.args[1]]
        return True

    def _param_matmul(self, node) -> bool:
        """A matmul with exactly one weight operand: its role (forced, or Megatron's from the
        input's state) and the output's state."""
        target = node.target
        if not (target in _PARAM_MATMULS or is_grouped_forward(node)):
            return False
        operands = list(node.args[1:3]) if target == aten.addmm.default else list(node.args[:2])
        weights = [a for a in operands if isinstance(a, torch.fx.Node) and a.name in self.weight_of]
        if len(weights) != 1:
            return False
        w = weights[0]
        x = operands[1] if operands[0] is w else operands[0]
        self.reduce(x)
        param = self.weight_of[w.name]
        if is_grouped_forward(node):
            self.grouped.add(param)
        if self.forward(node) and param not in self.roles and getattr(w.meta.get("val"), "ndim", 0) in (2, 3):
            # x @ W' reads W' as [in, out]: W is stored so unless a transpose made W'
            if (operands[1] is w) != self.flipped.get(w.name, False):
                self.in_out.add(param)
        if self._replicated_matmul(node, x, param):
            return True
        x_state = self._forced_input_state(node, x, param)
        if param in self.forced:
            self.roles[param] = self.forced[param]
        if param not in self.roles:
            self.roles[param] = COL if x_state == "R" else ROW
            if self.roles[param] == COL and target == aten.addmm.default:
                bias = node.args[0]
                if isinstance(bias, torch.fx.Node) and bias.name in self.weight_of:
                    self.bias_of_col.add(self.weight_of[bias.name])
        root = self.analysis.nodes[x.name].storage  # q, k, v share one gathered input
        if x_state == "R" and root not in self.gathered and self.batch_dep.get(x.name, False):
            self.gathered.add(root)
            self.gather(x, True, self.forward(node))
        self.state[node.name] = "S" if x_state == "R" else "P"
        self.sharded_mm.add(node.name)
        if x_state == "R" and self.forward(node):
            self.col_mm.add(node.name)
        return True

    def _replicated_matmul(self, node, x, param: str) -> bool:
        """A weight forced replicated, or with one output feature (Qwen2-MoE's shared-expert
        gate, [1, h]: it cannot split over columns, and a sharded output would flip every
        later layer's roles): the matmul runs whole on a whole input."""
        single = (param not in self.forced and param not in self.roles and self.state[x.name] == "R"
                  and node.meta["val"].shape[-1] == 1)
        if not (self.forced.get(param) == REPLICATED or single):
            return False
        self.roles[param] = REPLICATED
        if self.state[x.name] == "S":  # a replicated weight needs its whole input
            self.gather(x, self.batch_dep.get(x.name, False), self.forward(node), True)
        self.state[node.name] = "R"
        return True

    def _forced_input_state(self, node, x, param: str) -> str:
        """The input's state as a forced role meets it: forcing a role changes how the forward
        meets the weight; the backward's matmuls with it follow from the forward's states (as
        for Megatron's own roles)."""
        x_state = self.state[x.name]
        if self.forced.get(param) == COL and x_state == "S" and self.forward(node):
            self.gather(x, self.batch_dep.get(x.name, False), self.forward(node), True)
            return "R"
        if self.forced.get(param) == ROW and x_state == "R" and self.forward(node):
            return "S"  # a row-parallel weight slices a replicated input locally
        return x_state

    def _embedding(self, node) -> bool:
        """A table looked up by batch-dependent ids: vocabulary-parallel unless forced; a
        position table (ids not from the batch) stays replicated and falls through."""
        if node.target != aten.embedding.default:
            return False
        w, ids = node.args[0], node.args[1]
        if w.name in self.weight_of and self.batch_dep.get(ids.name, False):
            table = self.weight_of[w.name]
            self.roles.setdefault(table, self.forced.get(table, VOCAB))
            sharded = self.roles[table] in (VOCAB, COL)
            self.embed_sharded[node.meta.get("seq_nr")] = sharded
            self.state[node.name] = "P" if sharded else "R"
            return True
        self.embed_sharded[node.meta.get("seq_nr")] = False
        return False

    def _embedding_backward(self, node) -> bool:
        """The gradient of the table its forward looked up: sharded if the table is."""
        if node.target not in _EMBED_BWD:
            return False
        self.state[node.name] = "S" if self.embed_sharded.get(node.meta.get("seq_nr"), True) else "R"
        return True

    def _other(self, node) -> None:
        """Any other op: partial inputs reduced unless the op is linear in them; selections
        and factories replicated; a sharded input kept where the op admits it, else gathered."""
        target, ins = node.target, node.all_input_nodes
        in_states = [self.state.get(i.name, "R") for i in ins]
        if "P" in in_states:
            scalar_scale = target in (aten.mul.Tensor, aten.div.Tensor) and len(ins) == 1
            if scalar_scale or (target in _LINEAR and all(s == "P" for s in in_states)):
                self.state[node.name] = "P"
                return
            for i in ins:
                self.reduce(i)
            in_states = [self.state.get(i.name, "R") for i in ins]
        if target in _SELECTION and "S" in in_states:
            self.state[node.name] = "R"  # gather the small routing scores: routers stay replicated
            return
        if target in FACTORY_LIKE:
            self.state[node.name] = "R"  # reads only the dtype and device of its input
            return
        if "S" in in_states:
            # aten's grouped weight gradient X^T dY keeps W's split (`passes.grouped_matmul`)
            if is_grouped(node):
                allowed = True
            else:
                if node.name not in self.admits:
                    self.admits[node.name] = admits_sharding(node)
                allowed = self.admits[node.name]
            if not allowed:  # no strategy keeps a sharded input: gather it, run replicated
                if allowed is None:
                    warn_unknown(node)
                    self.fallback_ops.add(str(target))
                for i, st in zip(ins, in_states):
                    if st == "S" and self.batch_dep.get(i.name):
                        self.gather(i, True, self.forward(node), True)
                self.state[node.name] = "R"
                return
        self.state[node.name] = "S" if "S" in in_states else "R"
        if (target in _PARAM_MATMULS or is_grouped(node)) and self.state[node.name] == "S" and not self.forward(node):
            self.wgrad_mm.add(node.name)

    def _finish(self) -> TPRecipe:
        """A column layer's bias is column too; unused weights replicated; weight-derived
        nodes (casts, transposes of weights) follow their weight's sharding."""
        for name in self.bias_of_col:
            self.roles[name] = COL
        for spec in self.graph.inputs:
            if spec.kind == "param":
                self.roles.setdefault(spec.name, REPLICATED)
        for node_name, param in self.weight_of.items():
            if self.roles.get(param, REPLICATED) != REPLICATED:
                self.state[node_name] = "S"
        parts, heads = _fused_projections(self.graph, self.col_mm, self.weight_of)
        return TPRecipe(self.state, self.roles, self.sharded_mm, self.col_mm, self.wgrad_mm, self.events,
                        self.weight_of, self.batch_dep, self.fallback_ops, parts, heads, self.in_out,
                        self.grouped)


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
