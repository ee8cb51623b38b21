"""One rank's graph rewritten for the plan: the declared list of passes `parallelize` runs.

`PASSES` is the whole rewrite, in order. Each `Pass` takes one typed part of the plan
(`vocab.plan_types.PlanDecisions`: ``tensor_parallel()``, ``data_parallel()``, ``fp8_part()``,
``recompute_part()``, ``pipeline_part()``) and rewrites the rank's graph in a `RankRewrite`; what a
pass finds as it runs (the ops it had to run replicated, the values it recomputes) goes into
the rank's `vocab.plan_types.ExecutionReport`, never into the plan. The order, and why:

1. ``loss_denominators``: the loss's normalisers become step-wide inputs, before recompute
   could copy one.
2. ``fp8``: the FP8 casts, before TP: the TP pass shards the casts and reduces sharded amaxes.
3. ``tensor_parallel``: the global graph becomes one TP rank's graph (local shapes from here on).
4. ``context_parallel``: after TP's place, the sequence split over "cp", attention as ring
   attention.
4b. ``expert_parallel`` (ep > 1): each rank runs its share of every grouped expert list on the
   tokens of ep consecutive dp ranks, with all-to-alls, and stores only those experts (the
   others' parameters leave the graph); before recompute (whose chains then start from the
   all-to-alls) and before DP (which reduces the experts' gradients over their owners' group;
   under a pipeline the runtime does, after the schedule) and the pipeline split (which puts
   each block's all-to-alls on its stage).
5. ``fp8_scales``: after TP (whose DTensors reduce a sharded amax over TP), the DP ranks'
   amaxes all-reduced, so that the scales are those of the whole batch, as on one device.
6. ``recompute``: after TP, so that the rebuilt chains start from TP's collectives and never
   repeat them; before DP, so that ZeRO-3 gathers the weights a recomputed matmul reads for
   the backward, as for the backward's own matmuls.
7. ``loss_weighting``: the loss output weighted by its seed, before DP (which scales the seed
   for the gradients but keeps the reported loss's weight) and before the pipeline split
   (which puts the weighting on the loss's stage).
7a. ``async_tp`` (tp > 1 with SP, where the plan hides the SP gathers: `CommPlan.sp_gather_chunks`):
   each forward SP all-gather cut into sequence chunks, a chunk's matmuls running while the
   next is gathered (`passes.async_tp`); after recompute (whose copies regather whole).
7b. ``overlap`` (tp > 1): after every pass that inserts TP's collectives, each issued early and
   waited late (`passes.overlap`); before the pipeline split (which cuts the reordered graph)
   and before DP (whose bucketed reductions it leaves where DP schedules them).
8. ``pipeline_split`` (pp > 1): after every other rewrite, the stages run the rewritten
   graph's nodes, each on the stage of the captured node it comes from (the cost model's cut);
   gradients are reduced over "dp" by the pipeline runtime.
9. ``data_parallel`` (pp = 1, dp > 1 or cp > 1): last, gradient reduction and ZeRO over every
   gradient the graph makes (under cp over the dp x cp ranks: the CP pass leaves partial sums).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import fx
from torch.distributed.device_mesh import DeviceMesh

from autopar.analysis.graph import analyze
from autopar.errors import AutoparError
from autopar.execution.module import _dp_rank
from cost.stages import node_stages
from passes import overlap
from passes.async_tp import chunk_sequence_gathers
from passes.context_parallel import ContextParallelError, apply_context_parallel
from passes.data_parallel import apply_data_parallel
from passes.expert_parallel import ExpertParallelError, apply_expert_parallel, has_grouped_lists
from passes.expert_parallel_stacked import (
    StackedExpertError,
    apply_stacked_expert_parallel,
    has_stacked_experts,
)
from passes.fp8 import FP8_FOR, apply_fp8, reduce_scales, weight_matmuls
from passes.fp8 import RECIPES as FP8_RECIPES
from passes.loss_reduction import LossReduction, rewrite_denominators
from passes.pipeline_split import PipelineSplitError, split_backward, split_pipeline
from passes.recompute import apply_recompute, heavy_groups, is_backward, values_to_recompute
from passes.tensor_parallel import TensorParallelError, apply_tensor_parallel
from passes.token_count import weight_loss_by_seed
from runtime import ring_attention  # noqa: F401  (registers the ring attention ops the CP pass emits)
from runtime.mesh import dp_cp_mesh, expert_mesh, stacked_expert_mesh
from runtime.pipeline import PipelinePlan
from vocab.layout import Layout
from vocab.plan_types import (
    AxisGroup,
    DataParallelPlan,
    ExecutionReport,
    Fallback,
    Fp8Part,
    GraphSignature,
    PipelinePart,
    PlanDecisions,
    RecomputeChoice,
    RecomputePart,
    TensorParallelPlan,
)


class UnsupportedLayoutError(AutoparError):
    """The plan needs a parallelism the runtime does not execute yet."""


@dataclass(frozen=True)
class CapturedFacts:
    """What the passes read of the captured graph before any of them rewrites it: each node's
    block (``layers``), the heavy group a partial recompute choice names (``groups``:
    `passes.recompute.heavy_groups`), and under a pipeline each node's stage as the cost model
    cuts and prices them (``stage``)."""

    layers: dict[str, int | None] = field(default_factory=dict)
    groups: dict[str, str] = field(default_factory=dict)
    stage: dict[str, int] = field(default_factory=dict)


@dataclass
class RankRewrite:
    """One rank's graph as the passes rewrite it (``gm``, ``signature``, the local parameter
    ``shapes``), what they read beside their part of the plan, and what they find and make:
    the report's entries (``fallbacks``, ``recompute``), the data-parallel pass's accumulator
    inputs and no-sync graph, the pipeline split. ``decisions`` is read, never written."""

    gm: fx.GraphModule
    signature: GraphSignature
    shapes: dict[str, tuple[int, ...]]
    decisions: PlanDecisions
    mesh: DeviceMesh
    strict: bool = False
    reduction: LossReduction | None = None
    captured: CapturedFacts = field(default_factory=CapturedFacts)
    others: Sequence[int] = ()  # output indices of the forward's other tensors (logits)
    fallbacks: list[Fallback] = field(default_factory=list)
    recompute: dict[int, tuple[str, ...]] | None = None
    accum_inputs: list[tuple[str, str]] = field(default_factory=list)
    accumulate_gm: fx.GraphModule | None = None
    pipeline: PipelinePlan | None = None
    # ep > 1: the parameters of the experts this rank stores, reduced over their owners' group
    expert_params: frozenset[str] = frozenset()
    expert_group: AxisGroup | None = None
    # ep > 1: those of them stacked in one parameter (the rank holds its experts' rows)
    stacked_experts: frozenset[str] = frozenset()

    @property
    def layout(self) -> Layout:
        return self.decisions.layout

    def report(self) -> ExecutionReport:
        """What the passes found, as `pm.execution_report` shows it."""
        return ExecutionReport(recompute=self.recompute, fallbacks=tuple(self.fallbacks))


@dataclass(frozen=True)
class Pass:
    """One step of the rewrite: ``runs(state)``: whether the plan (or, for the loss's
    normalisers, the loss's analysis) asks for it; ``part(decisions)``: the typed part of the
    plan it executes; ``apply(state, part)``: rewrites ``state``'s graph and signature and
    adds its report entries."""

    name: str
    runs: Callable[[RankRewrite], bool]
    part: Callable[[PlanDecisions], Any]
    apply: Callable[[RankRewrite, Any], None]


def _recomputing(decisions: PlanDecisions) -> bool:
    return any(c.mode != "none" for c in decisions.stage_choices())


def _loss_denominators(state: RankRewrite, part: None) -> None:
    state.signature = rewrite_denominators(state.gm, state.signature, state.reduction)


def _fp8(state: RankRewrite, part: Fp8Part) -> None:
    apply_fp8(state.gm, state.signature, list(part.weights), FP8_RECIPES[part.recipe])


def _fp8_scales(state: RankRewrite, part: Fp8Part) -> None:
    reduce_scales(state.gm, _dp_group(state))


def _weight_loss(state: RankRewrite, part: None) -> None:
    weight_loss_by_seed(state.gm, state.signature)


def _dp_group(state: RankRewrite) -> AxisGroup:
    mesh = state.mesh
    return AxisGroup(mesh["dp"].get_group().group_name, state.layout.dp, _dp_rank(mesh))


def _tensor_parallel(state: RankRewrite, part: tuple[TensorParallelPlan, tuple[Fallback, ...]]) -> None:
    """The TP pass (`passes.tensor_parallel`): the rank's TP graph and local parameter shapes.
    ``part``: the TP plan and the fallbacks the plan lists for it (its replicated ops, with the
    reasons). The report's fallbacks: the planned ones the pass executed, then those it met;
    ``strict`` refuses any."""
    tp_plan, planned_fallbacks = part
    lay, gm = state.layout, state.gm
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        traced = apply_tensor_parallel(gm, state.signature, [tuple(n.meta["val"].shape) for n in holders],
                                       tp_plan, state.mesh["tp"])
    except TensorParallelError as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
    state.gm = traced.gm
    state.shapes.update(traced.local_shapes)
    state.signature = _signature(traced.gm, state.signature.inputs, state.signature.grad_index,
                                 state.signature.loss_index, state.signature.buffer_index)
    planned = {f.op for f in planned_fallbacks}
    unexecuted = planned - set(traced.fallback_ops)
    if unexecuted:
        # a guard: the pass gathers the plan's replicated ops (`replicated_ops`); one it
        # never met (a name the pass spells otherwise) might have run on shards
        raise UnsupportedLayoutError(
            f"layout {lay.short()}: the plan runs {', '.join(sorted(unexecuted))} replicated (no "
            "sharding rule autopar trusts) but the tensor-parallel pass did not gather its "
            "inputs; tensor parallelism around it is not executed yet: use tp=1 for this model")
    fallbacks = list(planned_fallbacks) + [
        Fallback(op, "no DTensor strategy for its inputs' placements: gathered, run replicated on "
                 "every TP rank") for op in traced.fallback_ops if op not in planned]
    if state.strict and fallbacks:
        raise UnsupportedLayoutError(
            "strict=True: these ops would run replicated under tensor parallelism: "
            + ", ".join(f.op for f in fallbacks) + "; use a layout without TP (tp=1), or strict=False "
            "to accept the replication (listed in pm.plan.fallbacks)")
    state.fallbacks += fallbacks


def _context_parallel(state: RankRewrite, lay: Layout) -> None:
    """The CP pass (`passes.context_parallel`) on this rank's graph. The sequence gathers it
    had to insert (ops mixing positions other than attention) join the report's fallbacks;
    ``strict`` refuses them."""
    gm, signature = state.gm, state.signature
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        traced = apply_context_parallel(gm, signature, [tuple(n.meta["val"].shape) for n in holders],
                                        state.mesh["cp"], balanced=lay.cp_balance,
                                        reduce_grads=False)
    except ContextParallelError as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
    gathered = [Fallback(op, why) for op, why in traced.gathered]
    if state.strict and gathered:
        raise UnsupportedLayoutError(
            f"strict=True: layout {lay.short()} gathers the whole sequence over cp for: "
            + "; ".join(f.reason for f in gathered) + ". Use cp=1, or strict=False to accept the gathers "
            "(listed in pm.plan.fallbacks)")
    state.fallbacks += gathered
    state.gm = traced.gm
    state.signature = _signature(traced.gm, signature.inputs, signature.grad_index, signature.loss_index,
                                 signature.buffer_index)


def _expert_parallel(state: RankRewrite, lay: Layout) -> None:
    """The EP passes over this rank's ep group (``lay.ep`` consecutive ranks of its "dp" group:
    `runtime.mesh.expert_mesh`'s "ep" axis): `passes.expert_parallel` for lists of experts (the
    other ranks' experts' parameters leave the signature), `passes.expert_parallel_stacked` for
    experts stacked in one parameter (the rank holds its rows of it). The rank's own experts are
    reduced over their owners' group (its "dp" axis)."""
    mesh = expert_mesh(state.mesh, lay.ep)
    group = AxisGroup(mesh["ep"].get_group().group_name, lay.ep, mesh.get_local_rank("ep"))
    stacked = has_stacked_experts(state.gm)
    try:
        done = apply_expert_parallel(state.gm, group) if has_grouped_lists(state.gm) or not stacked else None
        rows = apply_stacked_expert_parallel(state.gm, group) if stacked else None
    except (ExpertParallelError, StackedExpertError) as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
    sig = state.signature
    dropped = set(done.dropped) if done else set()
    inputs = [i for i, node in zip(sig.inputs, sig.placeholders) if node not in dropped]
    gone = {name for (kind, name), node in zip(sig.inputs, sig.placeholders) if node in dropped}
    outs = next(n for n in state.gm.graph.nodes if n.op == "output").args[0]
    grads = {name: i for name, i in sig.grad_index.items() if name not in gone and outs[i] is not None}
    state.signature = _signature(state.gm, inputs, grads, sig.loss_index, sig.buffer_index)
    by_node = {node: name for name, node in state.signature.placeholder_of("param").items()}
    state.expert_params = frozenset(by_node[node] for node in done.local) if done else frozenset()
    if rows:
        stored = {by_node[node]: experts for node, experts in rows.experts.items()}
        for name, experts in stored.items():
            state.shapes[name] = (experts // lay.ep, *state.shapes[name][1:])
        state.expert_params |= frozenset(stored)
        state.stacked_experts = frozenset(stored)
    state.expert_group = AxisGroup(mesh["dp"].get_group().group_name, lay.dp // lay.ep,
                                   mesh.get_local_rank("dp"))
    if state.stacked_experts:
        stacked_expert_mesh(state.mesh, lay.ep)  # made here, by every rank in the same order


def _recompute_pass(state: RankRewrite, part: RecomputePart) -> None:
    """The recompute pass: the report records, per block, the saved values it rebuilds."""
    executed = _recompute(state.gm, state.captured.layers, state.captured.groups, list(part.choices),
                          part.block_rank, state.layout.tp > 1, part.regather)
    state.recompute = {block: tuple(values) for block, values in executed.items()}


def _over_dp_cp(lay: Layout) -> bool:
    """Context parallelism without a pipeline: the CP pass leaves its gradients as partial
    sums and the DP pass reduces them over the dp x cp ranks (`runtime.mesh.dp_cp_mesh`) in
    one bucketed reduction, as the cost model prices it; ZeRO shards over those ranks."""
    return lay.cp > 1 and lay.pp == 1


def _data_parallel(state: RankRewrite, dp_plan: DataParallelPlan) -> None:
    """The DP pass (`passes.data_parallel`) on the rank's graph, in place. Whole gradients on
    every rank (DP, ZeRO-1) are reduced once per step, after the last micro-batch: the graph the
    micro-batches before it run (without the reduction) becomes ``state.accumulate_gm``.
    Sharded gradients (ZeRO-2/3) are reduced by every micro-batch. Under cp: over the dp x cp
    ranks, whose cp sets hold partial sums."""
    lay, gm, signature = state.layout, state.gm, state.signature
    group, partial = _dp_group(state), 1
    if _over_dp_cp(lay):
        flat = dp_cp_mesh(state.mesh)
        group = AxisGroup(flat["dp"].get_group().group_name, lay.dp * lay.cp, flat.get_local_rank("dp"))
        partial = lay.cp
    no_sync = lay.grad_accum > 1 and lay.zero <= 1
    held = set(signature.placeholder_of("param"))  # under ep: without the other ranks' experts
    dp_plan = dataclasses.replace(dp_plan, sharded=frozenset(p for p in dp_plan.sharded if p in held))
    groups = {name: state.expert_group for name in state.expert_params}
    if no_sync:
        state.accumulate_gm = copy.deepcopy(gm)
        apply_data_parallel(state.accumulate_gm, signature, state.shapes, dp_plan, group, sync="none",
                            partial=partial, groups=groups)
    apply_data_parallel(gm, signature, state.shapes, dp_plan, group,
                        sync="accumulated" if no_sync else "reduce", partial=partial, groups=groups)
    state.accum_inputs = [("accum", node.meta["accumulates"]) for node in gm.graph.nodes
                          if node.op == "placeholder" and "accumulates" in node.meta]


def _pipeline_split(state: RankRewrite, part: PipelinePart) -> None:
    state.pipeline = _pipeline(state.gm, state.signature, state.captured.stage, part, state.mesh,
                               (state.layout.tp > 1) + (state.layout.cp > 1), state.others)


def _no_part(decisions: PlanDecisions) -> None:
    return None


# The rewrite, in order (the module docstring says why each pass stands where it does).
PASSES: tuple[Pass, ...] = (
    Pass("loss_denominators", lambda s: s.reduction is not None and s.reduction.mode == "global",
         _no_part, _loss_denominators),
    Pass("fp8", lambda s: bool(s.decisions.fp8), PlanDecisions.fp8_part, _fp8),
    Pass("tensor_parallel", lambda s: s.layout.tp > 1,
         lambda d: (d.tensor_parallel(), tuple(d.fallbacks)), _tensor_parallel),
    Pass("context_parallel", lambda s: s.layout.cp > 1, lambda d: d.layout, _context_parallel),
    Pass("expert_parallel", lambda s: s.layout.ep > 1, lambda d: d.layout, _expert_parallel),
    Pass("fp8_scales", lambda s: bool(s.decisions.fp8) and s.layout.dp > 1, PlanDecisions.fp8_part, _fp8_scales),
    Pass("recompute", lambda s: _recomputing(s.decisions), PlanDecisions.recompute_part, _recompute_pass),
    Pass("loss_weighting", lambda s: True, _no_part, _weight_loss),
    Pass("async_tp", lambda s: s.layout.tp > 1 and s.layout.sp and s.decisions.comm.sp_gather_chunks > 1,
         lambda d: d.comm.sp_gather_chunks, lambda s, chunks: chunk_sequence_gathers(s.gm, chunks)),
    Pass("overlap", lambda s: s.layout.tp > 1 and overlap.enabled(), _no_part,
         lambda s, part: overlap.overlap_communication(s.gm)),
    Pass("pipeline_split", lambda s: s.layout.pp > 1, PlanDecisions.pipeline_part, _pipeline_split),
    Pass("data_parallel", lambda s: s.layout.pp == 1 and (s.layout.dp > 1 or _over_dp_cp(s.layout)),
         lambda d: d.data_parallel(), _data_parallel),
)


def rewrite(state: RankRewrite, passes: Sequence[Pass] = PASSES) -> ExecutionReport:
    """Run ``passes`` in order on ``state`` (each that the plan asks for, on its part of the
    plan); returns what they found."""
    for step in passes:
        if step.runs(state):
            step.apply(state, step.part(state.decisions))
    return state.report()


def read_captured(graph, decisions: PlanDecisions) -> CapturedFacts:
    """The captured graph's facts the passes need (`CapturedFacts`), read before any pass
    rewrites it (the recompute pass's rules; the cost model's cut). Raises
    `UnsupportedLayoutError` where the plan recomputes a group this graph does not have."""
    lay = decisions.layout
    recomputing = _recomputing(decisions)
    if not (recomputing or lay.pp > 1):
        return CapturedFacts()
    analysis = analyze(graph)
    layers = {name: info.layer for name, info in analysis.nodes.items()}
    stage: dict[str, int] = {}
    if lay.pp > 1:  # each captured node's stage, as the cost model cuts and prices them
        order = ((i.name, i.phase == "backward", i.layer) for i in analysis.nodes.values())
        stage = node_stages(order, analysis.blocks.count if analysis.blocks else 0, decisions.stages)
    groups: dict[str, str] = {}
    if recomputing:
        gm, signature = graph.gm, captured_signature(graph)
        forward_mm = {mm: w for w, mms in weight_matmuls(gm, signature).items() for mm in mms.forward}
        groups = heavy_groups(gm, layers, {n: i.module for n, i in analysis.nodes.items()}, forward_mm)
        unknown = {g for c in decisions.stage_choices() for g in c.outputs} - set(groups.values())
        if unknown:
            raise UnsupportedLayoutError(
                f"the plan recomputes {sorted(unknown)}, which this rank's graph does not have "
                f"(its groups: {sorted(set(groups.values()))}); re-plan on this model")
    return CapturedFacts(layers, groups, stage)


def captured_signature(graph) -> GraphSignature:
    """The `GraphSignature` of a captured step (`autopar.capture.joint.TrainingGraph`)."""
    return _signature(graph.gm, [(i.kind, i.name) for i in graph.inputs],
                      {o.name: o.index for o in graph.outputs if o.kind == "grad"},
                      next(o.index for o in graph.outputs if o.kind == "loss"),
                      {o.name: o.index for o in graph.outputs if o.kind == "buffer"})


def _pipeline(gm, signature: GraphSignature, captured_stage: dict[str, int], part: PipelinePart,
              mesh: DeviceMesh, retraced: int, others: Sequence[int] = ()) -> PipelinePlan:
    """Cut this rank's graph into the plan's stages (`passes.pipeline_split`) and set up the
    groups the step talks over: the pipeline's ranks, the stages sharing a parameter.

    A node runs on the stage of the captured node it comes from (``captured_stage``: the cost
    model's cut); a node the passes added (a collective's wait, the loss's weighting) on the
    latest stage of its inputs in the forward, the earliest in the backward."""
    lay = part.layout
    node_stage: dict[str, int] = {}
    backward: set[str] = set()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        inputs = [node_stage[i.name] for i in n.all_input_nodes if i.name in node_stage]
        if is_backward(n) or any(i.name in backward for i in n.all_input_nodes):
            backward.add(n.name)
        source = _source(n, retraced)
        if source in captured_stage:
            node_stage[n.name] = captured_stage[source]
        elif n.name in backward:
            node_stage[n.name] = min(inputs, default=lay.pp - 1)
        else:
            node_stage[n.name] = max(inputs, default=0)
    m = lay.grad_accum
    rounds = max(1, m // lay.pp)
    if lay.schedule in ("interleaved-1f1b", "zero-bubble") and m % rounds:
        raise UnsupportedLayoutError(
            f"layout {lay.short()}: PyTorch's {lay.schedule} schedule runs the micro-batches in "
            f"rounds of pp={lay.pp} and needs grad_accum ({m}) to be a multiple of the number of "
            f"rounds ({rounds}): use grad_accum <= pp or a multiple of pp")
    if lay.cp > 1:
        _refuse_shared_under_cp(gm, signature, node_stage, lay)
    try:  # one stage per entry of the plan's stages (v per rank under interleaving)
        split = split_pipeline(gm, signature, node_stage, len(part.stages), others)
    except PipelineSplitError as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: the stages {list(part.stages)} cannot be "
                                     f"run: {exc}") from exc
    if lay.schedule == "zero-bubble":  # each backward in two halves: input, then weight gradients
        for stage in split.stages:
            stage.weight_split = split_backward(stage)
    grid = mesh.mesh  # (dp, pp, tp) -> global rank
    shared_groups = {}
    for name, stages in sorted(split.shared.items()):
        pipeline_ranks = sorted({s % lay.pp for s in stages})
        if len(pipeline_ranks) == 1:  # its stages run on one rank: the parts add up there
            continue
        for d in range(lay.dp):  # every rank creates every group, in the same order
            for t in range(lay.tp):
                ranks = [int(grid[d, r, t]) for r in pipeline_ranks]
                group = dist.new_group(ranks)
                if dist.get_rank() in ranks:
                    shared_groups[name] = group
    zero_rows = list(part.zero_sharded)
    return PipelinePlan(graphs=split, rank=mesh.get_local_rank("pp"), pp=lay.pp,
                        group=mesh["pp"].get_group(), schedule=lay.schedule,
                        shared_groups=shared_groups, zero_sharded=zero_rows,
                        reduce_scatter=part.reduce_scatter)


def _refuse_shared_under_cp(gm, signature: GraphSignature, node_stage: dict[str, int], lay: Layout) -> None:
    """Under cp x pp the stages leave partial gradients over cp, summed over dp x cp after the
    schedule; a parameter read on several stages (tied embeddings), whose stages' terms the
    pipeline adds up over its own group, comes out wrong that way (tiny-gpt2 cp2 pp2: the
    embedding's gradient off by 7 %): refused until the two sums are composed."""
    aten = torch.ops.aten
    views = {aten.view.default, aten._unsafe_view.default, aten.t.default, aten.alias.default,
             aten.detach.default, aten._to_copy.default, aten.permute.default, aten.transpose.int}

    def stages(node: fx.Node) -> set[int]:  # the stages of the ops reading it, through its views
        out: set[int] = set()
        for user in node.users:
            if user.name not in node_stage:
                continue
            out |= stages(user) if user.target in views and user.users else {node_stage[user.name]}
        return out

    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    shared = [name for node, (kind, name) in zip(holders, signature.inputs)
              if kind == "param" and len(stages(node)) > 1]
    if shared:
        raise UnsupportedLayoutError(
            f"layout {lay.short()}: {', '.join(shared)} is read on several pipeline stages (tied weights); "
            "under context parallelism in a pipeline its gradient is reduced over cp as a whole and cannot "
            "be split into the stages' terms yet: use cp=1 or pp=1, or untie the weights")


def _recompute(gm, layers: dict[str, int | None], groups: dict[str, str],
               choices: list[RecomputeChoice], block_rank: dict[int, int], retraced: bool,
               regather: bool = True) -> dict[int, list[str]]:
    """Apply the recompute pass to this rank's graph ``gm``; block -> the saved values it
    rebuilds. ``choices``: what each pipeline rank recomputes (one entry without a pipeline);
    ``block_rank``: the pipeline rank of each block. ``layers`` and ``groups``: the block
    and heavy group of each node of the captured graph (its analysis); a graph the TP pass
    retraced names each node's source in ``meta["from_node"]``, a node of the FP8 pass the
    matmul it serves (its casts are that matmul's block's). ``regather``: `Layout.regather`."""
    source = {n.name: _source(n, retraced) for n in gm.graph.nodes}
    per_node = {name: layers.get(src) for name, src in source.items()}
    marked: set[str] = set()
    for choice in set(choices):
        ranks = {r for r, c in enumerate(choices) if c == choice}
        wanted = set(choice.outputs)
        also = [name for name, src in source.items() if groups.get(src) in wanted]
        values = values_to_recompute(gm, per_node, choice.mode, also=also, regather=regather)
        marked |= {v for v in values if len(choices) == 1 or block_rank.get(per_node[v]) in ranks}
    result = apply_recompute(gm, frozenset(marked))
    executed: dict[int, list[str]] = {}
    for name in result.recomputed:
        executed.setdefault(per_node[name], []).append(name)
    return executed


def _source(node, retraced: int = 1) -> str:
    """The captured node ``node`` comes from: itself, the matmul an FP8 cast serves, the node
    the TP pass (``retraced`` 1; then the CP pass: 2) retraced it from, or the forward node a
    recompute copy rebuilds."""
    served = node.meta.get("custom", {}).get(FP8_FOR)
    if served:
        return served
    sources = (node.meta.get("from_node") or []) if retraced else []
    if sources:  # retraced by TP, then by CP (retraced=2): the captured node is that many back
        source = sources[0]
        for _ in range(int(retraced) - 1):
            source = source.from_node[0] if source.from_node else source
        return source.name
    return node.meta.get("recomputes", node.name)


def _signature(gm, inputs, grad_index, loss_index, buffer_index) -> GraphSignature:
    return GraphSignature(inputs=list(inputs),
                          placeholders=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
                          grad_index=dict(grad_index), loss_index=loss_index,
                          buffer_index=dict(buffer_index))
