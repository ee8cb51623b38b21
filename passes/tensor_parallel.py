"""Tensor (and sequence) parallelism as a rewrite of the per-rank joint graph.

The plan gives every weight a placement on the TP axis; picotron's layers, in graph form:

    column-parallel  W = [W1 .. Wt] (Shard(0) of [out, in]):  Y_i = X W_i           (X replicated)
    row-parallel     W = [W1; .. ; Wt] (Shard(1)):           Y = sum_i X_i W_i     (a partial sum)
    vocab-parallel   E = [E1; .. ; Et] (Shard(0)):           e = sum_i mask_i(E_i[ids])

The pass runs the global joint graph once on DTensors (weights with the plan's placements,
the batch replicated over TP) and traces what each rank executes: local shapes, and the
functional collectives DTensor inserts where placements meet. The plan's decisions are made
explicit rather than left to DTensor's cost heuristics:

- a partial sum is reduced when it reaches an op that is not linear in it: all-reduce, or under
  sequence parallelism reduce-scatter onto the sequence dimension (Megatron-SP);
- the input of a column-parallel matmul is gathered first (a no-op without SP, the SP
  all-gather with it), so DTensor never chooses to gather a weight instead;
- every gradient leaves with its weight's placement, the loss replicated.

A fused projection (GPT-2's qkv = [Wq; Wk; Wv]) is column-parallel per part:
``_StridedShard(0, split_factor=3)``, rank r holds [Wq_r; Wk_r; Wv_r], so its output
[b, s, 3h/t] is [q_r | k_r | v_r] and the local view [b, s, 3, heads/t, head_dim] is rank r's
heads. DTensor's view rules split such a strided dim into (parts, heads, head_dim) as Shard on
the heads (a local view), and merge the backward's [b, s, 3, heads, head_dim] back into a
strided [b, s, 3h]; the weight's gradient leaves as the weight's strided shard.

MoE experts' grouped matmuls (`passes.grouped_matmul`) run column- or row-parallel by their
weight's shard, every expert alike; a fused gate/up weight is split per part as q, k, v are.
Ops with no DTensor strategy (e.g. MoE's index_add) run replicated, with a warning naming them.
Each collective in the traced graph carries ``meta["autopar"]``: the decision behind it.
"""

from __future__ import annotations

import contextlib
import operator
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import register_sharding
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from passes.expert_parallel import GROUP, RESULT, ROLE
from passes.grouped_matmul import is_grouped_backward, is_grouped_forward, is_grouped_weight_grad
from vocab.plan_types import AxisPlacement, GraphSignature, TensorParallelPlan

aten = torch.ops.aten

# node tags the retrace must keep: the grouped experts' (`passes.expert_parallel`), which runs after
KEPT_META = (GROUP, ROLE, RESULT)
# Ops through which a partial sum stays a partial sum: sum_i f(x_i) = f(sum_i x_i).
_KEEPS_PARTIAL = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
    aten.t.default, aten.permute.default, aten.clone.default, aten._to_copy.default,
    aten.expand.default, aten.unsqueeze.default, aten.squeeze.dim, aten.alias.default,
    aten.detach.default, aten.neg.default,
}
_MERGING_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default}
_LOSS_PLAIN_ARGS = {aten.nll_loss_forward.default: (1,), aten.nll_loss_backward.default: (2, 6)}
_CONVOLUTIONS = {aten.convolution.default, aten.convolution_backward.default}
_NLL_BACKWARD = {aten.nll_loss_backward.default, aten.nll_loss2d_backward.default}
_PARALLEL_LOSS = {aten._log_softmax.default, aten.nll_loss_forward.default,
                  aten._log_softmax_backward_data.default, aten.nll_loss_backward.default}
_SAME_VALUE = {aten.clone.default, aten.alias.default, aten.detach.default}
# The ops DTensor's loss_parallel takes over, and (argument, its dim argument) of the input it
# requires sharded on the class dim (dim None: 1, or 0 for 1-D).
_LOSS_PARALLEL_INPUT = {
    aten._log_softmax.default: (0, 1), aten._log_softmax_backward_data.default: (1, 2),
    aten.nll_loss_forward.default: (0, None), aten.nll_loss2d_forward.default: (0, None),
    aten.nll_loss_backward.default: (1, None), aten.nll_loss2d_backward.default: (1, None),
}
_COLLECTIVE_PREFIX = "_c10d_functional."


class TensorParallelError(ValueError):
    """An op of the graph cannot run on its inputs' TP placements (names the op, where the
    model runs it, and the fix)."""


@dataclass
class TensorParallelGraph:
    """The traced per-rank graph and the local shapes of its parameters."""

    gm: fx.GraphModule
    local_shapes: dict[str, tuple[int, ...]]
    fallback_ops: list[str]


def to_dtensor_placement(placement: AxisPlacement):
    """The plan's placement on one mesh axis as a DTensor placement."""
    if not placement.is_shard:
        return Replicate()
    if placement.split_factor > 1:
        return _StridedShard(placement.dim, split_factor=placement.split_factor)
    return Shard(placement.dim)


def apply_tensor_parallel(
    gm: fx.GraphModule,
    signature: GraphSignature,
    shapes: Sequence[tuple[int, ...]],
    plan: TensorParallelPlan,
    mesh: DeviceMesh,
) -> TensorParallelGraph:
    """Trace ``gm`` (global shapes) into the graph one TP rank of ``mesh`` (1-D) runs.

    signature: what feeds ``gm``'s placeholders and reads its outputs; shapes: the
    placeholders' global shapes; plan: every weight's TP placement (absent: replicated) and
    whether SP is on. The traced graph keeps the placeholder and output order of ``gm``.
    """
    _register_cpu_attention()
    _register_scaled_mm()
    inputs = signature.inputs
    param_placements = {n: to_dtensor_placement(p) for n, p in plan.placements.items()}
    grad_outputs = {i: n for n, i in signature.grad_index.items()}
    t = mesh.size()
    placements = []
    for (kind, name), shape in zip(inputs, shapes):
        p = param_placements.get(name, Replicate()) if kind == "param" else Replicate()
        if _is_shard(p) and shape[p.dim] % (t * _parts(p)):
            raise ValueError(f"{name} {tuple(shape)}: dim {p.dim} does not divide into {_parts(p)} "
                             f"part(s) of the TP degree {t}")
        placements.append(p)
    local_shapes = [_local_shape(shape, p, t) for shape, p in zip(shapes, placements)]
    ids = next(shape for (kind, _), shape in zip(inputs, shapes) if kind == "input")
    tokens = (ids[0], ids[1] if len(ids) > 1 else 1)
    interp = _Interpreter(gm, mesh, placements, shapes, plan.sequence_parallel, tokens, grad_outputs,
                          {i: param_placements.get(n, Replicate()) for i, n in grad_outputs.items()},
                          signature.loss_index, plan.replicated_ops)

    _carry_tags(gm)
    dtypes = [n.meta["val"].dtype for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [torch.empty(s, dtype=d) for s, d in zip(local_shapes, dtypes)]
    # vocab-sharded logits: log-softmax and the loss run sharded (Megatron's parallel cross-entropy)
    with fx_traceback.preserve_node_meta(), torch.no_grad(), loss_parallel():
        traced = make_fx(interp.run, tracing_mode="fake")(*examples)
    for node in traced.graph.nodes:
        custom = node.meta.get("custom", {})
        node.meta.update(custom.get("autopar_meta", {}))  # `_carry_tags`
        reason = custom.get("autopar")
        if reason and str(node.target).startswith(_COLLECTIVE_PREFIX):
            node.meta["autopar"] = reason
        elif custom.get("autopar_fp8"):  # the FP8 pass's casts and scaled matmuls
            node.meta["autopar"] = custom["autopar_fp8"]
    traced.graph.eliminate_dead_code()
    _refuse_fp8_moves(traced)
    traced.recompile()
    named = {name: tuple(s) for (kind, name), s in zip(inputs, local_shapes) if kind == "param"}
    return TensorParallelGraph(traced, named, sorted(interp.fallback_ops))


def _carry_tags(gm: fx.GraphModule) -> None:
    """Copy the tags of `KEPT_META` into ``meta["custom"]``, which the retrace under
    ``preserve_node_meta`` gives every node it makes from a tagged node; they are restored
    from it after the trace (expert parallelism finds its grouped experts by them)."""
    for node in gm.graph.nodes:
        tags = {k: node.meta[k] for k in KEPT_META if k in node.meta}
        if tags:
            node.meta["custom"] = {**node.meta.get("custom", {}), "autopar_meta": tags}


def _refuse_fp8_moves(traced: fx.GraphModule, axis: str = "tp", error: type[Exception] = ValueError) -> None:
    """FP8 data never crosses ranks: a collective on it means DTensor gathers an FP8 matmul's
    operand (no sharding rule for its placements), and gloo cannot move FP8 at all (its
    "Invalid scalar type" at run time would not say which matmul)."""
    for node in traced.graph.nodes:
        if not str(node.target).startswith(_COLLECTIVE_PREFIX) or not node.args:
            continue
        val = getattr(node.args[0], "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise error(
                f"{axis.upper()} would move FP8 data ({node.args[0]}: {node.meta.get('autopar', '')}); the "
                "FP8 matmul reading it has no sharding rule for its operands' placements. Run its weight "
                f"in high precision (leave it out of Layout.fp8) or use {axis}=1")


def _local_shape(shape, placement, t: int) -> tuple[int, ...]:
    shape = list(shape)
    if _is_shard(placement):
        shape[placement.dim] //= t
    return tuple(shape)


class _Interpreter:
    """Runs the global joint graph on DTensors, making the plan's redistributions explicit."""

    def __init__(self, gm, mesh, placements, shapes, sp, tokens, grad_outputs, grad_placements, loss_index,
                 replicated_ops=frozenset()):
        self.gm = gm
        self.tokens = tokens  # (batch, seq) of this rank's inputs
        self.mesh = mesh
        self.placements = placements
        self.shapes = shapes
        self.sp = sp
        self.grad_outputs = grad_outputs
        self.grad_placements = grad_placements
        self.loss_index = loss_index
        self.fallback_ops: set[str] = set()
        self.replicated_ops = replicated_ops  # the plan's: gathered even where DTensor has a rule
        self.gathered: dict[fx.Node, DTensor] = {}
        # weights and what is read straight from them (transposes, casts, views)
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.weights = {n for n, p in zip(holders, placements) if _is_shard(p)}
        for n in gm.graph.nodes:
            if n.target in _KEEPS_PARTIAL and n.all_input_nodes and n.all_input_nodes[0] in self.weights \
                    and len(n.all_input_nodes) == 1:
                self.weights.add(n)

    def run(self, *local_args):
        env: dict[fx.Node, object] = {}
        holders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, arg, placement, shape in zip(holders, local_args, self.placements, self.shapes):
            env[node] = _placed(arg, self.mesh, placement, shape)
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                with fx_traceback.set_current_meta(node):  # keep partitioner_tag (fwd / bwd)
                    try:
                        env[node] = self._call(node, env)
                    except TensorParallelError:
                        raise
                    except Exception as exc:  # DTensor's bare assertions and shape errors
                        raise TensorParallelError(_failure(node, env, exc, self.sp)) from exc
            elif node.op == "get_attr":
                env[node] = _tree_wrap(getattr(self.gm, node.target), self.mesh)
            elif node.op == "output":
                return self._outputs(node, env)
        raise AssertionError("graph without output")

    def _call(self, node: fx.Node, env):
        args = fx.node.map_arg(node.args, lambda n: env[n])
        kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
        if node.target is operator.getitem:
            return args[0][args[1]]
        if node.target not in _KEEPS_PARTIAL and not _partial_sum(node, args):
            args = self._reduce_partials(node, args, env)
        if self.sp and node.target in _MERGING_VIEWS:
            args = self._gather_merged_sequence(node, args)
        if node.target in _MATMULS and self.sp:
            args = self._gather_column_input(node, args)
        plain_loss = _outside_loss_parallel(node, args)
        if node.target in _LOSS_PLAIN_ARGS and not plain_loss:  # loss_parallel wants labels plain
            args = tuple(a.to_local() if i in _LOSS_PLAIN_ARGS[node.target] and isinstance(a, DTensor)
                         and a.placements[0] == Replicate() else a for i, a in enumerate(args))
        if str(node.target) in self.replicated_ops or (node.target in _CONVOLUTIONS and any(
                isinstance(a, DTensor) and _is_shard(a.placements[0]) for a in args)):
            # a convolution over a sharded (SP: sequence) dim needs its neighbours' halo: whole
            return self._replicated(node, args, kwargs, None)
        if node.target in _NLL_BACKWARD and _class_sharded(args[1]) and not _fused_loss_backward(node):
            return _vocab_nll_backward(node, args)
        if node.target is aten._log_softmax_backward_data.default and _class_sharded(args[1], args[2]) \
                and not _fused_loss_backward(node.args[0]):
            return self._vocab_log_softmax_backward(node, args)
        if is_grouped_forward(node) or is_grouped_backward(node):
            return self._grouped(node, args, kwargs)
        if is_grouped_weight_grad(node):
            return self._grouped_weight_grad(node, args, kwargs)
        parts = _split_parts(node, args) or _cat_parts(node, args)
        if parts is not None:
            return parts
        why = (f"TP: {node} ({_op_name(node)}) cannot run on its inputs' placements; "
               "DTensor redistributes them")
        if node.target in _PARALLEL_LOSS:
            why = (f"TP: parallel cross-entropy over the vocabulary-sharded logits ({node}: "
                   "max, sum of exponentials and target logit summed over TP ranks)")
        if plain_loss:
            why = f"TP: {node} ({_op_name(node)}) on logits not sharded over the classes"
        try:
            with _why(why), (_no_loss_parallel() if plain_loss else contextlib.nullcontext()):
                out = node.target(*args, **kwargs)
        except (NotImplementedError, RuntimeError) as exc:
            if not _no_strategy(exc):
                raise
            return self._replicated(node, args, kwargs, exc)
        if isinstance(out, DTensor) and any(isinstance(p, _MaskPartial) for p in out.placements):
            # a vocabulary-sharded lookup: its mask lives until the first reduction, so reduce
            # it here once rather than at each consumer (a view of it and the value itself)
            return self._reduced(out, node, "its consumers")
        return _tree_wrap(out, self.mesh)  # factories (arange, ...) give every rank the same

    def _reduce_partials(self, node, args, env):
        def reduce(x, arg_node):
            if not isinstance(x, DTensor) or not any(p.is_partial() for p in x.placements):
                return x
            if not isinstance(arg_node, fx.Node):
                raise AssertionError(f"a partial sum outside the graph's values at {node}")
            env[arg_node] = self._reduced(x, arg_node, _op_name(node))  # once, for every consumer
            return env[arg_node]

        return _map_with_nodes(node.args, args, reduce)

    def _reduced(self, x: DTensor, arg_node: fx.Node, before: str) -> DTensor:
        """``x`` (a partial sum or max over the TP shards) reduced: all-reduce, or under SP a
        reduce-scatter onto the sequence dimension."""
        target, how = Replicate(), "all-reduce"
        seq = _sequence_dim(x, *self.tokens)
        summed = all(p.reduce_op == "sum" for p in x.placements if p.is_partial())
        if self.sp and summed and seq is not None and x.shape[seq] % self.mesh.size() == 0:
            target, how = Shard(seq), "reduce-scatter onto the sequence (SP)"
        # a max over shards (an FP8 scale's amax) is reduced whole: every rank scales alike
        what = f"the partial sums of {arg_node} (row-/vocab-parallel output)" if summed else \
            f"(max) the amax {arg_node} over the TP shards (an FP8 scale)"
        with _why(f"TP: {how} {what} before {before}"):
            return x.redistribute(self.mesh, [target])

    def _vocab_log_softmax_backward(self, node, args):
        """The log-softmax's backward on vocabulary-sharded log-probabilities ``y``:
        dx = dy - exp(y) * sum_v dy, the sum over the whole vocabulary (an all-reduce of one
        value per row). DTensor's ``loss_parallel`` passes dy straight through instead, exact
        only when ``nll_loss`` is the log-probabilities' one consumer; this is exact for any
        (label smoothing, a gather of the target's log-probability, an entropy term)."""
        dy, y, dim, dtype = args
        total = dy.sum(dim, keepdim=True)
        if any(p.is_partial() for p in total.placements):
            with _why(f"TP: all-reduce the row sums of the gradient {node.args[0]} over the vocabulary "
                      f"shards (the log-softmax's backward, {node})"):
                total = total.redistribute(self.mesh, [Replicate()])
        return (dy - torch.exp(y) * total).to(dtype)

    def _gather_merged_sequence(self, node, args):
        """[b, s/t, h] -> [b*s, h] (before a matmul): Megatron-SP gathers the sequence here,
        once per tensor (q, k and v, or the backward's two matmuls, share it)."""
        x, arg_node = args[0], _root(node.args[0])
        if not isinstance(x, DTensor) or _sequence_dim(x, *self.tokens) != 1 or x.placements[0] != Shard(1):
            return args
        shape = list(args[1])
        if len(shape) >= 3 and shape[1] == x.shape[1]:
            return args  # the sequence dim survives the view: stay sharded
        gathered = self._gather_once(x, arg_node, f"TP+SP: all-gather the sequence of {arg_node} "
                                     "(Megatron-SP, before the tensor-parallel matmul)")
        return (gathered, *args[1:])

    def _gather_column_input(self, node, args):
        """A matmul with a sharded weight operand needs its activation whole (SP all-gather)."""
        weights = [a for a, n in zip(args, node.args) if isinstance(n, fx.Node) and n in self.weights]
        if not any(_is_shard(p) for w in weights for p in w.placements):
            return args

        def gather(x, arg_node):
            if not isinstance(x, DTensor) or arg_node in self.weights or x.placements[0] == Replicate():
                return x
            arg_node = _root(arg_node)
            if not isinstance(x.placements[0], Shard) or x.placements[0].dim != _sequence_dim(x, *self.tokens):
                return x
            return self._gather_once(x, arg_node, f"TP+SP: all-gather the sequence of {arg_node} "
                                     f"for the column-parallel {node}")

        return _map_with_nodes(node.args, args, gather)

    def _gather_once(self, x, root: fx.Node, reason: str):
        """Replicate ``x`` once per source tensor; later users (q, k and v) share the gather."""
        if root not in self.gathered:
            with _why(reason):
                self.gathered[root] = x.redistribute(self.mesh, [Replicate()])
        return self.gathered[root]

    def _grouped(self, node, args, kwargs):
        """A grouped matmul, Y = X W per expert (forward) or (X, W, offs, dY) -> (dX, dW):
        column-parallel where W [E, in, out] is sharded on ``out``, row-parallel where on
        ``in`` (`passes.grouped_matmul`); computed on the local shards, the output placed."""
        backward = is_grouped_backward(node)
        x, w = args[:2]
        dy = args[3] if backward else None
        wp = w.placements[0] if isinstance(w, DTensor) else Replicate()
        dim = wp.dim if _is_shard(wp) else None
        feature = _like(wp, 1)  # W's split, on the features of X / Y ([S, in] / [S, out])

        def placed(v, placement, what: str):
            if not isinstance(v, DTensor) or list(v.placements) == [placement]:
                return v
            with _why(f"TP: {what} for the grouped (MoE experts') matmul {node}"):
                return v.redistribute(self.mesh, [placement])

        if dim == 2:  # column: X whole, Y (and dY) sharded like W's outputs
            x = placed(x, Replicate(), f"gather {node.args[0]}")
            dy = placed(dy, feature, f"shard {node.args[3]}") if backward else None
        elif dim == 1:  # row: X sharded like W's inputs (a local slice of a whole X), dY whole
            x = placed(x, feature, f"shard {node.args[0]}")
            dy = placed(dy, Replicate(), f"gather {node.args[3]}") if backward else None
        else:
            return self._replicated(node, args, kwargs, None)
        args = (x, *args[1:3], dy) if backward else (x, *args[1:])
        out = node.target(*_locals(args), **dict(zip(kwargs, _locals(kwargs.values()))))
        val = node.meta["val"]
        if not backward:
            return _placed(out, self.mesh, feature if dim == 2 else Partial(), val.shape)
        dx = _placed(out[0], self.mesh, Partial() if dim == 2 else feature, val[0].shape)
        return dx, _placed(out[1], self.mesh, wp, val[1].shape)

    def _grouped_weight_grad(self, node, args, kwargs):
        """aten's dW = grouped(X^T, dY): dY sharded on its features (a column weight) gives dW
        sharded on ``out``; X^T sharded on its rows (a row weight) gives dW sharded on ``in``."""
        xt, dy, offs = args[:3]
        px, pd = (v.placements[0] if isinstance(v, DTensor) else Replicate() for v in (xt, dy))
        if _is_shard(pd) and pd.dim == 1 and px == Replicate():
            placement = _like(pd, 2)
        elif _is_shard(px) and px.dim == 0 and pd == Replicate():
            placement = _like(px, 1)
        else:
            return self._replicated(node, args, kwargs, None)
        out = node.target(*_locals(args), **dict(zip(kwargs, _locals(kwargs.values()))))
        return _placed(out, self.mesh, placement, node.meta["val"].shape)

    def _replicated(self, node, args, kwargs, exc):
        """No strategy shards this op (``exc`` from DTensor, or None where the plan says so):
        gather its inputs and run it whole on every rank."""
        op = str(node.target)
        if op not in self.fallback_ops and exc is not None:
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            warnings.warn(f"autopar: {op} ({node}) cannot run on its inputs' TP shards ({first_line}): "
                          "it runs replicated on every TP rank, its inputs gathered", stacklevel=2)
        self.fallback_ops.add(op)

        def whole(x, arg_node):
            if not isinstance(x, DTensor):
                return x
            if any(p != Replicate() for p in x.placements):
                with _why(f"TP: gather {arg_node} for {op}, which has no sharding strategy"):
                    x = x.redistribute(self.mesh, [Replicate()])
            return x.to_local()

        local_args = _map_with_nodes(node.args, args, whole)
        local_kwargs = {k: whole(v, k) for k, v in kwargs.items()}
        out = node.target(*local_args, **local_kwargs)
        return _tree_wrap(out, self.mesh)

    def _outputs(self, node, env):
        outs = []
        for index, arg in enumerate(node.args[0]):
            value = env[arg] if isinstance(arg, fx.Node) else arg
            if isinstance(value, DTensor):
                want = self.grad_placements.get(index, Replicate())
                if list(value.placements) != [want]:
                    what = (f"the gradient of {self.grad_outputs[index]}" if index in self.grad_outputs
                            else "the loss" if index == self.loss_index else f"output {index}")
                    verb = "all-reduce" if value.placements[0].is_partial() and want == Replicate() else \
                        "reduce-scatter" if value.placements[0].is_partial() else "redistribute"
                    with _why(f"TP: {verb} {what} to its placement {want}"):
                        value = value.redistribute(self.mesh, [want])
                value = value.to_local()
            outs.append(value)
        return tuple(outs)


def _failure(node: fx.Node, env, exc: Exception, sp: bool) -> str:
    """The message of an op that failed on its inputs' TP placements."""
    placements = [str(env[a].placements[0]) if isinstance(env.get(a), DTensor) else "local"
                  for a in node.all_input_nodes]
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines() if ln.strip()]
    module = node.meta.get("module") or next(reversed(node.meta.get("nn_module_stack") or {"": ""}), "")
    where = f"in the forward of {module or 'the top-level module'}"
    if lines:
        where += " at " + " / ".join(lines[-2:])
    if node.meta.get("partitioner_tag") == "is_backward":
        where = "in the backward, " + where
    first = (str(exc).strip().splitlines() or [""])[0] or type(exc).__name__
    fix = "use sp=0, or tp=1" if sp else "use tp=1"
    return (f"TP: {_op_name(node)} ({node}) {where} cannot run on its inputs' placements "
            f"{placements} ({type(exc).__name__}: {first}); fix: {fix} for this model, or keep the "
            "weights that feed this op replicated")


def _outside_loss_parallel(node: fx.Node, args) -> bool:
    """A log-softmax or nll op whose input is not sharded over the classes (the logits of a
    head left replicated, or split by rows): loss_parallel's handlers refuse any such input,
    so it runs under DTensor's own rules (`_no_loss_parallel`)."""
    where = _LOSS_PARALLEL_INPUT.get(node.target)
    if where is None:
        return False
    arg, dim = where
    return not _class_sharded(args[arg], None if dim is None else args[dim])


@contextlib.contextmanager
def _no_loss_parallel():
    """DTensor's dispatch without loss_parallel's handlers (its own `_disable_custom_loss_ops`
    touches the same table), restored afterwards."""
    handlers = DTensor._op_dispatcher._custom_op_handlers
    saved = {op: handlers.pop(op) for op in _LOSS_PARALLEL_INPUT if op in handlers}
    try:
        yield
    finally:
        handlers.update(saved)


def _class_sharded(x, dim: int | None = None) -> bool:
    """``x`` is a DTensor sharded on its class dimension (``dim``, else 1, or 0 for 1-D)."""
    if not isinstance(x, DTensor):
        return False
    dim = (1 if x.ndim >= 2 else 0) if dim is None else dim % x.ndim
    return isinstance(x.placements[0], Shard) and x.placements[0].dim == dim


def _fused_loss_backward(nll: fx.Node) -> bool:
    """``nll`` is an ``nll_loss`` backward whose gradient goes only to the backward of the
    log-softmax it reads: DTensor's ``loss_parallel`` fuses the two (Megatron's parallel
    cross-entropy, dx = (softmax - onehot) * g, no communication). Any other consumer of the
    log-probabilities (or of their gradient) takes the exact general path, and so do class
    weights: the fused backward gathers them at the raw target, out of bounds at an ignored
    label (-100), where `_vocab_nll_backward` masks it."""
    if not isinstance(nll, fx.Node) or nll.target not in _NLL_BACKWARD or len(nll.users) != 1:
        return False
    if nll.args[3] is not None:  # class weights
        return False
    user = next(iter(nll.users))
    return user.target is aten._log_softmax_backward_data.default and user.args[0] is nll \
        and _root(user.args[1]) is _root(nll.args[1])


def _vocab_nll_backward(node, args):
    """``nll_loss``'s own backward on vocabulary-sharded log-probabilities: the gradient is
    -w[t] * g (/ total weight for a mean) at each row's target class t, zero elsewhere, so each
    rank writes the rows whose target is in its shard of classes and needs no communication.
    (DTensor's ``loss_parallel`` instead fuses the log-softmax's backward in here.)"""
    grad, x, target, weight, reduction, ignore_index, total_weight = args
    cdim = 1 if x.ndim >= 2 else 0
    local_x = x.to_local()
    n = local_x.shape[cdim]
    offset = x.device_mesh.get_local_rank() * n
    target, total_weight = (v.full_tensor() if isinstance(v, DTensor) else v for v in (target, total_weight))
    local = target - offset
    mine = (target != ignore_index) & (local >= 0) & (local < n)
    local = torch.where(mine, local, -1)  # -1: another rank's class, or ignored
    if weight is not None:
        weight = (weight.full_tensor() if isinstance(weight, DTensor) else weight)[offset:offset + n]
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    out = node.target(grad, local_x, local, weight, reduction, -1, total_weight)
    return _placed(out, x.device_mesh, Shard(cdim), x.shape)


def _is_shard(placement) -> bool:
    """Shard(d), or a fused projection's _StridedShard(d, k) (k parts, each split over TP)."""
    return isinstance(placement, (Shard, _StridedShard))


def _split_parts(node, args):
    """A fused projection's output ``_StridedShard(d, k)`` split into its k parts on d (GPT-2's
    q, k, v; a gated MLP's gate and up): each rank splits its own shard, every part Shard(d).
    DTensor would gather the whole value first. None where this is not that split."""
    if node.target is not aten.split.Tensor or not isinstance(args[0], DTensor):
        return None
    x, size = args[0], args[1]
    dim = (args[2] if len(args) > 2 else node.kwargs.get("dim", 0)) % x.ndim
    p = x.placements[0]
    if not isinstance(p, _StridedShard) or p.dim != dim or size * p.split_factor != x.shape[dim]:
        return None
    local = x.to_local()
    shape = list(x.shape)
    shape[dim] = size
    return tuple(_placed(part, x.device_mesh, Shard(dim), shape)
                 for part in local.split(local.shape[dim] // p.split_factor, dim))


def _cat_parts(node, args):
    """The backward's inverse of `_split_parts`: k equal Shard(d) parts concatenated on d are
    the fused projection's ``_StridedShard(d, k)``, each rank's shards side by side."""
    if node.target is not aten.cat.default:
        return None
    parts = args[0]
    dim = args[1] if len(args) > 1 else node.kwargs.get("dim", 0)
    if len(parts) < 2 or not all(isinstance(v, DTensor) for v in parts):
        return None
    dim %= parts[0].ndim
    if any(list(v.placements) != [Shard(dim)] or v.shape != parts[0].shape for v in parts):
        return None
    shape = list(parts[0].shape)
    shape[dim] *= len(parts)
    local = torch.cat([v.to_local() for v in parts], dim)
    return _placed(local, parts[0].device_mesh, _StridedShard(dim, split_factor=len(parts)), shape)


def _locals(values) -> list:
    """Each DTensor as this rank's local tensor; anything else as it is."""
    return [v.to_local() if isinstance(v, DTensor) else v for v in values]


def _like(placement, dim: int):
    """``placement``'s kind of split (a plain or a per-part shard) on another dim."""
    if isinstance(placement, _StridedShard):
        return _StridedShard(dim, split_factor=placement.split_factor)
    return Shard(dim)


def _parts(placement) -> int:
    """How many equal parts a placement splits separately (q, k, v: 3); 1 for Shard(d)."""
    return placement.split_factor if isinstance(placement, _StridedShard) else 1


def _partial_sum(node, args) -> bool:
    """add/sub of partial sums, or a partial sum scaled by a constant, stays partial."""
    tensors = [a for a in args if isinstance(a, DTensor)]
    if not tensors:
        return True
    partial = [any(p.is_partial() for p in a.placements) for a in tensors]
    summed = [type(a.placements[0]) is Partial and a.placements[0].reduce_op == "sum" for a in tensors]
    if node.target in (aten.add.Tensor, aten.sub.Tensor) and all(partial):
        return all(summed)
    if node.target is aten.mul.Tensor and len(tensors) == 1:
        return summed[0]
    return False


def _no_strategy(exc: Exception) -> bool:
    """DTensor's ways of saying an op cannot run on these placements."""
    text = str(exc)
    return any(k in text for k in ("sharding strategy", "not supported", "Sharding propagation failed",
                                   "Cannot unflatten", "redistribute the tensor before"))


def _root(node):
    """Clones and aliases hold the same values as their source: gather the source once."""
    while isinstance(node, fx.Node) and node.target in _SAME_VALUE:
        node = node.args[0]
    return node


def _op_name(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target))


def _sequence_dim(x, batch: int, seq: int) -> int | None:
    """The sequence dim of an activation: [batch, seq, ...] or [batch * seq, ...]; else None."""
    if x.ndim >= 3 and x.shape[0] == batch and x.shape[1] == seq:
        return 1
    if x.ndim == 2 and x.shape[0] == batch * seq:
        return 0
    return None


def _map_with_nodes(arg_nodes, values, fn):
    return tuple(fn(v, n) for v, n in zip(values, arg_nodes))


def _tree_wrap(out, mesh):
    if isinstance(out, DTensor):
        return out
    if isinstance(out, torch.Tensor):
        return DTensor.from_local(out, mesh, [Replicate()], run_check=False)
    if isinstance(out, (tuple, list)):
        return type(out)(_tree_wrap(o, mesh) for o in out)
    return out


def _placed(local: torch.Tensor, mesh, placement, shape) -> DTensor:
    """``local`` as this rank's part of a DTensor of global ``shape`` laid out by ``placement``.

    A fused projection's ``_StridedShard(d, k)`` means "k parts, each split over TP", not a
    shard order over several mesh axes (DTensor's default reading of a _StridedShard in a
    spec). Its spec says so explicitly, as DTensor's own view rules write the strided shards
    they produce: specs of the two readings do not match in a matmul's strategies, and DTensor
    would gather q, k and v to multiply them.
    """
    stride = make_contiguous_strides_for(shape)
    if not isinstance(placement, _StridedShard):
        return DTensor.from_local(local, mesh, [placement], run_check=False,
                                  shape=torch.Size(shape), stride=stride)
    spec = DTensorSpec(mesh, (placement,), tensor_meta=TensorMeta(torch.Size(shape), stride, local.dtype),
                       use_strided_shard_as_shard_order=False)
    return DTensor(local.view_as(local), spec, requires_grad=False)




@contextlib.contextmanager
def _why(reason: str):
    """Tag every node traced inside with the plan decision that put it there."""
    with fx_traceback.annotate({"autopar": reason}):
        yield


_ATTENTION_REGISTERED = False


def _register_cpu_attention() -> None:
    """CPU flash attention has no DTensor strategy: heads (and batch) shard independently."""
    global _ATTENTION_REGISTERED
    if _ATTENTION_REGISTERED:
        return
    _ATTENTION_REGISTERED = True

    def mask(attn_mask, placement):
        # an explicit mask (transformers' causal mask under tracing) is [b or 1, h or 1, s, s]:
        # it follows the batch / head split where it has that dim, else it is broadcast whole
        if attn_mask is None:
            return []
        return [placement if attn_mask.shape[placement.dim] > 1 else Replicate()] if isinstance(
            placement, Shard) else [placement]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _attention(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
        out = [([Replicate(), Replicate()],
                [Replicate(), Replicate(), Replicate(), None, None, *mask(attn_mask, Replicate())])]
        for dim in (0, 1):  # batch, heads
            out.append(([Shard(dim), Shard(dim)],
                        [Shard(dim), Shard(dim), Shard(dim), None, None, *mask(attn_mask, Shard(dim))]))
        return out

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _attention_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *,
                            attn_mask=None, scale=None):
        rep = [Replicate()] * 6 + [None, None, *mask(attn_mask, Replicate())]
        strategies = [([Replicate()] * 3, rep)]
        for dim in (0, 1):
            strategies.append(([Shard(dim)] * 3,
                               [Shard(dim)] * 6 + [None, None, *mask(attn_mask, Shard(dim))]))
        return strategies


_SCALED_MM_REGISTERED = False


def _register_scaled_mm() -> None:
    """FP8 matmuls (passes/fp8.py) shard as matmuls do; a rowwise scale follows its operand's
    rows (A) or columns (B), a tensorwise one is replicated. DTensor's own rule gathers a
    K-sharded operand under rowwise scales, though a partial sum with global scales is exact:
    sum_r (A8_r / s_A)(B8_r / s_B) = (A8 / s_A)(B8 / s_B)."""
    global _SCALED_MM_REGISTERED
    if _SCALED_MM_REGISTERED:
        return
    _SCALED_MM_REGISTERED = True
    # DTensor consults its single-dim rules before registered strategies: drop its rule
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.op_single_dim_strategy_funcs.pop(aten._scaled_mm.default, None)
    cache_clear = getattr(propagator.propagate_op_sharding, "cache_clear", None)
    if cache_clear is not None:
        cache_clear()

    @register_sharding(aten._scaled_mm.default)
    def _scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False):
        def along(scale, placement):  # a rowwise scale [M, 1] / [1, N] follows the split
            return placement if len(scale.shape) == 2 and scale.shape[placement.dim] > 1 else Replicate()

        rep = Replicate()
        return [
            ([rep], [rep, rep, rep, rep]),
            ([Shard(0)], [Shard(0), rep, along(scale_a, Shard(0)), rep]),  # rows of A (tokens)
            ([Shard(1)], [rep, Shard(1), rep, along(scale_b, Shard(1))]),  # column-parallel
            ([Partial()], [Shard(1), Shard(0), rep, rep]),  # row-parallel: a partial sum
        ]
