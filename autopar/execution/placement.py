"""The plan's parameter placements as DTensors: each rank holds only its shards.

Where a rank's values sit in the whole tensor (`local_indices`) is also what a checkpoint
needs: importing this module teaches torch.distributed.checkpoint to save and load a DTensor
whose local tensor is several boxes of the whole (`dcp_chunks`: a fused projection's
``_StridedShard`` over TP), which torch describes as one box at the wrong rows.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import AutoparError
from passes.tensor_parallel import to_dtensor_placement
from vocab.plan_types import AxisPlacement, PlanDecisions


def placement_of(placement) -> AxisPlacement:
    """A DTensor placement in the plan's vocabulary (for comparing what runs with the plan)."""
    if isinstance(placement, _StridedShard):
        return AxisPlacement.shard(placement.dim, placement.split_factor)
    if isinstance(placement, Shard):
        return AxisPlacement.shard(placement.dim)
    if isinstance(placement, Replicate):
        return AxisPlacement.replicate()
    raise AutoparError(f"placement {placement!r} is not one autopar plans")


def _local_shard(data: torch.Tensor, place: AxisPlacement, n: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``data`` under ``place`` over ``n`` ranks."""
    if not place.is_shard:
        return data
    if place.split_factor == 1:
        return data.chunk(n, dim=place.dim)[rank]
    parts = data.chunk(place.split_factor, dim=place.dim)
    return torch.cat([part.chunk(n, dim=place.dim)[rank] for part in parts], dim=place.dim)


def placed_shard(data: torch.Tensor, dp_place: AxisPlacement, tp_place: AxisPlacement,
                 degrees: tuple[int, int], ranks: tuple[int, int]) -> torch.Tensor:
    """The part of ``data`` that the rank at (dp rank, tp rank) of a (dp, tp) mesh holds:
    its TP shard, then (ZeRO) that shard's rows over DP."""
    local = _local_shard(data, tp_place, degrees[1], ranks[1])
    if dp_place.is_shard:
        local = local.chunk(degrees[0], dim=0)[ranks[0]]
    return local


def _to_dtensors(module: nn.Module, mesh: DeviceMesh, decisions: PlanDecisions,
                 aliases: dict[str, str], held: set[str] | None = None,
                 meshes: dict[str, DeviceMesh] | None = None) -> set[str]:
    """Replace every parameter by an nn.Parameter holding a DTensor with the plan's placements.

    On the ("dp", "tp") mesh a weight is first split over TP, then (ZeRO) its TP shard's rows
    over DP; when both split dim 0 that is DTensor's right-to-left `_StridedShard` order.
    A parameter on the meta device gets only this rank's shard, allocated and left unset (NaN
    where floating): returns those parameters' names, to be filled from a checkpoint.
    ``held``: under a pipeline, the parameters of this rank's stage; under expert parallelism,
    all but the other ranks' experts; the others are removed from the module (their DTensors
    live on the (dp, tp) mesh of this rank's stage). ``meshes``: parameters whose DTensors live
    on another ("dp", "tp") mesh (an expert's: "dp" is its owners' group), or on an ("ep", "dp",
    "tp") one (`runtime.mesh.stacked_expert_mesh`: experts stacked in dim 0, the rank's rows).
    """
    if held is not None and mesh.ndim > 2:
        mesh = mesh["dp", "tp"]
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device(mesh.device_type))
    unloaded: set[str] = set()
    layout = decisions.layout
    made: dict[int, nn.Parameter] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            canonical = aliases.get(full_name, full_name)
            if held is not None and canonical not in held:
                sub._parameters[pname] = None  # another stage's
                continue
            decided = decisions.params[canonical]
            if id(p) not in made:
                on = (meshes or {}).get(canonical, mesh)
                dp_rank, tp_rank = on.get_local_rank("dp"), on.get_local_rank("tp")
                degrees = (on["dp"].size(), layout.tp)  # under cp with ZeRO "dp" is the dp x cp ranks
                data = p.detach()
                tp_place = decided.placements.get("tp", AxisPlacement.replicate())
                dp_place = decided.placements["dp"]
                stacked = "ep" in (on.mesh_dim_names or ())  # experts stacked in dim 0: own rows first
                rows = data.chunk(on["ep"].size(), dim=0)[on.get_local_rank("ep")] if stacked else data
                local = placed_shard(rows, dp_place, tp_place, degrees, (dp_rank, tp_rank))
                placements = [to_dtensor_placement(dp_place), to_dtensor_placement(tp_place)]
                if stacked:
                    placements.insert(0, Shard(0))
                if local.device.type == "meta":  # only this rank's shard is ever allocated
                    local = torch.empty(local.shape, dtype=local.dtype, device=device)
                    if local.is_floating_point():
                        local.fill_(float("nan"))  # never silently trained on garbage
                    unloaded.add(full_name)
                else:
                    local = local.contiguous().clone()
                dt = DTensor.from_local(local, on, placements,
                                        run_check=False, shape=data.shape, stride=data.stride())
                made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            sub._parameters[pname] = made[id(p)]
    return unloaded


def local_indices(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
                  placements) -> list[torch.Tensor | None]:
    """Per dimension, the global indices of the elements a rank holds (None: the whole dim).

    ``local == full[i_0][:, i_1]...`` for the rank at ``coordinate`` of a mesh of
    ``mesh_shape``. DTensor's order: placements apply left to right over the mesh dims, each
    taking its part of what the earlier ones left. ``Shard(d)`` keeps chunk r of the
    indices; ``_StridedShard(d, k)`` cuts them into k parts and keeps chunk r of each, so its
    indices are not one run: e.g. 12 rows, k=3, 2 ranks, rank 1 holds rows [2, 3, 6, 7, 10, 11].
    """
    from torch.distributed.tensor.placement_types import _StridedShardOffsetMode

    idx: list[torch.Tensor | None] = [None] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        if not isinstance(p, (Shard, _StridedShard)):
            raise AutoparError(f"placement {p!r} has no fixed place in the whole tensor (partial sums "
                               "are reduced before a checkpoint)")
        cur = idx[p.dim] if idx[p.dim] is not None else torch.arange(shape[p.dim])
        n, r = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(p, _StridedShard):
            _, offsets = p._local_shard_size_and_offset(curr_local_size=len(cur), num_chunks=n, rank=r,
                                                        offset_mode=_StridedShardOffsetMode.ALL)
            pos = torch.tensor(offsets, dtype=torch.long)
        else:
            size, offset = p._local_shard_size_and_offset(curr_local_size=len(cur), num_chunks=n, rank=r)
            pos = torch.arange(offset, offset + size)
        idx[p.dim] = cur[pos]
    return idx


def shard_of(full: torch.Tensor, like) -> torch.Tensor:
    """This rank's local tensor of ``full`` laid out as the DTensor ``like`` (exact: indexing)."""
    mesh = like.device_mesh
    local = full
    for dim, index in enumerate(local_indices(tuple(full.shape), tuple(mesh.shape), mesh.get_coordinate(),
                                              like.placements)):
        if index is not None:
            local = local.index_select(dim, index.to(local.device))
    return local


def _runs(index: torch.Tensor) -> list[tuple[int, int, int]]:
    """(local start, global start, length) of each run of consecutive global indices."""
    if len(index) == 0:
        return []
    breaks = (torch.nonzero(index[1:] != index[:-1] + 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(index)]
    return [(s, int(index[s]), e - s) for s, e in zip(starts, ends)]


def dcp_chunks(dt) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """The pieces of a DTensor's local tensor that are boxes of the whole tensor, for DCP:
    (global offsets, sizes, local offsets) each; None where the local tensor is one box.

    DCP describes a rank's local tensor by one offset and its size (torch's
    ``compute_local_shape_and_global_offset`` keeps only the first global index of each
    dim). A ``_StridedShard`` on its own (a fused projection's parts split over TP) holds
    several runs of rows, so that one box names the wrong rows on save and on load: each
    run (and each combination of runs over several dims) is its own chunk here.
    """
    mesh = dt.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None or not any(isinstance(p, _StridedShard) for p in dt.placements):
        return None
    return boxes(tuple(dt.shape), tuple(mesh.shape), coordinate, dt.placements)


def boxes(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: list[int],
          placements) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] | None:
    """`dcp_chunks` from the layout alone: the rank's local tensor as boxes of the whole,
    (global offsets, sizes, local offsets) each; None where it is one box."""
    indices = local_indices(shape, mesh_shape, coordinate, placements)
    runs = [_runs(i) if i is not None else [(0, 0, n)] for i, n in zip(indices, shape)]
    if all(len(r) <= 1 for r in runs):
        return None
    chunks = [((), (), ())]
    for dim_runs in runs:
        chunks = [(g + (gs,), s + (n,), loc + (ls,)) for g, s, loc in chunks for ls, gs, n in dim_runs]
    return chunks


def _local_box(dt, local_offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """A view of ``dt``'s local tensor: the box at ``local_offsets`` of ``sizes``."""
    view = dt._local_tensor
    for dim, (start, n) in enumerate(zip(local_offsets, sizes)):
        view = view.narrow(dim, start, n)
    return view


def _exact_write_items(self, fqn, obj):
    chunks = dcp_chunks(self)
    if chunks is None:
        return _DTENSOR_DCP["write"](self, fqn, obj)
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    self._raise_if_contains_partial_placements()
    props = TensorProperties.create_from_tensor(self._local_tensor)
    return [WriteItem(index=MetadataIndex(fqn, torch.Size(g), i), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(g), torch.Size(s)),
                                                  properties=props, size=self.size()))
            for i, (g, s, _) in enumerate(chunks)]


def _exact_chunk_list(self):
    chunks = dcp_chunks(self)
    if chunks is None:
        return _DTENSOR_DCP["chunks"](self)
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    return [ChunkStorageMetadata(torch.Size(g), torch.Size(s)) for g, s, _ in chunks]


def _exact_tensor_shard(self, index):
    chunks = dcp_chunks(self)
    if chunks is None:
        return _DTENSOR_DCP["shard"](self, index)
    offset = tuple(index.offset) if index.offset is not None else None
    if index.index is not None and index.index < len(chunks) and chunks[index.index][0] == offset:
        g, s, loc = chunks[index.index]
        return _local_box(self, loc, s)
    for g, s, loc in chunks:
        if g == offset:
            return _local_box(self, loc, s)
    raise AutoparError(f"no chunk of {index.fqn!r} on this rank starts at {offset}")


# torch's own methods, kept once even if this module is loaded again
_DTENSOR_DCP = DTensor.__dict__.get("_autopar_dcp_originals") or {
    "write": DTensor.__create_write_items__, "chunks": DTensor.__create_chunk_list__,
    "shard": DTensor.__get_tensor_shard__}
DTensor._autopar_dcp_originals = _DTENSOR_DCP


def _teach_dcp_strided_shards() -> None:
    """Make torch.distributed.checkpoint save and load every DTensor at its true place.

    A DTensor whose local tensor is one box of the whole keeps torch's own behaviour; one
    whose local tensor is several boxes (`dcp_chunks`) is saved and loaded box by box, each a
    view of the local tensor, so a load writes into the parameter in place.
    """
    DTensor.__create_write_items__ = _exact_write_items
    DTensor.__create_chunk_list__ = _exact_chunk_list
    DTensor.__get_tensor_shard__ = _exact_tensor_shard


_teach_dcp_strided_shards()
