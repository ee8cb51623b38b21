"""`autopar.parallelize`: run a plan on real process groups.

Each rank captures the training step for its slice of the batch, the passes rewrite that
graph for the plan (collectives for data parallelism and ZeRO), and the returned module is used
like the original: ``loss = pm(*batch)``, ``loss.backward()`` fills ``pm.parameters()`` (DTensors
with the plan's placements), any ``torch.optim`` optimizer steps them, and
``torch.distributed.checkpoint`` saves ``pm.state_dict()``.

The passes compose: the tensor-parallel pass (passes/tensor_parallel.py) turns the global graph
into one TP rank's graph, the data-parallel pass (passes/data_parallel.py) then adds gradient
reduction and ZeRO over the "dp" mesh axis. Executed today: DP, ZeRO 1/2/3, TP, TP+SP and their
products (a ("dp", "tp") mesh), with gradient accumulation (the step captured for one
micro-batch and run grad_accum times; see runtime/executor.py). Layouts with pipeline, context
or expert parallelism are planned but not yet executed: they raise a clear error.
Recomputation is a memory decision of the plan; the executed step keeps what the graph keeps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.analysis.graph import analyze
from autopar.capture.fingerprint import StepCache, model_fingerprint, step_key
from autopar.capture.joint import capture
from autopar.errors import AutoparError, InputError
from autopar.planning.plan import Plan
from autopar.planning.plan import make_plan as make_layout_plan
from autopar.planning.planner import plan as make_plan
from autopar.search.step import CapturedStep
from cost import Cluster, Layout
from cost.step import check_layout
from passes.data_parallel import apply_data_parallel
from passes.tensor_parallel import apply_tensor_parallel, parse_placement
from runtime.executor import RankGraph, run_step


class UnsupportedLayoutError(AutoparError):
    """The plan needs a parallelism the runtime does not execute yet."""


class ParallelModule(nn.Module):
    """The model, parallelised: call it like the original; its parameters are DTensors."""

    def __init__(self, module: nn.Module, rank_graph: RankGraph, plan: Plan, mesh: DeviceMesh,
                 global_shapes: list[tuple[int, ...]], canonical: list[str]) -> None:
        super().__init__()
        # adopt the copy's children, weights and buffers: names stay those of the original
        self._modules.update(module._modules)
        self._parameters.update(module._parameters)
        self._buffers.update(module._buffers)
        self.plan = plan
        self.mesh = mesh
        self._rank_graph = rank_graph
        self._global_shapes = global_shapes
        self._canonical = canonical

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        """The loss of the whole (global) batch; ``loss.backward()`` fills the gradients."""
        shapes = [tuple(x.shape) for x in batch]
        if shapes != self._global_shapes:
            raise InputError(
                f"batch shapes {shapes} differ from the example inputs {self._global_shapes} the "
                "step was planned for: call autopar.parallelize again with these shapes"
            )
        dp = self.plan.layout.dp
        local = tuple(x.chunk(dp, dim=0)[_dp_rank(self.mesh)] for x in batch)
        named = dict(self.named_parameters(remove_duplicate=False))
        params = [(name, named[name]) for name in self._canonical]
        buffers = dict(self.named_buffers())
        return run_step(self._rank_graph, params, buffers, local)

    def dump_graph(self, rank: int | None = None) -> str:
        """This rank's graph as Python, each collective commented with the decision behind it."""
        me = dist.get_rank() if dist.is_initialized() else 0
        head = f"# per-rank graph of rank {me} (layout {self.plan.layout.short()})"
        if rank is not None and rank != me:
            head += f"; rank {rank} runs the same graph on its own shards"
        nodes = list(self._rank_graph.gm.graph.nodes)
        reasons = {n.name: n.meta["autopar"] for n in nodes if "autopar" in n.meta}
        lines = [head]
        if self._rank_graph.accumulate_gm is not None:
            lines.append(f"# the last of {self._rank_graph.micro_batches} micro-batches; the earlier ones run it "
                         "without the gradient reduction, and their sums come in as 'accum' inputs")
        lines.append("# inputs:")
        placeholders = [n for n in nodes if n.op == "placeholder"]
        for node, (kind, name) in zip(placeholders, self._rank_graph.inputs):
            part = "one micro-batch of this rank's slice" if self._rank_graph.micro_batches > 1 else "this rank's slice"
            label = {"input": f"batch input {name} ({part})",
                     "tangent": "seed gradient of the loss (1 / grad_accum)"}
            note = reasons.get(node.name, "")
            lines.append(f"#   {node.name}: {label.get(kind, f'{kind} {name}')}" + (f" -- {note}" if note else ""))
        for line in self._rank_graph.gm.code.splitlines():
            name = line.strip().split(" = ")[0] if " = " in line else ""
            if name in reasons and not line.strip().startswith("#"):
                line = f"{line}  # {reasons[name]}"
            lines.append(line)
        return "\n".join(lines)


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | int,
    example_inputs: Sequence[torch.Tensor] | None = None,
    loss_fn: Callable | None = None,
    plan: Plan | None = None,
    layout: Layout | None = None,
) -> ParallelModule:
    """Parallelise ``model``'s training step over ``mesh`` (a DeviceMesh or a world size).

    ``example_inputs`` are one global batch (dim 0 split over data-parallel ranks). The layout
    comes from ``plan``, else ``layout``, else the solver on `Cluster.local()` with the mesh's
    size. Must be called on every rank of an initialised process group.
    """
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
    if any(p.device.type == "meta" for p in model.parameters()):
        raise InputError("parallelize needs the model's weights: build it on a real device "
                         "(device='meta' is for planning only)")
    example_inputs = tuple(example_inputs)
    batch = example_inputs[0].shape[0]
    chosen = _choose_plan(model, example_inputs, loss_fn, plan, layout, world)
    lay = chosen.layout
    if max(lay.pp, lay.cp, lay.ep) > 1:
        raise UnsupportedLayoutError(
            f"layout {lay.short()}: executing pipeline, context or expert parallelism is not "
            "implemented yet (planning is); run a DP / ZeRO / TP / TP+SP layout (pp=cp=ep=1) or "
            "use the plan for its predictions"
        )
    if batch % lay.dp:
        raise InputError(f"the batch of {batch} does not split over {lay.dp} data-parallel ranks: "
                         f"use a batch that is a multiple of {lay.dp}")
    m = lay.grad_accum
    if (batch // lay.dp) % m:
        raise InputError(f"each data-parallel rank gets {batch // lay.dp} sequences, which do not split "
                         f"into grad_accum={m} micro-batches: use a batch that is a multiple of "
                         f"dp * grad_accum = {lay.dp * m}")
    mesh = _mesh_for(mesh, lay, device_type)

    # the step is captured for one micro-batch; the executor runs it grad_accum times
    local_inputs = tuple(x.chunk(lay.dp, dim=0)[_dp_rank(mesh)] for x in example_inputs)
    micro_inputs = tuple(x[: x.shape[0] // m] for x in local_inputs)
    graph = _capture_local(model, micro_inputs, loss_fn)
    inputs = [(i.kind, i.name) for i in graph.inputs]
    grads = {o.name: o.index for o in graph.outputs if o.kind == "grad"}
    loss_index = next(o.index for o in graph.outputs if o.kind == "loss")
    gm, shapes = graph.gm, dict(graph.param_shapes)
    tp_placements = {name: parse_placement(axes.get("tp", "Replicate()"))
                     for name, axes in chosen.placements.items()} if lay.tp > 1 else {}
    if lay.tp > 1:
        holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        traced = apply_tensor_parallel(
            gm, inputs, [tuple(n.meta["val"].shape) for n in holders], tp_placements, mesh["tp"],
            lay.sp, {i: n for n, i in grads.items()}, loss_index)
        gm = traced.gm
        shapes.update(traced.local_shapes)
    holders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    params = {name: node for (kind, name), node in zip(inputs, holders) if kind == "param"}
    sharded: set[str] = set()
    accumulate_gm = None
    if lay.dp > 1:
        seed = next(node for (kind, _), node in zip(inputs, holders) if kind == "tangent")
        dp_args = (params, grads, loss_index, shapes, lay.zero, lay.dp, mesh["dp"].get_group().group_name,
                   seed, _dp_rank(mesh), device_type != "cpu")  # gloo: ZeRO reduces by all-reduce
        # whole gradients on every rank (DP, ZeRO-1): reduce once per step, after the last
        # micro-batch; sharded gradients (ZeRO-2/3) are reduced by every micro-batch
        no_sync = m > 1 and lay.zero <= 1
        if no_sync:
            accumulate_gm = copy.deepcopy(gm)
            apply_data_parallel(accumulate_gm, *dp_args, sync="none")
        sharded = apply_data_parallel(gm, *dp_args, sync="accumulated" if no_sync else "reduce")
        inputs += [("accum", node.meta["accumulates"]) for node in gm.graph.nodes
                   if node.op == "placeholder" and "accumulates" in node.meta]
    rank_graph = RankGraph(
        gm=gm,
        inputs=[(kind, name[len("input"):] if kind == "input" else name) for kind, name in inputs],
        loss_index=loss_index,
        grad_index=grads,
        micro_batches=m,
        accumulate_gm=accumulate_gm,
    )
    # the user's model stays as it was; the parallel module owns a copy with DTensor weights
    module = copy.deepcopy(model)
    _to_dtensors(module, mesh, lay, sharded, tp_placements, graph.aliases)
    return ParallelModule(module, rank_graph, chosen, mesh, [tuple(x.shape) for x in example_inputs],
                          list(params))


def _mesh_for(mesh: DeviceMesh | int, layout: Layout, device_type: str) -> DeviceMesh:
    """A ("dp", "tp") mesh for the layout: the user's, if it already has that shape."""
    shape = (layout.dp, layout.tp)
    if isinstance(mesh, DeviceMesh) and mesh.mesh_dim_names == ("dp", "tp") and tuple(mesh.shape) == shape:
        return mesh
    if isinstance(mesh, DeviceMesh) and mesh.ndim == 2 and tuple(mesh.shape) != shape:
        raise InputError(f"the mesh has shape {tuple(mesh.shape)} but the plan's layout {layout.short()} "
                         f"needs (dp, tp) = {shape}: pass mesh={mesh.size()} and let autopar build it")
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "tp"))


def _dp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the data-parallel axis: which slice of the batch it runs."""
    return mesh.get_local_rank("dp")


_LOCAL_GRAPHS = StepCache(size=4)


def _capture_local(model: nn.Module, local_inputs: tuple, loss_fn):
    """Capture the per-rank step; re-used (a fresh copy each time) for a model of the same
    class, parameter names and shapes, and input shapes, e.g. when trying several layouts."""
    key = step_key(model, local_inputs, loss_fn)
    graph = copy.copy(_LOCAL_GRAPHS.get(key, lambda: capture(model, local_inputs, loss_fn=loss_fn)))
    graph.gm = copy.deepcopy(graph.gm)  # the passes rewrite it in place
    return graph


def _choose_plan(model, example_inputs, loss_fn, plan, layout, world) -> Plan:
    if plan is not None:
        if plan.fingerprint and plan.fingerprint != model_fingerprint(model):
            raise InputError("this plan was made for another model (parameter names or shapes "
                             "differ): plan again for this model")
        if plan.layout.world_size != world:
            raise InputError(f"this plan is for {plan.layout.world_size} devices "
                             f"({plan.cluster.describe()}) but {world} ranks are running")
        return plan
    cluster = Cluster.local(ranks=world, threads_per_rank=torch.get_num_threads())
    if layout is not None:
        batch = example_inputs[0].shape[0]
        if batch % layout.dp == 0 and layout.tp == 1:
            # price the layout on the per-rank micro-batch capture that parallelize runs
            # (activations are linear in the batch)
            local = tuple(x.chunk(layout.dp, dim=0)[0] for x in example_inputs)
            micro = tuple(x[: max(1, x.shape[0] // layout.grad_accum)] for x in local)
            graph = _capture_local(model, micro, loss_fn)
            fused = not cluster.gpu.is_cpu  # CPU ranks run eager kernels
            facts = CapturedStep(graph, analyze(graph), getattr(model, "config", None), fused=fused).facts()
            check_layout(facts.rebatch(batch), cluster, layout)
            return make_layout_plan(facts.rebatch(batch), cluster, layout,
                                    model=getattr(getattr(model, "config", None), "name", type(model).__name__),
                                    fingerprint=model_fingerprint(model))
        return make_plan(model, example_inputs, cluster=cluster, loss_fn=loss_fn, layout=layout)
    return make_plan(model, example_inputs, cluster=cluster, loss_fn=loss_fn, executable_only=True)


def _to_dtensors(module: nn.Module, mesh: DeviceMesh, layout: Layout, sharded: set[str],
                 tp_placements: dict, aliases: dict[str, str]) -> None:
    """Replace every parameter by an nn.Parameter holding a DTensor with the plan's placements.

    On the ("dp", "tp") mesh a weight is first split over TP, then (ZeRO) its TP shard's rows
    over DP; when both split dim 0 that is DTensor's right-to-left `_StridedShard` order.
    """
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    made: dict[int, nn.Parameter] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for pname, p in list(sub._parameters.items()):
            if p is None:
                continue
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            canonical = aliases.get(full_name, full_name)
            if id(p) not in made:
                data = p.detach()
                tp_place = tp_placements.get(canonical, Replicate())
                local = data
                if isinstance(tp_place, Shard):
                    local = local.chunk(layout.tp, dim=tp_place.dim)[tp_rank]
                dp_place = Replicate()
                if canonical in sharded:
                    local = local.chunk(layout.dp, dim=0)[dp_rank]
                    strided = isinstance(tp_place, Shard) and tp_place.dim == 0 and layout.tp > 1
                    dp_place = _StridedShard(0, split_factor=layout.tp) if strided else Shard(0)
                dt = DTensor.from_local(local.contiguous().clone(), mesh, [dp_place, tp_place],
                                        run_check=False, shape=data.shape, stride=data.stride())
                made[id(p)] = nn.Parameter(dt, requires_grad=p.requires_grad)
            sub._parameters[pname] = made[id(p)]
