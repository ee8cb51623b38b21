"""Run one rank's rewritten joint graph as a training step that autograd understands.

The joint graph computes the loss and every gradient in one call. `run_step` wraps it in an
autograd Function: its forward runs the whole graph and keeps the gradients; its backward,
reached by ``loss.backward()``, hands them to the parameters (scaled by the incoming gradient,
1 for a plain ``loss.backward()``). Parameters are DTensors: the graph reads their local
shards and the gradients are wrapped back with the same placements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx
from torch.distributed.tensor import DTensor


@dataclass
class RankGraph:
    """One rank's executable step: the graph and what feeds its inputs and reads its outputs."""

    gm: fx.GraphModule
    inputs: list[tuple[str, str]]  # (kind, name) per placeholder: param | buffer | input | tangent
    loss_index: int
    grad_index: dict[str, int]  # parameter name -> output index


class _JointStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rank_graph: RankGraph, names: list[str], buffers: dict, user_inputs: tuple, *params):
        by_name = dict(zip(names, params))
        args = []
        for kind, name in rank_graph.inputs:
            if kind == "param":
                p = by_name[name]
                args.append(p.to_local() if isinstance(p, DTensor) else p)
            elif kind == "buffer":
                args.append(buffers[name])
            elif kind == "input":
                args.append(user_inputs[int(name)])
            else:  # the loss's seed gradient
                args.append(torch.ones((), dtype=torch.float32, device=user_inputs[0].device))
        with torch.no_grad():
            out = rank_graph.gm(*args)
        ctx.grads = []
        for name, p in zip(names, params):
            index = rank_graph.grad_index.get(name)
            g = out[index] if index is not None else None
            if g is not None and isinstance(p, DTensor):
                g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride())
            ctx.grads.append(g)
        loss = out[rank_graph.loss_index]
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        scale = grad_loss.item()  # the loss is a scalar: 1 for a plain loss.backward()
        scaled = ctx.grads if scale == 1.0 else [None if g is None else g * scale for g in ctx.grads]
        ctx.grads = None  # free them: one backward per step
        return (None, None, None, None, *scaled)


def run_step(rank_graph: RankGraph, params: Sequence[tuple[str, torch.Tensor]], buffers: dict,
             user_inputs: tuple) -> torch.Tensor:
    """The step's loss, with gradients delivered to ``params`` by ``loss.backward()``."""
    names = [n for n, _ in params]
    return _JointStep.apply(rank_graph, names, buffers, tuple(user_inputs), *[p for _, p in params])
