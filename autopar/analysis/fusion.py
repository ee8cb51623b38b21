"""Which nodes of the step run as one fused kernel, and what a fused step saves for backward.

Production training runs element-wise chains (norms, activations, residual adds, casts) as
fused kernels: Inductor under `torch.compile` (torchtitan), hand-written Triton kernels
(nanotron's fused RMSNorm). Pricing every aten node as its own kernel overstates the memory
traffic of a Llama block's RMSNorm about six-fold. This module groups connected element-wise
and reduction nodes of one phase into fusion groups, so that a group moves only the bytes that
enter or leave it and launches one kernel.

Saved activations follow Inductor's min-cut partitioner in spirit: an element-wise value the
backward needs is recomputed from its group's inputs rather than stored, so a fused step saves
the group inputs (matmul and attention outputs, the residual stream) instead.
"""

from __future__ import annotations

import operator

import torch

from autopar.analysis.graph import GraphAnalysis
from autopar.capture.joint import TrainingGraph

aten = torch.ops.aten

_REDUCTIONS = {
    aten.sum.dim_IntList, aten.sum.default, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var_mean.correction, aten._to_copy.default, aten.clone.default, aten.copy.default,
    aten.where.self, aten.masked_fill.Scalar, aten.fill.Scalar,
}


def _fusible(node: torch.fx.Node, analysis: GraphAnalysis) -> bool:
    if node.op != "call_function" or node.target is operator.getitem:
        return False
    info = analysis.nodes[node.name]
    if info.is_view or info.flops > 0 or info.is_matmul:
        return False
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or node.target in _REDUCTIONS


def _producer(node: torch.fx.Node, analysis: GraphAnalysis) -> torch.fx.Node:
    """Follow views back to the node that computed the data."""
    while analysis.nodes[node.name].is_view and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


def fusion_groups(graph: TrainingGraph, analysis: GraphAnalysis) -> dict[str, str]:
    """Map each fusible node to the name of its group's first node (same phase only)."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    # Barrier depth: the most non-fusible kernels on any path from the inputs. Fusing only
    # nodes of equal depth can never swallow a path that leaves the group and comes back
    # (the residual stream around a matmul), which would make the fused kernel a cycle.
    depth: dict[str, int] = {}
    order: dict[str, int] = {}
    for index, node in enumerate(graph.gm.graph.nodes):
        order[node.name] = index
        fusible = _fusible(node, analysis)
        depth[node.name] = max(
            (depth[a.name] + (0 if a.name in parent or analysis.nodes[a.name].is_view or a.op == "placeholder" else 1)
             for a in node.all_input_nodes),
            default=0,
        )
        if not fusible:
            continue
        parent[node.name] = node.name
        phase = analysis.nodes[node.name].phase
        for arg in node.all_input_nodes:
            src = _producer(arg, analysis)
            if src.name in parent and analysis.nodes[src.name].phase == phase and depth[src.name] == depth[node.name]:
                a, b = find(src.name), find(node.name)
                if a != b:  # the earlier node names the group
                    first, second = (a, b) if order[a] < order[b] else (b, a)
                    parent[second] = first
    return {name: find(name) for name in parent}


def external_bytes(
    graph: TrainingGraph, analysis: GraphAnalysis, groups: dict[str, str]
) -> tuple[dict[str, list[torch.fx.Node]], dict[str, bool]]:
    """For every node, the inputs it reads from outside its fusion group, and whether its
    output leaves the group (read by another group, the backward, or the graph output)."""
    consumers: dict[str, list[torch.fx.Node]] = {n.name: [] for n in graph.gm.graph.nodes}
    for node in graph.gm.graph.nodes:
        for arg in node.all_input_nodes:
            consumers[_producer(arg, analysis).name].append(node)
    inputs: dict[str, list[torch.fx.Node]] = {}
    leaves: dict[str, bool] = {}
    for node in graph.gm.graph.nodes:
        group = groups.get(node.name)
        ext = []
        seen = set()
        for arg in node.all_input_nodes:
            src = _producer(arg, analysis)
            if group is not None and groups.get(src.name) == group:
                continue
            if src.name not in seen:
                seen.add(src.name)
                ext.append(arg)
        inputs[node.name] = ext
        leaves[node.name] = group is None or any(
            c.op == "output" or groups.get(c.name) != group for c in consumers[node.name]
        )
    return inputs, leaves


def fused_saved(
    graph: TrainingGraph, analysis: GraphAnalysis, groups: dict[str, str]
) -> dict[str, int]:
    """Saved activations when fused element-wise values are recomputed from their group's
    inputs in the backward: {storage node: bytes}."""
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    saved: dict[str, int] = {}

    def keep(name: str) -> None:
        root = analysis.nodes[name].storage
        if analysis.nodes[root].phase == "forward":
            saved[root] = analysis.nodes[root].nbytes

    for name in analysis.saved:
        group = groups.get(name)
        if group is None:
            keep(name)
            continue
        stack, seen = [name], set()
        while stack:  # walk back inside the group; keep whatever enters it
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            for arg in by_name[current].all_input_nodes:
                src = _producer(arg, analysis)
                if groups.get(src.name) == group:
                    stack.append(src.name)
                else:
                    keep(src.name)
    return saved
