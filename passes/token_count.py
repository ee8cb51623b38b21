"""The loss output weighted by its seed, and the mean nll a loss may be.

A language-model loss is ``nll_loss(..., reduction="mean", ignore_index=-100)``: the sum over
the tokens whose label is not ignored, divided by their count. Split over d data-parallel ranks
and m micro-batches, each piece k computes its own mean L_k = S_k / n_k; weighting piece k by
n_k / N recovers the one-device gradient:

    sum_k (n_k / N) * grad L_k = grad (sum_k S_k) / N = grad (S / N)

`passes.loss_reduction` proves which losses split so (and computes the n_k); here:

- `weight_loss_by_seed` makes the graph's loss output ``loss * seed``, the seed being the
  loss's seed gradient (the tangent input): the reported loss is then weighted exactly as the
  gradients are, and the pieces' weighted losses add up to the step's loss;
- `mean_loss_node` finds the mean ``nll_loss`` that is the loss output, if it is one (the cost
  model's facts read it).
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from vocab.plan_types import GraphSignature

aten = torch.ops.aten

_MEAN = 1  # torch's Reduction::Mean
# meta key of the ``loss * seed`` node: the data-parallel pass leaves its seed unscaled (it
# averages the weighted loss over the ranks itself)
WEIGHTS_LOSS = "autopar_weights_loss"
# ops between the loss value and the graph output that keep its value
_SAME_VALUE = {aten.view.default, aten.alias.default, aten.clone.default, aten.detach.default,
               aten.squeeze.default, aten.reshape.default}


def mean_loss_node(gm: fx.GraphModule, loss_index: int) -> fx.Node | None:
    """The ``nll_loss_forward`` whose mean is the loss output, or None if the loss is not one
    mean negative log-likelihood (a sum, a mix of losses, class weights, a custom loss)."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    value = output.args[0][loss_index]
    while isinstance(value, fx.Node) and value.target in _SAME_VALUE:
        value = value.args[0]
    if not (isinstance(value, fx.Node) and value.target == operator.getitem and value.args[1] == 0):
        return None
    nll = value.args[0]
    if nll.target != aten.nll_loss_forward.default:
        return None
    _, _, weight, reduction, _ = nll.args  # (self, target, weight, reduction, ignore_index)
    if reduction != _MEAN or weight is not None:
        return None
    return nll


def weight_loss_by_seed(gm: fx.GraphModule, signature: GraphSignature) -> None:
    """Make the loss output ``loss * seed`` (the loss's seed gradient), in place."""
    seeds = signature.placeholder_of("tangent")
    if not seeds:
        return
    holders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    seed = holders[next(iter(seeds.values()))]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    loss = outs[signature.loss_index]
    with gm.graph.inserting_before(output):
        weighted = gm.graph.call_function(aten.mul.Tensor, (loss, seed))
    weighted.meta[WEIGHTS_LOSS] = True
    weighted.meta["autopar"] = ("the loss weighted as its gradients are (its seed: this micro-batch's "
                                "share of the step's valid tokens)")
    if "val" in loss.meta:
        weighted.meta["val"] = loss.meta["val"]
    outs[signature.loss_index] = weighted
    output.args = (tuple(outs),)
    gm.graph.lint()
    gm.recompile()
