"""How each of the forward's other outputs joins over gradient-accumulation micro-batches.

The executor runs the step captured for one micro-batch ``m`` times and joins each other output
(`runtime.executor.join_micro_batches`) as `output_joins` decided (`vocab.plan_types.OutputJoin`):
a per-sample tensor is concatenated on dim 0 ("cat"); a 0-dim value (a metric, an auxiliary
loss, a count) averaged ("mean": a mean over the batch, or a value the batch does not enter;
micro-batches hold equally many samples), summed ("sum": a sum over the batch) or weighted by
each micro-batch's share of its denominator ("ratio": N / D of batch sums), each in its own
dtype, as `passes.loss_reduction.output_join` proves on the captured graph. A tensor is exact
only where dim 0 is the batch, proven from the shapes (dim 0 is the micro-batch's batch and
grows ``m``-fold when the forward sees the ``m`` micro-batches at once). The rest (a max over
the batch, a 0-dim bool, a feature statistic) is refused before the step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from autopar.capture.graph import TrainingGraph
from autopar.errors import InputError
from passes.loss_reduction import ONE_ROW, LossReduction, output_join, samples_apart
from vocab.plan_types import GraphSignature, OutputJoin


def output_joins(model: nn.Module, graph: TrainingGraph, signature: GraphSignature,
                 micro_inputs: Sequence[torch.Tensor], local_inputs: Sequence[torch.Tensor],
                 loss_fn: Callable | None, m: int,
                 two_rows: Callable[[], tuple[TrainingGraph, GraphSignature]] | None = None,
                 fed: frozenset = frozenset()) -> list[OutputJoin]:
    """The join of each other output over ``m`` micro-batches (in `OutputTree` order; when
    ``m`` = 1 nothing is joined: "cat" for a tensor, "mean" for a 0-dim value), or `InputError`
    naming each output no join makes exact: a 0-dim bool (no sum or mean of flags is the step's
    flag), a 0-dim value `passes.loss_reduction.output_join` does not prove a mean, a sum or a
    ratio of sums over the batch (with its reason and source line), or a tensor whose dim 0 is
    not the batch (its shape for ``local_inputs``, the ``m`` micro-batches at once, is not its
    shape for ``micro_inputs`` with dim 0 times ``m``, or dim 0 is not the micro-batch's size).
    At one row per micro-batch an op along dim 0 is proven on the step captured at two rows
    (``two_rows``), as for the loss; ``fed``: the loss's normalisers the runtime feeds step-wide
    (a value over them averages exactly, and is the step's value: ``step_wide``, also at
    ``m`` = 1)."""
    tree = graph.output_tree
    if tree is None or not tree.tensor_leaves:
        return []
    micro = _captured_others(graph)
    joins = [OutputJoin("cat" if v.dim() > 0 else "mean") for v in micro]
    scalars = [k for k, v in enumerate(micro) if v.dim() == 0 and v.dtype != torch.bool]
    if m == 1:  # nothing joined; a value over the fed normalisers is still made step-wide
        for k in scalars if fed else ():
            found = output_join(graph.gm, signature, _other_nodes(graph)[k], fed=fed)
            joins[k] = OutputJoin("mean", step_wide=found.mode == "mean" and bool(found.denominators))
        return joins
    bad = [(k, "a 0-dim bool") for k, v in enumerate(micro) if v.dim() == 0 and v.dtype == torch.bool]
    for k in scalars:
        found = _scalar_join(graph, signature, k, two_rows, fed)
        if found.mode == "unproven":
            bad.append((k, f"a 0-dim value not proven a mean, a sum or a ratio of sums over the "
                            f"batch: {found.why} ({found.where() or 'in the forward'})"))
        joins[k] = OutputJoin(found.mode, found.counter,
                              step_wide=found.mode == "mean" and bool(found.denominators))
    shaped = [k for k, v in enumerate(micro) if v.dim() > 0]
    if shaped:
        from autopar.capture.joint import other_outputs_at

        whole = other_outputs_at(model, graph, local_inputs, loss_fn)
        rows = micro_inputs[0].shape[0]
        for k in shaped:
            small, big = tuple(micro[k].shape), tuple(whole[k].shape)
            if small[0] != rows or big != (small[0] * m, *small[1:]):
                bad.append((k, f"of shape {list(small)} per micro-batch (dim 0 is not the batch of {rows})"))
    if bad:
        what = "; ".join(f"{tree.name(k)}, {desc}" for k, desc in sorted(bad))
        raise InputError(
            f"grad_accum={m} joins the forward's other outputs over the micro-batches, which is not "
            f"exact for: {what}.\n  fix: return such a value per sample (dim 0 the batch), or as a "
            "mean or a sum over the batch (several ratios as their sums, divided after the step), "
            "or drop it from the output (return the loss only), or use grad_accum=1")
    return joins


def _scalar_join(graph: TrainingGraph, signature: GraphSignature, k: int,
                 two_rows: Callable[[], tuple[TrainingGraph, GraphSignature]] | None,
                 fed: frozenset) -> LossReduction:
    """`output_join` of the ``k``-th other output, retried at two rows where one row is too few:
    if the step captured at two rows keeps the samples apart (`samples_apart`), its ops along
    dim 0 are proven at one row too."""
    node = _other_nodes(graph)[k]
    found = output_join(graph.gm, signature, node, fed=fed)
    if found.mode == "unproven" and ONE_ROW in found.why and two_rows is not None:
        wider, wider_signature = two_rows()
        if samples_apart(wider.gm, wider_signature, _other_nodes(wider)[k]):
            found = output_join(graph.gm, signature, node, rows_proven=True, fed=fed)
    return found


def _other_nodes(graph: TrainingGraph) -> list[torch.fx.Node]:
    """The graph's output nodes of the other tensors, in `OutputTree` order."""
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    index = {o.name: o.index for o in graph.outputs if o.kind == "other"}
    return [out.args[0][index[f"output{k + 1}"]] for k in range(len(graph.output_tree.tensor_leaves))]


def _captured_others(graph: TrainingGraph) -> list[torch.Tensor]:
    """The other tensors' traced values (fake), in `OutputTree` order."""
    return [node.meta["val"] for node in _other_nodes(graph)]
