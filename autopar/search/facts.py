"""The cost facts of a captured step: what `cost.step.predict` prices, read off the graph.

For every node its FLOPs and the bytes it touches, split into the batch-dependent part
(activations) and the rest (weights), its TP state from `tp_recipe` (sharded t ways,
sequence-shardable, or replicated), its repeated block; the forward values saved for the
backward; the TP collectives the recipe implies; the parameters and where they are used.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import torch

from autopar.analysis.fusion import external_bytes, fused_saved, fusion_groups
from autopar.analysis.graph import ATTENTION_OPS, GraphAnalysis, attention_head_dim, attention_keys
from autopar.capture.joint import TrainingGraph
from autopar.errors import InputError
from autopar.strategies.tp_recipe import REPLICATED, TPRecipe, find_tp_recipe
from cost.stages import effective_layers
from cost.step_facts import EventTable, NodeTable, ParamTable, SavedTable, StepFacts
from passes.expert_parallel_stacked import StackedExpertError, StackedExperts, stacked_experts
from passes.fp8 import cast_shares, weight_matmuls
from passes.kv_expansion import kv_group
from passes.pipeline_split import weight_half_reads
from passes.recompute import heavy_groups, is_backward, values_to_recompute
from passes.token_count import mean_loss_node
from vocab.plan_types import GraphSignature

# the columns of `NodeTable` and `SavedTable` as built here, with their array dtypes
_NODE_DTYPES = {
    "name": str, "flops": float, "vflops": float, "bytes_act": float, "bytes_const": float,
    "batch_dep": bool, "tp_div": bool, "sp_div": bool, "is_matmul": bool,
    "fp8_act_bytes": float, "fp8_const_bytes": float, "fp8_weight": str, "fp8_wgrad": bool,
    "forward": bool, "launch": bool,
    "hides_gather": bool, "hides_reduce": bool, "layer": int, "is_attention": bool,
    "attention_kv_bytes": float, "attention_kv_heads_bytes": float, "attention_seq": int, "attention_head_dim": int,
    "rerun_selective": bool, "rerun_full": bool,
    "ep_rows": bool, "routed": bool,
}
_SAVED_DTYPES = {"name": str, "bytes": float, "batch_dep": bool, "tp_div": bool, "sp_div": bool, "ep_rows": bool,
                 "layer": int, "heavy": bool, "kept_none": bool, "kept_selective": bool,
                 "kept_full": bool, "rebuilt_selective": int, "rebuilt_full": int}
_RECOMPUTE_MODES = ("selective", "full")
_NOT_REBUILT = (-1, -1)  # the span of a storage no copy rebuilds


@dataclass(frozen=True)
class GraphParts:
    """What the facts read off a captured graph whatever the TP roles: built once per graph
    and fusion setting, shared by the facts of every TP recipe (Megatron's, each ILP's)."""

    nodes: list  # the graph's nodes, in order
    groups: dict  # fusion groups (`autopar.analysis.fusion.fusion_groups`; empty unfused)
    ext_inputs: dict  # node -> the inputs its kernel reads from memory
    leaves: dict  # node -> whether its kernel writes its output to memory
    saved_values: dict  # storage -> bytes autograd saves without recompute
    batch: int
    seq: int
    n_layers: int
    layer_eff: dict  # node -> effective block index (`cost.stages.effective_layers`)
    fp8_roles: dict  # matmul -> (weight, role): the FP8 candidates
    fp8_shares: dict  # matmul -> operand -> the share of its cast it pays
    expert_prefixes: tuple[str, ...]
    marks: dict  # recompute set -> `_Marks`
    group_names: dict  # heavy group -> its nodes
    params: dict  # parameter name -> placeholder node
    consumers: dict  # parameter name -> the blocks that read it
    zb_stash: np.ndarray
    counts_tokens: bool


def graph_parts(graph: TrainingGraph, analysis: GraphAnalysis, fused: bool = True) -> GraphParts:
    """`GraphParts` of a captured step (the recompute marks are the costly part)."""
    groups = fusion_groups(graph, analysis) if fused else {}
    ext_inputs, leaves = external_bytes(graph, analysis, groups)
    nodes = list(graph.gm.graph.nodes)
    input_names = {i.node for i in graph.inputs if i.kind == "input"}
    batch, seq = _batch_and_seq([n for n in nodes if n.name in input_names])
    n_layers = analysis.blocks.count if analysis.blocks else 0
    layer_eff = _effective_layers(nodes, analysis, n_layers)
    fp8_roles, fp8_shares = _fp8_roles(graph)
    # what the recompute pass keeps and rebuilds per mode (`_recompute_marks`)
    weight_of = {name: w for name, (w, role) in fp8_roles.items() if role == "forward"}
    marks, group_names = _recompute_marks(graph, analysis, weight_of)
    params = {i.name: i.node for i in graph.inputs if i.kind == "param"}
    loss_index = next(o.index for o in graph.outputs if o.kind == "loss")
    return GraphParts(
        nodes=nodes, groups=groups, ext_inputs=ext_inputs, leaves=leaves,
        saved_values=fused_saved(graph, analysis, groups) if fused else analysis.saved,
        batch=batch, seq=seq, n_layers=n_layers, layer_eff=layer_eff,
        fp8_roles=fp8_roles, fp8_shares=fp8_shares, expert_prefixes=_expert_modules(graph),
        marks=marks, group_names=group_names, params=params,
        consumers=_param_layers(graph, params, layer_eff, analysis),
        zb_stash=_zb_stash(graph, analysis, layer_eff, n_layers),
        counts_tokens=mean_loss_node(graph.gm, loss_index) is not None,
    )


def build_step_facts(graph: TrainingGraph, analysis: GraphAnalysis, config=None, fused: bool = True,
                     roles: dict[str, str] | None = None, parts: GraphParts | None = None,
                     recipe: TPRecipe | None = None) -> StepFacts:
    """The cost facts of a captured step (`cost.step_facts.StepFacts`), once per graph and TP recipe.

    config: a zoo ModelConfig (optional) supplies head counts. fused: price element-wise chains
    as fused kernels and save what a fused step saves (torch.compile, nanotron's kernels); False
    prices eager PyTorch, one kernel per op. roles: tensor-parallel roles of some weights (from
    `tp_ilp`); Megatron's otherwise. parts: the graph's `GraphParts` (built with the same
    ``fused``) when the caller keeps them; recipe: `find_tp_recipe` of ``roles``, when kept.
    """
    parts = parts if parts is not None else graph_parts(graph, analysis, fused)
    tp = recipe if recipe is not None else find_tp_recipe(graph, analysis, roles)
    arrays = _node_arrays(analysis, parts, tp)
    expert_io = _expert_io(analysis, parts, tp.batch_dependent)
    stacked, expert_gather, routed = _stacked_experts(graph, parts)
    # the nodes whose copies the recompute pass runs in the backward, per mode and heavy group
    marks, keys = parts.marks, list(parts.group_names)
    for mode in _RECOMPUTE_MODES:
        arrays[f"rerun_{mode}"] = [name in marks[mode].copied for name in arrays["name"]]
    rerun_groups = [[name in marks[g].copied for g in keys] for name in arrays["name"]]
    saved, kept_groups, rebuilt_groups = _saved_rows(analysis, parts, tp, routed.saved)
    arrays["ep_rows"] = [name in routed.rows and name not in routed.grouped for name in arrays["name"]]
    arrays["routed"] = [name in routed.grouped for name in arrays["name"]]
    rows = len(saved["name"])
    return StepFacts(
        batch=parts.batch,
        seq=parts.seq,
        n_layers=parts.n_layers,
        heads=getattr(config, "n_heads", None),
        kv_heads=getattr(config, "n_kv_heads", None),
        n_experts=(getattr(config, "n_experts", 0) or _expert_count(graph, parts.expert_prefixes)
                   or max(stacked.values(), default=0)),
        total_flops=analysis.forward_flops + analysis.backward_flops,
        nodes=NodeTable(**{k: np.array(v, dtype=_NODE_DTYPES[k]) for k, v in arrays.items()},
                        rerun_groups=np.array(rerun_groups, dtype=bool).reshape(len(rerun_groups), len(keys))),
        saved=SavedTable(**{k: np.array(v, dtype=_SAVED_DTYPES[k]) for k, v in saved.items()},
                         kept_groups=np.array(kept_groups, dtype=bool).reshape(rows, len(keys)),
                         rebuilt_groups=np.array(rebuilt_groups, dtype=int).reshape(rows, len(keys), 2)),
        recompute_groups=tuple(keys),
        events=_event_table(tp, parts.layer_eff),
        params=_param_table(graph, parts, tp, set(stacked)),
        block_input_bytes=_block_input_bytes(graph, analysis, tp.batch_dependent),
        expert_io_bytes=expert_io,
        expert_gather_bytes=expert_gather,
        expert_routed_rows=float(routed.routed),
        tp_fallbacks=sorted(tp.fallback_ops),
        zb_stash_bytes=parts.zb_stash.copy(),
        counts_tokens=parts.counts_tokens,
    )


def _node_arrays(analysis: GraphAnalysis, parts: GraphParts, tp: TPRecipe) -> dict[str, list]:
    """The columns of `NodeTable` (but the recompute ones) of every kernel-launching node."""
    bd, ext_inputs = tp.batch_dependent, parts.ext_inputs
    arrays: dict[str, list] = {k: [] for k in _NODE_DTYPES}
    for node in parts.nodes:
        if node.op != "call_function":
            continue
        info = analysis.nodes[node.name]
        if info.is_view:
            continue  # views launch no kernel and move no bytes
        state = tp.state.get(node.name, "R")
        act_in = sum(analysis.nodes[i.name].nbytes for i in ext_inputs[node.name] if bd.get(i.name))
        const_in = sum(analysis.nodes[i.name].nbytes for i in ext_inputs[node.name] if not bd.get(i.name))
        out_bd = bd.get(node.name, False)
        written = info.bytes_written if parts.leaves[node.name] else 0
        tp_div = state == "S" or node.name in tp.sharded_matmul
        is_attn = any(k in str(node.target) for k in ATTENTION_OPS) and info.phase == "forward"
        kv = kv_heads = 0
        if is_attn:
            kv_args = [a for a in node.args[1:3] if isinstance(a, torch.fx.Node)]
            kv = sum(analysis.nodes[a.name].nbytes for a in kv_args)
            kv_heads = _kv_heads_bytes(kv_args, analysis)
        kv_len = attention_keys(node)  # the backward's too: it runs at the attention's rate
        fp8_weight, fp8_role = parts.fp8_roles.get(node.name, ("", ""))
        fp8_act = fp8_const = 0
        if fp8_weight:  # the casts it pays: a cast shared with other matmuls, its share
            share = parts.fp8_shares.get(node.name, {})
            fp8_act = sum(analysis.nodes[i.name].nbytes * share.get(i.name, 1.0)
                          for i in ext_inputs[node.name] if bd.get(i.name))
            fp8_const = sum(analysis.nodes[i.name].nbytes * share.get(i.name, 1.0)
                            for i in ext_inputs[node.name] if not bd.get(i.name))
        arrays["name"].append(node.name)
        arrays["flops"].append(info.executed_flops)
        arrays["vflops"].append(info.vector_flops)
        arrays["bytes_act"].append(act_in + (written if out_bd else 0))
        arrays["bytes_const"].append(const_in + (0 if out_bd else written))
        arrays["launch"].append(parts.groups.get(node.name, node.name) == node.name)
        arrays["hides_gather"].append(node.name in tp.column_matmul)
        arrays["hides_reduce"].append(node.name in tp.weight_grad_matmul)
        arrays["batch_dep"].append(out_bd or act_in > 0)
        arrays["tp_div"].append(tp_div)
        arrays["sp_div"].append(state == "R" and out_bd and not tp_div)
        arrays["is_matmul"].append(info.is_matmul or info.flops > 0)
        arrays["fp8_act_bytes"].append(fp8_act)
        arrays["fp8_const_bytes"].append(fp8_const)
        arrays["fp8_weight"].append(fp8_weight)
        arrays["fp8_wgrad"].append(fp8_role == "weight_grad")
        arrays["forward"].append(info.phase == "forward")
        arrays["layer"].append(parts.layer_eff[node.name])
        arrays["is_attention"].append(is_attn)
        arrays["attention_kv_bytes"].append(kv)
        arrays["attention_kv_heads_bytes"].append(kv_heads)
        arrays["attention_seq"].append(kv_len)
        arrays["attention_head_dim"].append(attention_head_dim(node) if kv_len else 0)
    return arrays


def _kv_heads_bytes(kv_args: list, analysis: GraphAnalysis) -> int:
    """Bytes of an attention's K and V as the ring sends them: their kv heads where both are
    one grouped-query expansion (`passes.kv_expansion.kv_group`), else the values' own."""
    found = kv_group(*kv_args) if len(kv_args) == 2 else None
    nodes = found[:2] if found is not None and all(n.name in analysis.nodes for n in found[:2]) else kv_args
    return sum(analysis.nodes[n.name].nbytes for n in nodes)


def _expert_io(analysis: GraphAnalysis, parts: GraphParts, bd: dict) -> np.ndarray:
    """Bytes per slot of the activations crossing into or out of expert modules: the EP
    all-to-all volume (a value sent once, however many read it)."""
    expert_io = np.zeros(max(parts.n_layers, 1) + 2)
    prefixes = parts.expert_prefixes
    crossed: set[tuple[torch.fx.Node, bool]] = set()
    for node in parts.nodes if prefixes else ():
        if node.op != "call_function":
            continue
        info = analysis.nodes[node.name]
        if info.is_view or info.phase != "forward" or not bd.get(node.name, False):
            continue
        mine = _under(info.module, prefixes)
        for i in node.all_input_nodes:
            source = _source(node, i, analysis)
            other = _under(analysis.nodes[source.name].module, prefixes)
            if bd.get(i.name) and mine != other and analysis.nodes[i.name].phase == "forward" and \
                    (source, mine) not in crossed:
                crossed.add((source, mine))
                expert_io[parts.layer_eff[node.name] + 1] += analysis.nodes[i.name].nbytes
    _grouped_expert_io(parts.nodes, analysis, parts.layer_eff, expert_io)
    return expert_io


def _saved_rows(analysis: GraphAnalysis, parts: GraphParts, tp: TPRecipe, ep_rows: set[str]
                ) -> tuple[dict[str, list], list, list]:
    """The columns of `SavedTable`: the rows are the values saved without recompute, then the
    values only a recompute mode keeps (the roots of its chains) or rebuilds (its working set
    in the backward); each heavy group adds the columns of "selective" + that group.
    ``ep_rows``: values holding the ep group's rows under ep (stacked experts)."""
    bd, marks, keys = tp.batch_dependent, parts.marks, list(parts.group_names)
    rows = dict(parts.saved_values)
    for mark in marks.values():
        for name in (*mark.kept, *mark.rebuilt):
            rows.setdefault(name, analysis.nodes[name].nbytes)
    saved: dict[str, list] = {k: [] for k in _SAVED_DTYPES}
    kept_groups, rebuilt_groups = [], []
    for name, nbytes in rows.items():
        info = analysis.nodes[name]
        saved["kept_none"].append(name in parts.saved_values)
        for mode in _RECOMPUTE_MODES:
            saved[f"kept_{mode}"].append(name in marks[mode].kept)
            saved[f"rebuilt_{mode}"].append(marks[mode].rebuilt.get(name, _NOT_REBUILT))
        kept_groups.append([name in marks[g].kept for g in keys])
        rebuilt_groups.append([marks[g].rebuilt.get(name, _NOT_REBUILT) for g in keys])
        state = tp.state.get(name, "R")
        node_bd = bd.get(name, False)
        saved["name"].append(name)
        saved["bytes"].append(nbytes)
        saved["batch_dep"].append(node_bd)
        saved["tp_div"].append(state == "S")
        # a saved partial sum is stored after its reduction: replicated, or sequence-sharded
        saved["sp_div"].append(state in ("R", "P") and node_bd)
        saved["ep_rows"].append(name in ep_rows)
        saved["layer"].append(parts.layer_eff.get(name, -1))
        saved["heavy"].append(info.flops > 0 or info.is_matmul)
    return saved, kept_groups, rebuilt_groups


def _event_table(tp: TPRecipe, layer_eff: dict[str, int]) -> EventTable:
    """The TP collectives the recipe implies, as `EventTable` columns."""
    events = tp.events
    return EventTable(
        node=np.array([e.node for e in events], dtype=str),
        bytes=np.array([e.nbytes for e in events], dtype=float),
        batch_dep=np.array([e.batch_dependent for e in events], dtype=bool),
        reduce=np.array([e.kind == "reduce" for e in events], dtype=bool),
        layer=np.array([layer_eff.get(e.node, -1) for e in events], dtype=int),
        forward=np.array([e.forward for e in events], dtype=bool),
        always=np.array([e.always for e in events], dtype=bool),
    )


def _param_table(graph: TrainingGraph, parts: GraphParts, tp: TPRecipe, stacked: set[str]) -> ParamTable:
    """The parameters: sizes, TP roles and shard dims under ``tp``, experts (``stacked``: those
    stacking every expert in one parameter), where read."""
    params = parts.params
    return ParamTable(
        numel={n: math.prod(graph.param_shapes[n]) for n in params},
        tp_sharded={n: tp.roles.get(n, REPLICATED) != REPLICATED for n in params},
        expert={n: _under(n, parts.expert_prefixes) or n in stacked for n in params},
        stages_layer={n: list(v) for n, v in parts.consumers.items()},
        dtype_bytes={n: torch.empty((), dtype=graph.param_dtypes[n]).element_size() for n in params},
        tp_role=dict(tp.roles),
        tp_dim={n: tp.param_shard_dim(n) for n in params},
        shape={n: tuple(graph.param_shapes[n]) for n in params},
        tp_parts=dict(getattr(tp, "fused_parts", {})),
    )


def _zb_stash(graph: TrainingGraph, analysis: GraphAnalysis, layer_eff: dict[str, int],
              n_layers: int) -> np.ndarray:
    """Zero-bubble's stash per slot (-1 .. L), whole batch: bytes of the values its input halves
    keep for its weight halves (the runtime's own rule, `weight_half_reads`)."""
    out = np.zeros(max(n_layers, 1) + 2)
    for name in weight_half_reads(graph.gm, layer_eff):
        out[min(max(layer_eff.get(name, -1), -1), n_layers) + 1] += analysis.nodes[name].nbytes
    return out


def _batch_and_seq(user_inputs) -> tuple[int, int]:
    """The batch is dim 0 of the first user input, the sequence dim 1 (1 if absent)."""
    if not user_inputs:
        raise InputError("the captured step has no user inputs: nothing to split over data-parallel ranks")
    shape = tuple(user_inputs[0].meta["val"].shape)
    if not shape:
        raise InputError("the first example input is a scalar: it needs a batch dimension (dim 0)")
    return int(shape[0]), int(shape[1]) if len(shape) > 1 else 1


def _effective_layers(nodes, analysis: GraphAnalysis, n_layers: int) -> dict[str, int]:
    """Block index of every node by `cost.stages.effective_layers` (the pipeline split's rule)."""
    infos = (analysis.nodes[node.name] for node in nodes)
    return effective_layers(((i.name, i.phase == "backward", i.layer) for i in infos), n_layers)


def _expert_modules(graph: TrainingGraph) -> tuple[str, ...]:
    """Module prefixes of experts: a list of identical modules inside a repeated block
    (``layers.3.mlp.experts.5``), found from parameter names with two indices."""
    prefixes = set()
    for name in graph.param_shapes:
        match = re.match(r"^(.*?\.\d+\..*?\.)\d+\.", name)
        if match:
            prefixes.add(match.group(1))
    return tuple(sorted(prefixes))


def _source(node: torch.fx.Node, value: torch.fx.Node, analysis: GraphAnalysis) -> torch.fx.Node:
    """Where ``value``, read by ``node``, comes from for the experts' all-to-all: through views
    where either side is grouped experts' work (`autopar.capture.experts`: the grouped
    computation's first and last ops are views of what enters and leaves the experts)."""
    source = value
    while source.op == "call_function" and analysis.nodes[source.name].is_view and source.all_input_nodes:
        source = source.all_input_nodes[0]
    grouped = "expert_group" in node.meta or "expert_group" in source.meta
    return source if grouped and source.op == "call_function" else value


def _under(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module.startswith(p) for p in prefixes)


def _param_layers(graph, params, layer_eff, analysis) -> dict[str, list[int]]:
    """The blocks (effective layers) whose forward nodes read each parameter."""
    users: dict[str, set[int]] = {n: set() for n in params}
    by_node = {node: name for name, node in params.items()}
    for node in graph.gm.graph.nodes:
        if node.op == "call_function" and analysis.nodes[node.name].phase == "forward":
            for i in node.all_input_nodes:
                if i.name in by_node:
                    users[by_node[i.name]].add(layer_eff[node.name])
    return {n: sorted(s) or [-1] for n, s in users.items()}


def _block_input_bytes(graph, analysis: GraphAnalysis, bd) -> float:
    """Bytes of the activation entering one block (the residual stream), whole batch."""
    blocks = analysis.blocks
    if not blocks or not blocks.nodes:
        return 0.0
    first = blocks.nodes[min(blocks.nodes)]
    members = set(first)
    roots = set()
    by_name = {n.name: n for n in graph.gm.graph.nodes}
    for name in first:
        node = by_name[name]
        if analysis.nodes[name].phase != "forward":
            continue
        for i in node.all_input_nodes:
            if i.name not in members and bd.get(i.name) and analysis.nodes[i.name].phase == "forward":
                roots.add(analysis.nodes[i.name].storage)
    return float(sum(analysis.nodes[r].nbytes for r in roots))


@dataclass(frozen=True)
class _Marks:
    """What `passes.recompute.apply_recompute` does with one recompute set, read off the graph."""

    kept: set[str]  # storages held from the forward to the backward
    # storages the backward's copies rebuild -> (made, dead): the backward positions where the
    # first copy is made and after which the last dies
    rebuilt: dict[str, tuple[int, int]]
    copied: set[str]  # nodes copied into the backward (what the recompute costs in time)


def _recompute_marks(graph: TrainingGraph, analysis: GraphAnalysis, weight_of: dict[str, str]
                     ) -> tuple[dict[str, _Marks], dict[str, list[str]]]:
    """`_Marks` of "selective", "full" and, per heavy group g (`passes.recompute.heavy_groups`),
    of "selective" + g; and the nodes of each group. The pass's rule:

    - kept: the forward values the backward still reads (those not recomputed, and the roots
      every recompute chain starts from), held from the forward to the backward;
    - rebuilt: the life of each storage the backward's copies rebuild. A copy is made right
      before the first backward node that needs it (the pass's rule: its own first backward
      reader, or the first copy built from it) and dies after its last reader (a backward
      node, or a copy built from it); `cost.terms.recompute` sweeps these spans for the peak.

    One walk per recompute set, linear in the graph."""
    layers = {name: info.layer for name, info in analysis.nodes.items()}
    modules = {name: info.module for name, info in analysis.nodes.items()}
    groups: dict[str, list[str]] = {}
    for name, key in heavy_groups(graph.gm, layers, modules, weight_of).items():
        groups.setdefault(key, []).append(name)
    sets = {"selective": values_to_recompute(graph.gm, layers, "selective"),
            "full": values_to_recompute(graph.gm, layers, "full")}
    for key, names in groups.items():
        sets[key] = values_to_recompute(graph.gm, layers, "selective", also=names)
    return recompute_marks(graph, analysis, sets), groups


def recompute_marks(graph: TrainingGraph, analysis: GraphAnalysis,
                    sets: dict[str, frozenset[str]]) -> dict[str, _Marks]:
    """`_Marks` of each recompute set (`passes.recompute.values_to_recompute`'s answer), by
    the rule `_recompute_marks` states."""
    nodes = list(graph.gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    infos = analysis.nodes
    # each value the backward reads, once (the walks below are reachability: order-free)
    backward_reads = list(dict.fromkeys(a for n in nodes if is_backward(n) for a in n.all_input_nodes))
    storages: dict[str, str | None] = {}

    def forward_storage(node) -> str | None:
        if node.name not in storages:
            storage = infos[node.name].storage
            ok = node.op != "placeholder" and not is_backward(node) and infos[storage].phase == "forward"
            storages[node.name] = storage if ok else None  # a view of a weight lives in an input
        return storages[node.name]

    def marks(recompute: frozenset[str]) -> _Marks:
        kept: set[str] = set()
        copied: dict[str, object] = {}
        # the backward's reads, then the producer chains its copies rebuild
        stack = list(backward_reads)
        while stack:
            arg = stack.pop()
            if arg.name not in recompute:
                if (storage := forward_storage(arg)) is not None:
                    kept.add(storage)
            elif arg.name not in copied:
                copied[arg.name] = arg
                stack.extend(arg.all_input_nodes)
        # each copy's life in backward positions: made at `first`, dead after `last`
        first: dict[str, int] = {}
        span: dict[str, list[int]] = {}  # storage -> [made, dead]
        for name in sorted(copied, key=position.get, reverse=True):  # readers before producers
            value = copied[name]
            readers = [position[u.name] for u in value.users if is_backward(u) and "recomputes" not in u.meta]
            readers += [first[u.name] for u in value.users if u.name in first]
            first[name] = min(readers)
            storage = forward_storage(value)
            if storage is not None and storage in recompute:
                made, dead = span.setdefault(storage, [first[name], max(readers)])
                span[storage] = [min(made, first[name]), max(dead, max(readers))]
        return _Marks(kept, {k: (v[0], v[1]) for k, v in span.items()}, set(copied))

    return {key: marks(recompute) for key, recompute in sets.items()}


def _fp8_roles(graph: TrainingGraph) -> tuple[dict[str, tuple[str, str]], dict[str, dict[str, float]]]:
    """matmul node -> (its weight, "forward" | "input_grad" | "weight_grad"): the FP8
    candidates exactly as passes/fp8.py rewrites them; and the share of each operand's cast
    each pays (`passes.fp8.cast_shares`)."""
    holders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    signature = GraphSignature(inputs=[(i.kind, i.name) for i in graph.inputs], placeholders=holders,
                               grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
                               loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))
    out: dict[str, tuple[str, str]] = {}
    found = weight_matmuls(graph.gm, signature)
    for weight, mms in found.items():
        for role in ("forward", "input_grad", "weight_grad"):
            out.update({name: (weight, role) for name in getattr(mms, role)})
    return out, cast_shares(graph.gm, found)


def _grouped_expert_io(nodes, analysis: GraphAnalysis, layer_eff: dict[str, int], expert_io: np.ndarray) -> None:
    """In place: a block's all-to-all volume where its experts are grouped (the graph expert
    parallelism runs, `passes.expert_parallel`) is what that pass sends, the stacked inputs and
    results (their gradients again in the backward: `cost.terms.expert_parallel`)."""
    slots: dict[str, int] = {}  # list -> its block's slot (where its forward result is)
    sent: dict[str, float] = {}
    for node in nodes:
        roles = node.meta.get("expert_result", ())
        if "y" in roles or "dx" in roles:
            path = node.meta["expert_group"][0]
            sent[path] = sent.get(path, 0.0) + analysis.nodes[node.name].nbytes
            if "y" in roles:
                slots[path] = layer_eff[node.name] + 1
    for slot in set(slots.values()):
        expert_io[slot] = sum(sent[p] for p, s in slots.items() if s == slot)


def _stacked_experts(graph: TrainingGraph, parts: GraphParts) -> tuple[dict[str, int], np.ndarray, StackedExperts]:
    """Parameters stacking E experts (name -> E); per slot, the bytes the stacked experts'
    dispatch gathers and their combine reduce-scatters; what runs on the ep group's rows
    (`passes.expert_parallel_stacked.StackedExperts`). None where the experts are not in the
    form that pass runs (ep is then refused)."""
    gather = np.zeros(max(parts.n_layers, 1) + 2)
    try:
        found = stacked_experts(graph.gm)
    except StackedExpertError:
        return {}, gather, StackedExperts()
    names = {i.node: i.name for i in graph.inputs if i.kind == "param"}
    stacked = {names[node]: e for node, e in found.params.items() if node in names}
    for y, nbytes in found.io:
        gather[parts.layer_eff[y] + 1] += nbytes
    return stacked, gather, found


def _expert_count(graph: TrainingGraph, prefixes: tuple[str, ...]) -> int:
    """Experts per list of a model without a config saying so: E of its grouped lists, else
    the most indices under one expert prefix (`_expert_modules`)."""
    grouped = [n.meta["expert_group"][1] for n in graph.gm.graph.nodes if "expert_group" in n.meta]
    if grouped:
        return max(grouped)
    indices: dict[str, set[str]] = {}
    for name in graph.param_shapes:
        for prefix in prefixes:
            if name.startswith(prefix):
                indices.setdefault(prefix, set()).add(name[len(prefix):].split(".", 1)[0])
    return max((len(v) for v in indices.values()), default=0)
