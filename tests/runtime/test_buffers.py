"""Buffers the forward updates (BatchNorm's running statistics, a step counter) are updated by
a parallel training step on gloo ranks, as eager PyTorch updates them.

Under data parallelism each rank runs the forward on its own slice of the batch, so each rank's
BatchNorm statistics are those of its slice (DDP without SyncBatchNorm does the same). With
gradient accumulation the step runs once per micro-batch and the statistics update once per
micro-batch, as that many eager forwards would.

The loss and gradients are NOT compared with one device's step on the full batch: BatchNorm in
training mode normalises with the statistics of the batch it sees, so a data-parallel step of a
BatchNorm model differs from the single-device step (per-rank batch statistics). The reference
is the mean over the ranks' (and micro-batches') slices of the eager loss and gradients on each
slice, which is what a DDP step of this model computes. Under tensor parallelism every rank sees
the whole batch, and the reference is one device's step.
"""

import torch
import torch.nn.functional as F
from torch import nn

from runtime.launch import spawn

BATCH = 16


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> ReLU -> Linear, MSE loss, and a step counter buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        return F.mse_loss(self.out(F.relu(self.bn(self.inp(x)))), y)


def _setup() -> tuple[BatchNormNet, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    model = BatchNormNet()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 6, generator=g) * 3 + 2  # far from the initial running mean of 0
    return model, (x, torch.randn(BATCH, 2, generator=g))


def _worker(rank: int, world: int, layout: dict) -> dict:
    """One DP step on this rank; tensors come back as (values, dtype name): a tensor in the
    result would travel through torch's shared-memory pickling and not survive the rank's exit."""
    import autopar

    def plain(t):
        return t.detach().tolist(), str(t.dtype).removeprefix("torch.")

    model, batch = _setup()
    pm = autopar.parallelize(model, world, example_inputs=batch,
                             layout=autopar.Layout(**layout))
    loss = pm(*batch)
    loss.backward()
    return {
        "loss": plain(loss),
        "grads": {n: plain(p.grad.full_tensor()) for n, p in pm.named_parameters()},
        "buffers": {n: plain(b) for n, b in pm.named_buffers()},
        "user_buffers": {n: plain(b) for n, b in model.named_buffers()},
    }


def _tensors(result: dict) -> dict:
    """The worker's result with its tensors rebuilt."""
    def rebuild(v):
        if isinstance(v, dict):
            return {k: rebuild(x) for k, x in v.items()}
        values, dtype = v
        return torch.tensor(values, dtype=getattr(torch, dtype))
    return rebuild(result)


def _reference(world: int, grad_accum: int) -> list[dict]:
    """Per rank: eager forwards on its micro-batches in order (the buffers), and the mean over
    all slices of the eager loss and gradients (the DP step)."""
    model, (x, y) = _setup()
    slices = world * grad_accum
    losses, grads, buffers = [], [], []
    for rank in range(world):
        eager = BatchNormNet()
        eager.load_state_dict(model.state_dict())
        for xs, ys in zip(x.chunk(world)[rank].chunk(grad_accum), y.chunk(world)[rank].chunk(grad_accum)):
            eager.zero_grad()
            loss = eager(xs, ys)
            loss.backward()
            losses.append(loss.detach())
            grads.append({n: p.grad.clone() for n, p in eager.named_parameters()})
        buffers.append({n: b.clone() for n, b in eager.named_buffers()})
    loss = sum(losses) / slices
    grad = {n: sum(g[n] for g in grads) / slices for n in grads[0]}
    return [{"loss": loss, "grads": grad, "buffers": b} for b in buffers]


def _check(results: list[dict], dp: int, grad_accum: int) -> None:
    refs = _reference(dp, grad_accum)
    results = [_tensors(r) for r in results]
    tp = len(results) // dp
    for rank, got in enumerate(results):
        ref = refs[rank // tp]  # a TP group (rank = dp rank * tp + tp rank) runs one slice
        assert int(got["buffers"]["bn.num_batches_tracked"]) == grad_accum, rank
        assert int(got["buffers"]["steps"]) == grad_accum, rank
        assert got["buffers"]["bn.running_mean"].abs().min() > 0, rank
        for name, b in ref["buffers"].items():
            torch.testing.assert_close(got["buffers"][name], b, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, name=name, rank=rank: f"rank {rank} {name}: {m}")
        torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=1e-6)
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=1e-5, atol=1e-6)
        # parallelize works on a copy: the user's model keeps its buffers
        assert int(got["user_buffers"]["steps"]) == 0
        assert not got["user_buffers"]["bn.running_mean"].any()
    if dp > 1:  # each rank's statistics are those of its own slice
        assert not torch.allclose(results[0]["buffers"]["bn.running_mean"],
                                  results[-1]["buffers"]["bn.running_mean"])


def test_data_parallel_step_updates_per_rank_batchnorm_statistics():
    _check(spawn(_worker, 2, args=({"dp": 2},), timeout_s=120), dp=2, grad_accum=1)


def test_gradient_accumulation_updates_statistics_once_per_micro_batch():
    _check(spawn(_worker, 2, args=({"dp": 2, "grad_accum": 2},), timeout_s=120), dp=2, grad_accum=2)


def test_tensor_parallel_step_updates_replicated_statistics():
    """TP shards BatchNorm's features (the column-parallel Linear before it): the new running
    statistics leave the graph replicated, as plain tensors, and equal one device's, as do the
    loss and gradients (every TP rank sees the whole batch)."""
    _check(spawn(_worker, 2, args=({"tp": 2, "grad_accum": 2},), timeout_s=120), dp=1, grad_accum=2)
