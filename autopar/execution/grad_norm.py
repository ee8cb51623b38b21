"""Gradient clipping under any plan: the norm one device computes, every element counted once.

``torch.nn.utils.clip_grad_norm_(pm.parameters(), c)`` sees the rank's own tensors: under a
pipeline a stage's parameters only, under expert parallelism the rank's experts only, so each
rank would clip by a different, wrong norm. `clip_grad_norm_` computes the whole model's

    ||g||_p = (sum over every element e of the model's gradients |g_e|^p)^(1/p)
    (p = inf: max_e |g_e|)

as one device does, and scales every gradient by min(1, c / (||g|| + 1e-6)) (torch's rule).

Each gradient element lives on one or more ranks: a replicated placement (data parallelism, TP's
replicated weights, the owners of an expert) holds copies, a shard (ZeRO, TP, EP) a part, a
tied weight on two pipeline stages two copies. A shard is named by its parameter and its
coordinate on each mesh axis that shards it; the lowest rank holding a shard owns it (found once
per module by one all-gather of the names, `_owned`). Each rank sums |g|^p over the shards it
owns; one all-reduce (sum; max for p = inf) over the world gives the total. Copies of a gradient
are equal after the step's reductions, so the owner's copy stands for all.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def clip_grad_norm_(pm: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Scale the gradients of ``pm``'s parameters so that their total ``norm_type``-norm, over
    the whole model as one device holds it, is at most ``max_norm``; return the total norm
    before clipping (the module docstring). Collective: every rank calls it."""
    params = list(pm.named_parameters())
    p_ = float(norm_type)
    # every parameter, gradient or not: the same list on every call, so that the ranks find
    # their shards' owners together, once
    owned = _owned(pm, [_shard_key(n, p) for n, p in params])
    grads = [p.grad for _, p in params if p.grad is not None]
    device = params[0][1].device if params else torch.device("cpu")
    local = torch.zeros((), dtype=torch.float64, device=device)
    for (_, p), own in zip(params, owned):
        if not own or p.grad is None:
            continue
        g = _local(p.grad).detach().to(torch.float64)
        local = torch.maximum(local, g.abs().max()) if math.isinf(p_) else local + g.abs().pow(p_).sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(local, op=dist.ReduceOp.MAX if math.isinf(p_) else dist.ReduceOp.SUM)
    total = local if math.isinf(p_) else local.pow(1.0 / p_)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}): clip_grad_norm_ cannot scale them; fix: find the "
                           "step that overflowed, or pass error_if_nonfinite=False")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        g = _local(grad)
        g.mul_(coef.to(g.dtype))
    return total.to(torch.float32)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The rank's own values of a gradient (a view: scaling it scales the gradient)."""
    return grad._local_tensor if isinstance(grad, DTensor) else grad


def _shard_key(name: str, param: torch.Tensor) -> tuple:
    """A shard's name: the parameter and the rank's coordinate on each mesh axis whose
    placement splits it (equal keys: equal elements; a gradient is placed as its parameter)."""
    if not isinstance(param, DTensor):
        return (name,)
    coords = param.device_mesh.get_coordinate() or ()
    return (name, tuple((i, coords[i]) for i, p in enumerate(param.placements) if not p.is_replicate()))


def _owned(pm: nn.Module, keys: list[tuple]) -> list[bool]:
    """Whether this rank owns each of its shards ``keys`` (the lowest rank holding it), found
    once per module and list of shards."""
    memo = pm.__dict__.setdefault("_grad_norm_owners", {})
    signature = tuple(keys)
    if signature not in memo:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            memo[signature] = [True] * len(keys)
        else:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, keys)
            first: dict[tuple, int] = {}
            for rank, held in enumerate(every):
                for key in held:
                    first.setdefault(key, rank)
            memo[signature] = [first[k] == dist.get_rank() for k in keys]
    return memo[signature]
