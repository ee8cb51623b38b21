"""Measure the memory a graph's execution really holds: the peak of live tensor bytes.

`peak_live_bytes` runs a GraphModule node by node on real tensors and keeps each value alive
from the node that makes it to its last user, as a run that frees every value after its last
use does (the caching allocator's reuse aside). Bytes are counted per storage, so views cost
nothing and a storage is freed when no live value refers to it. The graph's inputs count from
the start and for the whole run (the caller holds them), its outputs to the end. The peak is
taken after each node's outputs exist and before its dead arguments are freed: both are
resident while the kernel runs. Kernel-internal scratch memory is not seen.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import fx


@dataclass(frozen=True)
class MemoryProfile:
    """The peak of live tensor bytes of one execution, and what made it up."""

    peak_bytes: int  # inputs included
    input_bytes: int  # the graph's inputs (parameters, batch, seeds): alive throughout
    peak_node: str  # the node at whose execution the peak was reached
    outputs: tuple  # the graph's outputs, as gm(*args) returns them
    # a joint graph's live bytes as its first backward node starts: the inputs and what the
    # forward keeps for the backward (the cost model's "activations"); None without a backward
    boundary_bytes: int | None = None

    @property
    def extra_bytes(self) -> int:
        """The peak above the inputs: what the step itself allocates (activations, gradients,
        temporaries)."""
        return self.peak_bytes - self.input_bytes


def _tensors(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _storages(value) -> dict[int, int]:
    """storage key -> bytes of every tensor in ``value``."""
    out = {}
    for t in _tensors(value):
        if t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        out[storage._cdata] = storage.nbytes()  # the StorageImpl: one key per storage
    return out


def peak_live_bytes(gm: fx.GraphModule, *args) -> MemoryProfile:
    """Run ``gm(*args)`` node by node and return the peak of live tensor bytes (see the module
    docstring), without autograd."""
    nodes = list(gm.graph.nodes)
    last_use: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        for arg in node.all_input_nodes:
            last_use[arg] = node
    dying: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last_use.items():
        dying.setdefault(user, []).append(value)
    env: dict[fx.Node, object] = {}
    holders: dict[int, set[fx.Node]] = {}  # storage -> live values in it
    size: dict[int, int] = {}
    live = 0
    inputs = iter(args)

    def hold(node: fx.Node, value) -> None:
        nonlocal live
        for key, nbytes in _storages(value).items():
            if key not in holders:
                holders[key] = set()
                size[key] = nbytes
                live += nbytes
            holders[key].add(node)

    def release(node: fx.Node) -> None:
        nonlocal live
        for key in _storages(env.pop(node)):
            holders[key].discard(node)
            if not holders[key]:
                live -= size.pop(key)
                del holders[key]

    with torch.no_grad():
        for node in nodes:
            if node.op == "placeholder":
                env[node] = next(inputs)
                hold(node, env[node])
        input_bytes = live
        peak, peak_node, boundary = live, "", None
        for node in nodes:
            if node.op == "placeholder":
                continue
            if boundary is None and node.meta.get("partitioner_tag") == "is_backward":
                boundary = live
            if node.op == "output":
                outputs = fx.node.map_arg(node.args[0], lambda n: env[n])
                break
            args_ = fx.node.map_arg(node.args, lambda n: env[n])
            kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
            if node.op == "get_attr":
                value = getattr(gm, node.target)
            elif node.op == "call_function":
                value = node.target(*args_, **kwargs)
            else:
                raise NotImplementedError(f"peak_live_bytes: {node.op} nodes are not supported")
            env[node] = value
            hold(node, value)
            if live > peak:
                peak, peak_node = live, node.name
            for dead in dying.get(node, ()):
                if dead.op != "placeholder":  # the caller holds the inputs
                    release(dead)
            if not node.users:
                release(node)
        else:
            raise ValueError("graph without output")
    return MemoryProfile(peak, input_bytes, peak_node, tuple(outputs), boundary)


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)
