"""The cost facts of a captured step: what `cost.step.predict` prices, read off the graph.

For every node its FLOPs and the bytes it touches, split into the batch-dependent part
(activations) and the rest (weights), its TP state from `tp_recipe` (sharded t ways,
sequence-shardable, or replicated), its repeated block; the forward values saved for the
backward; the TP collectives the recipe implies; the parameters and where they are used.
"""

from __future__ import annotations

import math
import re

import numpy as np
import torch

from autopar.analysis.fusion import external_bytes, fused_saved, fusion_groups
from autopar.analysis.graph import GraphAnalysis
from autopar.capture.joint import TrainingGraph
from autopar.errors import InputError
from autopar.strategies.tp_recipe import REPLICATED, find_tp_recipe
from cost.plan_types import GraphSignature
from cost.step_facts import EventTable, NodeTable, ParamTable, SavedTable, StepFacts
from passes.fp8 import cast_shares, weight_matmuls
from passes.recompute import is_backward, values_to_recompute

_ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention")
# the columns of `NodeTable` and `SavedTable` as built here, with their array dtypes
_NODE_DTYPES = {
    "name": str, "flops": float, "vflops": float, "bytes_act": float, "bytes_const": float,
    "batch_dep": bool, "tp_div": bool, "sp_div": bool, "is_matmul": bool,
    "fp8_act_bytes": float, "fp8_const_bytes": float, "fp8_weight": str, "fp8_wgrad": bool,
    "forward": bool, "launch": bool,
    "hides_gather": bool, "hides_reduce": bool, "layer": int, "is_attention": bool,
    "attention_kv_bytes": float, "rerun_selective": bool, "rerun_full": bool,
}
_SAVED_DTYPES = {"bytes": float, "batch_dep": bool, "tp_div": bool, "sp_div": bool,
                 "layer": int, "heavy": bool, "kept_none": bool, "kept_selective": bool,
                 "kept_full": bool, "rebuilt_selective": bool, "rebuilt_full": bool}
_RECOMPUTE_MODES = ("selective", "full")


def build_step_facts(graph: TrainingGraph, analysis: GraphAnalysis, config=None, fused: bool = True,
                     roles: dict[str, str] | None = None) -> StepFacts:
    """The cost facts of a captured step (`cost.step_facts.StepFacts`), once per graph and TP recipe.

    config: a zoo ModelConfig (optional) supplies head counts. fused: price element-wise chains
    as fused kernels and save what a fused step saves (torch.compile, nanotron's kernels); False
    prices eager PyTorch, one kernel per op. roles: tensor-parallel roles of some weights (from
    `tp_ilp`); Megatron's otherwise.
    """
    tp = find_tp_recipe(graph, analysis, roles)
    groups = fusion_groups(graph, analysis) if fused else {}
    ext_inputs, leaves = external_bytes(graph, analysis, groups)
    saved_values = fused_saved(graph, analysis, groups) if fused else analysis.saved
    nodes = [n for n in graph.gm.graph.nodes]
    user_inputs = [n for n in nodes if any(i.node == n.name and i.kind == "input" for i in graph.inputs)]
    batch, seq = _batch_and_seq(user_inputs)
    blocks = analysis.blocks
    n_layers = blocks.count if blocks else 0
    layer_eff = _effective_layers(nodes, analysis, n_layers)
    fp8_roles, fp8_shares = _fp8_roles(graph)
    bd = tp.batch_dependent
    expert_prefixes = _expert_modules(graph)

    arrays: dict[str, list] = {k: [] for k in _NODE_DTYPES}
    expert_io = np.zeros(max(n_layers, 1) + 2)
    for node in nodes:
        if node.op != "call_function":
            continue
        info = analysis.nodes[node.name]
        if info.is_view:
            continue  # views launch no kernel and move no bytes
        state = tp.state.get(node.name, "R")
        act_in = sum(analysis.nodes[i.name].nbytes for i in ext_inputs[node.name] if bd.get(i.name))
        const_in = sum(analysis.nodes[i.name].nbytes for i in ext_inputs[node.name] if not bd.get(i.name))
        out_bd = bd.get(node.name, False)
        written = info.bytes_written if leaves[node.name] else 0
        tp_div = state == "S" or node.name in tp.sharded_matmul
        is_attn = any(k in str(node.target) for k in _ATTENTION) and info.phase == "forward"
        kv = 0
        if is_attn:
            kv = sum(analysis.nodes[a.name].nbytes for a in node.args[1:3] if isinstance(a, torch.fx.Node))
        fp8_weight, fp8_role = fp8_roles.get(node.name, ("", ""))
        param_mm = bool(fp8_weight)
        if param_mm:  # the casts it pays: a cast shared with other matmuls, its share
            share = fp8_shares.get(node.name, {})
            fp8_act = sum(analysis.nodes[i.name].nbytes * share.get(i.name, 1.0)
                          for i in ext_inputs[node.name] if bd.get(i.name))
            fp8_const = sum(analysis.nodes[i.name].nbytes * share.get(i.name, 1.0)
                            for i in ext_inputs[node.name] if not bd.get(i.name))
        arrays["name"].append(node.name)
        arrays["flops"].append(info.executed_flops)
        arrays["vflops"].append(info.vector_flops)
        arrays["bytes_act"].append(act_in + (written if out_bd else 0))
        arrays["bytes_const"].append(const_in + (0 if out_bd else written))
        arrays["launch"].append(groups.get(node.name, node.name) == node.name)
        arrays["hides_gather"].append(node.name in tp.column_matmul)
        arrays["hides_reduce"].append(node.name in tp.weight_grad_matmul)
        arrays["batch_dep"].append(out_bd or act_in > 0)
        arrays["tp_div"].append(tp_div)
        arrays["sp_div"].append(state == "R" and out_bd and not tp_div)
        arrays["is_matmul"].append(info.is_matmul or info.flops > 0)
        arrays["fp8_act_bytes"].append(fp8_act if param_mm else 0)
        arrays["fp8_const_bytes"].append(fp8_const if param_mm else 0)
        arrays["fp8_weight"].append(fp8_weight)
        arrays["fp8_wgrad"].append(fp8_role == "weight_grad")
        arrays["forward"].append(info.phase == "forward")
        arrays["layer"].append(layer_eff[node.name])
        arrays["is_attention"].append(is_attn)
        arrays["attention_kv_bytes"].append(kv)
        # activations crossing into or out of expert modules: the EP all-to-all volume
        if expert_prefixes and info.phase == "forward" and out_bd:
            mine = _under(info.module, expert_prefixes)
            for i in node.all_input_nodes:
                other = _under(analysis.nodes[i.name].module, expert_prefixes)
                if bd.get(i.name) and mine != other and analysis.nodes[i.name].phase == "forward":
                    expert_io[layer_eff[node.name] + 1] += analysis.nodes[i.name].nbytes

    # what the recompute pass keeps and rebuilds per mode (`_recompute_marks`): the rows of the
    # saved table are the values saved without recompute, then the values only a mode keeps
    # (the roots of its recompute chains) or rebuilds (its working set in the backward)
    marks, reruns = _recompute_marks(graph, analysis)
    for mode in _RECOMPUTE_MODES:  # the nodes whose copies the pass runs in the backward
        arrays[f"rerun_{mode}"] = [name in reruns[mode] for name in arrays["name"]]
    rows = dict(saved_values)
    for mode in _RECOMPUTE_MODES:
        for name in (*marks[mode][0], *marks[mode][1]):
            rows.setdefault(name, analysis.nodes[name].nbytes)
    saved: dict[str, list] = {k: [] for k in _SAVED_DTYPES}
    for name, nbytes in rows.items():
        info = analysis.nodes[name]
        saved["kept_none"].append(name in saved_values)
        for mode in _RECOMPUTE_MODES:
            kept, rebuilt = marks[mode]
            saved[f"kept_{mode}"].append(name in kept)
            saved[f"rebuilt_{mode}"].append(name in rebuilt)
        state = tp.state.get(name, "R")
        node_bd = bd.get(name, False)
        saved["bytes"].append(nbytes)
        saved["batch_dep"].append(node_bd)
        saved["tp_div"].append(state == "S")
        # a saved partial sum is stored after its reduction: replicated, or sequence-sharded
        saved["sp_div"].append(state in ("R", "P") and node_bd)
        saved["layer"].append(layer_eff.get(name, -1))
        saved["heavy"].append(info.flops > 0 or info.is_matmul)

    events = tp.events
    params = {i.name: i.node for i in graph.inputs if i.kind == "param"}
    consumers = _param_layers(graph, params, layer_eff, analysis)
    facts = StepFacts(
        batch=batch,
        seq=seq,
        n_layers=n_layers,
        heads=getattr(config, "n_heads", None),
        kv_heads=getattr(config, "n_kv_heads", None),
        n_experts=getattr(config, "n_experts", 0) or 0,
        total_flops=analysis.forward_flops + analysis.backward_flops,
        nodes=NodeTable(**{k: np.array(v, dtype=_NODE_DTYPES[k]) for k, v in arrays.items()}),
        saved=SavedTable(**{k: np.array(v, dtype=_SAVED_DTYPES[k]) for k, v in saved.items()}),
        events=EventTable(
            node=np.array([e.node for e in events], dtype=str),
            bytes=np.array([e.nbytes for e in events], dtype=float),
            batch_dep=np.array([e.batch_dependent for e in events], dtype=bool),
            reduce=np.array([e.kind == "reduce" for e in events], dtype=bool),
            layer=np.array([layer_eff.get(e.node, -1) for e in events], dtype=int),
            forward=np.array([e.forward for e in events], dtype=bool),
            always=np.array([e.always for e in events], dtype=bool),
        ),
        params=ParamTable(
            numel={n: math.prod(graph.param_shapes[n]) for n in params},
            tp_sharded={n: tp.roles.get(n, REPLICATED) != REPLICATED for n in params},
            expert={n: _under(n, expert_prefixes) for n in params},
            stages_layer=consumers,
            dtype_bytes={n: torch.empty((), dtype=graph.param_dtypes[n]).element_size() for n in params},
            tp_role=dict(tp.roles),
            tp_dim={n: tp.param_shard_dim(n) for n in params},
            shape={n: tuple(graph.param_shapes[n]) for n in params},
            tp_parts=dict(getattr(tp, "fused_parts", {})),
        ),
        block_input_bytes=_block_input_bytes(graph, analysis, bd),
        expert_io_bytes=expert_io,
        tp_fallbacks=sorted(tp.fallback_ops),
    )
    return facts


def _batch_and_seq(user_inputs) -> tuple[int, int]:
    """The batch is dim 0 of the first user input, the sequence dim 1 (1 if absent)."""
    if not user_inputs:
        raise InputError("the captured step has no user inputs: nothing to split over data-parallel ranks")
    shape = tuple(user_inputs[0].meta["val"].shape)
    if not shape:
        raise InputError("the first example input is a scalar: it needs a batch dimension (dim 0)")
    return int(shape[0]), int(shape[1]) if len(shape) > 1 else 1


def _effective_layers(nodes, analysis: GraphAnalysis, n_layers: int) -> dict[str, int]:
    """Block index of every node; nodes outside blocks go to the nearest block in execution
    order: before the first block -1 (stage 0), after the last block n_layers (last stage)."""
    out: dict[str, int] = {}
    fwd_current, bwd_current = -1, n_layers
    for node in nodes:
        info = analysis.nodes[node.name]
        if info.layer is not None:
            out[node.name] = info.layer
            if info.phase == "forward":
                fwd_current = info.layer if info.layer < n_layers - 1 else n_layers
            else:
                bwd_current = info.layer if info.layer > 0 else -1
            continue
        if info.phase == "backward":
            out[node.name] = bwd_current
        else:
            out[node.name] = fwd_current
    return out


def _expert_modules(graph: TrainingGraph) -> tuple[str, ...]:
    """Module prefixes of experts: a list of identical modules inside a repeated block
    (``layers.3.mlp.experts.5``), found from parameter names with two indices."""
    prefixes = set()
    for name in graph.param_shapes:
        match = re.match(r"^(.*?\.\d+\..*?\.)\d+\.", name)
        if match:
            prefixes.add(match.group(1))
    return tuple(sorted(prefixes))


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


def _recompute_marks(graph: TrainingGraph,
                     analysis: GraphAnalysis) -> tuple[dict[str, tuple[set, set]], dict[str, set]]:
    """Per recompute mode, (kept, rebuilt) storages under `passes.recompute.apply_recompute`
    with that mode's `values_to_recompute`, and the nodes it copies into the backward (what the
    recompute costs in time), read off the captured graph by the pass's rule:

    - kept: the forward values the backward still reads (those not recomputed, and the roots
      every recompute chain starts from), held from the forward to the backward;
    - rebuilt: the backward's copies live together at the moment their block's copies peak.
      A copy is made right before the first backward node that needs it (the pass's rule:
      its own first backward reader, or the first copy built from it) and dies after its
      last reader (a backward node, or a copy built from it).

    One walk per mode, linear in the graph."""
    layers = {name: info.layer for name, info in analysis.nodes.items()}
    nodes = list(graph.gm.graph.nodes)
    position = {n.name: i for i, n in enumerate(nodes)}
    infos = analysis.nodes

    def forward_storage(node) -> str | None:
        storage = infos[node.name].storage
        ok = node.op != "placeholder" and not is_backward(node) and infos[storage].phase == "forward"
        return storage if ok else None  # a view of a weight lives in an input: not counted

    out, reruns = {}, {}
    for mode in _RECOMPUTE_MODES:
        recompute = values_to_recompute(graph.gm, layers, mode)
        kept: set[str] = set()
        copied: dict[str, object] = {}
        # the backward's reads, then the producer chains its copies rebuild
        stack = [a for n in nodes if is_backward(n) for a in n.all_input_nodes]
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
        rebuilt: set[str] = set()
        by_block: dict[int | None, list[str]] = {}
        for storage in span:
            by_block.setdefault(layers.get(storage), []).append(storage)
        for members in by_block.values():  # the moment each block's live copies peak
            events = sorted((t, kind, st) for st in members
                            for t, kind in ((span[st][0], 0), (span[st][1] + 1, -1)))
            live, best, now, best_set = set(), 0, 0, set()
            for _, kind, st in events:
                if kind == 0:
                    live.add(st)
                    now += infos[st].nbytes
                    if now > best:
                        best, best_set = now, set(live)
                else:
                    live.discard(st)
                    now -= infos[st].nbytes
            rebuilt |= best_set
        out[mode] = (kept, rebuilt)
        reruns[mode] = set(copied)
    return out, reruns


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
