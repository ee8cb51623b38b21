"""Evaluation: ``pm.eval()`` runs the model's eval-mode forward on the DTensor weights.

On 2 gloo ranks, under dp=2, ZeRO-3 and tp=2, against the eval-mode model on one device: a
plain-PyTorch model with BatchNorm and Dropout (returning ``(loss, logits)``) and tiny-llama.
The eval output equals one device's (fp32, rtol 1e-5), with and without ``torch.no_grad()`` and
at another batch size than the planned one; no buffer changes (BatchNorm's running statistics,
its batch counter); dropout is off (two evaluations agree). ``pm.train()`` then trains as
before: tiny-llama's next SGD step is in parity with one device, and the BatchNorm model's
training step updates its statistics again.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from parity_checks import sgd, train_and_compare_step
from torch import nn

from autopar.errors import InputError
from runtime.launch import spawn

LAYOUTS = ({"dp": 2}, {"dp": 2, "zero": 3}, {"tp": 2})


class BatchNormDropoutNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Dropout -> Linear; returns (MSE loss, predictions)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor):
        pred = self.out(self.drop(F.relu(self.bn(self.inp(x)))))
        return F.mse_loss(pred, y), pred


def _bn_setup(rows: int = 8, seed: int = 1):
    torch.manual_seed(0)
    model = BatchNormDropoutNet()
    with torch.no_grad():  # running statistics away from their initial 0 / 1
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    g = torch.Generator().manual_seed(seed)
    return model, (torch.randn(rows, 6, generator=g) * 2, torch.randn(rows, 2, generator=g))


def _close(a, b, what, failures, label):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.allclose(x.detach(), y.detach(), rtol=1e-5, atol=1e-6):
            failures.append((*label, what, i, (x.detach() - y.detach()).abs().max().item()))


def _buffers(module):
    return {n: b.clone() for n, b in module.named_buffers()}


def _eval_checks(pm, ref, batches, label, failures):
    """pm.eval() against ref.eval() on each batch; buffers unchanged; dropout off."""
    before = _buffers(pm)
    pm.eval()
    ref.eval()
    for i, batch in enumerate(batches):
        with torch.no_grad():
            got = pm(*batch)
            want = ref(*batch)
        _close(got, want, f"eval output, batch {i}", failures, label)
        again = pm(*batch)  # without no_grad: the same (no dropout, no statistics update)
        _close(again, want, f"eval output without no_grad, batch {i}", failures, label)
        loss = again[0] if isinstance(again, tuple) else again
        try:  # a backward from an evaluation names the fix
            loss.backward()
            failures.append((*label, "backward of an eval output did not raise"))
        except InputError as exc:
            if "pm.train()" not in str(exc):
                failures.append((*label, "backward of an eval output", str(exc)))
    for name, b in _buffers(pm).items():
        if not torch.equal(b, before[name]):
            failures.append((*label, f"buffer {name} changed by evaluation"))
    pm.train()
    ref.train()


def _worker(rank: int, world: int, layouts=LAYOUTS) -> list[tuple]:
    import autopar
    from autopar import models

    failures = []
    for degrees in layouts:
        layout = autopar.Layout(**degrees)
        # a model of our own: BatchNorm and Dropout, another batch size (5 rows) evaluated too
        model, batch = _bn_setup()
        ref = copy.deepcopy(model)
        # BatchNorm's training step normalises each rank's slice by its own statistics (DDP's
        # semantics without SyncBatchNorm), accepted knowingly; evaluation is exact regardless
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout,
                                 loss_reduction="mean_per_rank")
        label = ("bn-dropout", pm.plan.layout.short())
        _eval_checks(pm, ref, [batch, _bn_setup(rows=5, seed=2)[1]], label, failures)
        tracked = int(pm.bn.num_batches_tracked)
        loss, _ = pm(*batch)  # training again (the step returns (loss, pred) as the module does)
        loss.backward()
        if int(pm.bn.num_batches_tracked) != tracked + 1:
            failures.append((*label, "pm.train() did not return to the training step"))
        # tiny-llama: eval, an SGD step in parity with one device, eval again
        model = models.build("tiny-llama", seed=3)
        ref = copy.deepcopy(model)
        batch = models.example_inputs("tiny-llama", batch=4, seq=16)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        label = ("tiny-llama", pm.plan.layout.short())
        _eval_checks(pm, ref, [batch], label, failures)
        failures += train_and_compare_step(pm, ref, batch, label, sgd(pm.parameters()),
                                           sgd(ref.parameters()))
        _eval_checks(pm, ref, [batch], (*label, "after a step"), failures)
    return failures


def test_eval_matches_one_device_eval():
    for failures in spawn(_worker, 2, timeout_s=900):
        assert not failures, failures


def _pipeline_worker(rank: int, world: int) -> str:
    import autopar
    from autopar import models

    model = models.build("tiny-llama", seed=3)
    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(pp=2, dp=world // 2))
    pm.eval()
    try:
        pm(*batch)
    except InputError as exc:
        return str(exc)
    return "no error"


@pytest.mark.slow
def test_eval_under_dp_x_tp_matches_one_device_and_a_pipeline_says_why_not():
    for failures in spawn(_worker, 4, args=(({"dp": 2, "tp": 2}, {"dp": 2, "tp": 2, "zero": 3}),),
                          timeout_s=900):
        assert not failures, failures
    for message in spawn(_pipeline_worker, 4, timeout_s=900):
        assert "not executed under a pipeline (pp=2)" in message and "full_state_dict" in message, message
