"""`ParallelModule`: the parallelised model, used like the original.

``loss = pm(*batch)`` runs this rank's graph (`runtime.executor.run_step`); ``pm.parameters()``
are DTensors with the plan's placements; ``pm.dump_graph()`` prints the rank's graph with each
collective commented with the decision behind it. ``pm.eval()`` runs the eval-mode forward
instead (`autopar.execution.evaluation`); ``pm.train()`` switches back to the training step.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from autopar.capture.graph import OutputTree
from autopar.errors import InputError
from autopar.execution.evaluation import (
    EvalGraphs,
    evaluate,
    refuse_expert_storage,
    refuse_pipeline,
)
from autopar.planning.plan import Plan
from runtime.executor import RankGraph, run_step
from runtime.pipeline import PipelinePlan
from vocab.plan_types import ExecutionReport


class ParallelModule(nn.Module):
    """The model, parallelised: call it like the original; its parameters are DTensors.

    Training (``pm.train()``, the default): ``pm(*batch)`` runs the plan's step and returns
    what the module returns, in its structure (the loss; ``(loss, logits)``; a dict or a
    ModelOutput): the step's loss in the loss's place, the other tensors those of this rank's
    slice of the batch, as DDP returns them (see docs/runtime.md, "Outputs"), not
    differentiated; ``loss.backward()`` fills ``p.grad`` of ``pm.parameters()``. Evaluation
    (``pm.eval()``, with or without ``torch.no_grad()``): the module's eval-mode forward on the
    DTensor weights, its output whole on every rank and in the module's own structure; no
    buffer is updated (BatchNorm reads its running statistics), dropout is off.

    Every rank must pass the same global batch (or, with ``local_batch=True``, its own
    data-parallel slice, all of one size, the same on the ranks of one TP group): each call
    all-gathers a small digest of the batch (shapes and a float64 sum over at most 256 strided
    elements per input) over the ranks and raises `InputError` where they disagree, on every
    rank alike. ``batch_check_calls``: how many calls are checked (None: all).

    RNG: dropout draws its masks from each rank's own default generator (the process's
    ``torch.manual_seed``). Under data parallelism each rank draws the masks of its own slice
    of the batch: a valid step, not the one a single device takes with the same seed. Under
    tensor parallelism the ranks of one TP group must draw alike (a replicated activation is one
    value on every TP rank): before each step whose graph draws random numbers, the generator
    state of the group's first rank is copied to the others (`_keep_tp_rng_in_step`), so
    whatever the seeds, a dropout on a replicated activation is the mask one device draws from
    that state; a dropout on a TP-sharded activation draws the same mask for every shard
    (correlated halves, not one device's mask). ``pm.eval()`` draws none.
    """

    batch_check_calls: int | None = None

    def __init__(self, module: nn.Module, rank_graph: RankGraph, plan: Plan, mesh: DeviceMesh,
                 input_shapes: list[tuple[int, ...]], canonical: list[str],
                 local_batch: bool = False, unloaded: set[str] | None = None,
                 original: nn.Module | None = None, loss_fn: Callable | None = None,
                 output_tree: OutputTree | None = None) -> None:
        super().__init__()
        # adopt the copy's children, weights and buffers: names stay those of the original
        self._modules.update(module._modules)
        self._parameters.update(module._parameters)
        self._buffers.update(module._buffers)
        self.plan = plan
        self.mesh = mesh
        self._rank_graph = rank_graph
        self._input_shapes = input_shapes
        self._canonical = canonical
        self._local_batch = local_batch
        self._unloaded = set(unloaded or ())  # shards of a meta model not yet filled
        # the copy itself, unregistered (its children are ours): its forward is the model's
        self.__dict__["_source"] = module
        self.__dict__["_loss_fn"] = loss_fn
        self.__dict__["_output_tree"] = output_tree
        self._eval_graphs = EvalGraphs()
        self._calls = 0
        if original is not None:
            guard_original(original)
        self.__dict__["_tp_rng"] = _tp_rng_source(rank_graph, mesh)

    @property
    def execution_report(self) -> ExecutionReport | None:
        """What the passes found as they rewrote this rank's graph (the ops run replicated, the
        values recomputed per block); ``pm.plan`` is the chosen plan carrying it."""
        return self.plan.execution

    def train(self, mode: bool = True) -> ParallelModule:
        """`nn.Module.train`: ``mode=False`` (``pm.eval()``) makes calls evaluate."""
        super().train(mode)
        self._source.training = mode
        return self

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """`nn.Module.load_state_dict`; for a model parallelised from the meta device this is
        how its shards are filled (after ``torch.distributed.checkpoint.load(sd, ...)``).

        A one-device state dict (whole plain tensors where the module holds DTensors, as
        ``torch.save(model.state_dict())`` writes) is loaded by `load_full_state_dict`, which
        needs every key of the model and no other (``strict`` is not relaxed there)."""
        own = dict(self.named_parameters(remove_duplicate=False))
        if any(isinstance(own.get(k), DTensor) and isinstance(v, torch.Tensor)
               and not isinstance(v, DTensor) for k, v in state_dict.items()):
            self.load_full_state_dict(state_dict)
            return _IncompatibleKeys([], [])
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self._unloaded -= set(state_dict)
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer whole, in the original module's names (on every rank)."""
        from autopar.execution.state_dict import full_state_dict

        return full_state_dict(self)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Fill each rank's shards from whole tensors in the original module's names (a
        one-device ``model.state_dict()``; the same dict on every rank)."""
        from autopar.execution.state_dict import load_full_state_dict

        load_full_state_dict(self, state_dict)
        self._unloaded -= set(state_dict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model under this plan: the total
        norm of every gradient as one device computes it (each element once, across pipeline
        stages, experts, shards and replicas), the gradients scaled by min(1, max_norm /
        norm); returns the norm. Collective: every rank calls it
        (`autopar.execution.grad_norm`). Torch's own function over ``pm.parameters()`` sees
        this rank's tensors only: a stage's or an expert rank's norm under pp or ep."""
        from autopar.execution.grad_norm import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite)

    def forward(self, *batch: torch.Tensor, **named: torch.Tensor):
        """The loss of the whole (global) batch, in the module's output structure beside its
        other outputs (this rank's slice's); ``loss.backward()`` fills the gradients.

        With ``local_batch=True`` at `parallelize`, ``batch`` is this rank's data-parallel
        slice (ranks of one TP group pass the same slice). Keyword arguments are bound to the
        original forward's parameters. In eval mode: the module's eval-mode output."""
        if named:
            batch = self._bind(batch, named)
        # another memory layout of the planned shapes (column-major ids, channels_last images)
        batch = tuple(x.contiguous() if isinstance(x, torch.Tensor) else x for x in batch)
        if self._unloaded:
            raise InputError(
                f"the model was parallelised from the meta device and {len(self._unloaded)} "
                f"parameters (e.g. {sorted(self._unloaded)[0]!r}) hold no values yet.\n  fix: fill "
                "the shards from a checkpoint first: sd = pm.state_dict(); "
                "torch.distributed.checkpoint.load(sd, checkpoint_id=...); pm.load_state_dict(sd)")
        shapes = [tuple(x.shape) for x in batch]
        planned = shapes == self._input_shapes
        if self.batch_check_calls is None or self._calls < self.batch_check_calls:
            check_same_batch(batch, self.mesh, self._local_batch, planned or not self.training,
                             self._input_shapes)
        self._calls += 1
        if not self.training:
            refuse_pipeline(self.plan.layout.pp)
            refuse_expert_storage(self.plan.layout.ep)
            return evaluate(self._eval_graphs, self._source, self.mesh, dict(self.named_parameters()),
                            dict(self.named_buffers()), batch, self._local_batch, self._loss_fn)
        if not planned:
            what = "this rank's slice of the example inputs" if self._local_batch else "the example inputs"
            raise InputError(
                f"batch shapes {shapes} differ from {what}, {self._input_shapes}, that the step "
                "was planned for: call autopar.parallelize again with these shapes"
            )
        dp = self.plan.layout.dp
        local = batch if self._local_batch else tuple(x.chunk(dp, dim=0)[_dp_rank(self.mesh)] for x in batch)
        named_params = dict(self.named_parameters(remove_duplicate=False))
        params = [(name, named_params[name]) for name in self._canonical]
        buffers = dict(self.named_buffers())
        if self._tp_rng is not None:
            _keep_tp_rng_in_step(*self._tp_rng, local[0].device)
        result = run_step(self._rank_graph, params, buffers, local)
        if self._output_tree is None:
            return result
        loss, *others = result if isinstance(result, tuple) else (result,)
        return self._output_tree.build(loss, others)

    def profile_step(self, *batch: torch.Tensor, path: str = "step.json") -> dict[str, float]:
        """One forward + backward under torch.profiler: writes its Chrome trace to ``path``,
        each event tagged with its track of the predicted timeline (`autopar.planning.measured`:
        compute, communication, pipeline p2p), and returns {"compute_s", "communication_s",
        "total_s", "loss"}: total_s the step's wall time, communication_s the union of the
        collectives' intervals on this rank, compute_s the rest. Every rank calls it (the step
        runs collectives; each writes its own ``path``); it leaves the step's gradients."""
        import json
        import time
        from pathlib import Path

        from torch.profiler import record_function

        from autopar.planning.measured import label_trace
        from runtime.profiling import quiet_profile

        if not self.training:
            raise InputError("profile_step profiles a training step but the module is in eval "
                             "mode; fix: call pm.train() first")
        with quiet_profile() as prof:
            t0 = time.perf_counter()
            with record_function("autopar forward"):
                loss = self._loss_of(self(*batch))
            with record_function("autopar backward"):
                loss.backward()
            total = time.perf_counter() - t0
        prof.export_chrome_trace(str(path))
        trace = json.loads(Path(path).read_text())
        comm = min(label_trace(trace)["communication_s"], total)
        Path(path).write_text(json.dumps(trace))
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss
        return {"compute_s": total - comm, "communication_s": comm, "total_s": total,
                "loss": float(value.detach())}

    def _loss_of(self, output) -> torch.Tensor:
        """The loss in an output of the module's structure."""
        if self._output_tree is None:
            return output
        return pytree.tree_leaves(output)[self._output_tree.loss_leaf]

    def _bind(self, batch: tuple, named: dict) -> tuple:
        """Positional inputs, in the captured order, from keyword arguments bound to the
        original forward's signature; `InputError` naming its parameters otherwise."""
        signature = inspect.signature(self._source.forward)
        takes = ", ".join(signature.parameters)
        n = len(self._input_shapes)
        try:
            bound = signature.bind(*batch, **named)
        except TypeError as exc:
            raise InputError(f"pm(...) takes the arguments of {type(self._source).__name__}.forward"
                             f"({takes}): {exc}") from exc
        values = list(bound.args)
        if len(values) != n or bound.kwargs:
            raise InputError(
                f"the step was captured with {n} positional inputs but these arguments bind to "
                f"{len(values)} positional and {sorted(bound.kwargs) or 'no'} keyword-only ones of "
                f"{type(self._source).__name__}.forward({takes}).\n  fix: pass the inputs the example "
                "inputs held, in that order or by these names")
        return tuple(values)

    def dump_graph(self, rank: int | None = None) -> str:
        """This rank's graph as Python, each collective commented with the decision behind it."""
        me = dist.get_rank() if dist.is_initialized() else 0
        head = f"# per-rank graph of rank {me} (layout {self.plan.layout.short()})"
        if rank is not None and rank != me:
            head += f"; rank {rank} runs the same graph on its own shards"
        if self._rank_graph.pipeline is not None:
            if rank is not None and rank != me:
                head += " if it runs the same pipeline stage (each stage runs its own graphs)"
            return _dump_stage(head, self._rank_graph.pipeline, self.plan)
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
                     "tangent": "seed gradient of the loss (1 / grad_accum, or with labels ignored "
                                "dp x this micro-batch's share of the step's valid tokens)"}
            note = reasons.get(node.name, "")
            lines.append(f"#   {node.name}: {label.get(kind, f'{kind} {name}')}" + (f" -- {note}" if note else ""))
        for line in self._rank_graph.gm.code.splitlines():
            name = line.strip().split(" = ")[0] if " = " in line else ""
            if name in reasons and not line.strip().startswith("#"):
                line = f"{line}  # {reasons[name]}"
            lines.append(line)
        return "\n".join(lines)


def _dump_stage(head: str, pipeline: PipelinePlan, plan: Plan) -> str:
    """The forward and backward graphs of this rank's pipeline stages, inputs and outputs named."""
    n = pipeline.graphs.pp
    lines = [head]
    for s in pipeline.stages:
        graphs = pipeline.graphs.stages[s]
        first, last = plan.stages[s]
        where = ("the embedding, " if s == 0 else "") + f"blocks {first}..{last}" + \
            (", the head and the loss" if s == n - 1 else "")
        lines.append(f"# pipeline stage {s} of {n} on pipeline rank {pipeline.rank} of {pipeline.pp} "
                     f"({where}), schedule {pipeline.schedule}, {plan.layout.grad_accum} micro-batches; "
                     f"parameters held: {len(graphs.params)}"
                     + (f"; shared with other ranks: {sorted(pipeline.shared_groups)}"
                        if pipeline.shared_groups else ""))
        sends = f"{graphs.n_sends} values sent to stage {s + 1}, " if s < n - 1 else ""
        lines += _stage_graph_lines(s, graphs.forward, graphs.forward_inputs, "forward",
                                    sends + f"{graphs.n_saved} saved for the backward"
                                    + (", the loss x its seed" if graphs.has_loss else ""))
        grads = f"{graphs.n_grad_sends} gradient slots sent to stage {s - 1}, " if s > 0 else ""
        split = graphs.weight_split
        if split is None:
            lines += _stage_graph_lines(s, graphs.backward, graphs.backward_inputs, "backward",
                                        grads + f"gradients of {len(graphs.grads)} parameters")
        else:  # zero-bubble: the weight half runs later, in the schedule's W action
            lines += _stage_graph_lines(s, split.input_grad, split.input_grad_inputs,
                                        "backward, input-gradient half",
                                        grads + f"{split.n_stash} values kept for the weight half")
            lines += _stage_graph_lines(s, split.weight_grad, split.weight_grad_inputs,
                                        "backward, weight-gradient half (run later, in a bubble)",
                                        f"gradients of {len(graphs.grads)} parameters")
    return "\n".join(lines)


def _stage_graph_lines(s: int, gm, inputs, title: str, outputs: str) -> list[str]:
    """One of stage ``s``'s graphs as code, its inputs named and its collectives commented."""
    what = {"recv": f"received from stage {s - 1}", "saved": "saved by this stage's forward",
            "input": "batch input (this micro-batch)", "tangent": "seed gradient of the loss",
            "stash": "kept from the input-gradient half"}
    lines = [f"# {title}, once per micro-batch; inputs:"]
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, source in zip(holders, inputs):
        kind = (f"gradient slot {source.index}, received from stage {s + 1}" if source.kind == "grad"
                else what.get(source.kind, source.kind))
        lines.append(f"#   {node.name}: {kind} {source.name}")
    lines.append(f"# outputs: {outputs}")
    reasons = {n.name: n.meta["autopar"] for n in gm.graph.nodes if "autopar" in n.meta}
    for line in gm.code.splitlines():
        if line.strip():
            name = line.strip().split(" = ")[0] if " = " in line else ""
            lines.append(f"{line}  # {reasons[name]}" if name in reasons else line)
    return lines


def _dp_rank(mesh: DeviceMesh) -> int:
    """This rank's coordinate on the data-parallel axis: which slice of the batch it runs."""
    return mesh.get_local_rank("dp")


_GUARDED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> parameter
_HOOK: list = []


def guard_original(model: nn.Module) -> None:
    """Make an optimizer over ``model``'s parameters (the DDP habit: built over the model passed
    to `parallelize`) an `InputError` at its first ``step()`` where none of its parameters has a
    gradient: the parallel module trains a copy, so those parameters never receive one and the
    optimizer would silently train nothing. Training the original on one device (its own
    backward fills its gradients) is left alone."""
    for p in model.parameters():
        _GUARDED[id(p)] = p
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_original))


def _refuse_original(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """The optimizer step pre-hook of `guard_original`."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(_GUARDED.get(id(p)) is p for p in params) or any(p.grad is not None for p in params):
        return
    raise InputError(
        f"{type(optimizer).__name__} steps the parameters of the model passed to "
        "autopar.parallelize, which the parallel module does not train (it trains its own "
        "DTensor copy), so they never receive a gradient and nothing would change.\n  fix: build "
        f"the optimizer over the parallel module: opt = torch.optim.{type(optimizer).__name__}"
        "(pm.parameters(), ...)")


_SAMPLE = 256  # elements per input summed into the digest


def check_same_batch(batch, mesh: DeviceMesh, local_batch: bool, shapes_ok: bool,
                     planned: list[tuple[int, ...]]) -> None:
    """`InputError` on every rank where the ranks' batches disagree: under ``local_batch=False``
    all ranks must pass the same global batch; with ``local_batch=True`` slices of one size,
    the ranks of one TP group the same slice. ``shapes_ok``: this rank's shapes are usable
    (all ranks learn of one rank's wrong shapes here, and raise together, instead of the others
    waiting in the step's collectives).

    Cost per call: a float64 sum over at most 256 strided elements of each input and one
    all-gather of 2 + 3 x (inputs) float64 values over the world group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [x for x in batch if isinstance(x, torch.Tensor)]
    row = [float(mesh.get_local_rank("dp")), float(shapes_ok)]
    for x in tensors:
        flat = x.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // _SAMPLE)][:_SAMPLE].double()
        weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=sample.device)
        row += [float(x.shape[0]) if x.dim() else 0.0, float(x.numel()), float((sample * weights).sum())]
    device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
    mine = torch.tensor(row, dtype=torch.float64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    try:
        dist.all_gather(rows, mine)
    except RuntimeError as exc:  # another number of inputs on some rank: rows of other lengths
        raise InputError("the ranks passed different numbers of inputs to pm(...): pass the same "
                         "batch on every rank") from exc
    _judge([r.tolist() for r in rows], local_batch, planned)


def _judge(rows: list[list[float]], local_batch: bool, planned: list[tuple[int, ...]]) -> None:
    """The error, if any, that the gathered batch digests ``rows`` (one per rank) call for."""
    bad = [r for r, row in enumerate(rows) if not row[1]]
    if bad:
        what = "this rank's data-parallel slice" if local_batch else "the global batch"
        raise InputError(f"rank {bad[0]} passed a batch whose shapes differ from those the step was "
                         f"planned for ({what}: {planned}).\n  fix: pass batches of the planned shapes "
                         "on every rank, or call autopar.parallelize again with the new shapes")
    sizes = {tuple(row[2::3]) + tuple(row[3::3]) for row in rows}
    if len(sizes) > 1:
        raise InputError(
            "the ranks passed batches of different sizes "
            f"({sorted(set(tuple(int(v) for v in row[2::3]) for row in rows))} rows).\n  fix: "
            + ("give every rank a slice of the same size (drop or pad the last, uneven batch)"
               if local_batch else "pass the same global batch on every rank"))
    for r, row in enumerate(rows):
        peers = [o for o, other in enumerate(rows) if other[0] == row[0] or not local_batch]
        differ = [o for o in peers if rows[o][4::3] != row[4::3]]
        if differ:
            raise InputError(
                f"ranks {r} and {differ[0]} passed different data"
                + (" in one tensor-parallel group (its ranks share one data-parallel slice)"
                   if local_batch else "") + ".\n  fix: "
                + ("pass the same slice on the ranks of a TP group" if local_batch else
                   "pass the same global batch on every rank, or parallelize with "
                   "local_batch=True and give each rank its own data-parallel slice"))


def _tp_rng_source(rank_graph: RankGraph, mesh: DeviceMesh):
    """(TP group, its first rank's global rank) when the step draws random numbers under
    tensor parallelism (an op tagged ``nondeterministic_seeded``: dropout, rand, bernoulli),
    else None."""
    if "tp" not in (mesh.mesh_dim_names or ()) or mesh["tp"].size() == 1:
        return None
    graphs = [rank_graph.gm] + ([rank_graph.accumulate_gm] if rank_graph.accumulate_gm is not None else [])
    if not any(torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ())
               for gm in graphs for n in gm.graph.nodes if n.op == "call_function"):
        return None
    group = mesh["tp"].get_group()
    return group, dist.get_global_rank(group, 0)


def _keep_tp_rng_in_step(group, source: int, device: torch.device) -> None:
    """Copy the default generator's state of the TP group's first rank to the others (one
    broadcast of a few kilobytes on CPU, of the seed and offset on CUDA)."""
    if device.type == "cuda":
        state = torch.cuda.get_rng_state(device).to(device)
        dist.broadcast(state, src=source, group=group)
        torch.cuda.set_rng_state(state.cpu(), device)
    else:
        state = torch.get_rng_state()
        dist.broadcast(state, src=source, group=group)
        torch.set_rng_state(state)
