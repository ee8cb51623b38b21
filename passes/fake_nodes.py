"""New graph nodes with their fake values: what a pass that adds ops to a traced graph needs so
that the passes after it (and `pm.dump_graph()`) read shapes and dtypes as on traced nodes."""

from __future__ import annotations

import torch
from torch import fx

c10d = torch.ops._c10d_functional


def call_node(graph: fx.Graph, op, args: tuple, meta: dict, reason: str | None = None,
              kwargs: dict | None = None, compute: bool = True) -> fx.Node:
    """A call node with ``meta`` (``reason``: its ``meta["autopar"]``, the decision behind it),
    its fake value computed on its arguments' (``compute``; else left for the caller)."""
    node = graph.call_function(op, args, kwargs or {})
    node.meta.update(meta)
    if reason:
        node.meta["autopar"] = reason
    if compute:
        fake_value(node)
    return node


def fake_value(node: fx.Node) -> None:
    """``node``'s fake value from its arguments' (a collective's by its shape rule: no process
    group answers a call made here)."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
    if node.target is c10d.all_gather_into_tensor.default:
        val, n = args[0], args[1]
        node.meta["val"] = val.new_empty((n * val.shape[0], *val.shape[1:]))
    elif node.target is c10d.reduce_scatter_tensor.default:
        val, n = args[0], args[2]
        node.meta["val"] = val.new_empty((val.shape[0] // n, *val.shape[1:]))
    elif node.target is c10d.wait_tensor.default:
        node.meta["val"] = args[0]
    else:
        node.meta["val"] = node.target(*args, **kwargs)
