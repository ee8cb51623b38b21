"""parallelize runs exactly the plan, on real gloo ranks: no stale graph, no silent fallback."""

from __future__ import annotations

import torch
from torch import nn

from runtime.launch import spawn


class Scaled(nn.Module):
    """A plain PyTorch model whose forward reads a Python attribute."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.scale = scale

    def forward(self, x, y):
        return nn.functional.mse_loss(self.down(torch.relu(self.up(x))) * self.scale, y)


class CumSum(nn.Module):
    """An op without a DTensor sharding strategy (logcumsumexp) between two linears."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x, y):
        h = torch.logcumsumexp(self.up(x), dim=-1)
        return nn.functional.mse_loss(self.down(h), y)


def _batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)


def _contract_worker(rank: int, world: int) -> list:
    import autopar
    from autopar.execution.parallelize import UnsupportedLayoutError

    seen = []
    batch = _batch()
    for scale in (1.0, 100.0):  # before: the second run reused the first model's graph
        torch.manual_seed(0)
        model = Scaled(scale)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(dp=world))
        seen.append((float(pm(*batch)), float(model(*batch))))
    model = CumSum()
    try:
        autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(tp=world),
                            strict=True)
        seen.append("strict ran")
    except UnsupportedLayoutError as exc:
        seen.append("refused" if "logcumsumexp" in str(exc) else str(exc))
    # the plan runs logcumsumexp replicated; the TP pass gathers its inputs even though DTensor
    # would run it on the shards (before: silently wrong, 2.77 against 4.07)
    pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(tp=world))
    seen.append([f.op for f in pm.plan.fallbacks])
    loss = pm(*batch)
    loss.backward()
    ref = model(*batch)
    ref.backward()
    grads = all(torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6)
                for p, q in zip(pm.parameters(), model.parameters()))
    seen.append((float(loss), float(ref), grads))
    # local_batch: each rank passes only its data-parallel slice, as a DistributedSampler gives it
    torch.manual_seed(0)
    ref_model = Scaled(1.0)
    pm = autopar.parallelize(ref_model, world, example_inputs=batch, layout=autopar.Layout(dp=world),
                             local_batch=True)  # the user's model stays as it was: the reference
    mine = tuple(x.chunk(world)[rank] for x in batch)
    seen.append((float(pm(*mine)), float(ref_model(*batch))))
    return seen


def test_no_stale_graph_and_fallbacks_are_listed_or_refused():
    seen = spawn(_contract_worker, 2, timeout_s=300)[0]
    (a, a_ref), (b, b_ref) = seen[:2]
    assert abs(a - a_ref) <= 1e-5 * abs(a_ref) and abs(b - b_ref) <= 1e-5 * abs(b_ref)
    assert b > 100 * a  # and not scale=1's graph
    assert seen[2] == "refused"
    assert "aten.logcumsumexp.default" in seen[3]
    loss, ref, grads = seen[4]
    assert abs(loss - ref) <= 1e-5 * abs(ref) and grads
    loss, ref = seen[5]  # the mean over ranks of the slices' losses: the global batch's loss
    assert abs(loss - ref) <= 1e-5 * abs(ref)


class WithLogits(nn.Module):
    """Returns (loss, output), as Hugging Face models return (loss, logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x, y):
        out = self.down(torch.relu(self.up(x)))
        return nn.functional.mse_loss(out, y), out


def _logits_worker(rank: int, world: int) -> list:
    import autopar

    batch = _batch()
    torch.manual_seed(0)
    model = WithLogits()
    ref = WithLogits()
    ref.load_state_dict(model.state_dict())
    loss_ref, logits_ref = ref(*batch)
    loss_ref.backward()  # the returned output gets no gradient: eager's loss.backward()
    bad = []
    for layout in (autopar.Layout(dp=world), autopar.Layout(tp=world), autopar.Layout(dp=world, zero=3)):
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        loss, logits = pm(*batch)  # the module's (loss, logits): this rank's slice under DP
        want = logits_ref.detach().chunk(layout.dp)[rank % layout.dp]
        if logits.requires_grad or not torch.allclose(logits, want, rtol=1e-5, atol=1e-6):
            bad.append((layout.short(), "logits"))
        loss.backward()
        if abs(float(loss) - float(loss_ref)) > 1e-5 * abs(float(loss_ref)):
            bad.append((layout.short(), "loss"))
        for (name, p), q in zip(pm.named_parameters(), ref.parameters()):
            if not torch.allclose(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6):
                bad.append((layout.short(), name))
    return bad


def test_other_outputs_than_the_loss_get_no_seed_gradient():
    # before: every tangent was fed the loss's seed of ones, so (loss, logits) trained on
    # loss + logits.sum()
    assert spawn(_logits_worker, 2, timeout_s=300) == [[], []]
