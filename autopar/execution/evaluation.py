"""Evaluation of a `ParallelModule`: the model's eval-mode forward, run on the DTensor weights.

``pm.eval()`` switches the module to a forward-only graph (`autopar.capture.forward`), traced
once per input shape with the module in eval mode, so dropout is off, BatchNorm normalises with
its running statistics and nothing updates a buffer. The graph runs with the parameters as they
are (DTensors with the plan's placements: DP-replicated, ZeRO-sharded over "dp", TP-sharded
over "tp") and the batch as a DTensor split over "dp" (``Shard(0)``; ``Replicate()`` over
"tp"), so DTensor's own sharding propagation computes every op exactly: it gathers or reduces
where the placements call for it. Plain tensors the graph makes (constants, masks) and the
buffers join as replicated values (`implicit_replication`). Outputs come back whole on every
rank, in the module's own structure (a loss, ``(loss, logits)``, a dict).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import _MaskPartial, _StridedShard
from torch.utils import _pytree as pytree

from autopar.capture.forward import ForwardGraph, TensorSpec, capture_forward
from autopar.errors import InputError


class EvalGraphs:
    """The eval-mode forward graphs of one module, one per input signature (a few kept)."""

    def __init__(self, size: int = 4) -> None:
        self._graphs: dict[tuple, ForwardGraph] = {}
        self._size = size

    def get(self, module: nn.Module, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
            inputs: Sequence, loss_fn: Callable | None = None) -> ForwardGraph:
        """The graph for these inputs' shapes and dtypes and the modules' current modes."""
        key = (tuple((tuple(x.shape), x.dtype) if hasattr(x, "shape") else repr(x) for x in inputs),
               tuple(m.training for m in module.modules()))
        graph = self._graphs.get(key)
        if graph is None:
            graph = capture_forward(module, params, buffers, inputs, loss_fn)
            if len(self._graphs) >= self._size:
                self._graphs.pop(next(iter(self._graphs)))
            self._graphs[key] = graph
        return graph


def evaluate(graphs: EvalGraphs, module: nn.Module, mesh: DeviceMesh, params: dict[str, torch.Tensor],
             buffers: dict[str, torch.Tensor], batch: Sequence[torch.Tensor], local_batch: bool,
             loss_fn: Callable | None = None):
    """``module(*batch)`` in its current (eval) mode, computed on the DTensor ``params``; with
    ``loss_fn``, ``loss_fn(module(*batch[:-1]), batch[-1])``.

    ``batch`` is the global batch (every rank the same), or with ``local_batch`` this rank's
    data-parallel slice (all slices of one size). Returns the module's output with every tensor
    whole (a DTensor's ``full_tensor()``).
    """
    dp = mesh.size(mesh.mesh_dim_names.index("dp"))
    global_batch = [_global_shape(x, dp, local_batch) for x in batch]
    graph = graphs.get(module, params, buffers, global_batch, loss_fn)
    inputs = [_batch_dtensor(x, mesh, dp, local_batch) for x in batch]
    flat = [params[n] for n in graph.params] + [buffers[n] for n in graph.buffers] + inputs
    grad = torch.is_grad_enabled()
    with implicit_replication(), torch.no_grad():
        out = _Run(graph.gm).run(*flat)
        out = [o.full_tensor() if isinstance(o, DTensor) else o for o in out]
    if grad:  # a backward from an evaluation is an error that names the fix, not a bare one
        out = [_EvalOnly.apply(o, _ANCHOR) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
               for o in out]
    return pytree.tree_unflatten(out, graph.out_spec)


class _EvalOnly(torch.autograd.Function):
    """Passes an evaluation's output through; its backward raises `InputError`."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return value.view_as(value)

    @staticmethod
    def backward(ctx, *grads):
        raise InputError(
            "backward() of an output of pm.eval(): evaluation runs the eval-mode forward without "
            "gradients.\n  fix: call pm.train() before the training step (to train without "
            "dropout, build the model with dropout probability 0), or evaluate under "
            "torch.no_grad()")


_ANCHOR = torch.zeros((), requires_grad=True)  # makes _EvalOnly's output require grad


class _Run(torch.fx.Interpreter):
    """Runs the graph node by node, settling two kinds of placement DTensor's propagation
    mishandles in an activation as soon as an op produces one.

    A vocabulary-sharded embedding's output is a pending sum whose mask the first reduction
    releases: a second reader of the value (an RMSNorm's square and its product) would find it
    gone. An activation split like a fused weight (``_StridedShard``, from a fused qkv or
    gate|up projection) has no view rule for splitting heads. Both are made whole on their
    mesh axes (an all-reduce / all-gather); weights are left as they are."""

    def run_node(self, node: torch.fx.Node):
        out = super().run_node(node)
        if node.op == "placeholder" or not isinstance(out, DTensor):
            return out
        if any(isinstance(p, (_MaskPartial, _StridedShard)) for p in out.placements):
            out = out.redistribute(out.device_mesh, [Replicate() if isinstance(p, (_MaskPartial, _StridedShard))
                                                     else p for p in out.placements])
        return out


def _global_shape(x, dp: int, local_batch: bool):
    """The global batch's tensor as the trace sees it: with ``local_batch``, dp slices' worth."""
    if not isinstance(x, torch.Tensor) or not local_batch or x.dim() == 0:
        return x
    return TensorSpec(torch.Size((x.shape[0] * dp, *x.shape[1:])), x.dtype, x.device)


def _batch_dtensor(x, mesh: DeviceMesh, dp: int, local_batch: bool):
    """A batch tensor as a DTensor on ``mesh``: split over "dp" on dim 0 where it divides
    evenly (each rank then computes its slice), replicated otherwise."""
    if not isinstance(x, torch.Tensor):
        return x
    rest = [Replicate()] * (mesh.ndim - 1)
    if x.dim() == 0:
        return DTensor.from_local(x, mesh, [Replicate(), *rest], run_check=False)
    if local_batch:
        return DTensor.from_local(x, mesh, [Shard(0), *rest], run_check=False)
    if x.shape[0] % dp:
        return DTensor.from_local(x, mesh, [Replicate(), *rest], run_check=False)
    local = x.chunk(dp, dim=0)[mesh.get_local_rank("dp")]
    return DTensor.from_local(local, mesh, [Shard(0), *rest], run_check=False)


def refuse_pipeline(pp: int) -> None:
    """`InputError` for evaluation under a pipeline: this rank holds only its stage's weights."""
    if pp > 1:
        raise InputError(
            f"evaluation (pm.eval()) is not executed under a pipeline (pp={pp}): each rank holds "
            "only its stage's parameters and the eval-mode forward runs the whole model.\n  fix: "
            "evaluate the model on one device from pm.full_state_dict() (sd = pm.full_state_dict(); "
            "model.load_state_dict(sd); model.eval()), or parallelize it for evaluation with a "
            "layout without pp (autopar.Layout(dp=..., tp=...))")


def refuse_expert_storage(ep: int) -> None:
    """`InputError` for evaluation under expert parallelism: this rank stores only its experts."""
    if ep > 1:
        raise InputError(
            f"evaluation (pm.eval()) is not executed under expert parallelism (ep={ep}): each rank "
            "stores only its share of the experts' parameters and the eval-mode forward runs every "
            "expert.\n  fix: evaluate the model on one device from pm.full_state_dict() (sd = "
            "pm.full_state_dict(); model.load_state_dict(sd); model.eval()), or parallelize it for "
            "evaluation with a layout without ep (autopar.Layout(dp=...))")
