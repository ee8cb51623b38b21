"""`passes.cp_balance.zigzag_shards` on 2 gloo ranks: every move between DTensor placements on the
cp mesh reads Shard as the rank's chunks r and 2n-1-r of 2n, and the global view stays in
position order (Replicate -> Shard -> Replicate, Partial -> Shard, Shard(a) -> Shard(b), a view
flattening [batch, seq] into tokens and _StridedShard); a dim that does not cut into 2n chunks
is refused; outside the block DTensor's contiguous shards are back."""

from __future__ import annotations

from runtime.launch import spawn


def _moves(rank: int, world: int) -> list[str]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from passes.cp_balance import ZigzagError, rank_chunks, zigzag_shards

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    x = torch.arange(4 * 16 * 2, dtype=torch.float32).view(4, 16, 2)

    def mine(t, dim):
        return torch.cat([t.chunk(2 * world, dim)[c] for c in rank_chunks(rank, world)], dim)

    def placed(t, p):
        return DTensor.from_local(t, mesh, [p], run_check=False)

    fails = []
    with zigzag_shards(mesh):
        s = placed(x, Replicate()).redistribute(mesh, [Shard(1)])
        checks = {
            "replicate -> shard": (s.to_local(), mine(x, 1)),
            "shard -> replicate": (s.full_tensor(), x),
            "partial -> shard": (placed(x * (rank + 1), Partial()).redistribute(mesh, [Shard(1)]).to_local(),
                                 mine(x, 1) * sum(range(1, world + 1))),
            "shard(1) -> shard(0)": (s.redistribute(mesh, [Shard(0)]).to_local(), mine(x, 0)),
        }
        tokens = s[..., 0].reshape(-1)  # [batch, seq] flattened: a strided shard of the tokens
        checks["flattened view"] = (tokens.full_tensor(), x[..., 0].reshape(-1))
        strided = placed(x[..., 0].reshape(-1), Replicate()).redistribute(
            mesh, [_StridedShard(0, split_factor=4)])
        checks["replicate -> strided"] = (strided.to_local(), mine(x[..., 0], 1).reshape(-1))
        checks["strided -> replicate"] = (strided.full_tensor(), x[..., 0].reshape(-1))
        for what, (got, want) in checks.items():
            if got.shape != want.shape or not torch.equal(got, want):
                fails.append(what)
        try:
            placed(torch.zeros(2, 6), Replicate()).redistribute(mesh, [Shard(1)])
            fails.append("6 positions over 4 chunks not refused")
        except ZigzagError as exc:
            if "2*cp = 4" not in str(exc):
                fails.append(str(exc))
    contiguous = placed(x, Replicate()).redistribute(mesh, [Shard(1)]).to_local()
    if not torch.equal(contiguous, x.chunk(world, 1)[rank]):
        fails.append("contiguous shards not restored")
    return fails


def test_zigzag_moves_keep_position_order():
    results = spawn(_moves, 2, timeout_s=300)
    assert results == [[], []], results
