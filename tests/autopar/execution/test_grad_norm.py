"""`pm.clip_grad_norm_` (autopar/execution/grad_norm.py) clips as one device does under any plan.

On gloo ranks, fp32: after one backward, ``pm.clip_grad_norm_(c)`` returns the norm that
``torch.nn.utils.clip_grad_norm_`` computes on the one-device model (rtol 1e-5), every gradient
after clipping is the one-device clipped gradient, and the parameters after an SGD step are
the one-device ones. ``c`` is well below the norm, so clipping scales. Layouts where a rank's
own tensors are not the model: a pipeline whose stages hold different blocks and both hold
GPT-2's tied embedding (tiny-gpt2 pp2), expert parallelism (tiny-mixtral dp2 ep2: each rank
holds half the experts), ZeRO-3 shards (a plain-PyTorch model of two losses, the infinity norm
too); under ``slow`` on 4 ranks, TP's replicated weights (tp2 x dp2), a pipeline with data
parallelism, ep2 over dp4 with ZeRO-1, and transformers' Mixtral (experts stacked in one
parameter, each rank holding its rows) ep2 over dp4 with ZeRO-3.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from parity_checks import close
from torch import nn

from runtime.launch import spawn

MAX_NORM = 1e-2


class TwoLossNet(nn.Module):
    """A plain-PyTorch MLP with a class head and a regression head: cross-entropy plus a Huber
    (or squared) error."""

    def __init__(self, huber: bool) -> None:
        super().__init__()
        self.huber = huber
        self.body = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
        self.cls = nn.Linear(64, 4)
        self.reg = nn.Linear(64, 1)

    def forward(self, x, label, target):
        h = self.body(x)
        reg = self.reg(h).squeeze(-1)
        second = F.huber_loss(reg, target) if self.huber else F.mse_loss(reg, target)
        return F.cross_entropy(self.cls(h), label) + 0.5 * second


def _case(name: str):
    from autopar import models

    if name.startswith("two-loss"):
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        batch = (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g),
                 torch.randn(8, generator=g))
        return TwoLossNet(huber=name.endswith("huber")), batch
    if name.startswith("hf-"):
        import hf_tiny

        return hf_tiny.build(name[3:], seed=3), hf_tiny.batch(size=8, seq=16)
    return models.build(name, seed=3), models.example_inputs(name, batch=4, seq=16)


def _worker(rank: int, world: int, runs) -> list:
    import autopar

    failures = []
    for name, kw, norm_type in runs:
        model, batch = _case(name)
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**kw))
        label = (name, str(kw), norm_type)
        pm(*batch).backward()
        total = pm.clip_grad_norm_(MAX_NORM, norm_type=norm_type)
        ref(*batch).backward()
        ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, norm_type=norm_type)
        if not ref_total > 10 * MAX_NORM:
            failures.append((*label, "clipping does not scale", ref_total.item()))
        if not torch.allclose(total, ref_total, rtol=1e-5, atol=0):
            failures.append((*label, "norm", total.item(), ref_total.item()))
        named_ref = dict(ref.named_parameters())
        for pname, p in pm.named_parameters():
            if not close(p.grad.full_tensor(), named_ref[pname].grad):
                failures.append((*label, f"clipped grad {pname}"))
        opt, ref_opt = torch.optim.SGD(pm.parameters(), lr=1.0), torch.optim.SGD(ref.parameters(), lr=1.0)
        opt.step()
        ref_opt.step()
        for pname, p in pm.named_parameters():
            if not close(p.detach().full_tensor(), named_ref[pname].detach()):
                failures.append((*label, f"param {pname}"))
    return failures


def test_clip_grad_norm_matches_one_device_on_two_ranks():
    runs = [("tiny-gpt2", {"pp": 2, "microbatch": 2}, 2.0),
            ("tiny-mixtral", {"dp": 2, "ep": 2}, 2.0),
            ("two-loss", {"dp": 2, "zero": 3}, 2.0),
            ("two-loss-huber", {"dp": 2, "zero": 3}, float("inf"))]
    assert spawn(_worker, 2, (runs,), timeout_s=900) == [[], []]


@pytest.mark.slow
def test_clip_grad_norm_matches_one_device_on_four_ranks():
    runs = [("tiny-llama", {"dp": 2, "tp": 2, "sp": True, "zero": 1}, 2.0),
            ("tiny-llama", {"dp": 2, "pp": 2, "zero": 1, "microbatch": 1}, 2.0),
            ("tiny-mixtral", {"dp": 4, "ep": 2, "zero": 1}, 2.0),
            ("hf-mixtral", {"dp": 4, "ep": 2, "zero": 3}, 2.0),  # experts stacked: rows over ep
            ("two-loss-huber", {"dp": 2, "tp": 2}, 1.0)]
    assert spawn(_worker, 4, (runs,), timeout_s=1500) == [[], [], [], []]
