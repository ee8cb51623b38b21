"""Context parallelism as a rewrite of the per-rank joint graph: the sequence split over cp ranks.

Context parallelism is data parallelism over the sequence. The sequence is cut in 2n chunks and
CP rank r of n holds chunks r and 2n-1-r (load-balanced: under a causal mask every rank attends
the same number of (query, key) pairs; `passes.cp_balance`), or with ``balanced=False`` the
r-th contiguous block; parameters are replicated over cp. Every op that treats positions
independently (embeddings, norms, matmuls, MLPs, the per-token loss) runs on the rank's
positions alone; a weight's gradient is a sum over positions, so each rank's is a partial sum,
all-reduced over cp (before the data-parallel reduction over dp, which sums over the batch the
same way); a loss that is a mean or a ratio of sums over tokens is the ratio of the sums
all-reduced over cp.

The pass runs the dp-local global joint graph once on DTensors over the 1-D "cp" mesh, as the
tensor-parallel pass does over "tp": parameters and data replicated. Values of the data only
(computed from the inputs and constants alone: shifted labels, position ids, RoPE tables,
attention masks) are computed whole, as on one device; where one shaped [batch, seq, ...] meets
parameters or activations (token ids into the embedding) it enters as the rank's part of the
sequence (``Shard(1)``: a local slice, no communication). Balanced, ``Shard`` on the cp mesh
means the rank's two chunks while the graph is traced (`passes.cp_balance.zigzag_shards`): the
global view stays in position order, so every slice, gather and output follows the chunks.
DTensor's sharding propagation computes every op exactly on those placements: other data-only
values are sliced where they meet the rank's positions; partial sums are all-reduced before an
op not linear in them; an op that mixes positions (a slice shifting the sequence, a cumsum, a
convolution along it) gathers the sequence first (correct, not parallel: listed as the plan's
fallbacks, refused under ``strict``). The one op that must mix positions of activations and is
not gathered is attention: each scaled-dot-product attention (causal, unmasked or under a mask
of the data only; no dropout) and its backward are replaced by ring attention
(`runtime.ring_attention`: K/V blocks passed round the cp ranks, a grouped-query model's as
its kv heads (`passes.kv_expansion`), partial results merged by the
log-sum-exp rule, causal blocks above the diagonal skipped, a mask sliced per block; the ops
``autopar::ring_attention`` and its backward, registered by importing runtime.ring_attention,
which the caller does: passes do not import the runtime).

After the TP pass the graph is one TP rank's (its heads, its vocabulary shard, TP's
collectives over ranks holding the same positions): those collectives run on the rank's tokens
with their cp placement, and the ring runs on the rank's heads. Tokens flattened from
[batch, seq] are a `_StridedShard` over cp, which DTensor's element-wise, ``gather`` and
``index_put`` rules do not take: the pass runs those ops on the rank's tokens itself, values of
the data of the same shape sliced alike. Under TP's sequence parallelism SP splits the CP
rank's sequence over tp, cp outer and tp inner: SP's split and concatenation run on the rank's
local sequence, so its all-gather rebuilds the rank's chunks for the ring
(`passes.cp_sequence_parallel`). Under `autopar.parallelize` the gradients leave as
partial sums (``reduce_grads=False``) and the data-parallel pass (a pipeline's reduction after
its schedule) sums them over dp x cp.

Cross-entropy's mean over tokens (nll_loss over [tokens, C], nll_loss2d over [N, C, d1, ...]:
every dim but the class dim 1 is tokens) is computed as sum_r sum_{t in r} -w_t log p_t /
sum_r sum_{t in r} w_t (both all-reduced): DTensor's own rule averages the ranks' local means,
which is exact only when every rank has the same number of counted tokens (not so with ignored
labels or class weights). Per-token losses (reduction none) stay on the rank's tokens; any
other mean-reduced loss op over a sequence-split input is refused.
"""

from __future__ import annotations

import contextlib
import re
from collections import ChainMap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx import traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from passes.cp_balance import ZigzagError, zigzag_shards
from passes.cp_sequence_parallel import (
    SequenceParallelError,
    SequenceRegion,
    is_sp_cat,
    is_sp_split,
    sp_cat,
    sp_split,
)
from passes.kv_expansion import kv_group
from passes.tensor_parallel import (
    _COLLECTIVE_PREFIX,
    TensorParallelError,
    _failure,
    _Interpreter,
    _placed,
    _refuse_fp8_moves,
    _register_cpu_attention,
    _tree_wrap,
    _why,
)
from vocab.plan_types import GraphSignature

aten = torch.ops.aten

ATTENTION = aten._scaled_dot_product_flash_attention_for_cpu.default
ATTENTION_BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# attention ops of other devices' captures: refused by name (their ring is not wired yet)
_OTHER_ATTENTION = {aten._scaled_dot_product_flash_attention.default,
                    aten._scaled_dot_product_efficient_attention.default,
                    aten._scaled_dot_product_cudnn_attention.default}
_NLL_NONE = 0
_NLL_MEAN = 1
_NLL_SUM = 2
# cross-entropy's nll: [tokens, C] and [N, C, d1, ...] (every dim but the class dim 1 is tokens)
_NLL_FORWARD = {aten.nll_loss_forward.default, aten.nll_loss2d_forward.default}
_NLL_BACKWARD = {aten.nll_loss_backward.default, aten.nll_loss2d_backward.default}
_GATHERS = ("all_gather", "all_to_all")
_C10D = torch.ops._c10d_functional
_INDEX_PUT = {aten.index_put_.default, aten.index_put.default}
# the TP interpreter's words for gathering a step output (not a gradient, not the loss) whole
_OUTPUT_REASON = re.compile(r"CP: redistribute output \d+ to its placement")


class ContextParallelError(ValueError):
    """The graph cannot run with its sequence split over context-parallel ranks (names the op,
    where the model runs it, and the fix)."""


@dataclass
class ContextParallelGraph:
    """The traced per-rank graph and the ops whose inputs were gathered over the sequence."""

    gm: fx.GraphModule
    gathered: list[tuple[str, str]]  # (op, why): sequence gathers DTensor inserted
    ring_attention: int  # attention forwards run as ring attention


def sequence_inputs(signature: GraphSignature, shapes: Sequence[tuple[int, ...]]) -> list[int]:
    """Placeholders split over the sequence: inputs shaped [batch, seq, ...] like the first
    input (token ids, labels, masks, position ids)."""
    kinds = [(i, s) for i, ((kind, _), s) in enumerate(zip(signature.inputs, shapes)) if kind == "input"]
    if not kinds or len(kinds[0][1]) < 2:
        return []
    batch, seq = kinds[0][1][:2]
    return [i for i, s in kinds if len(s) >= 2 and tuple(s[:2]) == (batch, seq)]


def data_only(gm: fx.GraphModule, signature: GraphSignature) -> set[str]:
    """Nodes computed from the step's inputs and constants only (shifted labels, masks,
    position ids): no parameter, no activation. Gathering one over the sequence costs no
    parallelism (every rank computes it whole, as one device does). A buffer the step never
    writes (not in ``signature.buffer_index``: a constant causal mask, a RoPE table) is data."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = {n.name for n, (kind, name) in zip(holders, signature.inputs)
           if kind == "input" or (kind == "buffer" and name not in signature.buffer_index)}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "get_attr") and all(a.name in out for a in node.all_input_nodes):
            out.add(node.name)
    return out


def check_context_parallel(gm: fx.GraphModule, signature: GraphSignature,
                           shapes: Sequence[tuple[int, ...]], cp: int, balanced: bool = True) -> None:
    """Raise `ContextParallelError` where ``gm`` cannot run with its sequence over ``cp`` ranks:
    no input with a sequence dimension, a sequence not divisible into cp equal blocks (2 cp
    chunks, ``balanced``), a
    random op (its draws on a rank's block would not be one device's), or an attention the
    ring does not compute (dropout, a mask computed from activations, another
    device's kernel)."""
    seq_inputs = sequence_inputs(signature, shapes)
    if not seq_inputs:
        raise ContextParallelError(
            f"cp={cp}: no input of the step has a sequence dimension ([batch, seq, ...]) to split; "
            "use cp=1 for this model")
    seq = shapes[seq_inputs[0]][1]
    if seq % cp:
        raise ContextParallelError(
            f"cp={cp}: the sequence of {seq} positions does not split into {cp} equal blocks; use a "
            f"sequence length that is a multiple of {cp}, or another cp")
    if balanced and seq % (2 * cp):
        raise ContextParallelError(
            f"cp={cp}: the sequence of {seq} positions does not cut into 2*cp = {2 * cp} equal chunks "
            f"(each rank holds chunks r and {2 * cp - 1}-r, so causal attention costs every rank the same); "
            f"use a sequence length that is a multiple of {2 * cp}, or Layout(cp_balance=False)")
    data = data_only(gm, signature)
    for node in gm.graph.nodes:
        if _draws_random(node):
            raise ContextParallelError(
                f"cp={cp}: random op {node.target} ({node}) {_where(node)} would draw on each CP rank's "
                "block of the sequence, not as one device draws over the whole (the generator is not "
                "kept in step over cp); use dropout 0 / no random ops in the training step, or cp=1")
        if node.target in _OTHER_ATTENTION:
            raise ContextParallelError(
                f"cp={cp}: attention op {node.target} ({node}) has no ring implementation yet (the ring "
                "runs the CPU flash kernel's captures); use cp=1")
        if node.target is ATTENTION and not _ring_ready(node):
            raise ContextParallelError(
                f"cp={cp}: attention {node} {_where(node)} has dropout, which ring attention does not "
                "draw as one device does; use attention dropout 0, or cp=1")
        mask = node.kwargs.get("attn_mask") if node.target is ATTENTION else None
        if isinstance(mask, fx.Node) and mask.name not in data:
            raise ContextParallelError(
                f"cp={cp}: attention {node} {_where(node)} has a mask computed from activations ({mask}), "
                "which ring attention cannot slice per block (a mask of the data only, such as causal "
                "or padding masks, is); use is_causal=True or a mask made from the inputs, or cp=1")


def _draws_random(node: fx.Node) -> bool:
    """An op that draws from the generator (dropout with p > 0 in training, rand*, bernoulli)."""
    tags = getattr(node.target, "tags", ())
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in tags:
        return False
    if node.target in (ATTENTION, ATTENTION_BACKWARD) or node.target in _OTHER_ATTENTION:
        return False  # attention dropout: refused on its own, with its own fix
    if node.target is aten.native_dropout.default:  # (input, p, train): p = 0 or eval draws nothing
        p, train = node.args[1], node.args[2] if len(node.args) > 2 else None
        return bool(p) and train is not False
    return True


def _ring_ready(node: fx.Node) -> bool:
    """An attention forward / backward the ring computes: no dropout."""
    if node.target is ATTENTION:
        dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
    else:
        dropout = node.args[6] if len(node.args) > 6 else node.kwargs.get("dropout_p", 0.0)
    return not dropout


def _where(node: fx.Node) -> str:
    module = node.meta.get("module") or next(reversed(node.meta.get("nn_module_stack") or {"": ""}), "")
    return f"in the forward of {module}" if module else "in the model"


def apply_context_parallel(gm: fx.GraphModule, signature: GraphSignature,
                           shapes: Sequence[tuple[int, ...]], mesh: DeviceMesh,
                           balanced: bool = True, reduce_grads: bool = True) -> ContextParallelGraph:
    """Trace ``gm`` (the dp-local step, whole sequences) into the graph one rank of the 1-D cp
    ``mesh`` runs. Placeholders and outputs keep their order and shapes (inputs whole: each
    rank slices its positions in the graph); gradients and the loss leave whole (all-reduced
    over cp), returned outputs whole in position order. ``balanced``: rank r holds sequence
    chunks r and 2cp-1-r of 2cp (`passes.cp_balance`), else the r-th contiguous block.

    ``reduce_grads=False`` leaves each gradient as this rank's partial sum g_r, with
    sum_r g_r = g (the sum over its positions; a gradient not split over the sequence whole
    on CP rank 0 and 0 on the others, so the sum stays exact): the data-parallel pass then
    reduces over the dp x cp ranks at once, as ZeRO sharding over dp x cp needs (Megatron's
    dp-cp group)."""
    check_context_parallel(gm, signature, shapes, mesh.size(), balanced)
    _register_cpu_attention()
    grad_outputs = {i: n for n, i in signature.grad_index.items()}
    ids = shapes[sequence_inputs(signature, shapes)[0]]
    grad_placement = Replicate() if reduce_grads else Partial()
    interp = _Interpreter(gm, mesh, [Replicate()] * len(shapes), shapes, False, (ids[0], ids[1]),
                          grad_outputs, {i: grad_placement for i in grad_outputs}, signature.loss_index)
    runner = _Runner(interp, data_only(gm, signature), (ids[0], ids[1]), balanced)
    dtypes = [n.meta["val"].dtype for n in gm.graph.nodes if n.op == "placeholder"]
    examples = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes)]
    shards = zigzag_shards(mesh) if balanced else contextlib.nullcontext()
    try:
        with fx_traceback.preserve_node_meta(), torch.no_grad(), shards:
            # (constants of a graph the TP pass traced are real tensors: kept as constants)
            traced = make_fx(runner.run, tracing_mode="fake", _allow_non_fake_inputs=True)(*examples)
    except TensorParallelError as exc:
        raise ContextParallelError(_cp_words(str(exc))) from exc
    except ContextParallelError:
        raise
    gathered = []
    data = data_only(gm, signature)
    cp_group = mesh.get_group().group_name
    for node in traced.graph.nodes:
        reason = node.meta.get("custom", {}).get("autopar")
        if reason and str(node.target).startswith(_COLLECTIVE_PREFIX) and cp_group not in node.args:
            node.meta["autopar"] = reason  # a collective of the TP graph, over the TP ranks
        elif reason and (str(node.target).startswith(_COLLECTIVE_PREFIX) or "ring_attention" in str(node.target)):
            node.meta["autopar"] = _cp_words(reason)
            if not any(g in str(node.target) for g in _GATHERS):
                continue
            source = (node.meta.get("from_node") or [None])[0]
            if getattr(source, "name", None) in data:  # labels shifted, masks: whole, as one device
                node.meta["autopar"] += " (a value of the data only: computed whole on every CP rank)"
            elif _OUTPUT_REASON.match(node.meta["autopar"]):  # logits returned: whole, not a compute gather
                node.meta["autopar"] += " (a forward output returned whole, as one device returns it)"
            else:
                gathered.append((str(node.target), node.meta["autopar"]))
    traced.graph.eliminate_dead_code()
    _refuse_fp8_moves(traced, "cp", ContextParallelError)
    traced.recompile()
    return ContextParallelGraph(traced, gathered, runner.rings)


def _cp_words(text: str) -> str:
    """The TP interpreter's words for its redistributions, said of the cp axis."""
    return text.replace("TP: ", "CP: ").replace("TP ranks", "CP ranks").replace("use tp=1", "use cp=1") \
        .replace("TP placements", "CP placements").replace("use sp=0, or cp=1", "use cp=1") \
        .replace("over the TP shards", "over the CP ranks") \
        .replace("or keep the weights that feed this op replicated",
                 "or compute this op on values that do not depend on the split sequence")


class _Runner:
    """The TP interpreter on the cp mesh, with the sequence inputs split, attention as ring
    attention and cross-entropy's token mean as a ratio of all-reduced sums."""

    def __init__(self, interp: _Interpreter, data: set[str], tokens: tuple[int, int], balanced: bool) -> None:
        self.interp = interp
        self.balanced = balanced  # zigzag chunks (passes.cp_balance), else contiguous blocks
        self.data = data  # values of the data only: computed whole, as on one device
        self.tokens = tokens  # (batch, seq) of the step's inputs
        self.mesh = interp.mesh
        self.rings = 0
        self._tp_call = interp._call
        interp._call = self._call
        self._split: dict = {}  # node, or (node, placements): its rank-local slice
        self.region = SequenceRegion(self.mesh.size())  # TP's SP blocks of the rank's sequence

    def run(self, *args):
        holders = [n for n in self.interp.gm.graph.nodes if n.op == "placeholder"]
        env = {node: _placed(arg, self.mesh, Replicate(), shape)
               for node, arg, shape in zip(holders, args, self.interp.shapes)}
        return self._run(env)

    def _split_data(self, node: fx.Node, env):
        """Where ``node`` computes activations, its data-only operands shaped [batch, seq, ...]
        (token ids, masks, position ids) enter as the rank's block of the sequence (a local
        slice, once per value); the rest of the data meets the sharded activations through
        DTensor's propagation (sliced where broadcast against them). Returns the values this
        node reads: data-only consumers keep reading the whole values."""
        if node.name in self.data:
            return env
        split = {}
        for arg in node.all_input_nodes:
            value = env.get(arg)
            if arg.name not in self.data or not isinstance(value, DTensor) or value.ndim < 2 \
                    or tuple(value.shape[:2]) != self.tokens or list(value.placements) != [Replicate()]:
                continue
            if arg not in self._split:
                with _why(f"CP: this rank's block of the sequence of {arg} (a local slice)"):
                    self._split[arg] = value.redistribute(self.mesh, [Shard(1)])
            split[arg] = self._split[arg]
        self._split_alike(node, env, split)
        return ChainMap(split, env) if split else env

    def _split_alike(self, node: fx.Node, env, split: dict) -> None:
        """Data-only operands of ``node`` of the same shape as a sequence-split operand (a
        token mask flattened like the tokens: a label-smoothed loss's ignore mask) enter split
        as it is (a local slice); DTensor would gather the split operand instead where the
        placement is a `_StridedShard`."""
        values = {a: split.get(a, env.get(a)) for a in node.all_input_nodes}
        cut = next((v for a, v in values.items() if a.name not in self.data and _token_split(v)), None)
        if cut is None:
            return
        for arg, value in values.items():
            if arg.name not in self.data or not isinstance(value, DTensor) or arg in split \
                    or list(value.placements) != [Replicate()] or value.shape != cut.shape:
                continue
            key = (arg, tuple(cut.placements))
            if key not in self._split:
                with _why(f"CP: this rank's tokens of {arg} (a local slice)"):
                    self._split[key] = value.redistribute(self.mesh, list(cut.placements))
            split[arg] = self._split[key]

    def _run(self, env):
        for node in self.interp.gm.graph.nodes:
            if node.op == "call_function":
                with fx_traceback.set_current_meta(node):
                    try:
                        env[node] = self._call(node, env)
                    except (TensorParallelError, ContextParallelError):
                        raise
                    except SequenceParallelError as exc:
                        raise ContextParallelError(str(exc)) from exc
                    except ZigzagError as exc:
                        n = self.mesh.size()
                        raise ContextParallelError(
                            f"cp={n}: {node.target} ({node}) {_where(node)}: {exc}; make that dimension a "
                            f"multiple of {2 * n} (e.g. the sequence length), or Layout(cp_balance=False)") from exc
                    except Exception as exc:
                        raise TensorParallelError(_failure(node, env, exc, False)) from exc
            elif node.op == "get_attr":
                env[node] = _tree_wrap(getattr(self.interp.gm, node.target), self.mesh)
            elif node.op == "output":
                return self.interp._outputs(node, self._partial_grads(node, env))
        raise AssertionError("graph without output")

    def _partial_grads(self, node: fx.Node, env):
        """Where the gradients leave unreduced (``Partial`` wanted): a gradient not already a
        partial sum over cp (replicated, or split over the sequence: gathered whole) as the
        whole value on CP rank 0 and zeros on the others, so that the sum over cp is exact."""
        wanted = self.interp.grad_placements
        fixed = {}
        for index, arg in enumerate(node.args[0]):
            value = env.get(arg) if isinstance(arg, fx.Node) else None
            if not isinstance(value, DTensor) or wanted.get(index) != Partial() \
                    or list(value.placements) == [Partial()] or arg in fixed:
                continue
            if list(value.placements) != [Replicate()]:
                with _why(f"CP: gather the gradient {arg} whole (kept on CP rank 0, reduced over dp x cp)"):
                    value = value.redistribute(self.mesh, [Replicate()])
            whole = value.to_local()
            local = whole if self.mesh.get_local_rank() == 0 else torch.zeros_like(whole)
            fixed[arg] = DTensor.from_local(local, self.mesh, [Partial()], run_check=False,
                                            shape=value.shape, stride=value.stride())
        return ChainMap(fixed, env) if fixed else env

    def _call(self, node: fx.Node, env):
        """``node`` on the rank's positions; TP's sequence-parallel split and concatenation on
        the rank's local sequence (`passes.cp_sequence_parallel`), the values between them
        checked to stay the rank's SP blocks."""
        if is_sp_split(node):
            out = sp_split(node, env[node.args[0]], self.mesh.size())
            if out is not None:
                self.region.enter(node)
                return out
        if is_sp_cat(node):
            out = sp_cat(node, [env[p] for p in node.args[0]])
            if out is not None:
                return out
        if not self.region.inside(node):
            return self._call_op(node, env)
        local = self.region.rank_inputs(node, env, self.data, _where(node))
        out = self._call_op(node, ChainMap(local, env) if local else env)
        self.region.check_output(node, out, _where(node))
        return out

    def _call_op(self, node: fx.Node, env):
        if node.target not in (ATTENTION, ATTENTION_BACKWARD):  # the ring takes the mask whole
            env = self._split_data(node, env)
        if node.target is ATTENTION:
            return self._ring_forward(node, env)
        if node.target is ATTENTION_BACKWARD and _ring_ready(node):
            return self._ring_backward(node, env)
        if node.target in _NLL_FORWARD and isinstance(env[node.args[0]], DTensor):
            return self._nll_forward(node, env)
        if node.target in _NLL_BACKWARD and isinstance(env[node.args[1]], DTensor):
            return self._nll_backward(node, env)
        if node.target is aten.sum.default and _token_split(env.get(node.args[0])):
            return self._full_sum(node, env)
        local = self._strided_pointwise(node, env)
        if local is not None:
            return local
        if str(node.target).startswith(_COLLECTIVE_PREFIX) and isinstance(env.get(node.args[0]), DTensor):
            return self._tp_collective(node, env)
        if node.target is aten.gather.default and _token_split(env.get(node.args[0])):
            out = self._gather_local(node, env)
            if out is not None:
                return out
        if node.target in _INDEX_PUT:
            out = self._index_put_partial(node, env) if _accumulates(node) else self._index_put_local(node, env)
            if out is not None:
                return out
        if node.target is aten._scaled_mm.default:
            out = self._scaled_mm_local(node, env)
            if out is not None:
                return out
        _refuse_mean_loss(node, env, self.mesh.size())
        return self._tp_call(node, env)

    def _strided_pointwise(self, node: fx.Node, env):
        """An element-wise op on tokens flattened from [b, s] (a `_StridedShard` over cp, which
        DTensor's element-wise rules do not take: it would gather them): run on the rank's
        tokens, its other operands of the same shape sliced alike (a local slice of a whole
        value), scalars as they are. None where the operands do not fit that (DTensor's rule)."""
        if torch.Tag.pointwise not in getattr(node.target, "tags", ()):
            return None
        values = [env[a] for a in node.all_input_nodes]
        cuts = [v for v in values if isinstance(v, DTensor) and type(v.placements[0]) is _StridedShard]
        val = node.meta.get("val")
        if not cuts or not isinstance(val, torch.Tensor):
            return None
        want, dim = list(cuts[0].placements), cuts[0].placements[0].dim
        # every split operand split alike, on the output's dim (broadcast along other dims)
        if any(list(c.placements) != want or c.ndim != val.ndim or c.shape[dim] != val.shape[dim] for c in cuts):
            return None
        local = {}
        for arg, v in zip(node.all_input_nodes, values):
            if not isinstance(v, DTensor) or list(v.placements) == want:
                local[arg] = v.to_local() if isinstance(v, DTensor) else v
            elif list(v.placements) != [Replicate()]:
                return None
            elif v.ndim < val.ndim - dim or v.shape[dim - val.ndim] == 1:  # broadcast along the tokens
                local[arg] = v.to_local()
            elif v.shape == val.shape:
                with _why(f"CP: this rank's tokens of {arg} (a local slice)"):
                    local[arg] = v.redistribute(self.mesh, want).to_local()
            else:
                return None
        out = node.target(*fx.node.map_arg(node.args, local.__getitem__),
                          **fx.node.map_arg(node.kwargs, local.__getitem__))
        if not isinstance(out, torch.Tensor):
            return None
        return DTensor.from_local(out, self.mesh, want, run_check=False, shape=val.shape, stride=val.stride())

    def _scaled_mm_local(self, node: fx.Node, env):
        """An FP8 matmul (passes/fp8.py) on the rank's tokens, its scales global (their amaxes
        reduced over cp): A's rows split (tokens along M: the forward, the input gradient) give
        the rank's rows of C, B's columns split its columns; A's columns and B's rows split
        alike (tokens along K: the weight gradient) give a partial sum over cp,
        sum_r (A8_r / s_A)(B8_r / s_B) = (A8 / s_A)(B8 / s_B). Neither DTensor's own rule nor
        TP's (`Shard` only) takes tokens flattened from [b, s] (a `_StridedShard`), and
        DTensor's shards a rowwise [M, 1] scale along a K split: both would gather the FP8
        operands, which gloo cannot move. None where the operands fit none of these (DTensor's
        rule)."""
        args = dict(zip(("a", "b", "scale_a", "scale_b", "bias", "scale_result"), node.args))
        if any(args.get(k, node.kwargs.get(k)) is not None for k in ("bias", "scale_result")):
            return None
        a, b, scale_a, scale_b = (env[args[k]] for k in ("a", "b", "scale_a", "scale_b"))
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)) or any(
                isinstance(v, DTensor) and any(p.is_partial() for p in v.placements) for v in (a, b, scale_a, scale_b)):
            return None
        pa = a.placements[0] if _token_split(a) else None
        pb = b.placements[0] if _token_split(b) else None
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        scales = {args["scale_a"]: scale_a, args["scale_b"]: scale_b}
        if pa is not None and pa.dim == 0 and pb is None:  # rows of A: the rank's rows of C
            want, along = list(a.placements), (args["scale_a"], 0)
        elif pb is not None and pb.dim == 1 and pa is None:  # columns of B: the rank's columns
            want, along = list(b.placements), (args["scale_b"], 1)
        elif pa is not None and pb is not None and (pa.dim, pb.dim) == (1, 0) and type(pa) is type(pb) \
                and getattr(pa, "split_factor", 1) == getattr(pb, "split_factor", 1):
            want, along = [Partial()], None  # tokens along K: scales of M and N alone
        else:
            return None
        local = {args["a"]: a.to_local(), args["b"]: b.to_local()}
        for arg, scale in scales.items():
            if not isinstance(scale, DTensor):
                local[arg] = scale
            elif along and arg is along[0] and scale.ndim == 2 and scale.shape[along[1]] > 1:
                # a rowwise scale follows A's rows (B's columns): the rank's part of it
                if list(scale.placements) == [Replicate()]:
                    with _why(f"CP: this rank's tokens of the FP8 scale {arg} (a local slice)"):
                        scale = scale.redistribute(self.mesh, want)
                if list(scale.placements) != want:
                    return None
                local[arg] = scale.to_local()
            elif list(scale.placements) == [Replicate()]:
                local[arg] = scale.to_local()
            else:
                return None
        out = node.target(*fx.node.map_arg(node.args, local.__getitem__),
                          **fx.node.map_arg(node.kwargs, local.__getitem__))
        return DTensor.from_local(out, self.mesh, want, run_check=False, shape=val.shape, stride=val.stride())

    def _tp_collective(self, node: fx.Node, env):
        """A collective the TP pass put in the graph (over the TP ranks, which hold the same
        positions) on a value placed over cp: the rank's part, placed as its input is. Each TP
        rank's part is its CP rank's: element-wise across the TP ranks, so an all-reduce or a
        wait keeps the cp placement, a partial sum stays one (a sum; another reduction, or
        a gather / scatter along a sequence-split dim 0, takes the value whole first)."""
        x = env[node.args[0]]
        p = x.placements[0]
        reduce_op = node.args[1] if node.target is _C10D.all_reduce.default else "sum"
        on_tokens = node.target is not _C10D.all_reduce.default and node.target is not _C10D.wait_tensor.default \
            and getattr(p, "dim", None) == 0 and not p.is_partial()
        if (p.is_partial() and reduce_op != "sum") or on_tokens:
            with _why(f"CP: {node.args[0]} whole for the TP collective {node}"):
                x = x.redistribute(self.mesh, [Replicate()])
        args = [x.to_local(), *(env[a] if isinstance(a, fx.Node) else a for a in node.args[1:])]
        out = node.target(*args, **node.kwargs)
        val = node.meta["val"]
        return DTensor.from_local(out, self.mesh, list(x.placements), run_check=False, shape=val.shape,
                                  stride=val.stride())

    def _gather_local(self, node: fx.Node, env):
        """``torch.gather(x, d, index)`` along a dim other than ``x``'s split one (a
        vocabulary-parallel loss reading each token's label logit), ``index`` a value of the
        data: on the rank's tokens, the index sliced alike. None otherwise (DTensor's rule)."""
        x, dim, index = env[node.args[0]], node.args[1], node.args[2]
        p = x.placements[0]
        if dim % x.ndim == p.dim or not isinstance(index, fx.Node) or index.name not in self.data:
            return None
        value = env.get(index)
        if not isinstance(value, DTensor) or value.ndim != x.ndim or value.shape[p.dim] != x.shape[p.dim]:
            return None
        if list(value.placements) == [Replicate()]:
            with _why(f"CP: this rank's tokens of {index} (a local slice)"):
                value = value.redistribute(self.mesh, list(x.placements))
        if value.placements != x.placements:
            return None
        out = aten.gather.default(x.to_local(), dim, value.to_local(), *node.args[3:])
        val = node.meta["val"]
        return DTensor.from_local(out, self.mesh, list(x.placements), run_check=False, shape=val.shape,
                                  stride=val.stride())

    def _index_put_local(self, node: fx.Node, env):
        """``base[indices] = values`` on a sequence-split ``base`` whose indices are masks or
        ids over its leading (token) dims (a vocabulary-parallel embedding zeroing the ids
        outside its TP shard): on the rank's tokens, indices sliced alike, a scalar value as it
        is. None where the operands do not fit (DTensor's rule)."""
        base, values = env[node.args[0]], env[node.args[2]]
        if not _token_split(base):
            return None
        local_indices = self._alike(node.args[1], base, env)
        if local_indices is None:
            return None
        if isinstance(values, DTensor) and values.ndim > 0:  # one value per indexed token
            local_values = self._alike([node.args[2]], base, env, indexing=False)
            if local_values is None or node.args[2].name not in self.data:
                return None
            local_values = local_values[0]
        else:
            local_values = values.to_local() if isinstance(values, DTensor) else values
        out = node.target(base.to_local(), local_indices, local_values, False)
        if node.target is aten.index_put_.default:
            return base  # its local tensor written in place, as the graph's in-place op
        return DTensor.from_local(out, self.mesh, list(base.placements), run_check=False, shape=base.shape,
                                  stride=base.stride())

    def _alike(self, indices, like: DTensor, env, indexing: bool = True) -> list | None:
        """Index tensors over ``like``'s leading dims (``indexing``; else values, one per
        token) as ``like``'s local part: a whole value of the data sliced as ``like`` is (a
        local slice); None where one is neither."""
        out = []
        split_dim = like.placements[0].dim if indexing else -1
        for dim, index in enumerate(indices):
            if dim == split_dim and isinstance(index, fx.Node) and _positions(index, like.shape[dim]):
                # arange over the split dim (a loss's row of each token): the local rows
                out.append(torch.arange(like.to_local().shape[dim]))
                continue
            if dim == split_dim and isinstance(index, fx.Node) and index.meta["val"].dtype != torch.bool:
                return None  # positions into the split dim: not the rank's
            value = self._split.get((index, tuple(like.placements)), None) if isinstance(index, fx.Node) else None
            value = value if value is not None else (env.get(index) if isinstance(index, fx.Node) else index)
            if isinstance(value, DTensor) and list(value.placements) == [Replicate()] and index.name in self.data \
                    and value.shape == like.shape[:value.ndim]:
                with _why(f"CP: this rank's tokens of {index} (a local slice)"):
                    value = value.redistribute(self.mesh, list(like.placements))
                self._split[(index, tuple(like.placements))] = value
            if not isinstance(value, DTensor) or value.placements != like.placements \
                    or value.shape != like.shape[:value.ndim]:
                return None
            out.append(value.to_local())
        return out

    def _index_put_partial(self, node: fx.Node, env):
        """``index_put(base, indices, values, accumulate=True)`` with indices and values split
        alike over cp (a vocabulary-parallel embedding's backward under TP): each rank adds its
        tokens' values, onto ``base`` on CP rank 0 and onto zeros elsewhere, a partial sum over
        cp. None where the operands do not fit (DTensor's rule)."""
        base, indices, values = env[node.args[0]], node.args[1], env[node.args[2]]
        if not isinstance(base, DTensor) or list(base.placements) != [Replicate()] or not _token_split(values) \
                or len(node.args[0].users) != 1:
            return None
        local_indices = self._alike(indices, values, env)
        if local_indices is None:
            return None
        whole = base.to_local()
        start = whole.clone() if self.mesh.get_local_rank() == 0 else torch.zeros_like(whole)
        out = aten.index_put.default(start, local_indices, values.to_local(), True)
        return DTensor.from_local(out, self.mesh, [Partial()], run_check=False, shape=base.shape,
                                  stride=base.stride())

    def _full_sum(self, node: fx.Node, env):
        """The sum of every element of a sequence-split value (a label-smoothed loss's token
        sum; DTensor has no rule for tokens flattened from [b, s], a `_StridedShard`): the
        rank's local sum, a partial sum over cp."""
        x = env[node.args[0]]
        dtype = node.kwargs.get("dtype")
        local = x.to_local().sum(dtype=dtype) if dtype is not None else x.to_local().sum()
        return DTensor.from_local(local, self.mesh, [Partial()], run_check=False, shape=torch.Size([]),
                                  stride=())

    def _sequence(self, x, arg: fx.Node, dim: int, op: fx.Node) -> torch.Tensor:
        """``x`` split on ``dim`` (the sequence), as this rank's local block."""
        if not isinstance(x, DTensor):
            x = _placed(x, self.mesh, Replicate(), x.shape)
        if list(x.placements) != [Shard(dim)]:
            with _why(f"CP: {arg} to the rank's block of the sequence for ring attention {op}"):
                x = x.redistribute(self.mesh, [Shard(dim)])
        return x.to_local()

    def _whole_mask(self, node: fx.Node, env) -> torch.Tensor | None:
        """The attention's mask (a value of the data only) whole, [.., S, S]: the ring slices
        each block's part."""
        mask = node.kwargs.get("attn_mask")
        if mask is None:
            return None
        value = env[mask]
        if isinstance(value, DTensor):
            if list(value.placements) != [Replicate()]:
                with _why(f"CP: gather the attention mask {mask} whole for ring attention {node}"):
                    value = value.redistribute(self.mesh, [Replicate()])
            value = value.to_local()
        return value

    def _ring_args(self, node: fx.Node, env):
        n = self.mesh.size()
        return (self.mesh.get_group().group_name, self.mesh.get_local_rank(), n)

    def _ring_tail(self, mask, k: fx.Node, v: fx.Node):
        """The ring ops' trailing arguments: the whole mask, the chunk layout and the
        grouped-query group of K and V (`passes.kv_expansion`: their kv heads travel)."""
        found = kv_group(k, v)
        return mask, self.balanced, (found[2] if found is not None else 1)

    def _ring_forward(self, node: fx.Node, env):
        """(O, lse) of the whole sequence's attention, this rank's block of the queries."""
        _check_ring_lengths(node, [env[a].shape for a in node.args[:3]], self.mesh.size(), self.balanced)
        q, k, v = (self._sequence(env[a], a, 2, node) for a in node.args[:3])
        causal = node.args[4] if len(node.args) > 4 else node.kwargs.get("is_causal", False)
        scale = node.kwargs.get("scale")
        n = self.mesh.size()
        mask = self._whole_mask(node, env)
        with _why(f"CP: ring attention {node} (K/V blocks passed round the {n} CP ranks, merged by "
                  "log-sum-exp)"):
            out, lse = torch.ops.autopar.ring_attention(q, k, v, bool(causal), scale, *self._ring_args(node, env),
                                                        *self._ring_tail(mask, *node.args[1:3]))
        self.rings += 1
        shape = tuple(env[node.args[0]].shape)
        val = node.meta["val"]
        return (_place_like(out, self.mesh, val[0]), _placed(lse, self.mesh, Shard(2), shape[:-1]))

    def _ring_backward(self, node: fx.Node, env):
        """(dQ, dK, dV) of the ring: K/V and their gradients' accumulators round the ring again."""
        dout, q, k, v, out = (self._sequence(env[a], a, 2, node) for a in node.args[:5])
        lse = self._sequence(env[node.args[5]], node.args[5], 2, node)
        causal = node.args[7] if len(node.args) > 7 else node.kwargs.get("is_causal", False)
        scale = node.kwargs.get("scale")
        mask = self._whole_mask(node, env)
        with _why(f"CP: ring attention's backward {node} (K/V and their gradients round the CP ranks)"):
            dq, dk, dv = torch.ops.autopar.ring_attention_backward(dout, q, k, v, out, lse, bool(causal), scale,
                                                                   *self._ring_args(node, env),
                                                                   *self._ring_tail(mask, *node.args[2:4]))
        return tuple(_place_like(g, self.mesh, val) for g, val in zip((dq, dk, dv), node.meta["val"]))

    def _nll_backward(self, node: fx.Node, env):
        """nll_loss's backward on the rank's tokens, with the step's total weight: each row's
        gradient -w_t g / W depends on its own token and the all-reduced W only."""
        args = list(fx.node.map_arg(node.args, lambda a: env[a]))
        grad, x, target, weight, reduction, ignore, total = args
        if not _token_sharded(x):
            x = x.redistribute(self.mesh, [Replicate()])
        want = _target_placements(x)
        grad_l = _local(grad, want) if reduction == _NLL_NONE else _local(grad)
        out = node.target(grad_l, x.to_local(), _local(target, want), _local(weight), reduction, ignore,
                          _local(total))
        return DTensor(out, x._spec, requires_grad=False)

    def _nll_forward(self, node: fx.Node, env):
        """nll_loss over token-sharded log-probabilities: (sum, total weight) of the rank's
        tokens, all-reduced; the mean their ratio (DTensor would average the ranks' means)."""
        args = list(fx.node.map_arg(node.args, lambda a: env[a]))
        x, target, weight, reduction, ignore = (args + [None] * 5)[:5]
        if not _token_sharded(x):  # whole: as one device
            x = x.redistribute(self.mesh, [Replicate()])
            out = node.target(x.to_local(), _local(target), _local(weight), *args[3:])
            return tuple(_placed(o, self.mesh, Replicate(), o.shape) for o in out)
        want = _target_placements(x)
        x_l, t_l = x.to_local(), _local(target, want)
        w_l = weight.full_tensor() if isinstance(weight, DTensor) else weight
        if reduction == _NLL_NONE:  # per-token losses: the rank's tokens, placed as the target's
            out, total = node.target(x_l, t_l, w_l, _NLL_NONE, ignore)
            whole = tuple(target.shape) if isinstance(target, DTensor) else tuple(node.meta["val"][0].shape)
            return (DTensor.from_local(out, self.mesh, want, run_check=False, shape=torch.Size(whole),
                                       stride=node.meta["val"][0].stride()),
                    _placed(total, self.mesh, Replicate(), total.shape))
        loss, total = node.target(x_l, t_l, w_l, _NLL_SUM, ignore)
        loss, total = (_placed(t, self.mesh, Partial(), ()) for t in (loss, total))
        with _why(f"CP: all-reduce the sum and the weight of the loss's tokens over the CP ranks ({node})"):
            loss, total = loss.redistribute(self.mesh, [Replicate()]), total.redistribute(self.mesh, [Replicate()])
        if reduction == _NLL_MEAN:
            loss = loss / total
        return loss, total


def _check_ring_lengths(node: fx.Node, shapes, cp: int, balanced: bool) -> None:
    """The ring splits Q and K/V into the same cp equal blocks (2 cp chunks, ``balanced``):
    their sequence lengths (dim 2 of [b, h, s, d]) must agree and divide by them (a token
    prepended inside the model does not)."""
    lengths = [s[2] for s in shapes]
    parts = 2 * cp if balanced else cp
    if len(set(lengths)) != 1 or lengths[0] % parts:
        raise ContextParallelError(
            f"cp={cp}: attention {node} {_where(node)} runs over sequences of lengths q={lengths[0]}, "
            f"k={lengths[1]}, v={lengths[2]}; ring attention needs Q and K/V of one length divisible "
            f"by cp={cp}" + (f" into 2*cp = {parts} load-balanced chunks" if balanced else "")
            + " (a token prepended or a cache appended inside the model changes it); make the "
            f"attention's length a multiple of {parts} (e.g. shorten the input by the prepended tokens), or cp=1")


def _place_like(local: torch.Tensor, mesh: DeviceMesh, like: torch.Tensor) -> DTensor:
    """``local`` (this rank's sequence block, dim 2 of [b, h, s, d]) as a DTensor with the
    shape and memory layout of the captured value ``like`` (CPU flash attention writes O as
    [b, s, h, d]), so the graph's later views of it stay views, locally and globally."""
    order = sorted(range(like.ndim), key=lambda d: -like.stride(d))
    if order != list(range(like.ndim)):
        inverse = [order.index(d) for d in range(like.ndim)]
        local = local.permute(order).contiguous().permute(inverse)
    return DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=like.shape, stride=like.stride())


def _local(x, like: DTensor | list | None = None):
    """``x``'s local tensor: a replicated DTensor's whole value, else (``like`` given: a
    DTensor or placements) its block placed as ``like`` is."""
    if not isinstance(x, DTensor):
        return x
    if isinstance(like, DTensor):
        like = list(like.placements)
    want = like if like is not None else [Replicate()]
    if list(x.placements) != want:
        x = x.redistribute(x.device_mesh, want)
    return x.to_local()


def _token_sharded(x) -> bool:
    """Log-probabilities [tokens, classes] or [N, classes, d1, ...] split over a token dim
    (any dim but the class dim 1), on one mesh axis."""
    if not isinstance(x, DTensor) or x.ndim < 2 or len(x.placements) != 1:
        return False
    p = x.placements[0]
    d = getattr(p, "dim", None)  # Shard, or _StridedShard (tokens flattened from [b, s])
    if d is None or p.is_replicate() or p.is_partial():
        return False
    return d == 0 or (d >= 2 and type(p) is Shard)


def _positions(node: fx.Node, size: int) -> bool:
    """``node`` is ``arange(size)`` (every position of a dim, in order)."""
    if node.target not in (aten.arange.default, aten.arange.start, aten.arange.start_step):
        return False
    ends = [a for a in node.args if isinstance(a, int)]
    return ends in ([size], [0, size], [0, size, 1])


def _accumulates(node: fx.Node) -> bool:
    """An index_put that adds its values (accumulate=True)."""
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False))


def _token_split(x) -> bool:
    """``x`` is a DTensor split over cp (a `Shard` or `_StridedShard`), not whole or partial."""
    if not isinstance(x, DTensor) or len(x.placements) != 1:
        return False
    p = x.placements[0]
    return getattr(p, "dim", None) is not None and not p.is_replicate() and not p.is_partial()


def _target_placements(x: DTensor) -> list:
    """The target's placements matching log-probabilities ``x``: the target has x's dims
    without the class dim 1, so x's Shard(d) is the target's Shard(d) for d = 0, Shard(d - 1)
    for d >= 2; x whole: the target whole."""
    if not _token_sharded(x):
        return [Replicate()]
    p = x.placements[0]
    return [p if p.dim == 0 else Shard(p.dim - 1)]


def _refuse_mean_loss(node: fx.Node, env, cp: int) -> None:
    """A mean-reduced loss op other than nll over a sequence-split input: DTensor would average
    the ranks' local means, which is not the mean over the step's tokens when they count
    differently. Refused by name (cross-entropy's nll is computed exactly)."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not any(a.name == "reduction" for a in schema.arguments):
        return
    names = [a.name for a in schema.arguments]
    i = names.index("reduction")
    reduction = node.args[i] if len(node.args) > i else node.kwargs.get("reduction", _NLL_MEAN)
    split = any(isinstance(env.get(a), DTensor) and not all(p.is_replicate() for p in env[a].placements)
                for a in node.all_input_nodes)
    if reduction == _NLL_MEAN and split:
        raise ContextParallelError(
            f"cp={cp}: loss op {node.target} ({node}) {_where(node)} takes a mean over a sequence split "
            f"over the CP ranks, which averaging the ranks' means does not give exactly; compute the "
            "loss with reduction='sum' or 'none' and divide by the token count, use cross-entropy, or cp=1")
