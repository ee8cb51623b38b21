"""The live bytes one rank's graph holds at its peak, run on that rank's own arguments."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from runtime.memory import peak_live_bytes


def rank_peak_extra_bytes(pm, batch, dp_rank: int = 0, dp: int = 1) -> int:
    """`peak_live_bytes(...).extra_bytes` of ``pm``'s graph for one micro-batch: its local
    parameter shards, the data-parallel rank's slice of ``batch`` and the loss's scalars."""
    graph = pm._rank_graph
    params = dict(pm.named_parameters())
    args = []
    for kind, name in graph.inputs:
        if kind == "param":
            p = params[name]
            args.append(p.to_local() if isinstance(p, DTensor) else p.detach())
        elif kind == "input":
            args.append(batch[int(name)].chunk(dp)[dp_rank])
        else:  # the loss's seed, or a step-wide loss denominator: scalars whose value moves no byte
            assert kind in ("tangent", "denominator"), kind
            args.append(torch.ones(()))
    with torch.no_grad():
        return peak_live_bytes(graph.gm, *args).extra_bytes
