"""A mean over valid tokens stays a mean over the whole step's valid tokens when it is split.

A language-model loss is ``nll_loss(..., reduction="mean", ignore_index=-100)``: the sum over
the tokens whose label is not ignored, divided by their count. Split over d data-parallel ranks
and m micro-batches, each piece k computes its own mean L_k = S_k / n_k. Averaging the pieces,
(1/(d m)) sum_k S_k / n_k, is the one-device loss S / N only when every n_k is the same; with
padding labels spread unevenly it is not (issue: 5.809 against 5.706 after two steps on 4
ranks). The one-device gradient is recovered by weighting piece k by n_k / N:

    sum_k (n_k / N) * grad L_k = grad (sum_k S_k) / N = grad (S / N)

Two rewrites make that so:

- `token_counter` extracts from the captured graph the computation of the loss's labels (the
  ops between the user's inputs and the nll loss's target: transformers' shift of the labels,
  a view) and counts the labels not ignored: n_k for a micro-batch, before it runs.
- `weight_loss_by_seed` makes the graph's loss output ``loss * seed``, the seed being the
  loss's seed gradient (the tangent input): the reported loss is then weighted exactly as the
  gradients are, and the pieces' weighted losses add up to S / N.

`passes.loss_reduction` generalises the counter to any loss divided by data-only batch sums
(and is what `autopar.parallelize` runs); `weight_loss_by_seed` serves both.

The runtime feeds seed_k = d * n_k / N (the data-parallel pass divides by d again), with N the
sum of the counts over micro-batches and ranks (one all-reduce of an integer per step). With
equal counts the seed is 1/m, exactly what it is without a counter.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

from cost.plan_types import GraphSignature

aten = torch.ops.aten

_MEAN = 1  # torch's Reduction::Mean
# meta key of the ``loss * seed`` node: the data-parallel pass leaves its seed unscaled (it
# averages the weighted loss over the ranks itself)
WEIGHTS_LOSS = "autopar_weights_loss"
# ops between the loss value and the graph output that keep its value
_SAME_VALUE = {aten.view.default, aten.alias.default, aten.clone.default, aten.detach.default,
               aten.squeeze.default, aten.reshape.default}


@dataclass
class TokenCounter:
    """Counts the labels a micro-batch's mean loss is taken over.

    gm: (the user inputs listed in ``inputs``) -> the number of labels not ignored (int64).
    inputs: which user inputs (indices of the step's example inputs) ``gm`` reads.
    """

    gm: fx.GraphModule
    inputs: list[int]

    def __call__(self, user_inputs: tuple[torch.Tensor, ...]) -> int:
        with torch.no_grad():
            return int(self.gm(*[user_inputs[i] for i in self.inputs]))


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


def token_counter(gm: fx.GraphModule, signature: GraphSignature) -> TokenCounter | None:
    """The counter of the loss's valid labels, or None where the loss is not a mean nll over
    labels computed from the user's inputs alone (then every piece's mean weighs the same)."""
    nll = mean_loss_node(gm, signature.loss_index)
    if nll is None:
        return None
    target, ignore_index = nll.args[1], nll.args[4]
    kinds = dict(zip(signature.placeholders, signature.inputs))
    needed: list[fx.Node] = []
    seen: set[fx.Node] = set()
    stack = [target]
    while stack:  # the labels' ancestors; they must come from user inputs only
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder" and kinds.get(node.name, ("", ""))[0] != "input":
            return None  # labels computed from weights or buffers: not a token count
        if node.op not in ("placeholder", "call_function"):
            return None
        needed.append(node)
        stack.extend(node.all_input_nodes)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[int] = []
    for node in sorted(needed, key=order.__getitem__):
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
            inputs.append(int(kinds[node.name][1].removeprefix("input")))
        else:
            env[node] = graph.node_copy(node, env.__getitem__)
    valid = graph.call_function(aten.ne.Scalar, (env[target], ignore_index))
    graph.output(graph.call_function(aten.sum.default, (valid,)))
    return TokenCounter(fx.GraphModule(torch.nn.Module(), graph), inputs)


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
