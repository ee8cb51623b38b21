"""`autopar.parallelize`: run a plan on real process groups.

Each rank captures the training step for its slice of the batch, the passes rewrite that
graph for the plan (collectives for data parallelism and ZeRO), and the returned module is used
like the original: ``loss = pm(*batch)``, ``loss.backward()`` fills ``pm.parameters()`` (DTensors
with the plan's placements), any ``torch.optim`` optimizer steps them, and
``torch.distributed.checkpoint`` saves ``pm.state_dict()``.

The plan's decisions (`vocab.plan_types.PlanDecisions`) travel to the passes as typed parts,
through the declared list `autopar.execution.rewrite.PASSES` (its docstring gives the order and
the reason for it); the plan is never edited: what the passes find as they run (the ops run
replicated, the values recomputed) is the rank's `vocab.plan_types.ExecutionReport`, which
``pm.plan`` (the chosen plan `Plan.with_execution`) and ``pm.execution_report`` carry. Executed today: DP, ZeRO 1/2/3, TP, TP+SP
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
the module then holds only its stages' parameters. Context parallelism (cp > 1, with DP, ZeRO,
TP and SP, pipelines with ZeRO 0 or 1, and recompute) runs on a ("dp", "cp", "tp") mesh
(("dp", "pp", "cp", "tp") with a pipeline): after TP's place, the context-parallel pass
(passes/context_parallel.py) splits every sequence over "cp" (SP's splits then cut the CP rank's
own sequence over "tp", passes/cp_sequence_parallel.py) and runs attention as ring attention on
the rank's TP heads, leaving partial gradients that the DP pass reduces over the dp x cp ranks
(a pipeline's DP reduction sums them once per step over the dp x cp ranks); the parameters live on the
("dp", "tp") mesh, replicated over cp, or under ZeRO sharded over the dp x cp ranks
(`runtime.mesh.dp_cp_mesh`). Expert parallelism
(ep > 1, with DP, ZeRO, TP, pipelines and FP8) groups every list of alike experts at capture and
the expert-parallel pass (passes/expert_parallel.py) runs each rank's share of the experts on the
tokens of ep consecutive dp ranks, with all-to-alls; each rank stores only its experts' parameters
(the module holds no others), on the ("dp", "tp") mesh of their owners (`runtime.mesh.expert_mesh`).
Experts stacked in one parameter (transformers' MoE blocks) are dispatched by all-gather and
combined by reduce-scatter (passes/expert_parallel_stacked.py), each rank holding its rows of the
parameter (`runtime.mesh.stacked_expert_mesh`). Any
other decision (ZeRO-2/3 inside a pipeline, cp with weights tied across pipeline
stages, ep with cp, a precision other than the model's) is an
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
import functools
import hashlib
import pickle
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.analysis.graph import analyze
from autopar.capture.fingerprint import StepCache, model_fingerprint, step_key
from autopar.capture.joint import TrainingGraph, capture, capture_with_sources
from autopar.capture.outputs import output_joins
from autopar.errors import InputError
from autopar.execution.module import ParallelModule, _dp_rank
from autopar.execution.placement import _to_dtensors
from autopar.execution.rewrite import (  # noqa: F401  (_recompute, _signature: tests read them here)
    RankRewrite,
    UnsupportedLayoutError,
    _recompute,
    _signature,
    captured_signature,
    read_captured,
    rewrite,
)
from autopar.planning.plan import Plan
from autopar.planning.plan import make_plan as make_layout_plan
from autopar.planning.planner import model_precision
from autopar.planning.planner import plan as make_plan
from autopar.search.step import CapturedStep
from cost import Cluster, Layout
from cost.step import check_layout
from passes.loss_reduction import ONE_ROW, LossReduction, analyze_loss, for_layout
from runtime.executor import RankGraph
from runtime.mesh import dp_cp_mesh, expert_mesh, stacked_expert_mesh
from vocab.layout import unsupported_decisions
from vocab.plan_types import GraphSignature, OutputJoin


class LossReductionError(InputError):
    """The loss's reduction over the batch cannot be proven to split exactly."""


LOSS_REDUCTIONS = ("exact", "mean_per_rank")


def _loss_reduction(gm, signature: GraphSignature, lay: Layout, mode: str,
                    sources: Callable[[], fx.GraphModule] | None = None,
                    two_rows: Callable[[], TrainingGraph] | None = None) -> LossReduction | None:
    """How the loss splits over the layout's pieces of the batch; None where nothing splits it
    (dp = 1 and grad_accum = 1) or the user accepted per-piece means ("mean_per_rank").
    Raises `LossReductionError` for a loss not proven linear in the batch, naming the user's
    source line of the op (``sources``: the step traced again with them). At one row per piece
    an op along dim 0 is proven on the step captured at two rows (``two_rows``), where the batch
    dim is told apart (transformers' MoE counts its experts' tokens with a cumsum)."""
    if mode == "mean_per_rank" or (lay.dp == 1 and lay.grad_accum == 1):
        return None
    reduction = analyze_loss(gm, signature)
    if reduction.mode == "unproven" and ONE_ROW in reduction.why and two_rows is not None:
        wider = two_rows()
        if analyze_loss(wider.gm, captured_signature(wider)).mode != "unproven":
            reduction = analyze_loss(gm, signature, rows_proven=True)
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
    cluster = (Cluster.detect() if device_type == "cuda"
               else Cluster.local(ranks=world, threads_per_rank=torch.get_num_threads()))
    chosen = _one_plan(lambda: _choose_plan(model, example_inputs, loss_fn, plan, layout, cluster))
    lay = chosen.layout
    m = lay.grad_accum
    batch = example_inputs[0].shape[0]
    if batch % (lay.dp * m):
        raise InputError(f"the batch of {batch} does not split over dp={lay.dp} ranks x grad_accum={m} "
                         f"micro-batches: use a batch that is a multiple of dp * grad_accum = {lay.dp * m}")
    mesh = _mesh_for(mesh, lay, device_type)

    # the step is captured for one micro-batch; the executor runs it grad_accum times
    local_inputs = tuple(x.chunk(lay.dp, dim=0)[_dp_rank(mesh)] for x in example_inputs)
    micro_inputs = tuple(x[: x.shape[0] // m] for x in local_inputs)
    graph = _capture_local(model, micro_inputs, loss_fn, lay.ep)
    signature = captured_signature(graph)

    @functools.cache
    def two_rows() -> tuple[TrainingGraph, GraphSignature]:  # where one row per piece is too few
        wider = capture(model, tuple(x[:2] for x in example_inputs), loss_fn=loss_fn)
        return wider, captured_signature(wider)

    reduction = _loss_reduction(graph.gm, signature, lay, loss_reduction,
                                lambda: capture_with_sources(model, micro_inputs, loss_fn).gm,
                                lambda: two_rows()[0])
    # a ratio over the loss's normalisers reads the step-wide ones the runtime feeds
    fed = frozenset(reduction.denominators) if reduction is not None and reduction.mode == "global" else frozenset()
    joins = output_joins(model, graph, signature, micro_inputs, local_inputs, loss_fn, m, two_rows, fed)
    if lay.cp > 1 and any(j.step_wide for j in joins):
        raise InputError(
            f"layout {lay.short()}: an output other than the loss divides by the loss's normaliser "
            "(a copy of a cross-entropy loss), which under context parallelism is not made the "
            "step's value; fix: return the loss alone (it is the step's), or use cp=1")
    # the passes of `rewrite.PASSES`, in order, each on its part of the plan; the plan is
    # never edited: what they find is the execution report pm.plan carries
    state = RankRewrite(gm=graph.gm, signature=signature, shapes=dict(graph.param_shapes),
                        decisions=chosen.decisions, mesh=mesh, strict=strict, reduction=reduction,
                        captured=read_captured(graph, chosen.decisions), others=_other_outputs(graph))
    report = rewrite(state)
    # the user's model stays as it was; the parallel module owns a copy with DTensor weights
    # (under a pipeline only those of this rank's stage)
    module = copy.deepcopy(model)
    held = state.pipeline.params if state.pipeline else None
    params_mesh = mesh
    if lay.cp > 1 and lay.pp == 1:  # parameters are replicated over cp: each cp rank's copy on
        # its (dp, tp) mesh, ZeRO shards them over the dp x cp ranks (a pipeline's stage holds its
        # parameters on the (dp, tp) mesh of its stage, replicated over cp)
        params_mesh = dp_cp_mesh(mesh) if lay.zero else mesh["dp", "tp"]
        mesh = mesh["dp", "tp"]
    elif lay.cp > 1 and lay.zero:  # a pipeline's ZeRO-1 rows over the dp x cp ranks
        params_mesh = dp_cp_mesh(mesh)
    meshes = None
    if lay.ep > 1:  # each rank stores its own experts only, on their owners' ("dp", "tp") mesh
        stored = set(state.signature.placeholder_of("param"))
        held = stored if held is None else stored & held  # under a pipeline: of the rank's stage
        meshes = dict.fromkeys(state.expert_params, expert_mesh(mesh, lay.ep)["dp", "tp"])
        meshes.update(dict.fromkeys(state.stacked_experts, stacked_expert_mesh(mesh, lay.ep)))
    unloaded = _to_dtensors(module, params_mesh, chosen.decisions, graph.aliases, held, meshes)
    shapes_in = [tuple(x.shape) for x in (local_inputs if local_batch else example_inputs)]
    canonical = [p for p in state.signature.placeholder_of("param") if held is None or p in held]
    return ParallelModule(module, _rank_graph(state, joins), chosen.with_execution(report), mesh,
                          shapes_in, canonical, local_batch=local_batch, unloaded=unloaded, original=model,
                          loss_fn=loss_fn, output_tree=graph.output_tree)


def _rank_graph(state: RankRewrite, joins: list[OutputJoin]) -> RankGraph:
    """What the executor runs on this rank: the rewritten graph, what feeds it and reads it
    (``joins``: how each other output joins over the micro-batches, `output_joins`)."""
    lay, signature = state.layout, state.signature
    inputs = list(signature.inputs) + state.accum_inputs
    dp, group = lay.dp, state.mesh["dp"].get_group() if lay.dp > 1 else None
    partial = 1
    if lay.pp > 1 and lay.cp > 1:
        # a pipeline under cp: the stages leave partial gradients over cp (the CP pass), summed
        # once per step over the dp x cp ranks after the schedule, as the cost model prices it
        # (ZeRO-1: each rank keeps its rows of the dp x cp shards)
        dp, group, partial = lay.dp * lay.cp, dp_cp_mesh(state.mesh)["dp"].get_group(), lay.cp
    owners = None
    if lay.pp > 1 and lay.ep > 1:
        # a pipeline under ep: the experts' gradients are summed after the schedule over their
        # owners (the dp/ep ranks of the stage storing them), ZeRO-1's rows over those ranks
        owners = expert_mesh(state.mesh, lay.ep)["dp"]
        owners = (state.expert_params, owners.get_group(), owners.size(), owners.get_local_rank())
    return RankGraph(
        gm=state.gm,
        inputs=[(kind, name[len("input"):] if kind == "input" else name) for kind, name in inputs],
        loss_index=signature.loss_index,
        grad_index=signature.grad_index,
        micro_batches=lay.grad_accum,
        accumulate_gm=state.accumulate_gm,
        buffer_index=signature.buffer_index,
        reduction=state.reduction,
        dp=dp,
        dp_group=group,
        dp_partial=partial,
        expert_owners=owners,
        pipeline=state.pipeline,
        other_index=list(state.others),
        other_join=list(joins),
    )


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


def _mesh_for(mesh: DeviceMesh | int, layout: Layout, device_type: str) -> DeviceMesh:
    """A ("dp", "tp") mesh for the layout, ("dp", "pp", "tp") under a pipeline, ("dp", "cp",
    "tp") under context parallelism, ("dp", "pp", "cp", "tp") under both (the playbook's rank
    order: TP innermost, in a node): the user's, if it already has that shape."""
    names = ("dp",) + (("pp",) if layout.pp > 1 else ()) + (("cp",) if layout.cp > 1 else ()) + ("tp",)
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


def _executable(layout: Layout, precision: str, refused: Sequence[str] = ()) -> None:
    """Raise `UnsupportedLayoutError` for any decision of ``layout`` the runtime cannot run
    (``refused``: a plan's own list, `autopar.search.executable.refusals` on its model)."""
    missing = list(dict.fromkeys([*unsupported_decisions(layout), *refused]))
    if layout.precision != precision and layout.precision != "fp8":
        missing.append(f"precision={layout.precision!r} on a {precision} model (the runtime runs the "
                       f"model's dtype; convert the model with model.to(...) instead)")
    if missing:
        raise UnsupportedLayoutError(
            f"layout {layout.short()}: autopar.parallelize does not execute "
            + "; ".join(missing) + " yet. Drop what is named (each says what runs today: DP, ZeRO, "
            "TP+SP, pipelines with ZeRO 0/1, cp with DP, ZeRO, TP+SP, pipelines and FP8, ep with DP, "
            "ZeRO, TP+SP, pipelines and FP8, any recompute, the model's precision), or use the plan for its predictions")


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
        _executable(plan.layout, precision, plan.refused)
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
