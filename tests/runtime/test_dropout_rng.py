"""The RNG contract of dropout under tensor parallelism, as it runs (2 gloo ranks, tp=2).

Dropout draws from each rank's own default generator; before each step that draws random
numbers the TP group's first rank's generator state is copied to the others. Two placements of
a dropout are probed: on the replicated output of a row-parallel projection (every TP rank holds
the whole value) and on the column-sharded hidden activation (each TP rank holds half of it),
each with every rank seeded alike and with each rank seeded on its own:

- dropout on a replicated value: every TP rank draws the mask one device draws from the first
  rank's state, whatever the seeds: the loss and gradients equal one device's seeded as the
  first rank is (asserted; with per-rank seeds this was silently wrong before the state was
  kept in step).
- dropout on a sharded value: both ranks draw the same mask for their own halves (the whole
  mask is one half-mask twice: correlated, not one device's). The ranks agree on the loss.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from runtime.launch import spawn


class DropoutMLP(nn.Module):
    """fc1 (column-parallel) -> gelu -> [dropout on shards] -> fc2 (row-parallel) ->
    [dropout on the replicated output] -> head -> MSE."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.fc1 = nn.Linear(8, 32)
        self.fc2 = nn.Linear(32, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        if self.where == "sharded":
            h = F.dropout(h, 0.5, self.training)
        h = self.fc2(h)
        if self.where == "replicated":
            h = F.dropout(h, 0.5, self.training)
        return F.mse_loss(self.head(h), y)


def _worker(rank: int, world: int) -> dict:
    import autopar

    out = {}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g))
    for where in ("replicated", "sharded"):
        torch.manual_seed(0)
        model = DropoutMLP(where)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(tp=world))
        for seeding in ("alike", "per-rank"):
            torch.manual_seed(0 if seeding == "alike" else 100 + rank)
            loss = pm(*batch)
            loss.backward()
            grad = pm.fc1.weight.grad.full_tensor()
            pm.zero_grad()
            torch.manual_seed(0 if seeding == "alike" else 100)  # the first TP rank's seed
            ref_loss = ref(*batch)
            ref_loss.backward()
            ref_grad = ref.fc1.weight.grad.clone()
            ref.zero_grad()
            out[(where, seeding)] = (loss.item(), ref_loss.item(),
                                     torch.allclose(grad, ref_grad, rtol=1e-5, atol=1e-6))
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_worker, 2, timeout_s=600)


def test_replicated_dropout_is_one_devices_whatever_the_seeds(runs):
    for r in runs:
        for seeding in ("alike", "per-rank"):
            loss, ref_loss, grads_equal = r[("replicated", seeding)]
            assert loss == pytest.approx(ref_loss, rel=1e-5) and grads_equal, (seeding, r)
    for seeding in ("alike", "per-rank"):  # the ranks agree on a loss computed from sharded masks
        assert runs[0][("sharded", seeding)][0] == pytest.approx(runs[1][("sharded", seeding)][0], rel=1e-6)
