"""`autopar.parallelize`: run a plan on real process groups.

Each rank captures the training step for its slice of the batch, the passes rewrite that
graph for the plan (collectives for data parallelism and ZeRO), and the returned module is used
like the original: ``loss = pm(*batch)``, ``loss.backward()`` fills ``pm.parameters()`` (DTensors
with the plan's placements), any ``torch.optim`` optimizer steps them, and
``torch.distributed.checkpoint`` saves ``pm.state_dict()``.

The plan's decisions (`cost.plan_types.PlanDecisions`) travel to the passes as typed parts: the
tensor-parallel pass (passes/tensor_parallel.py) turns the global graph into one TP rank's graph,
the recompute pass (passes/recompute.py) makes the backward rebuild the plan's recomputed
forward values from the kept ones (after TP: the chains start from TP's collectives, never
repeat them; before DP: ZeRO-3 gathers the weights a recomputed matmul reads for the backward,
as for the backward's own matmuls), the data-parallel pass (passes/data_parallel.py) then adds
gradient reduction and ZeRO over the "dp" mesh axis. Executed today: DP, ZeRO 1/2/3, TP, TP+SP
and their products (a ("dp", "tp") mesh), recompute "selective", "full" and partial choices
(the plan's `RecomputeChoice`: "auto" resolved by the cost model, or named groups), FP8 matmuls
(passes/fp8.py: before TP, whose DTensors reduce a sharded amax over TP; the DP ranks' amaxes
are all-reduced after it, `reduce_scales`), with gradient
accumulation (the step captured for one micro-batch and run grad_accum times; see
runtime/executor.py), in the model's own dtype. Pipelines (pp > 1, with DP / ZeRO-1 and TP)
run on a ("dp", "pp", "tp") mesh: after every other pass the rank's graph is cut at the plan's
stages (passes/pipeline_split.py; each node on the stage of the captured node it
comes from, as the cost model priced it) and the stage's graphs run under
torch.distributed.pipelining (runtime/pipeline.py; GPipe, 1F1B, interleaved 1F1B, zero-bubble);
the module then holds only its stages' parameters. Context parallelism (cp > 1, with DP and recompute)
runs on a ("dp", "cp", "tp") mesh: after TP's place, the context-parallel pass
(passes/context_parallel.py) splits every sequence over "cp" and runs attention as ring
attention; the parameters live on the ("dp", "tp") mesh, replicated over cp. Expert parallelism
(ep > 1, with DP and ZeRO) groups every list of alike experts at capture and the expert-parallel
pass (passes/expert_parallel.py) runs each rank's share of the experts on the tokens of ep
consecutive dp ranks, with all-to-alls; the experts' parameters stay whole on every rank. Any
other decision (ZeRO-2/3 inside a pipeline, cp with ZeRO, TP, pipelines or FP8, ep with TP,
pipelines, cp or FP8, a precision other than the model's) is an
`UnsupportedLayoutError` naming it: a plan runs exactly as planned or not at all.

The loss trains as on one device wherever the layout splits the batch (data parallelism,
micro-batches): `passes.loss_reduction` proves it a linear combination of batch sums, means and
ratios of batch sums with data-only normalisers (token counts, mask sums, class-weight sums) and
the runtime weights the pieces or feeds the normalisers' step-wide values; a loss it cannot prove
is a `LossReductionError` naming the op, unless ``loss_reduction="mean_per_rank"`` accepts DDP's
per-rank averaging.

Buffers the forward updates (BatchNorm statistics) are written back on every rank; under data
parallelism each rank keeps its own statistics, as DDP does without SyncBatchNorm.

A model whose parameters are on the meta device is parallelised without ever being whole: each
rank allocates only its shards, filled from a checkpoint of any layout by
``torch.distributed.checkpoint.load(pm.state_dict(), ...)`` and ``pm.load_state_dict``.
"""

from __future__ import annotations

import copy
import hashlib
import pickle
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.analysis.graph import analyze
from autopar.capture.fingerprint import StepCache, model_fingerprint, step_key
from autopar.capture.joint import capture, capture_with_sources
from autopar.capture.outputs import check_mergeable
from autopar.errors import AutoparError, InputError
from autopar.execution.module import ParallelModule, _dp_rank
from autopar.execution.placement import _to_dtensors
from autopar.planning.plan import Plan
from autopar.planning.plan import make_plan as make_layout_plan
from autopar.planning.planner import model_precision
from autopar.planning.planner import plan as make_plan
from autopar.search.decisions import _recomputed
from autopar.search.step import CapturedStep
from cost import Cluster, Layout
from cost.layout import unsupported_decisions
from cost.plan_types import (
    AxisGroup,
    Fallback,
    GraphSignature,
    PlanDecisions,
    RecomputeChoice,
)
from cost.stages import node_stages
from cost.step import check_layout
from passes.context_parallel import ContextParallelError, apply_context_parallel
from passes.data_parallel import apply_data_parallel
from passes.expert_parallel import ExpertParallelError, apply_expert_parallel, expert_groups
from passes.fp8 import FP8_FOR, apply_fp8, reduce_scales, weight_matmuls
from passes.fp8 import RECIPES as FP8_RECIPES
from passes.loss_reduction import LossReduction, analyze_loss, for_layout, rewrite_denominators
from passes.pipeline_split import PipelineSplitError, split_backward, split_pipeline
from passes.recompute import apply_recompute, heavy_groups, is_backward, values_to_recompute
from passes.tensor_parallel import TensorParallelError, apply_tensor_parallel
from passes.token_count import weight_loss_by_seed
from runtime import ring_attention  # noqa: F401  (registers the ring attention ops the CP pass emits)
from runtime.executor import RankGraph
from runtime.pipeline import PipelinePlan


class UnsupportedLayoutError(AutoparError):
    """The plan needs a parallelism the runtime does not execute yet."""


class LossReductionError(InputError):
    """The loss's reduction over the batch cannot be proven to split exactly."""


LOSS_REDUCTIONS = ("exact", "mean_per_rank")


def _loss_reduction(gm, signature: GraphSignature, lay: Layout, mode: str,
                    sources: Callable[[], fx.GraphModule] | None = None) -> LossReduction | None:
    """How the loss splits over the layout's pieces of the batch; None where nothing splits it
    (dp = 1 and grad_accum = 1) or the user accepted per-piece means ("mean_per_rank").
    Raises `LossReductionError` for a loss not proven linear in the batch, naming the user's
    source line of the op (``sources``: the step traced again with them)."""
    if mode == "mean_per_rank" or (lay.dp == 1 and lay.grad_accum == 1):
        return None
    reduction = analyze_loss(gm, signature)
    if reduction.mode == "unproven":
        op = reduction.node.target if reduction.node is not None else "the loss"
        if reduction.node is not None and sources is not None:
            _name_source(reduction.node, gm, sources)
        raise LossReductionError(
            f"layout {lay.short()} splits the batch over dp={lay.dp} x grad_accum={lay.grad_accum} "
            f"pieces, but the loss's reduction over the batch is not provably a linear combination "
            f"of batch sums and ratios of them: {reduction.why} (op {op}, "
            f"{reduction.where()}), so the pieces would not add up to the one-device loss.\n  fix: "
            "write the loss as a sum / mean over samples, or a sum divided by a count or weight sum "
            "computed from the inputs only; or pass autopar.parallelize(..., "
            "loss_reduction=\"mean_per_rank\") to accept DDP's per-rank averaging knowingly; or use "
            "a layout with dp=1 and grad_accum=1")
    return for_layout(reduction, lay.tp, lay.pp)


def _name_source(node: fx.Node, gm: fx.GraphModule, sources: Callable[[], fx.GraphModule]) -> None:
    """Copy to ``node`` the source lines of its counterpart in the graph ``sources()`` traces
    with them: the node of the same op at the same place counted from the graph's end (the
    loss comes after any repeated blocks, so the two traces agree there)."""
    def same_op(g):
        return [n for n in g.graph.nodes if n.op == "call_function" and n.target is node.target]

    try:
        place = same_op(gm)[::-1].index(node)
        twin = same_op(sources())[::-1][place]
    except Exception:  # (IndexError, ValueError, a capture error): the module name stays
        return
    if twin.meta.get("stack_trace"):
        node.meta["stack_trace"] = twin.meta["stack_trace"]


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | int,
    example_inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: Callable | None = None,
    plan: Plan | None = None,
    layout: Layout | None = None,
    local_batch: bool = False,
    strict: bool = False,
    loss_reduction: str = "exact",
) -> ParallelModule:
    """Parallelise ``model``'s training step over ``mesh`` (a DeviceMesh or a world size).

    ``example_inputs`` are one global batch (dim 0 split over data-parallel ranks). The layout
    comes from ``plan``, else ``layout`` (omitted fields derived, `Layout.resolve`), else the
    solver, searching only what runs, on this process's devices: `Cluster.detect()` under NCCL,
    `Cluster.local()` on CPU ranks. ``local_batch``: ``pm(*batch)`` takes this rank's
    data-parallel slice instead of the global batch. ``strict``: refuse any op that would fall
    back to replication. Must be called on every rank of an initialised process group; every
    rank runs rank 0's plan.
    ``loss_reduction``: "exact" (default): where the layout splits the batch (dp > 1 or
    grad_accum > 1) the loss must be proven a linear combination of batch sums and of ratios
    of batch sums (`passes.loss_reduction`), split so that the step trains as on one device,
    else `LossReductionError`; "mean_per_rank": every rank and micro-batch averages its own
    loss and the pieces are averaged, DDP's semantics, accepted knowingly.
    """
    world, device_type = _check_call(model, mesh, example_inputs, loss_reduction)
    example_inputs = tuple(example_inputs)
    batch = example_inputs[0].shape[0]
    cluster = (Cluster.detect() if device_type == "cuda"
               else Cluster.local(ranks=world, threads_per_rank=torch.get_num_threads()))
    chosen = _one_plan(lambda: _choose_plan(model, example_inputs, loss_fn, plan, layout, cluster))
    lay = chosen.layout
    m = lay.grad_accum
    if batch % (lay.dp * m):
        raise InputError(f"the batch of {batch} does not split over dp={lay.dp} ranks x grad_accum={m} "
                         f"micro-batches: use a batch that is a multiple of dp * grad_accum = {lay.dp * m}")
    mesh = _mesh_for(mesh, lay, device_type)

    # the step is captured for one micro-batch; the executor runs it grad_accum times
    local_inputs = tuple(x.chunk(lay.dp, dim=0)[_dp_rank(mesh)] for x in example_inputs)
    micro_inputs = tuple(x[: x.shape[0] // m] for x in local_inputs)
    graph = _capture_local(model, micro_inputs, loss_fn, lay.ep)
    check_mergeable(model, graph, micro_inputs, local_inputs, loss_fn, m)
    signature = _signature(graph.gm, [(i.kind, i.name) for i in graph.inputs],
                           {o.name: o.index for o in graph.outputs if o.kind == "grad"},
                           next(o.index for o in graph.outputs if o.kind == "loss"),
                           {o.name: o.index for o in graph.outputs if o.kind == "buffer"})
    reduction = _loss_reduction(graph.gm, signature, lay, loss_reduction,
                                lambda: capture_with_sources(model, micro_inputs, loss_fn).gm)
    gm, shapes = graph.gm, dict(graph.param_shapes)
    decisions = chosen.decisions
    # each node's block and the heavy groups a partial choice names, read before any pass
    # rewrites the graph (the recompute pass's rules)
    # what each pipeline rank recomputes (one choice without a pipeline)
    choices = [decisions.stage_recompute(r) for r in range(lay.pp)]
    recomputing = any(c.mode != "none" for c in choices)
    groups: dict[str, str] = {}
    layers: dict[str, int | None] = {}
    captured_stage: dict[str, int] = {}
    if recomputing or lay.pp > 1:
        analysis = analyze(graph)
        layers = {name: info.layer for name, info in analysis.nodes.items()}
    if lay.pp > 1:  # each captured node's stage, as the cost model cuts and prices them
        order = ((i.name, i.phase == "backward", i.layer) for i in analysis.nodes.values())
        captured_stage = node_stages(order, analysis.blocks.count if analysis.blocks else 0,
                                     decisions.stages)
    if recomputing:
        forward_mm = {mm: w for w, mms in weight_matmuls(gm, signature).items() for mm in mms.forward}
        groups = heavy_groups(gm, layers, {n: i.module for n, i in analysis.nodes.items()}, forward_mm)
        unknown = {g for c in choices for g in c.outputs} - set(groups.values())
        if unknown:
            raise UnsupportedLayoutError(
                f"the plan recomputes {sorted(unknown)}, which this rank's graph does not have "
                f"(its groups: {sorted(set(groups.values()))}); re-plan on this model")
    if reduction is not None and reduction.mode == "global":  # before recompute copies a normaliser
        signature = rewrite_denominators(gm, signature, reduction)
    if decisions.fp8:  # before TP: the TP pass shards the casts and reduces sharded amaxes
        apply_fp8(gm, signature, decisions.fp8, FP8_RECIPES[lay.fp8_recipe])
    gm, signature = _tensor_parallel(gm, signature, shapes, decisions, mesh, strict)
    if lay.cp > 1:  # the sequence over "cp", attention as ring attention
        gm, signature = _context_parallel(gm, signature, decisions, mesh, strict)
    if lay.ep > 1:  # each rank runs its share of the experts on its ep group's tokens
        try:
            apply_expert_parallel(gm, expert_groups(mesh.mesh.T.tolist(), lay.ep, dist.get_rank())[1])
        except ExpertParallelError as exc:
            raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
    if decisions.fp8 and lay.dp > 1:  # scales over all DP ranks' tokens, as on one device
        reduce_scales(gm, AxisGroup(mesh["dp"].get_group().group_name, lay.dp, _dp_rank(mesh)))
    if recomputing:
        # the plan lists what is recomputed, value by value, as it runs
        block_rank = {b: c % lay.pp for c, (first, last) in enumerate(decisions.stages)
                      for b in range(first, last + 1)}
        decisions.recompute = _recomputed(None, choices[0], _recompute(gm, layers, groups, choices, block_rank,
                                                                       lay.tp > 1, lay.regather))
    weight_loss_by_seed(gm, signature)
    inputs = list(signature.inputs)
    pipeline, accumulate_gm = None, None
    if lay.pp > 1:  # after every other pass: the stages run the rewritten graph's nodes
        pipeline = _pipeline(gm, signature, captured_stage, decisions, mesh, lay.tp > 1, _other_outputs(graph))
    elif lay.dp > 1:
        accumulate_gm = _data_parallel(gm, signature, shapes, decisions, mesh)
        inputs += [("accum", node.meta["accumulates"]) for node in gm.graph.nodes
                   if node.op == "placeholder" and "accumulates" in node.meta]
    rank_graph = RankGraph(
        gm=gm,
        inputs=[(kind, name[len("input"):] if kind == "input" else name) for kind, name in inputs],
        loss_index=signature.loss_index,
        grad_index=signature.grad_index,
        micro_batches=m,
        accumulate_gm=accumulate_gm,
        buffer_index=signature.buffer_index,
        reduction=reduction,
        dp=lay.dp,
        dp_group=mesh["dp"].get_group() if lay.dp > 1 else None,
        pipeline=pipeline,
        other_index=_other_outputs(graph),
    )
    # the user's model stays as it was; the parallel module owns a copy with DTensor weights
    # (under a pipeline only those of this rank's stage)
    module = copy.deepcopy(model)
    held = pipeline.params if pipeline else None
    if lay.cp > 1:  # parameters are replicated over cp: each cp rank's copy on its (dp, tp) mesh
        mesh = mesh["dp", "tp"]
    unloaded = _to_dtensors(module, mesh, decisions, graph.aliases, held)
    shapes_in = [tuple(x.shape) for x in (local_inputs if local_batch else example_inputs)]
    canonical = [p for p in signature.placeholder_of("param") if held is None or p in held]
    return ParallelModule(module, rank_graph, chosen, mesh, shapes_in, canonical,
                          local_batch=local_batch, unloaded=unloaded, original=model, loss_fn=loss_fn,
                          output_tree=graph.output_tree)


def _other_outputs(graph) -> list[int]:
    """Output indices of the forward's tensors other than the loss, in `OutputTree` order
    (the capture names them output1, output2, ...)."""
    if graph.output_tree is None:
        return []
    index = {o.name: o.index for o in graph.outputs if o.kind == "other"}
    return [index[f"output{k + 1}"] for k in range(len(graph.output_tree.tensor_leaves))]


def _check_call(model: nn.Module, mesh, example_inputs, loss_reduction: str) -> tuple[int, str]:
    """The arguments of `parallelize` that can be checked before planning: (world, device type)."""
    if loss_reduction not in LOSS_REDUCTIONS:
        raise InputError(f"loss_reduction={loss_reduction!r}: use one of {', '.join(map(repr, LOSS_REDUCTIONS))}")
    if not dist.is_initialized():
        raise InputError("parallelize needs an initialised process group: launch with torchrun "
                         "(or torch.distributed.init_process_group) on every rank")
    if example_inputs is None:
        raise InputError("parallelize needs example_inputs: one global batch, as the model takes it")
    world = dist.get_world_size()
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    if isinstance(mesh, int):
        if mesh != world:
            raise InputError(f"mesh of {mesh} ranks but the process group has {world}: pass "
                             f"mesh={world} or start {mesh} ranks")
    elif mesh.size() != world:
        raise InputError(f"the mesh has {mesh.size()} ranks but the process group has {world}")
    meta_buffers = [n for n, b in model.named_buffers() if b.device.type == "meta"]
    if meta_buffers:
        raise InputError(
            f"buffer {meta_buffers[0]!r} (and {len(meta_buffers) - 1} more) is on the meta device: "
            "autopar allocates only the parameters' shards of a meta model and cannot compute "
            "buffers (rotary frequencies and the like are not in checkpoints).\n  fix: build the "
            "model with its parameters only on meta (accelerate's init_empty_weights("
            "include_buffers=False), or move the buffers: module.register_buffer(name, value))")
    return world, device_type


def _tensor_parallel(gm, signature: GraphSignature, shapes: dict, decisions: PlanDecisions,
                     mesh: DeviceMesh, strict: bool):
    """The TP pass (`passes.tensor_parallel`) on this rank's graph, when the plan has tp > 1:
    returns (graph, signature); ``shapes`` gets the local parameter shapes. The plan's fallbacks
    become what ran: the planned ones the pass executed, then those it met."""
    lay = decisions.layout
    # ops the TP recipe planned to run replicated (no strategy), and below those the TP pass met
    fallbacks: list[Fallback] = list(decisions.fallbacks) if lay.tp > 1 else []
    if lay.tp > 1:
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        try:
            traced = apply_tensor_parallel(gm, signature, [tuple(n.meta["val"].shape) for n in holders],
                                           decisions.tensor_parallel(), mesh["tp"])
        except TensorParallelError as exc:
            raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
        gm = traced.gm
        shapes.update(traced.local_shapes)
        signature = _signature(gm, signature.inputs, signature.grad_index, signature.loss_index,
                               signature.buffer_index)
        planned = {f.op for f in fallbacks}
        unexecuted = planned - set(traced.fallback_ops)
        if unexecuted:
            # a guard: the pass gathers the plan's replicated ops (`replicated_ops`); one it
            # never met (a name the pass spells otherwise) might have run on shards
            raise UnsupportedLayoutError(
                f"layout {lay.short()}: the plan runs {', '.join(sorted(unexecuted))} replicated (no "
                "sharding rule autopar trusts) but the tensor-parallel pass did not gather its "
                "inputs; tensor parallelism around it is not executed yet: use tp=1 for this model")
        fallbacks += [Fallback(op, "no DTensor strategy for its inputs' placements: gathered, run "
                               "replicated on every TP rank") for op in traced.fallback_ops
                      if op not in planned]
    # the plan lists what ran: the TP pass's fallbacks join the planned ones
    decisions.fallbacks = fallbacks
    if strict and fallbacks:
        raise UnsupportedLayoutError(
            "strict=True: these ops would run replicated under tensor parallelism: "
            + ", ".join(f.op for f in fallbacks) + "; use a layout without TP (tp=1), or strict=False "
            "to accept the replication (listed in pm.plan.fallbacks)")
    return gm, signature


def _context_parallel(gm, signature: GraphSignature, decisions: PlanDecisions, mesh: DeviceMesh,
                      strict: bool):
    """The CP pass (`passes.context_parallel`) on this rank's graph: (graph, signature). The
    sequence gathers it had to insert (ops mixing positions other than attention) join the
    plan's fallbacks; ``strict`` refuses them."""
    lay = decisions.layout
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        traced = apply_context_parallel(gm, signature, [tuple(n.meta["val"].shape) for n in holders], mesh["cp"])
    except ContextParallelError as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: {exc}") from exc
    gathered = [Fallback(op, why) for op, why in traced.gathered]
    if strict and gathered:
        raise UnsupportedLayoutError(
            f"strict=True: layout {lay.short()} gathers the whole sequence over cp for: "
            + "; ".join(f.reason for f in gathered) + ". Use cp=1, or strict=False to accept the gathers "
            "(listed in pm.plan.fallbacks)")
    decisions.fallbacks = list(decisions.fallbacks) + gathered
    return traced.gm, _signature(traced.gm, signature.inputs, signature.grad_index, signature.loss_index,
                                 signature.buffer_index)


def _data_parallel(gm, signature: GraphSignature, shapes: dict, decisions: PlanDecisions,
                   mesh: DeviceMesh):
    """The DP pass (`passes.data_parallel`) on ``gm``, in place. Whole gradients on every rank
    (DP, ZeRO-1) are reduced once per step, after the last micro-batch: returns the graph the
    micro-batches before it run (without the reduction), else None. Sharded gradients
    (ZeRO-2/3) are reduced by every micro-batch."""
    lay = decisions.layout
    group = AxisGroup(mesh["dp"].get_group().group_name, lay.dp, _dp_rank(mesh))
    dp_plan = decisions.data_parallel()
    no_sync = lay.grad_accum > 1 and lay.zero <= 1
    accumulate_gm = None
    if no_sync:
        accumulate_gm = copy.deepcopy(gm)
        apply_data_parallel(accumulate_gm, signature, shapes, dp_plan, group, sync="none")
    apply_data_parallel(gm, signature, shapes, dp_plan, group,
                        sync="accumulated" if no_sync else "reduce")
    return accumulate_gm


def _pipeline(gm, signature: GraphSignature, captured_stage: dict[str, int], decisions: PlanDecisions,
              mesh: DeviceMesh, retraced: bool, others: Sequence[int] = ()) -> PipelinePlan:
    """Cut this rank's graph into the plan's stages (`passes.pipeline_split`) and set up the
    groups the step talks over: the pipeline's ranks, the stages sharing a parameter.

    A node runs on the stage of the captured node it comes from (``captured_stage``: the cost
    model's cut); a node the passes added (a collective's wait, the loss's weighting) on the
    latest stage of its inputs in the forward, the earliest in the backward."""
    lay = decisions.layout
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
    try:  # one stage per entry of the plan's stages (v per rank under interleaving)
        split = split_pipeline(gm, signature, node_stage, len(decisions.stages), others)
    except PipelineSplitError as exc:
        raise UnsupportedLayoutError(f"layout {lay.short()}: the stages {decisions.stages} cannot be "
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
    zero_rows = [p for p, decided in decisions.params.items() if decided.placements["dp"].is_shard]
    return PipelinePlan(graphs=split, rank=mesh.get_local_rank("pp"), pp=lay.pp,
                        group=mesh["pp"].get_group(), schedule=lay.schedule,
                        shared_groups=shared_groups, zero_sharded=zero_rows)


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


def _source(node, retraced: bool = True) -> str:
    """The captured node ``node`` comes from: itself, the matmul an FP8 cast serves, the node
    the TP pass retraced it from, or the forward node a recompute copy rebuilds."""
    served = node.meta.get("custom", {}).get(FP8_FOR)
    if served:
        return served
    sources = (node.meta.get("from_node") or []) if retraced else []
    if sources:
        return sources[0].name
    return node.meta.get("recomputes", node.name)


def _signature(gm, inputs, grad_index, loss_index, buffer_index) -> GraphSignature:
    return GraphSignature(inputs=list(inputs),
                          placeholders=[n.name for n in gm.graph.nodes if n.op == "placeholder"],
                          grad_index=dict(grad_index), loss_index=loss_index,
                          buffer_index=dict(buffer_index))


def _mesh_for(mesh: DeviceMesh | int, layout: Layout, device_type: str) -> DeviceMesh:
    """A ("dp", "tp") mesh for the layout, ("dp", "pp", "tp") under a pipeline, ("dp", "cp",
    "tp") under context parallelism (the playbook's rank order: TP innermost, in a node): the
    user's, if it already has that shape."""
    names = ("dp", "pp", "tp") if layout.pp > 1 else ("dp", "cp", "tp") if layout.cp > 1 else ("dp", "tp")
    shape = tuple(getattr(layout, n) for n in names)
    if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names == names and tuple(mesh.shape) == shape:
        return mesh
    if isinstance(mesh, DeviceMesh) and mesh.ndim > 1:
        raise InputError(f"the mesh has shape {tuple(mesh.shape)} but the plan's layout {layout.short()} "
                         f"needs {names} = {shape}: pass mesh={mesh.size()} and let autopar build it")
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


_LOCAL_GRAPHS = StepCache(size=4)


def _capture_local(model: nn.Module, local_inputs: tuple, loss_fn, ep: int = 1):
    """Capture the per-rank step; re-used (a fresh copy each time) for a model whose
    `step_key` is the same (class, attributes, mode, dtypes, inputs, loss), e.g. when trying
    several layouts. Under expert parallelism (``ep`` > 1) every expert list is grouped."""
    grouping = {"min_experts": 2} if ep > 1 else {}
    key = step_key(model, local_inputs, loss_fn, *grouping.values())
    graph = copy.copy(_LOCAL_GRAPHS.get(key, lambda: capture(model, local_inputs, loss_fn=loss_fn, **grouping)))
    graph.gm = copy.deepcopy(graph.gm)  # the passes rewrite it in place
    return graph


def _executable(layout: Layout, precision: str) -> None:
    """Raise `UnsupportedLayoutError` for any decision of ``layout`` the runtime cannot run."""
    missing = unsupported_decisions(layout)
    if layout.precision != precision and layout.precision != "fp8":
        missing.append(f"precision={layout.precision!r} on a {precision} model (the runtime runs the "
                       f"model's dtype; convert the model with model.to(...) instead)")
    if missing:
        raise UnsupportedLayoutError(
            f"layout {layout.short()}: autopar.parallelize does not execute "
            + "; ".join(missing) + " yet. Run a DP / ZeRO / TP / TP+SP layout (with any "
            "recompute) without them (pp=cp=ep=1, the model's precision), or use the plan for its "
            "predictions")


def _one_plan(choose: Callable[[], Plan]) -> Plan:
    """Rank 0's plan, on every rank. Ranks plan alike in principle, but a near tie between two
    layouts or TP roles can break another way in another process (floats summed in another
    order: Python's per-process hash seeds order sets), and ranks running different plans fail
    in a collective (gloo: "Received data size doesn't match expected size") or hang. Every
    rank plans and the ranks compare digests of their plans; where one differs rank 0's plan
    (JSON) is broadcast and a rank whose plan differs runs rank 0's decisions (on its own
    captured step). An error on any rank is raised on every rank (the first in rank order:
    the same exception where it pickles)."""
    if dist.get_world_size() == 1:
        return choose()
    mine, error, text = None, None, None
    try:
        mine = choose()
        text = mine.to_json()
    except Exception as exc:  # the others must not wait for a plan that never comes
        error = exc
    status: list = [None] * dist.get_world_size()
    dist.all_gather_object(status, ("error", _portable(error)) if error is not None
                           else ("plan", hashlib.sha256(text.encode()).hexdigest()))
    for kind, payload in status:
        if kind == "error":
            raise error if error is not None else payload
    if all(digest == status[0][1] for _, digest in status):
        return mine
    box = [text if dist.get_rank() == 0 else None]  # only when they differ: one plan's bytes
    dist.broadcast_object_list(box, src=0)
    if box[0] == text:
        return mine
    plan = Plan.from_json(box[0])
    plan._step = mine._step  # the same model and inputs: only the decisions differed
    return plan


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling (what the all-gather does), else an InputError saying it."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return InputError(f"a rank could not plan, so no rank runs: {type(exc).__name__}: {exc}")


def _choose_plan(model, example_inputs, loss_fn, plan, layout, cluster: Cluster) -> Plan:
    world = cluster.world_size
    batch = example_inputs[0].shape[0]
    precision = model_precision(model)  # the runtime inserts no casts: the model's dtype
    if plan is not None:
        if plan.fingerprint and plan.fingerprint != model_fingerprint(model):
            raise InputError("this plan was made for another model (parameter names or shapes "
                             "differ): plan again for this model")
        if plan.layout.world_size != world:
            raise InputError(f"this plan is for {plan.layout.world_size} devices "
                             f"({plan.cluster.describe()}) but {world} ranks are running")
        if plan.batch and plan.batch != batch:
            raise InputError(f"this plan is for a batch of {plan.batch} sequences, the example inputs "
                             f"hold {batch}: plan again for this batch")
        _executable(plan.layout, precision)
        return plan
    if layout is None:
        return make_plan(model, example_inputs, cluster=cluster, loss_fn=loss_fn, executable_only=True,
                         precision=precision)
    layout = layout.resolve(batch, precision)
    _executable(layout, precision)
    if layout.world_size != world:
        raise InputError(f"layout {layout.short()} needs {layout.world_size} ranks but {world} are "
                         "running: change the degrees to multiply to the world size")
    if batch % (layout.dp * layout.grad_accum):
        raise InputError(f"the batch of {batch} does not split over dp={layout.dp} ranks x "
                         f"grad_accum={layout.grad_accum} micro-batches")
    name = getattr(getattr(model, "config", None), "name", type(model).__name__)
    if layout.tp == 1:
        # price the layout on the per-rank micro-batch capture that parallelize runs
        # (activations are linear in the batch)
        local = tuple(x.chunk(layout.dp, dim=0)[0] for x in example_inputs)
        micro = tuple(x[: x.shape[0] // layout.grad_accum] for x in local)
        graph = _capture_local(model, micro, loss_fn, layout.ep)
        step = CapturedStep(graph, analyze(graph), getattr(model, "config", None),
                            fused=not cluster.gpu.is_cpu)  # CPU ranks run eager kernels
        facts = step.facts_for(cluster, layout).rebatch(batch)
        check_layout(facts, cluster, layout)
        return make_layout_plan(step, cluster, layout, model=name, fingerprint=model_fingerprint(model),
                                facts=facts)
    return make_plan(model, example_inputs, cluster=cluster, loss_fn=loss_fn, layout=layout)
