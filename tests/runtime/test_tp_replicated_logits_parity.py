"""Logits that tensor parallelism leaves whole (a head the TP plan makes row-parallel or keeps
replicated, here after an op without a sharding rule runs replicated) still train under TP: the
log-softmax and the loss run under DTensor's own rules, not loss_parallel's (which accept only
logits sharded over the classes). Loss, gradients and parameters after SGD steps match one
device for a plain cross-entropy and a label-smoothed one, with and without SP."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from parity_checks import sgd, train_and_compare
from torch import nn

from runtime.launch import spawn


class CumNet(nn.Module):
    """Plain PyTorch: a block around logcumsumexp (no DTensor rule: runs replicated), a linear
    classifier over 8 classes, and the loss ``loss`` per token."""

    def __init__(self, loss: str, hidden: int = 16, classes: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, classes)
        self.smoothing = 0.1 if loss == "smoothed" else 0.0

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(torch.logcumsumexp(self.fc1(self.norm(x)), dim=-1))
        logits = self.head(x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), label_smoothing=self.smoothing)


def _worker(rank: int, world: int) -> list[tuple]:
    import autopar

    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(4, 8, 16, generator=gen), torch.randint(0, 8, (4, 8), generator=gen))
    failures = []
    for loss in ("ce", "smoothed"):
        for sp in (False, True):
            model = CumNet(loss)
            ref = copy.deepcopy(model)
            pm = autopar.parallelize(model, world, example_inputs=batch,
                                     layout=autopar.Layout(tp=world, sp=sp, precision="fp32"))
            if pm.plan.placements["head.weight"]["tp"] == "Shard(0)":
                failures.append((loss, sp, "the logits are sharded over the classes: the test "
                                 "lost its case", pm.plan.placements["head.weight"]))
            failures += train_and_compare(pm, ref, batch, (loss, f"sp={sp}"), steps=2, optimizers=(sgd,))
    return failures


def test_replicated_logits_under_tp_match_one_device():
    assert spawn(_worker, 2, timeout_s=600) == [[], []]
