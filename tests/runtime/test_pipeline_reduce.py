"""A pipeline's data-parallel reduction after the schedule (`runtime.pipeline`): ZeRO-1's
gradients reduce-scattered (as on GPUs, `CommPlan.reduce_scatter`) give each rank exactly the
rows the all-reduce path keeps, for rows that do not divide by the ranks too (3 gloo ranks)."""

import torch

from runtime.launch import spawn

SHAPES = {"a.weight": (7, 3), "b.weight": (4,), "c.bias": (1, 2), "d.weight": (6, 2, 2)}
SHARDED = {"a.weight", "b.weight", "c.bias"}


def _grads(rank: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + rank)
    return {p: torch.randn(s, generator=gen) for p, s in SHAPES.items()}


def _expected(world: int, rank: int, partial: int) -> tuple[dict[str, torch.Tensor], float]:
    """What every rank's gradients summed (x partial / world), this rank's rows of the sharded
    ones, computed on one process from the same seeds."""
    total = {p: sum(_grads(r)[p] for r in range(world)) * (partial / world) for p in SHAPES}
    rows = {p: (g.chunk(world)[rank] if rank < len(g.chunk(world)) else g[:0]) if p in SHARDED else g
            for p, g in total.items()}
    loss = sum(float(r + 1) for r in range(world)) / world
    return rows, loss


def _reduce(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from runtime.pipeline import reduce_data_parallel, reduce_experts

    group = dist.group.WORLD
    problems = []
    for partial in (1, world):
        want, want_loss = _expected(world, rank, partial)
        loss, got = reduce_data_parallel(_grads(rank), torch.tensor(float(rank + 1)), world,
                                         group, SHARDED.__contains__, rank, partial=partial,
                                         reduce_scatter=True)
        if abs(float(loss) - want_loss) > 1e-5:
            problems.append(f"partial={partial}: loss {float(loss)} != {want_loss}")
        for p, g in want.items():
            if got[p].shape != g.shape or not torch.allclose(got[p], g, rtol=1e-5, atol=1e-6):
                problems.append(f"partial={partial}: {p} rows {tuple(got[p].shape)} differ")
    # the experts' share: summed over their owners (here every rank), divided by dp
    want = {p: g * world for p, g in _expected(world, rank, 1)[0].items()}
    got = reduce_experts(_grads(rank), dp=1, group=group, owners=world, owner_rank=rank,
                         sharded=SHARDED.__contains__, reduce_scatter=True)
    problems += [f"experts: {p} differs" for p, g in want.items()
                 if got[p].shape != g.shape or not torch.allclose(got[p], g, rtol=1e-5, atol=1e-6)]
    return problems


def test_reduce_scatter_keeps_each_ranks_rows_of_the_sum():
    assert spawn(_reduce, 3, timeout_s=120) == [[]] * 3
