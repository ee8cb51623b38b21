"""Device meshes over the current process group, and a fake world for planning and tests.

``init_mesh`` wraps ``init_device_mesh`` with the check people get wrong most often (a mesh
shape that does not multiply out to the world size) and a message that says so plainly.
``fake_world`` gives one process a ``world_size``-rank "fake" process group, so meshes,
DTensors and traced collectives can be built for worlds far larger than this machine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["dp_cp_mesh", "expert_mesh", "fake_world", "init_mesh", "stacked_expert_mesh"]


def init_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], device_type: str = "cpu"
) -> DeviceMesh:
    """Build a named ``DeviceMesh`` of ``shape`` over the already initialised process group.

    Args:
        shape: ranks per mesh dimension, e.g. ``(2, 2)``; its product must be the world size.
        names: one name per dimension, e.g. ``("dp", "tp")``.
        device_type: ``"cpu"`` for gloo / fake groups, ``"cuda"`` for NCCL.

    Raises:
        RuntimeError: no process group is initialised.
        ValueError: ``shape`` and ``names`` disagree in length, a name repeats, a size is < 1,
            or ``prod(shape)`` differs from the world size.
    """
    shape = tuple(int(s) for s in shape)
    names = tuple(names)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"init_mesh{shape}: no process group is initialised; start ranks with "
            "runtime.launch.spawn (or torchrun), or use runtime.mesh.fake_world for planning"
        )
    if len(shape) != len(names):
        raise ValueError(
            f"mesh shape {shape} has {len(shape)} dims but names {names} has {len(names)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"mesh dimension names must be distinct, got {names}")
    if any(s < 1 for s in shape):
        raise ValueError(f"mesh shape {shape} has a dimension smaller than 1")
    world = dist.get_world_size()
    n = math.prod(shape)
    if n != world:
        raise ValueError(
            f"mesh {shape} has {n} ranks but the process group has {world}: the product of "
            f"the mesh shape must equal the world size (names {names})"
        )
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


_DP_CP: dict[int, tuple[DeviceMesh, DeviceMesh]] = {}  # id(mesh) -> (mesh, its dp x cp mesh)


def dp_cp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ("dp", "tp") mesh whose "dp" axis is the dp x cp ranks of a ("dp", "cp", "tp")
    ``mesh`` (rank (d, c) at d * cp + c; Megatron's dp-cp group): ZeRO under context
    parallelism shards over it, since parameters are replicated over cp and gradients are
    summed over dp x cp. Of a ("dp", "pp", "cp", "tp") mesh: the ("dp", "pp", "tp") mesh with
    the dp x cp ranks on "dp" (rank (d, p, c, t) at (d * cp + c, p, t)), a pipeline's ZeRO-1
    rows over them. Made once per mesh (every rank must call it, in the same order: it creates
    process groups)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp", "cp", "tp"), ("dp", "pp", "cp", "tp")):
        raise ValueError(f"dp_cp_mesh needs a ('dp', 'cp', 'tp') or ('dp', 'pp', 'cp', 'tp') mesh, got {names}")
    # keyed by the mesh object, kept alive beside its flattening (a new process group makes a
    # new mesh, never a stale hit)
    if id(mesh) not in _DP_CP:
        if len(names) == 3:
            dp, cp, tp = mesh.shape
            flat = DeviceMesh(mesh.device_type, mesh.mesh.reshape(dp * cp, tp), mesh_dim_names=("dp", "tp"))
        else:
            dp, pp, cp, tp = mesh.shape
            grid = mesh.mesh.permute(0, 2, 1, 3).reshape(dp * cp, pp, tp)
            flat = DeviceMesh(mesh.device_type, grid, mesh_dim_names=("dp", "pp", "tp"))
        _DP_CP[id(mesh)] = (mesh, flat)
    return _DP_CP[id(mesh)][1]


_EXPERT: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}  # (id(mesh), ep) -> (mesh, its expert mesh)


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """The ("dp", "ep", "tp") mesh of a ("dp", "tp") ``mesh`` under expert parallelism: dp
    index d = g ep + j is at ("dp" g, "ep" j), so the "ep" axis is an ep group (ep consecutive
    dp ranks, which exchange tokens with all-to-alls) and the "dp" axis is the owners' group
    of ep rank j (the dp/ep ranks {g ep + j} that store the same experts, over which their
    gradients are reduced and ZeRO shards them). Of a pipeline's ("dp", "pp", "tp") mesh: that
    view of this rank's stage (the "dp" and "ep" axes never cross stages), cut from one
    ("dp", "pp", "ep", "tp") mesh of the whole world so that every rank creates the same
    groups. Made once per (mesh, ep) (every rank must call it, in the same order: it creates
    process groups)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp", "tp"), ("dp", "pp", "tp")):
        raise ValueError(f"expert_mesh needs a ('dp', 'tp') or ('dp', 'pp', 'tp') mesh, got {names}")
    dp, tp = mesh.shape[0], mesh.shape[-1]
    if ep < 1 or dp % ep:
        raise ValueError(f"ep={ep} does not divide the {dp} data-parallel ranks")
    if (id(mesh), ep) not in _EXPERT:
        if len(names) == 2:
            made = DeviceMesh(mesh.device_type, mesh.mesh.reshape(dp // ep, ep, tp),
                              mesh_dim_names=("dp", "ep", "tp"))
        else:
            pp = mesh.shape[1]
            grid = mesh.mesh.reshape(dp // ep, ep, pp, tp).permute(0, 2, 1, 3)
            made = DeviceMesh(mesh.device_type, grid, mesh_dim_names=("dp", "pp", "ep", "tp"))["dp", "ep", "tp"]
        _EXPERT[(id(mesh), ep)] = (mesh, made)
    return _EXPERT[(id(mesh), ep)][1]


_STACKED: dict[tuple[int, int], tuple[DeviceMesh, DeviceMesh]] = {}


def stacked_expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """`expert_mesh` with its "ep" axis first: ("ep", "dp", "tp"). A parameter stacking E
    experts along dim 0 is held as ``Shard(0)`` over "ep" (rank j of an ep group holds experts
    [j E/ep, (j+1) E/ep)), then (ZeRO) ``Shard(0)`` over its owners' "dp" axis, which DTensor
    applies in that order: the rows of the rank's own experts. Of a pipeline's mesh: that of
    this rank's stage (cut from a ("pp", "ep", "dp", "tp") mesh of the whole world). Made once
    per (mesh, ep), by every rank in the same order."""
    if (id(mesh), ep) not in _STACKED:
        by_ep = expert_mesh(mesh, ep)
        if mesh.ndim == 2:
            made = DeviceMesh(mesh.device_type, by_ep.mesh.transpose(0, 1), mesh_dim_names=("ep", "dp", "tp"))
        else:
            dp, pp, tp = mesh.shape
            grid = mesh.mesh.reshape(dp // ep, ep, pp, tp).permute(2, 1, 0, 3)
            made = DeviceMesh(mesh.device_type, grid, mesh_dim_names=("pp", "ep", "dp", "tp"))["ep", "dp", "tp"]
        _STACKED[(id(mesh), ep)] = (mesh, made)
    return _STACKED[(id(mesh), ep)][1]


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[int]:
    """Initialise a ``world_size``-rank fake process group in this one process; yield the size.

    The fake backend answers every collective locally without communication, which is what
    planning needs: meshes like 8x8 or 4x4x4, DTensor placements and collectives traced into
    graphs, with no processes or real memory. The group is destroyed on exit, even on error.

    Raises:
        RuntimeError: a process group is already initialised here (nesting would clobber it).
    """
    # Imported lazily: torch.testing._internal is a private, test-only module.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: a process group is already initialised in this process; "
            "destroy it first (fake worlds do not nest)"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield world_size
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
