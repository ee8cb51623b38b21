"""FP8 matmuls as a rewrite of the joint forward+backward graph.

For a matmul C = A B (A [M, K], B [K, N]) in an FP8 format whose largest value is q:

    s_A = q / max(amax|A|, eps)        A8 = fp8(clamp(A * s_A, -q, q))       (B alike)
    C   = _scaled_mm(A8, B8, scale_a=1/s_A, scale_b=1/s_B)  =  (A8 / s_A) (B8 / s_B)

with one amax over the whole tensor (tensorwise scales) or one per row of A and per column of
B, i.e. over K (rowwise). A weight W [out, in] read as Y = X W^T has three matmuls:

    forward        Y  = X W^T       A = X     (e4m3)   B = W^T (e4m3)
    input grad     dX = dY W        A = dY    (grads)  B = W   (e4m3)
    weight grad    dW = dY^T X      A = dY^T  (grads)  B = X   (e4m3), or kept in high precision

The gradient format (e4m3 or e5m2) and whether the weight gradient stays in high precision
are the recipe's (`RECIPES`). One cast per (tensor, scaling axis, format) is shared by every
matmul that reads it: q, k and v read one cast of X; the input and weight gradients one of dY
under tensorwise scales. A is made row-major and B column-major, as cuBLAS's FP8 kernels need.

Sharded tensors: a tensor's scale is the amax over all its shards, so a parallel FP8 step
computes what a single-device FP8 step does (the same casts and the same scales):

- under TP the tensor-parallel pass runs these ops on DTensors: an amax over a sharded dim
  comes out a Partial(max), all-reduced (max) over TP before the scale reads it;
- over DP, `reduce_scales` all-reduces (max) every amax that reduces over tokens (the
  tensorwise scales of activations and gradients; under rowwise scales, the weight gradient's
  operands, whose amax runs along M): each DP rank holds other tokens. Weights are whole (or
  ZeRO-3-gathered) on every DP rank: their scales need nothing;
- under CP the context-parallel pass runs these ops on DTensors over cp, as TP does: an amax
  over the rank's tokens comes out a Partial(max), all-reduced (max) over cp.

With gradient accumulation a scale is its micro-batch's, as on one device running the same
micro-batches. Every node the pass adds carries ``meta["autopar"]``: the decision behind it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import fx

from vocab.plan_types import AxisGroup, GraphSignature
from vocab.plan_types import block_pattern as group_of

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# amax floor: a zero tensor gets a finite scale (torchao's EPS)
AMAX_EPS = 1e-12
# views of a weight that a matmul may read it through
_VIEWS = {aten.t.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
          aten.transpose.int, aten.permute.default, aten.alias.default, aten.detach.default}
_MATMULS = {aten.mm.default, aten.addmm.default}
_SAME_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# the key of the custom meta the pass's scale nodes carry (it survives the TP pass's retrace)
SCALE_TAG = "autopar_fp8_scale"
# the custom-meta key naming the matmul (of the graph before the pass) a new node serves
FP8_FOR = "autopar_fp8_for"


@dataclass(frozen=True)
class Fp8Recipe:
    """How FP8 matmuls scale and cast (torchao's recipe names).

    scaling: "tensorwise" (one amax per tensor) or "rowwise" (one per row of A / column of B).
    grad_format: the gradients' FP8 format ("e5m2": range; "e4m3": precision).
    weight_grad_fp8: False keeps dW = dY^T X in the model's precision.
    """

    name: str
    scaling: str
    grad_format: str
    weight_grad_fp8: bool = True


RECIPES = {
    "tensorwise": Fp8Recipe("tensorwise", "tensorwise", "e5m2"),
    "rowwise": Fp8Recipe("rowwise", "rowwise", "e4m3"),
    "rowwise_with_gw_hp": Fp8Recipe("rowwise_with_gw_hp", "rowwise", "e4m3", weight_grad_fp8=False),
}


@dataclass
class WeightMatmuls:
    """The joint graph's matmuls of one weight, by role (node names)."""

    forward: list[str] = field(default_factory=list)
    input_grad: list[str] = field(default_factory=list)
    weight_grad: list[str] = field(default_factory=list)

    def all(self) -> list[str]:
        return [*self.forward, *self.input_grad, *self.weight_grad]


@dataclass(frozen=True)
class Fp8Result:
    """What `apply_fp8` rewrote: per weight its matmuls now in FP8, and the casts it added."""

    matmuls: dict[str, list[str]]
    casts: int


def matches(weight: str, patterns: Iterable[str]) -> bool:
    """Whether ``weight`` is one of ``patterns`` (weight names or `group_of` names)."""
    group = group_of(weight)
    return any(p in (weight, group) for p in patterns)


def weight_matmuls(gm: fx.GraphModule, signature: GraphSignature) -> dict[str, WeightMatmuls]:
    """Every 2-D weight's matmuls in ``gm``: a forward or input-gradient ``mm``/``addmm`` reads
    the weight through views; a weight-gradient one produces (through views, or summed with
    others for a tied weight) the gradient output of the weight. Weights read only otherwise
    (an embedding's gather, MoE's grouped experts) are absent: they are no FP8 candidates."""
    holders = dict(zip(signature.placeholders, signature.inputs))
    params = {n: name for n in gm.graph.nodes if n.op == "placeholder"
              for kind, name in [holders.get(n.name, ("", ""))] if kind == "param"
              and n.meta.get("val") is not None and n.meta["val"].ndim == 2}
    reads: dict[fx.Node, str] = {}  # a weight and its views -> the weight
    for node in gm.graph.nodes:
        if node in params:
            reads[node] = params[node]
        elif node.op == "call_function" and node.target in _VIEWS and node.args and node.args[0] in reads:
            reads[node] = reads[node.args[0]]
    found: dict[str, WeightMatmuls] = {}
    for node in gm.graph.nodes:
        if node.target in _MATMULS:
            a, b = _operands(node)
            weight = reads.get(b) or reads.get(a)
            if weight is not None:
                role = found.setdefault(weight, WeightMatmuls())
                (role.input_grad if _is_backward(node) else role.forward).append(node.name)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    for name, index in signature.grad_index.items():
        if name not in found or not isinstance(outs[index], fx.Node):
            continue
        found[name].weight_grad = [n.name for n in _producing_matmuls(outs[index])]
    return {w: m for w, m in found.items() if m.forward}


def cast_shares(gm: fx.GraphModule, found: dict[str, WeightMatmuls]) -> dict[str, dict[str, float]]:
    """matmul -> its operand (node name) -> the share of that operand's cast the matmul pays:
    1 / the number of FP8 candidate matmuls of the same phase reading the same value, as
    `apply_fp8` shares one cast among them (q, k and v one cast of x; tensorwise, the input
    and weight gradients one of dY) when all of them run in FP8. ``found``: `weight_matmuls`'s
    answer for ``gm``. For the cost model."""
    names = {n for m in found.values() for n in m.all()}
    readers: dict[tuple, set[str]] = {}
    keys: dict[str, dict[str, tuple]] = {}
    for node in gm.graph.nodes:
        if node.name not in names:
            continue
        for operand in _operands(node):
            source = operand
            while source.target is aten.t.default:
                source = source.args[0]
            key = (_value_key(source), _is_backward(node))
            readers.setdefault(key, set()).add(node.name)
            keys.setdefault(node.name, {})[operand.name] = key
    return {m: {op: 1 / len(readers[key]) for op, key in ops.items()} for m, ops in keys.items()}


def apply_fp8(gm: fx.GraphModule, signature: GraphSignature, weights: Iterable[str],
              recipe: Fp8Recipe) -> Fp8Result:
    """Rewrite ``gm`` in place: the matmuls of ``weights`` (names or `group_of` patterns) run
    in FP8 under ``recipe``. A pattern that names no FP8 candidate is a ValueError naming them."""
    wanted = list(weights)
    found = weight_matmuls(gm, signature)
    unmatched = [p for p in wanted if not any(matches(w, [p]) for w in found)]
    if unmatched:
        raise ValueError(
            f"FP8 asked for {unmatched}, which name no weight read by a matmul; the candidates "
            f"are {sorted({group_of(w) for w in found}) or 'none'}")
    roles: dict[str, tuple[str, str]] = {}  # matmul -> (weight, role)
    for weight, mms in found.items():
        if not matches(weight, wanted):
            continue
        roles.update({n: (weight, "forward") for n in mms.forward})
        roles.update({n: (weight, "input gradient") for n in mms.input_grad})
        if recipe.weight_grad_fp8:
            roles.update({n: (weight, "weight gradient") for n in mms.weight_grad})
    rewriter = _Rewriter(gm.graph, recipe, _param_nodes(gm, signature))
    done: dict[str, list[str]] = {}
    # in graph order: a shared cast is placed before the first matmul that reads it
    for node in [n for n in gm.graph.nodes if n.name in roles]:
        weight, role = roles[node.name]
        done.setdefault(weight, []).append(rewriter.rewrite(node, weight, role).name)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return Fp8Result(done, rewriter.casts)


def reduce_scales(gm: fx.GraphModule, group: AxisGroup) -> int:
    """All-reduce (max) over the data-parallel ``group`` every amax of ``gm`` that reduces over
    tokens, right before its scale is computed: each DP rank holds other tokens. Runs on the
    per-rank graph (after the TP pass: a TP-sharded amax is reduced there already, and max is
    idempotent). Returns how many amaxes it reduced."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        tag = node.meta.get("custom", {}).get(SCALE_TAG)
        if not tag or not tag["over_tokens"] or node.target is not aten.clamp_min.default:
            continue
        amax = node.args[0]
        reason = (f"FP8: amax of {tag['operand']} over the {group.size} DP ranks' tokens (a "
                  "batch-sharded tensor's scale, as on one device)")
        with graph.inserting_before(node):
            issued = graph.call_function(c10d.all_reduce.default, (amax, "max", group.name))
            done = graph.call_function(c10d.wait_tensor.default, (issued,))
        for new in (issued, done):
            new.meta["autopar"] = reason
            new.meta["partitioner_tag"] = node.meta.get("partitioner_tag")
        node.replace_input_with(amax, done)
        count += 1
    graph.lint()
    gm.recompile()
    return count


class _Rewriter:
    """Replaces weight matmuls by `_scaled_mm` on scaled casts, sharing casts per
    (tensor, scaling dims, format, phase)."""

    def __init__(self, graph: fx.Graph, recipe: Fp8Recipe, params: set[fx.Node]) -> None:
        self.graph = graph
        self.recipe = recipe
        self.params = params
        self.cache: dict[tuple, tuple[fx.Node, fx.Node]] = {}
        self.casts = 0

    def rewrite(self, node: fx.Node, weight: str, role: str) -> fx.Node:
        """Replace matmul ``node`` (the ``role`` matmul of ``weight``) by `_scaled_mm`."""
        if node.target is aten.addmm.default and (node.kwargs.get("beta", 1) != 1
                                                  or node.kwargs.get("alpha", 1) != 1):
            raise ValueError(f"{node}: an addmm with beta or alpha is not an FP8 candidate")
        a, b = _operands(node)
        reason = f"FP8 ({self.recipe.name}): {role} matmul of {weight}"
        # fp8_for: the matmul a node serves (its block, for the recompute pass's rules)
        meta = {"partitioner_tag": node.meta.get("partitioner_tag"), "autopar": reason,
                "custom": {"autopar_fp8": reason, FP8_FOR: node.name}}
        rowwise = self.recipe.scaling == "rowwise"
        # tokens run along M (A) or N (B) of the forward and the input gradient (where the
        # operand is no weight), along K of the weight gradient (dY^T X, or Conv1D's X^T dY)
        tokens = {"A": 1, "B": 0} if role == "weight gradient" else {"A": 0, "B": 1}
        # rowwise: A [M, K] is scaled along K (dim 1), B [K, N] along K (dim 0)
        a8, sa = self._operand(a, 1 if rowwise else None, tokens["A"], node, meta)
        b8, sb = self._operand(b, 0 if rowwise else None, tokens["B"], node, meta)
        g = self.graph
        with g.inserting_before(node):
            a8 = _layout(g, a8, row_major=True, meta=meta)
            b8 = _layout(g, b8, row_major=False, meta=meta)
            out = _new(g, aten._scaled_mm.default, (a8, b8, sa, sb),
                       {"out_dtype": node.meta["val"].dtype}, meta)
            if node.target is aten.addmm.default:
                out = _new(g, aten.add.Tensor, (out, node.args[0]), {}, meta)
        out.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(out)
        g.erase_node(node)
        return out

    def _operand(self, x: fx.Node, k_dim: int | None, token_dim: int, matmul: fx.Node,
                 meta: dict) -> tuple[fx.Node, fx.Node]:
        """(x8, 1 / scale) for matmul operand ``x``. A transposed operand is cast at its source
        (one cast then serves the readers of either orientation) and transposed after."""
        source, flipped = x, False
        while source.target is aten.t.default:
            source, flipped = source.args[0], not flipped
        flip = (lambda d: 1 - d) if flipped else (lambda d: d)
        ndim = source.meta["val"].ndim
        dims = tuple(range(ndim)) if k_dim is None else (flip(k_dim),)
        is_weight = _base(source) in self.params
        # the amax spans other DP ranks' tokens: a tensorwise amax of an activation or a
        # gradient, a rowwise one along the tokens
        over_tokens = not is_weight and (k_dim is None or k_dim == token_dim)
        gradient = _is_backward(source) and not is_weight
        kind = "the weight" if is_weight else "a gradient" if gradient else "an activation"
        fmt = self.recipe.grad_format if gradient else "e4m3"
        key = (_value_key(source), dims, fmt, _is_backward(matmul))
        if key not in self.cache:
            self.cache[key] = self._cast(source, dims, fmt, f"{kind} ({source.name})", over_tokens,
                                         matmul, meta)
        x8, inverse = self.cache[key]
        if not flipped:
            return x8, inverse
        g = self.graph
        with g.inserting_before(matmul):
            x8 = _new(g, aten.t.default, (x8,), {}, meta)
            if k_dim is not None:  # the rowwise scales follow the transpose (kept contiguous)
                inverse = _new(g, aten.clone.default, (_new(g, aten.t.default, (inverse,), {}, meta),),
                               {"memory_format": torch.contiguous_format}, meta)
        return x8, inverse

    def _cast(self, x: fx.Node, dims: tuple[int, ...], fmt: str, what: str, over_tokens: bool,
              before: fx.Node, meta: dict) -> tuple[fx.Node, fx.Node]:
        dtype = FORMATS[fmt]
        q = torch.finfo(dtype).max
        keep = len(dims) < x.meta["val"].ndim
        g = self.graph
        with g.inserting_before(before):
            wide = x if x.meta["val"].dtype == torch.float32 else _new(
                g, aten._to_copy.default, (x,), {"dtype": torch.float32}, meta)
            amax = _new(g, aten.amax.default, (_new(g, aten.abs.default, (wide,), {}, meta), list(dims), keep),
                        {}, meta)
            floor = _new(g, aten.clamp_min.default, (amax, AMAX_EPS), {}, meta)
            floor.meta["custom"] = {**meta["custom"], SCALE_TAG: {"operand": what, "over_tokens": over_tokens}}
            scale = _new(g, aten.mul.Tensor, (_new(g, aten.reciprocal.default, (floor,), {}, meta), q), {}, meta)
            inverse = _new(g, aten.div.Tensor, (floor, q), {}, meta)
            scaled = _new(g, aten.clamp.default, (_new(g, aten.mul.Tensor, (wide, scale), {}, meta), -q, q),
                          {}, meta)
            x8 = _new(g, aten._to_copy.default, (scaled,), {"dtype": dtype}, meta)
        self.casts += 1
        return x8, inverse


def _new(g: fx.Graph, target, args: tuple, kwargs: dict, meta: dict) -> fx.Node:
    node = g.call_function(target, args, kwargs)
    node.meta.update({k: (dict(v) if isinstance(v, dict) else v) for k, v in meta.items()})
    return node


def _layout(g: fx.Graph, x: fx.Node, row_major: bool, meta: dict) -> fx.Node:
    """``x`` row-major (A) or column-major (B), as the FP8 GEMM kernels read them: a cast
    transposed back (``t(x8)``) is column-major, a cast as it came is row-major."""
    transposed = x.target is aten.t.default
    if row_major != transposed:
        return x
    if row_major:
        return _new(g, aten.clone.default, (x,), {"memory_format": torch.contiguous_format}, meta)
    copy = _new(g, aten.clone.default, (_new(g, aten.t.default, (x,), {}, meta),),
                {"memory_format": torch.contiguous_format}, meta)
    return _new(g, aten.t.default, (copy,), {}, meta)


def _param_nodes(gm: fx.GraphModule, signature: GraphSignature) -> set[fx.Node]:
    kinds = dict(zip(signature.placeholders, (kind for kind, _ in signature.inputs)))
    return {n for n in gm.graph.nodes if n.op == "placeholder" and kinds.get(n.name) == "param"}


def _base(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _VIEWS:
        node = node.args[0]
    return node


def _value_key(node: fx.Node):
    """Equal for nodes that hold the same values: q and k view one input each on their own."""
    if node.op == "call_function" and node.target in _SAME_VIEWS and isinstance(node.args[0], fx.Node):
        return ("view", _value_key(node.args[0]), tuple(node.args[1]))
    return node


def _operands(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    return (node.args[1], node.args[2]) if node.target is aten.addmm.default else (node.args[0], node.args[1])


def _producing_matmuls(node: fx.Node) -> list[fx.Node]:
    """The mm nodes whose (viewed, or summed) output is ``node``."""
    if node.target in _MATMULS:
        return [node]
    if node.op == "call_function" and node.target in _VIEWS:
        return _producing_matmuls(node.args[0])
    if node.op == "call_function" and node.target is aten.add.Tensor:
        return [m for a in node.args if isinstance(a, fx.Node) for m in _producing_matmuls(a)]
    return []


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"
