"""Whole tensors in and out of a `ParallelModule`, exactly, under any plan.

`full_state_dict` gives what ``torch.save(model.state_dict())`` of the one-device model holds
(every parameter and persistent buffer whole, in the module's own names); `load_full_state_dict`
fills each rank's shards from such a dict. `full_optim_state_dict` / `load_full_optim_state_dict`
do the same for an optimizer's state (AdamW's moments: each tensor shaped like its parameter is
gathered whole and cut again by the new plan's placements; ``step`` and scalars are copied).

Cutting is indexing (`placement.shard_of`: ``local = full[i_0][:, i_1]...`` with the rank's
global indices of each dim), gathering is DTensor's ``full_tensor``, so a value moved between
any two plans is bit-identical. Under a pipeline each rank holds its stage's parameters only:
the whole dict is assembled by broadcasting each tensor from the lowest rank that holds it.

Every function here is collective: every rank of the world calls it, in the same order, with
the same dict (for the loads).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from autopar.errors import InputError
from autopar.execution.placement import shard_of

_SEP = "\x00"  # joins a parameter's name and an optimizer state key into one flat key


def full_state_dict(pm: nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter and persistent buffer of ``pm`` whole, keyed by the original module's
    names (tied weights under each of their names, as ``model.state_dict()`` has them).

    Default: every rank gets the whole dict (the gather of a sharded tensor is an all-gather,
    so every rank holds it whole anyway, and a rank can compare or save without a second
    exchange). ``rank0_only=True``: rank 0 gets it, the others ``{}`` (a pipeline's other
    stages then send to rank 0 only, and the others drop each tensor after its gather).
    Tensors stay on the device the rank computes on.
    """
    keep = _rank() == 0 or not rank0_only
    local: dict[str, Any] = {}
    gathered: dict[int, torch.Tensor] = {}  # tied weights: one gather for all their names
    for name, value in sorted(pm.state_dict(keep_vars=True).items()):
        if isinstance(value, torch.Tensor):
            if id(value) not in gathered:
                gathered[id(value)] = _whole(value)
            local[name] = gathered[id(value)]
    merged = _merge_across_ranks(local, rank0_only, _device(pm))
    return merged if keep else {}


def load_full_state_dict(pm: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Fill every rank's shards of ``pm`` from whole tensors ``sd`` (a one-device
    ``model.state_dict()`` in the original module's names), exactly: rank r's local tensor
    is ``sd[name]`` indexed at r's global indices. Every rank passes the same whole dict.

    A key of the model absent from ``sd``, a key of ``sd`` the model lacks, or a shape that
    differs is an `InputError` naming the keys (checked against the names and shapes of all
    ranks, so under a pipeline too, and on every rank alike). Values are cast to each
    parameter's dtype, as ``nn.Module.load_state_dict`` does. A model parallelised from the
    meta device is marked loaded.
    """
    local = pm.state_dict(keep_vars=True)
    shapes = _global_shapes({n: tuple(v.shape) for n, v in local.items() if isinstance(v, torch.Tensor)})
    _check_keys(shapes, sd)
    with torch.no_grad():
        for name, value in local.items():
            if not isinstance(value, torch.Tensor):
                continue
            full = sd[name].to(device=value.device)
            if isinstance(value, DTensor):
                value._local_tensor.copy_(shard_of(full, value))
            else:
                value.copy_(full)
    unloaded = getattr(pm, "_unloaded", None)
    if isinstance(unloaded, set):
        unloaded.difference_update(local)


def full_optim_state_dict(pm: nn.Module, opt: torch.optim.Optimizer,
                          rank0_only: bool = False) -> dict[str, Any]:
    """``opt``'s state with every tensor whole, keyed by parameter name: ``{"state": {name:
    {key: value}}, "param_groups": [{hyperparameters..., "params": [names]}]}``.

    A state tensor shaped like its parameter's local shard (a DTensor: AdamW's ``exp_avg``,
    ``exp_avg_sq``) is gathered whole; others (``step``) are taken as they are. Names are
    the graph's canonical names (a tied weight: its first name). ``rank0_only`` as in
    `full_state_dict`.
    """
    names = _param_names(pm)
    local: dict[str, Any] = {}
    for p in sorted(_opt_params(opt), key=lambda q: names[id(q)]):
        for key, value in sorted(opt.state.get(p, {}).items()):
            local[names[id(p)] + _SEP + key] = _whole(value) if isinstance(value, torch.Tensor) else value
    groups = [{**{k: v for k, v in g.items() if k != "params"},
               "params": [names[id(p)] for p in g["params"]]} for g in opt.param_groups]
    merged = _merge_across_ranks(local, rank0_only, _device(pm))
    all_groups = _all_gather(groups)
    if rank0_only and _rank() != 0:
        return {}
    state: dict[str, dict[str, Any]] = {}
    for flat, value in merged.items():
        name, key = flat.split(_SEP)
        state.setdefault(name, {})[key] = value
    union = [{**all_groups[0][i], "params": sorted({n for g in all_groups for n in g[i]["params"]})}
             for i in range(len(groups))]
    return {"state": state, "param_groups": union}


def load_full_optim_state_dict(pm: nn.Module, opt: torch.optim.Optimizer, sd: dict[str, Any]) -> None:
    """Set ``opt``'s state (over ``pm.parameters()``) from `full_optim_state_dict`'s form,
    exactly: each whole state tensor shaped like its parameter becomes a DTensor with the
    parameter's placements, holding this rank's indices; hyperparameters are taken from
    the saved group holding each group's first parameter.

    A parameter of ``opt`` with no saved state while others have some, or saved state for a
    name the model lacks, is an `InputError` naming it.
    """
    names = _param_names(pm)
    saved = sd.get("state", {})
    everywhere = set().union(*_all_gather(sorted(names[id(p)] for p in _opt_params(opt))))
    extra = sorted(set(saved) - everywhere)
    missing = sorted(everywhere - set(saved)) if saved else []
    if extra or missing:
        raise InputError(
            f"optimizer state does not match the model: {len(missing)} parameters without state "
            f"{missing[:5]}, {len(extra)} saved names the model lacks {extra[:5]}.\n  fix: load "
            "the state saved by full_optim_state_dict for the same model (any plan), over "
            "pm.parameters()")
    by_name = {n: g for g in sd.get("param_groups", []) for n in g["params"]}
    for group in opt.param_groups:
        first = names[id(group["params"][0])] if group["params"] else None
        if first in by_name:
            group.update({k: v for k, v in by_name[first].items() if k != "params"})
        for p in group["params"]:
            entry = saved.get(names[id(p)])
            if entry is not None:
                opt.state[p] = {key: _placed_like(value, p) for key, value in entry.items()}


def _placed_like(value: Any, p: torch.Tensor) -> Any:
    """A saved optimizer value for parameter ``p``: a whole tensor of ``p``'s shape becomes
    this rank's shard of it, laid out as ``p``; anything else is copied."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(p, DTensor) and tuple(value.shape) == tuple(p.shape):
        local = shard_of(value.to(device=p.device, dtype=value.dtype), p).contiguous()
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return value.clone()


def _check_keys(shapes: dict[str, tuple[int, ...]], sd: dict[str, torch.Tensor]) -> None:
    """The model's keys and shapes (all ranks) against ``sd``'s: an InputError naming each gap."""
    missing = sorted(set(shapes) - set(sd))
    extra = sorted(set(sd) - set(shapes))
    if missing or extra:
        raise InputError(
            f"state dict does not match the model: {len(missing)} missing keys {missing[:5]}, "
            f"{len(extra)} unexpected keys {extra[:5]}.\n  fix: pass the state_dict() of the module "
            "given to autopar.parallelize (its own parameter names; a checkpoint of an inner "
            "module needs its prefix, e.g. {'model.' + k: v for k, v in sd.items()})")
    wrong = [(k, tuple(getattr(sd[k], "shape", ())), s) for k, s in sorted(shapes.items())
             if not isinstance(sd[k], torch.Tensor) or tuple(sd[k].shape) != s]
    if wrong:
        k, got, want = wrong[0]
        raise InputError(
            f"state dict entry {k!r} has shape {got}, the model's parameter {want} "
            f"({len(wrong)} entries differ).\n  fix: load a checkpoint of the same model "
            "configuration (widths, vocabulary, layer count)")


def _whole(value: torch.Tensor) -> torch.Tensor:
    return value.full_tensor().detach() if isinstance(value, DTensor) else value.detach()


def _param_names(pm: nn.Module) -> dict[int, str]:
    """id(parameter) -> its canonical name: the graph's name for it where the rank's graph
    names it (a tied weight has one), else its first name in the module."""
    canonical = set(getattr(pm, "_canonical", ()))
    names: dict[int, str] = {}
    for name, p in pm.named_parameters(remove_duplicate=False):
        if id(p) not in names or (name in canonical and names[id(p)] not in canonical):
            names[id(p)] = name
    return names


def _opt_params(opt: torch.optim.Optimizer) -> Iterable[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _all_gather(obj: Any) -> list[Any]:
    if _world() == 1:
        return [obj]
    out: list[Any] = [None] * _world()
    dist.all_gather_object(out, obj)
    return out


def _global_shapes(local: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Union over ranks of name -> shape (a pipeline's stages hold different names)."""
    merged: dict[str, tuple[int, ...]] = {}
    for shapes in _all_gather(local):
        merged.update(shapes)
    return merged


def _device(pm: nn.Module) -> torch.device:
    """Where this rank's collectives run (NCCL needs CUDA buffers; gloo CPU ones)."""
    mesh = getattr(pm, "mesh", None)
    if mesh is not None and mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _merge_across_ranks(local: dict[str, Any], rank0_only: bool, device: torch.device) -> dict[str, Any]:
    """Every rank's entries in one dict: an entry every rank holds is kept; one only some
    ranks hold (another pipeline stage's) comes from the lowest of them, tensors by broadcast
    (point-to-point to rank 0 with ``rank0_only``), other values with the metadata."""
    if _world() == 1:
        return dict(local)
    meta = {k: (("tensor", tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v))
            for k, v in local.items()}
    everyone = _all_gather(meta)
    me, world = _rank(), _world()
    merged: dict[str, Any] = {}
    for key in sorted(set().union(*everyone)):
        holders = [r for r in range(world) if key in everyone[r]]
        info = everyone[holders[0]][key]
        if len(holders) == world or info[0] == "value":
            merged[key] = local[key] if key in local else info[1]
            continue
        owner = holders[0]
        buf = local[key].to(device).contiguous() if me == owner else torch.empty(info[1], dtype=info[2], device=device)
        if rank0_only:
            if owner != 0 and me == owner:
                dist.send(buf, dst=0)
            elif owner != 0 and me == 0:
                dist.recv(buf, src=owner)
        else:
            dist.broadcast(buf, src=owner)
        if me == owner or me == 0 or not rank0_only:
            merged[key] = buf
    return merged
