"""Which of the forward's other outputs can be joined over gradient-accumulation micro-batches.

The executor runs the step captured for one micro-batch ``m`` times and joins each other output
(`runtime.executor.merge_micro_batches`): a per-sample tensor is concatenated on dim 0, a 0-dim
floating value averaged (micro-batches hold equally many samples), a 0-dim integer summed (a
count), each in its own dtype. That is exact only where dim 0 is the batch: `check_mergeable`
proves it from the shapes (dim 0 is the micro-batch's batch and grows ``m``-fold when the
forward sees the ``m`` micro-batches at once) and refuses the rest before the step runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from autopar.capture.graph import TrainingGraph
from autopar.errors import InputError


def check_mergeable(model: nn.Module, graph: TrainingGraph, micro_inputs: Sequence[torch.Tensor],
                    local_inputs: Sequence[torch.Tensor], loss_fn: Callable | None, m: int) -> None:
    """`InputError` naming each other output that ``m`` > 1 micro-batches cannot join exactly:
    a 0-dim bool (no sum or mean of flags is the step's flag), or a tensor whose dim 0 is not the
    batch (its shape for ``local_inputs``, the ``m`` micro-batches at once, is not its shape for
    ``micro_inputs`` with dim 0 times ``m``, or dim 0 is not the micro-batch's size)."""
    tree = graph.output_tree
    if m == 1 or tree is None or not tree.tensor_leaves:
        return
    micro = _captured_others(graph)
    bad = [(k, "a 0-dim bool") for k, v in enumerate(micro) if v.dim() == 0 and v.dtype == torch.bool]
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
            "float or integer scalar, or drop it from the output (return the loss only), or use "
            "grad_accum=1")


def _captured_others(graph: TrainingGraph) -> list[torch.Tensor]:
    """The other tensors' traced values (fake), in `OutputTree` order."""
    out = next(n for n in graph.gm.graph.nodes if n.op == "output")
    index = {o.name: o.index for o in graph.outputs if o.kind == "other"}
    return [out.args[0][index[f"output{k + 1}"]].meta["val"] for k in range(len(graph.output_tree.tensor_leaves))]
