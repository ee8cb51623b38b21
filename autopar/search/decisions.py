"""Write a layout's decisions as plan data: placements, ZeRO shards, stages, recompute, FP8.

`decide` is where the solver's choice becomes the `vocab.plan_types.PlanDecisions` that the
passes execute, so the Plan shows what runs: a ZeRO-1/2/3 weight is ``Shard(0)`` on "dp" (the
data-parallel pass keeps 1/dp of its rows on each rank), a TP weight its recipe's shard, a
fused q/k/v projection a per-part shard.
"""

from __future__ import annotations

import re

import numpy as np

from autopar.search.choices import choose
from cost import Cluster, Layout
from cost.step import StepFacts, recompute_choices, zero_reduction
from cost.terms.common import comm_overlap
from cost.terms.compute import fp8_candidates, fp8_nodes, slot_chunks, stage_of, virtual_stages
from vocab.plan_types import (
    AxisPlacement,
    CommPlan,
    Fallback,
    ParamPlan,
    PlanDecisions,
    RecomputeChoice,
    fp8_group,
)


def decide(facts: StepFacts, cluster: Cluster, layout: Layout) -> PlanDecisions:
    """The decisions of ``layout`` on this step, as the passes will run them: its own degrees
    and recipes, and the choices it leaves open as the search makes them
    (`autopar.search.choices.choose`)."""
    chosen = choose(facts, cluster, layout)
    params = {name: _param_plan(facts, layout, name) for name in facts.param_numel}
    choices = recompute_choices(facts, cluster, chosen)
    choice = choices[0]
    per_stage = choices if len(set(choices)) > 1 else ()
    return PlanDecisions(
        layout=layout,
        params=params,
        stages=_stages(facts, cluster, chosen),
        recompute=_recomputed(facts, choice, block_choices=[
            choices[s] for s in stage_of(facts, np.arange(facts.n_layers), cluster, chosen)] if per_stage else None),
        recompute_choice=choice,
        recompute_per_stage=per_stage,
        fp8=_fp8_weights(facts, cluster, chosen),
        fp8_high=_fp8_kept_high(facts, cluster, chosen),
        fp8_fused_high=_fp8_fused_high(facts, layout),
        fp8_expert_high=_fp8_expert_high(facts, layout),
        comm=CommPlan(reduce_scatter=zero_reduction(cluster) == "reduce_scatter",
                      reshard_after_forward=layout.reshard,
                      # async TP where the cost model hides the SP gathers (GPUs; CPU ranks
                      # hide nothing: one gather each)
                      sp_gather_chunks=layout.tp if layout.sp and comm_overlap(cluster) > 0 else 1),
        fallbacks=[Fallback(op, "no sharding strategy on its inputs: gathered, run replicated")
                   for op in facts.tp_fallbacks] if layout.tp > 1 else [],
    )


def _param_plan(facts: StepFacts, layout: Layout, name: str) -> ParamPlan:
    shape = facts.param_shape.get(name, ())
    role = facts.tp_roles.get(name, "replicated")
    parts = facts.param_tp_parts.get(name, 1)
    placements: dict[str, AxisPlacement] = {}
    tp_dim = facts.param_tp_dim.get(name) if layout.tp > 1 else None
    tp_place = AxisPlacement.shard(tp_dim, parts) if tp_dim is not None else AxisPlacement.replicate()
    # ZeRO shards dim 0 of the TP-local weight evenly over dp (the data-parallel pass keeps a
    # weight whole where it does not divide); a per-part TP shard is left whole over dp
    # (under cp over the dp x cp ranks: parameters are replicated over cp)
    local0 = shape[0] // layout.tp if shape and tp_dim == 0 else (shape[0] if shape else 0)
    ranks = layout.dp * layout.cp
    zero = (layout.zero >= 1 and ranks > 1 and bool(shape) and local0 % ranks == 0
            and tp_place.split_factor == 1)
    if zero and tp_dim == 0:
        placements["dp"] = AxisPlacement.shard(0, layout.tp)  # the rows of the TP shard
    elif zero:
        placements["dp"] = AxisPlacement.shard(0)
    else:
        placements["dp"] = AxisPlacement.replicate()
    if layout.tp > 1:
        placements["tp"] = tp_place
    return ParamPlan(shape=tuple(shape), placements=placements, tp_role=role, zero_sharded=zero,
                     fused_parts=parts)


def _stages(facts: StepFacts, cluster, layout: Layout) -> list[tuple[int, int]]:
    """Blocks of each pipeline stage, as the search cut them (`autopar.search.choices`);
    under interleaved 1F1B one entry per chunk (virtual stage), chunk c on rank c mod pp."""
    n = max(facts.n_layers, 1)
    of = slot_chunks(facts, cluster, layout)[1:n + 1]
    out = []
    for s in range(layout.pp * virtual_stages(layout)):
        blocks = np.flatnonzero(of == s)
        out.append((int(blocks[0]), int(blocks[-1])) if len(blocks) else (0, -1))
    return out


def _recomputed(facts: StepFacts | None, choice: RecomputeChoice,
                executed: dict[int, list[str]] | None = None,
                block_choices: list[RecomputeChoice] | None = None) -> list[str]:
    """What the backward recomputes, per block: the rule of ``choice`` (every block alike, or
    block i under ``block_choices[i]`` where pipeline stages choose apart), or with
    ``executed`` (block -> the saved values the recompute pass rebuilds, as
    `autopar.parallelize` ran it; ``facts`` unused) the values themselves: the first few names
    of each block and their count."""
    if executed is not None:
        # by op (node names less their numbering), so that alike blocks read alike
        return [f"block {block}: {len(values)} values ("
                + ", ".join(sorted({re.sub(r"_\d+$", "", v) for v in values})) + ")"
                for block, values in sorted(executed.items())]
    if facts is None or not facts.n_layers:
        return []
    out = []
    for i in range(facts.n_layers):
        c = block_choices[i] if block_choices else choice
        if c.mode == "none":
            continue
        if c.mode == "full":
            what = "every forward value but the block's input"
        elif c.outputs:
            what = ("element-wise forward values and the outputs of " + ", ".join(c.outputs)
                    + " (other matmul and attention outputs kept)")
        else:
            what = "element-wise forward values (matmul and attention outputs kept)"
        out.append(f"block {i}: {what}")
    return out


def _fp8_weights(facts: StepFacts, cluster: Cluster, layout: Layout) -> list[str]:
    """The weights whose matmuls run in FP8: the layout's ``fp8`` resolved (``layout`` chosen:
    "auto" by the predicted gain of each block-tied group, `choose_fp8`), as passes/fp8.py
    rewrites them."""
    nodes = fp8_nodes(facts, cluster, layout)
    return sorted(set(facts.nodes.fp8_weight[nodes].tolist()))


def _fp8_fused_high(facts: StepFacts, layout: Layout) -> list[str]:
    """Weights FP8 was asked of that run in high precision because TP splits them per part (a
    fused projection, `fp8_candidates`): named in the plan so that nothing is kept silently."""
    if not layout.uses_fp8 or layout.tp == 1:
        return []
    names = {w for w in facts.nodes.fp8_weight.tolist() if w and facts.param_tp_parts.get(w, 1) > 1}
    return _asked(names, layout)


def _fp8_expert_high(facts: StepFacts, layout: Layout) -> list[str]:
    """Expert weights a layout using FP8 runs in high precision: experts stacked in one
    parameter (grouped matmuls: no FP8 rule) and, under ep, lists of experts (one grouped
    computation), named in the plan so that nothing is kept silently."""
    if not layout.uses_fp8:
        return []
    candidates = set(facts.nodes.fp8_weight[fp8_candidates(facts, layout)].tolist())
    return _asked({w for w, e in facts.params.expert.items() if e and w not in candidates}, layout)


def _asked(names: set[str], layout: Layout) -> list[str]:
    """``names`` the layout asks FP8 of: all of them, or (a list) the weights or block-tied
    groups it names."""
    if isinstance(layout.fp8, (tuple, list)):
        names = {w for w in names if w in layout.fp8 or fp8_group(w) in layout.fp8}
    return sorted(names)


def _fp8_kept_high(facts: StepFacts, cluster: Cluster, layout: Layout) -> list[str]:
    """FP8 candidates the layout leaves in high precision (none unless it uses FP8)."""
    if not layout.uses_fp8:
        return []
    candidates = set(facts.nodes.fp8_weight[fp8_candidates(facts, layout)].tolist())
    return sorted(candidates - set(_fp8_weights(facts, cluster, layout)))
