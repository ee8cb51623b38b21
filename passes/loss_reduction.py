"""The loss's reduction over the batch: proven to split exactly, or refused.

Data parallelism over d ranks and gradient accumulation over m micro-batches cut one step's
batch into P = d m pieces; piece k runs the captured graph on its rows and computes its own loss
L_k. The step's loss must be the one-device loss L over the whole batch, its gradients those of
L. `analyze_loss` proves, on the captured joint graph, that L is a linear combination

    L = sum_i c_i N_i / D_i + sum_j a_j M_j + U                                         (1)

of batch-reduced values, each of a kind whose pieces add up:

- E, extensive: a sum over the batch of per-sample values, N = sum_k N_k;
- A, averaged: a mean over the batch (a sum divided by its constant element count),
  M = (1/P) sum_k M_k, since every piece holds the same number of rows;
- U, uniform: no user input in it (a weight decay term, a constant), the same in every piece;
- a ratio N_i / D_i whose denominator D_i is a *data-only* extensive value (from user inputs,
  buffers and constants, never parameters: a token count, a mask's sum, the ``total_weight``
  of a weighted or mean ``nll_loss``).

Per-sample values (kind B, with the dimension the batch is split on) are followed through
pointwise ops, views and reductions over other dimensions; the model's own ops (matmuls,
embeddings, attention, norms) are taken as per-sample along dim 0, as data parallelism itself
assumes. Anything else reaching the loss (a batch-reduced value squared or logged, a max or
median over the batch, a product of two means, a sum added to a mean) is refused with the
op and the user's source line.

A mean written by hand arrives as a batch sum divided by a number (the capture bakes the
piece's sizes in): `_by_number` takes it as a mean only when the number is a multiple of the
piece's rows dividing the count of elements the sums added, and refuses it where that number
is also one of the model's other sizes (a constant could be it too) or is a multiple of the
rows counting no elements. A tensor divisor is a uniform scale only when computed from
parameters; a data tensor is read as a number, or refused. At one row per piece the dims
cannot be told apart by size: ops that combine values along dim 0 are refused there.

The pieces then add up to L in one of four ways (`LossReduction.mode`), each a choice of the
loss's seed gradient s_k for piece k (the data-parallel pass divides it by d again, so the
runtime feeds d w_k with sum over all pieces of w_k = 1 for a mean):

- "mean": no ratio: w_k = 1 / P (every piece's mean weighs the same; uniform terms too);
- "sum": the loss is extensive (``reduction="sum"``): w_k = 1;
- "ratio": one data-only denominator D and otherwise only uniform terms, L = N / D + U:
  w_k = D_k / D, since sum_k (D_k / D)(N_k / D_k + U) = N / D + U. A piece with D_k = 0 (all
  labels ignored) would compute 0/0, so `for_layout` runs every "ratio" as "global";
- "global": several denominators, or ratios beside means: every denominator node D_i is
  replaced by a new graph input fed D_i / P, D_i summed over all pieces before the step runs
  (`rewrite_denominators`). Piece k then computes c_i N_ik P / D_i, which averages (w_k = 1/P)
  to c_i N_i / D_i, while means and uniform terms average as in "mean". The forward and the
  backward read the same node, so both see the global value. A mean ``nll_loss`` is rewritten
  as its sum divided by the new input; its backward already divides by ``total_weight``.
  The inputs are scalars computed from data only: replicated under TP, fed to every pipeline
  stage that reads them.

``Counter`` computes every D_i of one micro-batch from its user inputs and buffers (ops copied
from the captured graph; a ``total_weight`` from the labels and class weights).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from vocab.plan_types import GraphSignature

aten = torch.ops.aten

_MEAN, _SUM = 1, 2  # torch's Reduction::Mean, Reduction::Sum
# kind of the graph inputs `rewrite_denominators` adds (runtime.executor feeds them; the same
# string there, as runtime may not import passes)
DENOMINATOR = "denominator"
# ops that keep a value's content (a view, a copy, a dtype change)
_SAME = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.alias.default,
         aten.clone.default, aten.detach.default, aten.contiguous.default, aten._to_copy.default,
         aten.lift_fresh_copy.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
         aten.unsqueeze.default, aten.expand.default, aten.permute.default, aten.transpose.int,
         aten.t.default}
# ops that read only their input's shape, dtype and device: a new constant tensor
_SHAPE_ONLY = {aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
               aten.new_full.default, aten.zeros_like.default, aten.ones_like.default,
               aten.empty_like.default, aten.full_like.default, aten.sym_size.int}
# ops along a dimension whose every output reads every input along it (along the batch: the
# pieces do not combine)
_ACROSS = {aten._softmax.default, aten._log_softmax.default}
_LINEAR_SUM = {aten.sum.default, aten.sum.dim_IntList}
_LINEAR_MEAN = {aten.mean.default, aten.mean.dim}
_NLL = {aten.nll_loss_forward.default: aten.nll_loss_backward.default,
        aten.nll_loss2d_forward.default: aten.nll_loss2d_backward.default}


@dataclass(frozen=True)
class _Facts:
    """What the analysis reads besides kinds: the piece's rows, which nodes read parameters,
    the values of scalar tensor constants, and the sizes a divisor could be made of other than
    the batch (the inputs' other dims and the parameters' dims, and products of two)."""

    batch: int
    has_param: dict
    consts: dict
    sizes: frozenset
    rows_proven: bool = False  # at one row: the same step at two rows was proven (`analyze_loss`)


@dataclass(frozen=True)
class Kind:
    """How a value behaves when the batch is cut into pieces (see the module docstring).

    kind: "U" | "B" (per-sample, batch on dim ``dim``) | "E" | "A" | "X" (not provable, ``why``);
    dens: the data-only denominators a value divides by ("B": pending, "A": its ratios);
    data_only: an "E" computed without parameters (a candidate denominator);
    means: an "A" holding a mean over the batch (not only ratios and uniform terms);
    count: an "E": how many elements its sums added (a hand-written mean divides by it, by the
    rows, or by a multiple of the rows dividing it), 0 if unknown;
    per: a "B": how many elements each of its values summed over other dims (multiplied into
    ``count`` when the batch is summed);
    loose: a "B" the model computed with rows other than the batch's (a mixture-of-experts
    capacity buffer): the model's business, its ops not followed dim by dim.
    """

    kind: str
    dim: int = 0
    dens: tuple = ()
    data_only: bool = False
    means: bool = False
    loose: bool = False
    count: int = 0
    per: int = 1
    why: str = ""
    node: fx.Node | None = None


_U = Kind("U")


def _x(node: fx.Node, why: str) -> Kind:
    return Kind("X", why=why, node=node)


@dataclass
class Counter:
    """The denominators of one micro-batch: ``gm(*inputs) -> tuple of 0-dim tensors``.

    inputs: ("input", index of the step's user input) or ("buffer", name), per placeholder.
    """

    gm: fx.GraphModule
    inputs: list[tuple[str, str]]

    def __call__(self, user_inputs: tuple, buffers: dict) -> torch.Tensor:
        args = [user_inputs[int(name)] if kind == "input" else buffers[name] for kind, name in self.inputs]
        with torch.no_grad():
            return torch.stack([v.to(torch.float64).reshape(()) for v in self.gm(*args)])


@dataclass
class LossReduction:
    """What `analyze_loss` proved about the loss, and how the runtime splits it exactly.

    mode: "mean" | "sum" | "ratio" | "global" (see the module docstring) | "unproven";
    counter: the denominators' counter ("ratio": one, "global": one per denominator node);
    denominators: the denominator nodes, in the counter's order; why/node: what is unproven.
    """

    mode: str
    counter: Counter | None = None
    denominators: list[fx.Node] = field(default_factory=list)
    why: str = ""
    node: fx.Node | None = None

    def where(self) -> str:
        """Where the unproven op comes from: the user's source line if the capture recorded
        it (``meta["stack_trace"]``), else the module whose forward ran it."""
        if self.node is None:
            return ""
        trace = self.node.meta.get("stack_trace") or ""
        lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
        if len(lines) >= 2 and lines[-2].startswith("File "):  # the innermost frame and its code
            head = lines[-2].removeprefix("File ").split(", ")
            if len(head) == 3:
                return f"at {head[0].strip(chr(34))}:{head[1].removeprefix('line ')} {head[2]}: {lines[-1]}"
        if lines:
            return "\n    ".join(lines[-2:])
        module = self.node.meta.get("module")
        return f"in the forward of {module or 'the top-level module (or loss_fn)'}"


# why a one-row piece is unproven where more rows might be (`analyze_loss`'s ``rows_proven``)
ONE_ROW = "runs along dim 0 of a micro-batch of one row"


def analyze_loss(gm: fx.GraphModule, signature: GraphSignature, rows_proven: bool = False) -> LossReduction:
    """Prove the loss output of the joint graph ``gm`` is of form (1), and say how to split it.

    At one row per piece the batch dim is not told apart from the others by size, and an op
    combining values along dim 0 is unproven (`ONE_ROW`); ``rows_proven``: the same step
    captured at two rows was proven (its ops keep the samples apart), so such ops are not."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    loss = output.args[0][signature.loss_index]
    kinds_in = dict(zip(signature.placeholders, signature.inputs))
    top = _kind_of(gm, signature, loss, rows_proven)
    if top.kind == "X":
        return LossReduction("unproven", why=top.why, node=top.node)
    if top.kind == "B":
        return LossReduction("unproven", why="the loss is not reduced over the batch", node=loss)
    if top.kind == "E":
        return LossReduction("sum")
    dens = list(dict.fromkeys(top.dens))
    if not dens:
        return LossReduction("mean")
    for den in dens:
        if den.target in _NLL:  # its total_weight, read by its backward
            uses = [(u, t) for t in den.users if t.args[1] == 1 for u in t.users]
        else:
            uses = [(u, den) for u in den.users]
        bad = [u for u, d in uses if not _divides_by(u, d)]
        if bad:
            return LossReduction("unproven", node=bad[0], why=f"the normaliser {den.name} is also "
                                 f"used otherwise than as a divisor ({bad[0].target})")
    counter = _counter(gm, dens, kinds_in)
    if isinstance(counter, str):
        return LossReduction("unproven", why=counter, node=dens[0])
    mode = "ratio" if len(dens) == 1 and not top.means else "global"
    return LossReduction(mode, counter=counter, denominators=dens)


def output_join(gm: fx.GraphModule, signature: GraphSignature, node: fx.Node,
                rows_proven: bool = False, fed: frozenset = frozenset()) -> LossReduction:
    """How the 0-dim output ``node`` of ``gm`` (a value the forward returns beside the loss: a
    metric, an auxiliary loss, a count) joins over the step's micro-batches, each of the same
    rows: mode "mean" for a mean over the batch (kind A) or a value the batch does not enter (U:
    every micro-batch computes the same), "sum" for a sum over it (E: a count, a summed loss).
    A ratio of batch sums averages where each of its denominators is one of ``fed``, the loss's
    normalisers that `rewrite_denominators` replaces by the step's (D / P in every piece: the
    pieces' c N_k P / D average to c N / D over all P = d m pieces, so over the d data-parallel
    ranks too: the mode's denominators name them; a copy of a cross-entropy loss); a ratio L = N / D + U
    over one other data-only denominator is mode "ratio", with the counter of D: the pieces'
    values weighted by D_k / D add up to it (sum_k (D_k / D)(N_k / D_k + U) = N / D + U; an
    accuracy over the labels a mask keeps). "unproven" otherwise, with why: several
    denominators or a mean beside a ratio, a max over the batch, a value not reduced over it.
    ``rows_proven``: as for `analyze_loss`."""
    k = _kind_of(gm, signature, node, rows_proven)
    if k.kind == "X":
        return LossReduction("unproven", why=k.why, node=k.node)
    if k.kind == "E":
        return LossReduction("sum")
    dens = list(dict.fromkeys(k.dens))
    if k.kind == "U" or (k.kind == "A" and set(dens) <= fed):
        return LossReduction("mean", denominators=dens)
    if k.kind == "A" and len(dens) == 1 and not k.means:
        counter = _counter(gm, dens, dict(zip(signature.placeholders, signature.inputs)))
        if isinstance(counter, str):
            return LossReduction("unproven", why=counter, node=dens[0])
        return LossReduction("ratio", counter=counter, denominators=dens)
    if k.kind == "A":
        return LossReduction("unproven", node=node, why="a mean beside a ratio of sums over the "
                             "batch, or ratios of several: no weights of the micro-batches give it")
    return LossReduction("unproven", why="not reduced over the batch", node=node)


def samples_apart(gm: fx.GraphModule, signature: GraphSignature, node: fx.Node) -> bool:
    """Whether the analysis follows ``node`` without mixing the batch's samples (a mean, a sum, a
    ratio of sums or a value the batch does not enter, however the pieces then join): on a step
    captured at two rows, what proves an op along dim 0 keeps them apart at one row."""
    return _kind_of(gm, signature, node, False).kind in ("U", "E", "A")


def _kind_of(gm: fx.GraphModule, signature: GraphSignature, target: fx.Node, rows_proven: bool) -> Kind:
    """The `Kind` of ``target``, from the kinds of the nodes it is computed from."""
    kinds_in = dict(zip(signature.placeholders, signature.inputs))
    batch = _local_batch(gm, kinds_in)
    needed = _ancestors(target)
    has_param: dict[fx.Node, bool] = {}
    kinds: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        if node not in needed:
            continue
        has_param[node] = (kinds_in.get(node.name, ("",))[0] == "param"
                           or any(has_param.get(i, False) for i in node.all_input_nodes))
    facts = _Facts(batch, has_param, _constants(gm), _sizes(gm, kinds_in), rows_proven)
    for node in gm.graph.nodes:
        if node in needed:
            kinds[node] = _kind(node, kinds, kinds_in, facts)
    return kinds[target]


def for_layout(reduction: LossReduction, tp: int, pp: int) -> LossReduction:
    """The reduction to execute: a "ratio" runs as "global" under every layout (the step-wide
    normaliser fed in, divided by the pieces: a piece without a valid label computes
    0 / (D / P) = 0, as one device adds nothing for it, where "ratio"'s seed-weighted 0 / 0 is
    a NaN). ``tp`` and ``pp`` are kept for the callers: the fed normalisers run under tensor
    parallelism and pipelines alike."""
    if reduction.mode == "ratio":
        return LossReduction("global", counter=reduction.counter, denominators=list(reduction.denominators))
    return reduction


def _local_batch(gm: fx.GraphModule, kinds_in: dict) -> int:
    sizes = [n.meta["val"].shape[0] for n in gm.graph.nodes if n.op == "placeholder"
             and kinds_in.get(n.name, ("",))[0] == "input" and n.meta["val"].dim() > 0]
    return int(sizes[0]) if sizes else 1


def _constants(gm: fx.GraphModule) -> dict[fx.Node, float]:
    """The value of every one-element tensor constant of the graph (``torch.tensor(4.0)`` in the
    loss), and of its copies."""
    consts: dict[fx.Node, float] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            val = getattr(gm, node.target, None)
            if isinstance(val, torch.Tensor) and val.numel() == 1 and not val.requires_grad:
                consts[node] = float(val)
        elif node.op == "call_function" and node.target in _SAME and node.args[0] in consts:
            consts[node] = consts[node.args[0]]
    return consts


def _sizes(gm: fx.GraphModule, kinds_in: dict) -> frozenset:
    """The sizes a number in the loss could be read from other than the batch: 1, the user
    inputs' other dims (and each input's product of them), every parameter's dims, and the
    products of two of these."""
    single = {1}
    for node in gm.graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        kind = kinds_in.get(node.name, ("",))[0]
        shape = tuple(node.meta["val"].shape)
        if kind == "input":
            single |= set(shape[1:]) | {math.prod(shape[1:])}
        elif kind == "param":
            single |= set(shape)
    return frozenset(single | {a * b for a in single for b in single})


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _divides_by(user: fx.Node, den: fx.Node) -> bool:
    if user.target in (aten.div.Tensor,) and len(user.args) == 2 and user.args[1] is den and user.args[0] is not den:
        return True
    return user.target in _NLL.values() and user.args[6] is den and user.args[4] == _MEAN


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _kind(node: fx.Node, kinds: dict, kinds_in: dict, facts: _Facts):
    """The kind of ``node`` from its inputs' (a list of kinds for a multi-output op)."""
    batch, has_param = facts.batch, facts.has_param
    if node.op == "placeholder":
        # one row per piece: its dims cannot be told apart by size, and need not be (every
        # value is one sample's); reductions take dim 0 as the batch's
        return Kind("B", 0, loose=batch == 1) if kinds_in.get(node.name, ("",))[0] == "input" else _U
    if node.op != "call_function":
        return _U
    ins = [kinds[i] for i in node.all_input_nodes]
    flat = [k for i in ins for k in (i if isinstance(i, list) else [i])]
    if all(k.kind == "U" for k in flat):
        return _U
    bad = next((k for k in flat if k.kind == "X"), None)
    if bad is not None:
        return bad
    target = node.target
    if target == operator.getitem:
        parent = kinds[node.args[0]]
        return parent[node.args[1]] if isinstance(parent, list) else parent
    if target in _NLL:
        return _nll(node, kinds, has_param)
    if target in _LINEAR_SUM or target in _LINEAR_MEAN:
        return _reduce(node, kinds[node.args[0]], has_param)
    schema = getattr(target, "_schema", None)
    if schema is not None and any(a.name == "reduction" for a in schema.arguments):
        return _elementwise_loss(node, kinds, has_param)
    if any(k.kind == "B" and k.loose for k in flat) and not any(k.kind in "EA" for k in flat):
        if batch == 1 and not facts.rows_proven and _along_rows(node, kinds):
            return _x(node, f"{target} {ONE_ROW}, which may be the "
                      "batch: its pieces would not combine into the whole batch's value (fix: run it "
                      "along another dim, or use a micro-batch of more than one row to let autopar "
                      "tell the dims apart)")
        return _model_op(node, kinds, batch)
    if target in _SAME:
        return _same(node, kinds[node.args[0]])
    if target in _SHAPE_ONLY:
        return _U
    if any(k.kind in "EA" for k in flat):
        return _algebra(node, kinds, facts)
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise(node, kinds)
    if schema is not None and any(a.name in ("dim", "dims") for a in schema.arguments):
        return _along_dims(node, kinds, batch)
    return _model_op(node, kinds, batch)


def _along_rows(node: fx.Node, kinds: dict) -> bool:
    """At one row per piece (dims not told apart by size): whether ``node`` combines values
    along dim 0 of a per-sample input, which would mix the rows of a larger batch (a softmax, a
    reduction even with ``keepdim``, a cumulative sum). Views and indexing are let through: after
    a permute dim 0 need not be the batch, and they only move values."""
    schema = getattr(node.target, "_schema", None)
    first = next((i for i in node.all_input_nodes if kinds[i] != _U), None)
    src = _shape(first)
    if schema is None or src is None or not src or node.target in _SAME:
        return False
    names = [a.name for a in schema.arguments]
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound |= dict(zip(names, node.args)) | dict(node.kwargs)
    dims = bound.get("dim", bound.get("dims")) if ("dim" in names or "dims" in names) else ()
    dims = list(range(len(src))) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    if 0 not in [d % len(src) for d in dims]:
        return False
    return (node.target in _ACROSS or "keepdim" in names
            or schema.name.removeprefix("aten::") in ("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin"))


def _value(node, kinds) -> Kind | None:
    """A python number or a node's kind (None for a number)."""
    return kinds[node] if isinstance(node, fx.Node) else None


_FIX_NUMBER = ("fix: a micro-batch size that differs from the model's other sizes, "
               "loss_reduction=\"mean_per_rank\", or a mean op (.mean(), reduction=\"mean\")")


def _by_number(node: fx.Node, divisor: float, facts: _Facts, k: Kind, strict: bool = True) -> Kind:
    """A batch sum S of n = ``k.count`` elements divided by a number d (the capture bakes the
    piece's sizes in, so ``S / x.shape[0]``, ``S / x.numel()`` arrive as numbers).

    A hand-written mean divides by a d proportional to the piece's rows b: then one device's
    S / (P d) = (1/P) sum_k S_k / d, an average of the pieces. Such a d is a multiple of b
    that divides n (the rows, the flattened tokens, the elements): taken as a mean, unless d is
    also one of the model's other sizes (or a product of two, or 1), which a constant could be
    as well (ambiguous: refused). A d that is no multiple of b is a constant scale: S / d adds
    up over the pieces. A multiple of b that does not divide n is refused, not guessed. A
    factor multiplied in (``not strict``: ``0.1 * S``, ``S * (1 / b)``) is a coefficient as
    often as a mean: one whose inverse could be a mean is refused as ambiguous, any other is a
    constant scale. At one
    row every d is a multiple of b: a d that could be a mean (one of the sizes dividing n) is
    refused as ambiguous, any other is a constant scale."""
    d = abs(float(divisor))
    constant = Kind("E", data_only=k.data_only)
    if d == 0 or not math.isfinite(d) or abs(d - round(d)) > 1e-9 * d:
        return constant
    d = round(d)
    divides = bool(k.count) and k.count % d == 0
    if facts.batch == 1 and not (divides and d in facts.sizes):
        return constant  # a mean of one row would divide by one of the sizes
    if d % facts.batch or (not divides and not strict):
        return constant
    if not strict:
        return _x(node, f"a sum over the batch times 1/{d}: a mean over the micro-batch of "
                  f"{facts.batch} row(s) or a coefficient; autopar cannot tell which (fix: write a "
                  "mean as a division, S / x.shape[0], or a mean op; or use loss_reduction="
                  "\"mean_per_rank\")")
    if not divides:
        return _x(node, f"a sum over the batch divided by {d}, a multiple of the micro-batch's "
                  f"{facts.batch} rows that is not a count of the elements the sum added: neither a "
                  "mean nor a constant scale autopar can prove (fix: divide by x.shape[0] or "
                  "x.numel() of the summed value, or use a mean op)")
    if d in facts.sizes:
        return _x(node, f"a sum over the batch divided by {d}: a mean over the micro-batch of "
                  f"{facts.batch} row(s), or a constant scale ({d} is also one of the model's other "
                  f"sizes); autopar cannot tell which ({_FIX_NUMBER})")
    return Kind("A", means=True)


def _scale(node: fx.Node, other, facts: _Facts, k: Kind, inverse: bool) -> Kind:
    """A batch sum ``k`` times or divided by ``other`` (a number or a tensor node): by a
    parameter-derived tensor (a temperature) a uniform scale; by a number or a data tensor of
    known value, `_by_number`; by a data tensor autopar cannot read, refused."""
    if k.kind != "E":
        return k
    if isinstance(other, fx.Node):
        if facts.has_param.get(other, False):
            return k
        if other not in facts.consts:
            return _x(node, "a sum over the batch scaled by a tensor computed without parameters, "
                      "whose value autopar cannot read (a mean over the batch, or a constant?) "
                      "(fix: divide by a python number such as x.shape[0], or use a mean op)")
        other = facts.consts[other]
    if not inverse:
        if other == 0:
            return Kind("E", data_only=k.data_only)
        other = 1.0 / other
    return _by_number(node, other, facts, k, strict=inverse)


def _algebra(node: fx.Node, kinds: dict, facts: _Facts) -> Kind:
    """Linear combinations of batch-reduced values, and B / D with a data-only D."""
    t = node.target
    args = [_value(a, kinds) for a in node.args[:2]]
    name = str(getattr(t, "__name__", t))
    if t in (aten.neg.default,):
        return args[0]
    if t in (aten.add.Tensor, aten.sub.Tensor) and all(a is not None for a in args):
        a, b = args
        if a.kind == "U":
            a, b = b, a
        if b.kind == "U" and a.kind == "A":
            return a
        if a.kind == b.kind == "E":
            return Kind("E", data_only=a.data_only and b.data_only, count=a.count if a.count == b.count else 0)
        if a.kind == b.kind == "A":
            return Kind("A", dens=a.dens + b.dens, means=a.means or b.means)
        return _x(node, f"{name} adds a sum over the batch to a mean or a per-sample value "
                  f"({a.kind} + {b.kind}): no split of the batch keeps it")
    if t in (aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar):
        k = next(a for a in args if a is not None)
        return k if k.kind == "A" else _x(node, f"{name} adds a constant to a sum over the batch")
    if t in (aten.mul.Tensor, aten.mul.Scalar):
        a, b = args
        if a is None or a.kind == "U":
            return _scale(node, node.args[0], facts, b, inverse=False)
        if b is None or b.kind == "U":
            return _scale(node, node.args[1], facts, a, inverse=False)
        if a.kind == b.kind == "A":
            return _x(node, f"{name} multiplies two means over the batch (a load-balancing auxiliary "
                      "loss f . P is one): a product of batch means is no sum over samples, so no split "
                      "of the batch keeps it (fix: loss_reduction=\"mean_per_rank\" to average it "
                      "per micro-batch knowingly, as DDP does, or a layout with dp=1 and grad_accum=1)")
        return _x(node, f"{name} multiplies two batch-dependent values ({a.kind} x {b.kind}): not linear "
                  "in the batch")
    if t in (aten.div.Tensor, aten.div.Scalar):
        a, b = args
        if b is None or b.kind == "U":
            return _scale(node, node.args[1], facts, a, inverse=True)
        if b.kind == "E" and b.data_only and a.kind in "EB" and not a.dens:
            den = node.args[1]
            return Kind("A", dens=(den,)) if a.kind == "E" else Kind("B", a.dim, dens=(den,))
        return _x(node, f"{name} divides by a batch-dependent value that is not a data-only sum over "
                  "the batch (a count or a mask's sum)")
    return _x(node, f"{name} of a value reduced over the batch: not linear in the batch")


def _reduce(node: fx.Node, k: Kind, has_param: dict) -> Kind:
    """sum / mean: over the batch dimension, a per-sample value becomes E / A. A sum's
    element count is carried: per row through sums over other dims (``per``), then into the
    batch sum's ``count``, and on through later sums of it."""
    shape = _shape(node.args[0]) or ()
    mean = node.target in _LINEAR_MEAN
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = list(range(len(shape))) if not dims else [d % max(len(shape), 1) for d in dims]
    added = math.prod(shape[d] for d in dims) if shape else 1
    if k.kind == "E" and not mean:  # over the remaining (non-batch) dims: still linear
        return Kind("E", data_only=k.data_only, count=k.count * added)
    if k.kind in "EA":
        return k
    if k.dim not in dims:
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        return Kind("B", k.dim if keep else k.dim - sum(d < k.dim for d in dims), dens=k.dens,
                    per=k.per if mean else k.per * added)
    if mean:
        if k.dens:
            return _x(node, "a mean over the batch of values divided by a batch sum")
        return Kind("A", means=True)
    if k.dens:
        return Kind("A", dens=k.dens)
    return Kind("E", data_only=not has_param[node], count=k.per * added)


def _elementwise_loss(node: fx.Node, kinds: dict, has_param: dict) -> Kind:
    """mse_loss, l1_loss, binary_cross_entropy(_with_logits), huber / smooth_l1 ...: per element
    of its per-sample inputs, then reduced by ``reduction`` (mean: a constant count)."""
    if isinstance(node.meta.get("val"), (tuple, list)):
        return _x(node, f"{node.target}: a loss op autopar does not know")
    ins = [kinds[i] for i in node.all_input_nodes]
    if any(isinstance(k, list) or k.kind not in "BU" or k.dens for k in ins):
        return _x(node, f"{node.target} of a value reduced over the batch")
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound |= dict(zip([a.name for a in schema.arguments], node.args)) | dict(node.kwargs)
    reduction = bound.get("reduction", _MEAN)
    if reduction == _MEAN:
        return Kind("A", means=True)
    if reduction == _SUM:
        return Kind("E", data_only=not has_param[node], count=math.prod(_shape(node.args[0]) or ()))
    return _pointwise(node, kinds)


def _nll(node: fx.Node, kinds: dict, has_param: dict) -> list[Kind] | Kind:
    """nll_loss_forward, nll_loss2d_forward (classes on dim 1, as a (B, C, T) cross entropy
    lowers): (loss, total_weight), per sample along dim 0."""
    x, target, weight, reduction, _ = node.args
    kx, kt = kinds[x], kinds[target]
    if kx.kind != "B" or kx.dim != 0 or kt.kind not in "BU" or kx.dens:
        return _x(node, "nll_loss over values that are not per-sample along dim 0")
    data_only = not has_param[target] and (weight is None or not has_param[weight])
    total = Kind("E", data_only=data_only)
    if reduction == _SUM:
        return [Kind("E", count=math.prod(_shape(target) or ())), total]
    if reduction == _MEAN:
        if not data_only:
            return _x(node, "nll_loss's class weights come from parameters")
        return [Kind("A", dens=(node,)), total]
    return [Kind("B", 0), total]


def _same(node: fx.Node, k: Kind) -> Kind:
    """Views and copies: E / A / U unchanged, a per-sample value's batch dimension followed."""
    if k.kind != "B":
        return k
    t, a = node.target, node.args
    src, out = _shape(a[0]), _shape(node)
    if src is None or out is None:
        return _x(node, f"{t} without shapes")
    d = k.dim
    if t in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
        d = _view_dim(src, out, d)
    elif t == aten.expand.default:
        d = d + len(out) - len(src)
    elif t == aten.permute.default:
        d = [p % len(src) for p in a[1]].index(d)
    elif t in (aten.transpose.int, aten.t.default):
        i, j = (0, 1) if t == aten.t.default else (a[1] % len(src), a[2] % len(src))
        d = j if d == i else i if d == j else d
    elif t == aten.unsqueeze.default:
        d = d + (a[1] % len(out) <= d)
    elif t in (aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims):
        d = _view_dim(src, out, d)
    if d is None:
        return _x(node, f"{t} reshapes the batch dimension")
    return Kind("B", d, dens=k.dens, per=k.per)


def _view_dim(src: tuple, out: tuple, d: int) -> int | None:
    """The dim of ``out`` the batch dim ``d`` of ``src`` becomes, with the batch its outermost
    factor (so the pieces stay contiguous chunks of it); None if the view mixes it otherwise."""
    before = math.prod(src[:d])
    for j in range(len(out)):  # the same size at the same offset: the batch kept as it is
        if math.prod(out[:j]) == before and out[j] == src[d]:
            return j
    for j in range(len(out)):
        if math.prod(out[:j]) == before and out[j] != 1:
            return j if out[j] % src[d] == 0 or src[d] % out[j] == 0 else None
        if math.prod(out[:j]) > before:
            break
    return 0 if src[d] == 1 and len(out) else None


def _aligned(node: fx.Node, kinds: dict, rank: int) -> tuple[int | None, tuple, str]:
    """The output batch dim of a broadcasting op, or None and why."""
    dims, dens = set(), ()
    for i in node.all_input_nodes:
        k = kinds[i]
        if isinstance(k, list) or k.kind != "B":
            continue
        shape = _shape(i) or ()
        dims.add(k.dim + rank - len(shape))
        dens += k.dens
    if len(dims) != 1:
        return None, (), "per-sample inputs disagree on the batch dimension"
    d = dims.pop()
    # a constant as long as the batch (an index over the rows, as a mixture-of-experts
    # dispatch builds) is each piece's own, as data parallelism assumes of the model
    if len(set(dens)) > 1:
        return None, (), "per-sample values divided by different batch sums"
    return d, tuple(dict.fromkeys(dens)), ""


def _pointwise(node: fx.Node, kinds: dict) -> Kind:
    out = _shape(node)
    if out is None:
        return _x(node, f"{node.target} without a shape")
    d, dens, why = _aligned(node, kinds, len(out))
    if d is None:
        return _x(node, f"{node.target}: {why}")
    pers = {kinds[i].per for i in node.all_input_nodes if not isinstance(kinds[i], list) and kinds[i].kind == "B"}
    return Kind("B", d, dens=dens, per=pers.pop() if len(pers) == 1 else 1)


def _along_dims(node: fx.Node, kinds: dict, batch: int) -> Kind:
    """An op with a ``dim`` argument (softmax, amax, cumsum, gather, slice, ...): per-sample
    unless it runs along the batch dimension."""
    if kinds[node.all_input_nodes[0]] == _U:  # index_add / scatter into a new buffer
        return _model_op(node, kinds, batch, loose=True)
    first = next((i for i in node.all_input_nodes if kinds[i] != _U), node.all_input_nodes[0])
    k = kinds[first]
    src, out = _shape(first), _shape(node)
    if isinstance(k, list) or k.kind != "B" or src is None:
        return _x(node, f"{node.target} of a value reduced over the batch")
    if out is None:  # several outputs (max.dim, sort): read the first's shape
        val = node.meta.get("val")
        out = tuple(val[0].shape) if isinstance(val, (tuple, list)) else None
    schema = node.target._schema
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    bound |= dict(zip([a.name for a in schema.arguments], node.args)) | dict(node.kwargs)
    dims = bound.get("dim", bound.get("dims"))
    dims = list(range(len(src))) if dims is None or dims == [] else (
        [dims] if isinstance(dims, int) else list(dims))
    dims = [x % max(len(src), 1) for x in dims]
    if k.dim == 0 in dims and node.target == aten.cat.default:  # rows added to the batch's
        return Kind("B", 0, loose=True)
    if k.dim in dims and (node.target in _ACROSS or out is None or len(out) != len(src)
                          or out[k.dim] != src[k.dim]):
        return _x(node, f"{node.target} runs along the batch dimension: its pieces do not combine "
                  "into the whole batch's value")
    # otherwise (a sort, a scatter or gather of the rows, as a mixture-of-experts dispatch
    # permutes the tokens and puts them back) taken as within each piece, as data parallelism
    # assumes of the model
    d = k.dim if out is None or len(out) == len(src) else k.dim - sum(x < k.dim for x in dims)
    result = Kind("B", d, dens=k.dens)
    val = node.meta.get("val")
    return [result] * len(val) if isinstance(val, (tuple, list)) else result


def _model_op(node: fx.Node, kinds: dict, batch: int, loose: bool = False) -> Kind | list[Kind]:
    """Another op (a matmul, an embedding, attention, a norm): per-sample along dim 0 when its
    per-sample inputs are, as data parallelism assumes of the model. A matmul whose right
    operand is per-sample too (``x @ y.T``, a contrastive loss's similarities) mixes samples."""
    ins = [kinds[i] for i in node.all_input_nodes]
    rhs = {aten.mm.default: 1, aten.addmm.default: 2, aten.matmul.default: 1}.get(node.target)
    if rhs is not None and isinstance(node.args[rhs], fx.Node) and kinds[node.args[rhs]] != _U:
        return _x(node, f"{node.target} multiplies two per-sample values: it mixes the samples")
    if node.target in (aten.bmm.default, aten.baddbmm.default):
        # [b, m, k] @ [b, k, n] keeps the samples apart on the left's rows (dim 1: the grouped
        # experts' tokens) or on the shared dim 0 of both; on k, or paired with dim 0, it mixes
        lhs, rhs_ = (kinds[a] if isinstance(a, fx.Node) and kinds[a] != _U else None for a in node.args[-2:])
        dims = (getattr(lhs, "dim", None), getattr(rhs_, "dim", None))
        if isinstance(lhs, list) or isinstance(rhs_, list) or \
                dims not in ((0, 0), (0, None), (None, 0), (1, None), (None, 2)):
            return _x(node, f"{node.target} multiplies across the samples of the batch")
        rows = dims[0] if dims[0] is not None else dims[1]
        if rows:  # the samples on the output's rows (1) or columns (2), not on dim 0
            if any(isinstance(k, list) or k.kind not in ("B", "U") for k in ins):
                return _x(node, f"{node.target} of a value reduced over the batch")
            bias = kinds[node.args[0]] if node.target == aten.baddbmm.default \
                and isinstance(node.args[0], fx.Node) else _U
            if bias != _U and bias.dim != rows:  # baddbmm's added term: per-sample on those rows
                return _x(node, f"{node.target} adds a value whose samples are not on the product's")
            if any(k.kind == "B" and k.dens for k in ins):
                return _x(node, f"{node.target} of per-sample values divided by a batch sum")
            return Kind("B", rows, loose=(lhs if dims[0] is not None else rhs_).loose)
    if any(isinstance(k, list) or k.kind != "B" and k.kind != "U" for k in ins):
        return _x(node, f"{node.target} of a value reduced over the batch")
    if any(k.kind == "B" and k.dens for k in ins):
        return _x(node, f"{node.target} of per-sample values divided by a batch sum")
    # per-sample values whose batch is not on dim 0 (attention's heads first): the model's own
    loose = loose or any(k.kind == "B" and k.dim != 0 for k in ins)
    val = node.meta.get("val")
    vals = list(val) if isinstance(val, (tuple, list)) else [val]
    out = []
    for v in vals:
        # rows that are not the batch's (a mixture-of-experts capacity buffer) are the model's
        # own business, as under data parallelism; a scalar is a reduction over everything
        ok = isinstance(v, torch.Tensor) and v.dim() > 0
        mixed = loose or batch == 1 or (ok and v.shape[0] % batch != 0)
        out.append(Kind("B", 0, loose=mixed) if ok else _x(node, f"{node.target} reduces over the whole batch"))
    return out if isinstance(val, (tuple, list)) else out[0]


def _counter(gm: fx.GraphModule, dens: list[fx.Node], kinds_in: dict) -> Counter | str:
    """A graph computing every denominator from user inputs and buffers, or why it cannot."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    needed: set[fx.Node] = set()
    for den in dens:
        roots = [den] if den.target not in _NLL else [
            a for a in (den.args[1], den.args[2]) if isinstance(a, fx.Node)]
        for r in roots:
            needed |= _ancestors(r)
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[tuple[str, str]] = []
    for node in sorted(needed, key=order.__getitem__):
        if node.op == "placeholder":
            kind, name = kinds_in.get(node.name, ("", ""))
            if kind not in ("input", "buffer"):
                return f"the normaliser reads {kind or node.name} {name}, not only inputs and buffers"
            env[node] = graph.placeholder(node.name)
            inputs.append((kind, name.removeprefix("input") if kind == "input" else name))
        elif node.op == "call_function":
            env[node] = graph.node_copy(node, env.__getitem__)
        else:
            return f"the normaliser reads {node.op} {node.target}"
    outs = []
    for den in dens:
        if den.target in _NLL:
            outs.append(_total_weight(graph, env[den.args[1]], env.get(den.args[2]), den.args[4]))
        else:
            outs.append(env[den])
    graph.output(tuple(outs))
    return Counter(fx.GraphModule(torch.nn.Module(), graph), inputs)


def _total_weight(graph: fx.Graph, target: fx.Node, weight: fx.Node | None, ignore: int) -> fx.Node:
    """nll_loss's total_weight: sum over the labels not ignored of their class weight (1 each
    without weights)."""
    valid = graph.call_function(aten.ne.Scalar, (target, ignore))
    if weight is None:
        return graph.call_function(aten.sum.default, (valid,))
    safe = graph.call_function(aten.where.ScalarOther, (valid, target, 0))
    picked = graph.call_function(aten.index.Tensor, (weight, [safe]))
    kept = graph.call_function(aten.where.ScalarOther, (valid, picked, 0.0))
    return graph.call_function(aten.sum.default, (kept,))


def rewrite_denominators(gm: fx.GraphModule, signature: GraphSignature,
                         reduction: LossReduction) -> GraphSignature:
    """Replace each denominator node by a new graph input (kind `DENOMINATOR`, named by its
    index in the counter's outputs), in place; the new signature. A mean ``nll_loss`` becomes
    its sum divided by the input; its backward reads the input as ``total_weight``."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    inputs = list(signature.inputs)
    for i, den in enumerate(reduction.denominators):
        with graph.inserting_after(last):
            holder = graph.placeholder(f"loss_denominator_{i}")
        last = holder
        val = den.meta.get("val")
        val = val[1] if isinstance(val, (tuple, list)) else val
        holder.meta["val"] = torch.empty((), dtype=_den_dtype(gm, signature, val), device=val.device)
        holder.meta["autopar"] = "the loss's normaliser summed over the step's pieces, / pieces"
        inputs.append((DENOMINATOR, str(i)))
        if den.target in _NLL:
            _nll_over(graph, den, holder)
        else:
            den.replace_all_uses_with(holder)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return GraphSignature(inputs=inputs, placeholders=[n.name for n in graph.nodes if n.op == "placeholder"],
                          grad_index=dict(signature.grad_index), loss_index=signature.loss_index,
                          buffer_index=dict(signature.buffer_index))


def _den_dtype(gm: fx.GraphModule, signature: GraphSignature, val) -> torch.dtype:
    """The loss's dtype (a count is an integer, its share of the step is not)."""
    seeds = set(signature.placeholder_of("tangent").values())
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n.name in seeds:
            return n.meta["val"].dtype
    return val.dtype if val.is_floating_point() else torch.float32


def _nll_over(graph: fx.Graph, nll: fx.Node, holder: fx.Node) -> None:
    """(nll mean, total_weight) -> (nll sum / holder, holder)."""
    users = list(nll.users)
    with graph.inserting_before(nll.next):  # in order, after nll
        summed = graph.call_function(nll.target, (*nll.args[:3], _SUM, nll.args[4]))
        summed.meta = dict(nll.meta)
        value = graph.call_function(operator.getitem, (summed, 0))
        value.meta["val"] = nll.meta["val"][0]
        divided = graph.call_function(aten.div.Tensor, (value, holder))
        divided.meta["val"] = nll.meta["val"][0]
    for user in users:  # getitem 0: the loss; getitem 1: total_weight, read by the backward
        user.replace_all_uses_with(divided if user.args[1] == 0 else holder)
