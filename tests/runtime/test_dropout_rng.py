"""The RNG contract of dropout under tensor parallelism, as it runs (2 gloo ranks, tp=2).

Dropout draws from each rank's own default generator. Two placements of a dropout are probed:
on the replicated output of a row-parallel projection (every TP rank holds the whole value) and
on the column-sharded hidden activation (each TP rank holds half of it). Each with every rank
seeded alike and with each rank seeded on its own. What runs today:

- seeded alike, dropout on a replicated value: every TP rank draws the mask one device draws
  with that seed: the loss and gradients equal one device's (asserted).
- seeded per rank, dropout on a replicated value: the TP ranks draw different masks for what
  should be one value, so the ranks' losses differ and the gradients mix two masks: silently
  wrong (a strict xfail: it passes once the TP pass keeps masks of replicated values in step).
- dropout on a sharded value: seeded alike, both ranks draw the same mask for their own halves
  (the whole mask is one half-mask twice: correlated, not one device's); seeded per rank, the
  halves are independent (a valid dropout, not one device's). The ranks agree on the loss.
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
            torch.manual_seed(0)
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


def test_seeded_alike_replicated_dropout_is_one_devices(runs):
    for r in runs:
        loss, ref_loss, grads_equal = r[("replicated", "alike")]
        assert loss == pytest.approx(ref_loss, rel=1e-5) and grads_equal, r
    for where in ("sharded",):  # the ranks agree on a loss computed from sharded masks
        for seeding in ("alike", "per-rank"):
            assert runs[0][(where, seeding)][0] == pytest.approx(runs[1][(where, seeding)][0], rel=1e-6)


@pytest.mark.xfail(strict=True, reason="TP ranks seeded apart draw different dropout masks for a "
                   "replicated value (no RNG kept in step across the TP group)")
def test_tp_ranks_agree_on_replicated_dropout_whatever_the_seeds(runs):
    assert runs[0][("replicated", "per-rank")][0] == pytest.approx(runs[1][("replicated", "per-rank")][0],
                                                                    rel=1e-6)
