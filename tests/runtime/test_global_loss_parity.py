"""Losses with several normalisers train as on one device under TP and pipelines.

Label smoothing over labels with ignored positions (its smoothing term and its nll term are
two means over the valid tokens) and a ratio beside a mean (a token mean plus a class-weighted
mean: two different normalisers) are "global" reductions (`passes.loss_reduction`): the
runtime feeds each normaliser's step-wide value to the graph. Under tp=2 with two micro-batches
every TP rank reads them replicated; under pp=2 with two micro-batches the stage that divides
reads them. Loss, gradients and parameters after two SGD steps match one device (fp32, rtol
1e-5) on a model of our own and on the zoo's tiny Llama, on two gloo ranks (one spawn).
"""

import copy

import torch
import torch.nn.functional as F
from parity_checks import sgd, train_and_compare
from torch import nn

from runtime.launch import spawn

V, H = 16, 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, 2 * H), nn.Linear(2 * H, H)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


class LM(nn.Module):
    """Our own LM (embedding, two residual blocks, head) or the zoo's tiny Llama, with ``loss``."""

    def __init__(self, loss: str, zoo: bool = False) -> None:
        super().__init__()
        from autopar import models

        torch.manual_seed(9)  # every rank builds the same model
        self.zoo = models.build("tiny-llama", seed=9) if zoo else None
        if not zoo:
            self.embed, self.layers, self.head = nn.Embedding(V, H), nn.ModuleList([Block(), Block()]), nn.Linear(H, V)
        self.register_buffer("class_w", torch.linspace(0.5, 2.0, self.zoo.config.vocab if zoo else V))
        self.loss = loss

    def forward(self, ids, labels):
        if self.zoo is not None:
            z = self.zoo(ids)
        else:
            x = self.embed(ids)
            for block in self.layers:
                x = block(x)
            z = self.head(x)
        return LOSSES[self.loss](z.flatten(0, 1), labels.flatten(), self.class_w)


def _two(z, y, w):
    """A token mean plus a class-weighted mean of the log-sum-exp: two normalisers."""
    keep = y != -100
    nll = torch.where(keep, F.cross_entropy(z, y, reduction="none"), 0).sum() / keep.sum()
    wy = torch.where(keep, w[y.clamp(min=0)], 0)
    return nll + 0.1 * (z.logsumexp(-1) * wy).sum() / wy.sum()


LOSSES = {
    "smoothed": lambda z, y, w: F.cross_entropy(z, y, label_smoothing=0.1),
    "two": _two,
}


def _batch(vocab: int):
    g = torch.Generator().manual_seed(13)
    ids = torch.randint(0, vocab, (4, 6), generator=g)
    labels = torch.randint(0, vocab, (4, 6), generator=g)
    labels[0, 2:] = -100  # padding spread unevenly over the micro-batches
    labels[3, 5:] = -100
    return ids, labels


def _worker(rank: int, world: int) -> list[tuple]:
    import autopar

    failures = []
    cells = [("own", loss, lay) for loss in LOSSES for lay in ("tp", "pp")]
    cells += [("tiny-llama", "smoothed", "tp"), ("tiny-llama", "two", "pp")]
    for model_name, loss, lay in cells:
        model = LM(loss, zoo=model_name == "tiny-llama")
        ref = copy.deepcopy(model)
        batch = _batch(model.class_w.numel())
        layout = autopar.Layout(tp=2, grad_accum=2) if lay == "tp" else autopar.Layout(pp=2, grad_accum=2)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        if pm._rank_graph.reduction is None or pm._rank_graph.reduction.mode != "global":
            failures.append((model_name, loss, lay, "not a global reduction", pm._rank_graph.reduction))
        failures += train_and_compare(pm, ref, batch, (model_name, loss, pm.plan.layout.short()),
                                      steps=2, optimizers=(sgd,))
    return failures


def test_global_losses_under_tp_and_pipelines():
    assert spawn(_worker, 2, timeout_s=900) == [[], []]
