"""Load-balanced sequence shards for context parallelism: DTensor's Shard read as zigzag chunks.

Under a causal mask, query position i attends i + 1 keys: with contiguous blocks, the last of
n ranks attends 2n/(n+1) times the average (the first one 1/(n+1) of it). Cut the sequence in
2n equal chunks and give rank r chunks r and 2n-1-r: every rank then attends

    (r + 1/2) + (2n - 1 - r + 1/2) = 2n   (query chunk, key chunk) pairs,

the same on every rank (Brandon et al. 2023, "Striped attention"; the Ultra-Scale Playbook's
"zig-zag" ring).

The context-parallel pass runs the step on DTensors whose global view is the sequence in its
original order; `zigzag_shards` changes what ``Shard(d)`` means on the cp mesh while the step is
traced: rank r's local tensor holds chunks r and 2n-1-r of dim d (in that order), not the r-th
contiguous block. Every move between placements follows that reading:

    Replicate -> Shard      the rank's two chunks (a local slice, as before)
    Shard -> Replicate      all-gather, then the chunks put back in position order
    Partial -> Shard        the whole value's chunks put in rank order, then reduce-scatter
    Shard(a) -> Shard(b)    through Replicate
    _StridedShard(d, k)     the same per each of the k pieces of dim d (tokens flattened
                            from [batch, seq])

Ops on shards that treat positions alike (matmuls, norms, the per-token loss) do not care which
positions a rank holds; DTensor gathers an op that mixes positions (a shift, a cumsum) whole, in
position order; values of the data only (positions, RoPE tables, masks, labels) enter a rank
through Replicate -> Shard: all follow the chunks. A sharded dim whose size does not cut into 2n
equal chunks cannot be read so: its move is refused (`ZigzagError`), naming the size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

__all__ = ["ZigzagError", "from_rank_order", "rank_chunks", "to_rank_order", "zigzag_shards"]


class ZigzagError(ValueError):
    """A sharded dimension that does not cut into 2n equal chunks."""


def rank_chunks(rank: int, size: int) -> tuple[int, int]:
    """Chunks of 2 ``size`` that rank ``rank`` holds, in position order."""
    return rank, 2 * size - 1 - rank


def _rank_order(size: int) -> list[int]:
    """Chunk indices as ranks hold them, rank after rank: 0, 2n-1, 1, 2n-2, ..."""
    return [c for r in range(size) for c in rank_chunks(r, size)]


def _chunks(x: torch.Tensor, dim: int, size: int) -> list[torch.Tensor]:
    length = x.shape[dim]
    if length % (2 * size):
        raise ZigzagError(
            f"a dimension of {length} positions split over {size} CP ranks does not cut into "
            f"2*cp = {2 * size} equal load-balanced chunks")
    width = length // (2 * size)
    return [x.narrow(dim, c * width, width) for c in range(2 * size)]


def to_rank_order(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` (dim ``dim`` in position order) with its 2n chunks in rank order: contiguous block
    r of the result is rank r's chunks."""
    parts = _chunks(x, dim, size)
    return torch.cat([parts[c] for c in _rank_order(size)], dim=dim)


def from_rank_order(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """The inverse of `to_rank_order`: chunks in rank order back in position order."""
    parts = _chunks(x, dim, size)
    where = {c: i for i, c in enumerate(_rank_order(size))}
    return torch.cat([parts[where[c]] for c in range(2 * size)], dim=dim)


def _local(x: torch.Tensor, dim: int, size: int, rank: int) -> torch.Tensor:
    parts = _chunks(x, dim, size)
    return torch.cat([parts[c] for c in rank_chunks(rank, size)], dim=dim)


def _pieces(x: torch.Tensor, dim: int, split: int) -> torch.Tensor:
    """Dim ``dim`` of ``x`` as [split, rest] (a _StridedShard's pieces)."""
    return x.unflatten(dim, (split, x.shape[dim] // split))


@contextlib.contextmanager
def zigzag_shards(mesh) -> Iterator[None]:
    """Within the block, ``Shard`` and ``_StridedShard`` on the 1-D ``mesh`` hold each rank's
    zigzag chunks (see the module's docstring); other meshes are untouched."""
    originals = {
        (Shard, "_replicate_to_shard"): Shard._replicate_to_shard,
        (Shard, "_to_replicate_tensor"): Shard._to_replicate_tensor,
        (Shard, "_to_new_shard_dim"): Shard._to_new_shard_dim,
        (_StridedShard, "_replicate_to_strided_shard"): _StridedShard._replicate_to_strided_shard,
        (_StridedShard, "_to_replicate_tensor"): _StridedShard._to_replicate_tensor,
        (Partial, "_reduce_shard_value"): Partial._reduce_shard_value,
    }
    size = mesh.size()

    def ours(m) -> bool:
        return m is mesh or m == mesh

    def replicate_to_shard(self, local, m, mesh_dim, shard_index):
        if not ours(m):
            return originals[Shard, "_replicate_to_shard"](self, local, m, mesh_dim, shard_index)
        return _local(local, self.dim, size, int(shard_index))

    def shard_to_replicate(self, local, m, mesh_dim, shape):
        whole = originals[Shard, "_to_replicate_tensor"](self, local, m, mesh_dim, shape)
        return from_rank_order(whole, self.dim, size) if ours(m) else whole

    def new_shard_dim(self, local, m, mesh_dim, shape, new_dim):
        if not ours(m):
            return originals[Shard, "_to_new_shard_dim"](self, local, m, mesh_dim, shape, new_dim)
        whole = shard_to_replicate(self, local, m, mesh_dim, shape)
        return _local(whole, new_dim, size, m.get_local_rank())

    def replicate_to_strided(self, local, m, mesh_dim, shard_index):
        if not ours(m):
            return originals[_StridedShard, "_replicate_to_strided_shard"](self, local, m, mesh_dim, shard_index)
        split = self._split_factor_int()
        return _local(_pieces(local, self.dim, split), self.dim + 1, size, int(shard_index)).flatten(
            self.dim, self.dim + 1)

    def strided_to_replicate(self, local, m, mesh_dim, shape):
        whole = originals[_StridedShard, "_to_replicate_tensor"](self, local, m, mesh_dim, shape)
        if not ours(m):
            return whole
        split = self._split_factor_int()
        return from_rank_order(_pieces(whole, self.dim, split), self.dim + 1, size).flatten(self.dim, self.dim + 1)

    def reduce_shard(self, tensor, m, mesh_dim, shard_spec):
        if ours(m) and type(shard_spec) is Shard:
            tensor = to_rank_order(tensor, shard_spec.dim, size)
        elif ours(m):
            raise ZigzagError(f"a partial sum reduced to {shard_spec} over the CP ranks")
        return originals[Partial, "_reduce_shard_value"](self, tensor, m, mesh_dim, shard_spec)

    patches = {
        (Shard, "_replicate_to_shard"): replicate_to_shard,
        (Shard, "_to_replicate_tensor"): shard_to_replicate,
        (Shard, "_to_new_shard_dim"): new_shard_dim,
        (_StridedShard, "_replicate_to_strided_shard"): replicate_to_strided,
        (_StridedShard, "_to_replicate_tensor"): strided_to_replicate,
        (Partial, "_reduce_shard_value"): reduce_shard,
    }
    for (cls, name), fn in patches.items():
        setattr(cls, name, fn)
    try:
        yield
    finally:
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
