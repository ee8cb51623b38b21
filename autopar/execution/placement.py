"""The plan's parameter placements as DTensors: each rank holds only its shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.errors import AutoparError
from cost.plan_types import AxisPlacement, PlanDecisions
from passes.tensor_parallel import to_dtensor_placement


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


def _to_dtensors(module: nn.Module, mesh: DeviceMesh, decisions: PlanDecisions,
                 aliases: dict[str, str], held: set[str] | None = None) -> set[str]:
    """Replace every parameter by an nn.Parameter holding a DTensor with the plan's placements.

    On the ("dp", "tp") mesh a weight is first split over TP, then (ZeRO) its TP shard's rows
    over DP; when both split dim 0 that is DTensor's right-to-left `_StridedShard` order.
    A parameter on the meta device gets only this rank's shard, allocated and left unset (NaN
    where floating): returns those parameters' names, to be filled from a checkpoint.
    ``held``: under a pipeline, the parameters of this rank's stage; the others are removed
    from the module (their DTensors live on the (dp, tp) mesh of this rank's stage).
    """
    if held is not None:
        mesh = mesh["dp", "tp"]
    device = (torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda"
              else torch.device(mesh.device_type))
    unloaded: set[str] = set()
    layout = decisions.layout
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
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
                data = p.detach()
                tp_place = decided.placements.get("tp", AxisPlacement.replicate())
                dp_place = decided.placements["dp"]
                local = _local_shard(data, tp_place, layout.tp, tp_rank)
                if dp_place.is_shard:  # ZeRO: the rows of the TP-local shard
                    local = local.chunk(layout.dp, dim=0)[dp_rank]
                placements = [to_dtensor_placement(dp_place), to_dtensor_placement(tp_place)]
                if local.device.type == "meta":  # only this rank's shard is ever allocated
                    local = torch.empty(local.shape, dtype=local.dtype, device=device)
                    if local.is_floating_point():
                        local.fill_(float("nan"))  # never silently trained on garbage
                    unloaded.add(full_name)
                else:
                    local = local.contiguous().clone()
                dt = DTensor.from_local(local, mesh, placements,
                                        run_check=False, shape=data.shape, stride=data.stride())
                made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            sub._parameters[pname] = made[id(p)]
    return unloaded
