"""Run one rank's rewritten joint graph as a training step that autograd understands.

The joint graph computes the loss and every gradient in one call. `run_step` wraps it in an
autograd Function: its forward runs the whole graph and keeps the gradients; its backward,
reached by ``loss.backward()``, hands them to the parameters (scaled by the incoming gradient,
1 for a plain ``loss.backward()``). Parameters are DTensors: the graph reads their local
shards and the gradients are wrapped back with the same placements.

Gradient accumulation: with ``micro_batches`` m > 1 the graph was captured for one micro-batch
and runs m times on the rank's batch, one slice after another, so only one micro-batch's
activations live at a time. The loss's seed gradient is 1/m, so the summed gradients are those
of the mean loss over the rank's batch. Where the loss divides by a batch sum (a mean over
valid tokens, class weights, a mask's sum: `passes.loss_reduction`) the seeds and the
rewritten normalisers make the pieces add up to the one-device loss: the counter computes
each micro-batch's normalisers before the step, summed over the micro-batches and all-reduced
over the d data-parallel ranks (one all-reduce per step), and the graph reads each as N / (d m)
(`LossReduction.mode` "global"; a piece without a valid label then adds 0, as on one device).
The graph returns its loss weighted by the seed (`weight_loss_by_seed`), and the reported loss
is the sum of the m weighted losses: the mean of the step. With an
``accumulate_gm`` (DP and ZeRO-1: gradients are whole on every rank anyway) the first m-1
micro-batches run it, without any gradient reduction, and the last runs ``gm``, which adds
their sums (its "accum" inputs) and reduces once, as DDP's ``no_sync`` does; otherwise (ZeRO-2/3,
whose gradients must stay sharded) every micro-batch reduces its own.

A pipeline stage (``RankGraph.pipeline``) runs its stage's graphs under the plan's schedule
instead (runtime/pipeline.py), with the same seeds; data parallelism around the pipeline
reduces once, after the schedule.

Buffers the forward updates in place (BatchNorm's running statistics, a step counter): the
captured graph is functional and returns their new values (``RankGraph.buffer_index``); after
every micro-batch they are copied into the module's buffer tensors, so m micro-batches update
them m times, as m eager forwards would. Each rank updates its own buffers from its own slice of
the batch (as DDP without SyncBatchNorm does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.distributed.tensor import DTensor

from runtime.pipeline import (
    PipelinePlan,
    gather_rows,
    reduce_data_parallel,
    reduce_experts,
    run_pipeline_step,
)
from vocab.plan_types import LOSS, OutputJoin

# the loss's normalisers over the whole step (`passes.loss_reduction.DENOMINATOR`)
DENOMINATOR = "denominator"


@dataclass
class RankGraph:
    """One rank's executable step: the graph and what feeds its inputs and reads its outputs."""

    gm: fx.GraphModule
    inputs: list[tuple[str, str]]  # (kind, name) per placeholder: param | buffer | input | tangent
    #   | zero_tangent (seed of an output other than the loss: 0) | accum
    loss_index: int
    grad_index: dict[str, int]  # parameter name -> output index
    micro_batches: int = 1  # gradient accumulation: the graph runs once per micro-batch
    accumulate_gm: fx.GraphModule | None = None  # micro-batches before the last, if they skip the sync
    buffer_index: dict[str, int] = field(default_factory=dict)  # buffer -> output of its new value
    # how the loss's batch reduction splits exactly (`passes.loss_reduction.LossReduction`: its
    # mode and counter); None: every micro-batch weighs the same (a plain mean, or
    # ``loss_reduction="mean_per_rank"``)
    reduction: object = None
    dp: int = 1  # data-parallel ranks the step's normalisers are summed over
    dp_group: object = None  # their process group (torch.distributed.ProcessGroup)
    # ranks of ``dp`` in sets of this many sharing one batch slice, each holding partial sums of
    # its gradients (context parallelism in a pipeline): the step averages over dp / partial slices
    dp_partial: int = 1
    # a pipeline under expert parallelism: (the rank's expert parameters, their owners' process
    # group, its size, this rank's index in it); their gradients are summed over the owners
    expert_owners: tuple | None = None
    # a pipeline stage's step (runtime/pipeline.py): ``gm`` is the whole rank graph, kept for
    # reading; the stage's own graphs run under the plan's schedule
    pipeline: PipelinePlan | None = None
    # outputs of the forward other than the loss (logits, a dict's fields): their output
    # indices, returned after the loss (`merge_micro_batches`), not differentiated, and how
    # each joins over the micro-batches (`join_micro_batches`)
    other_index: list[int] = field(default_factory=list)
    other_join: list[OutputJoin] = field(default_factory=list)


class _JointStep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rank_graph: RankGraph, names: list[str], buffers: dict, user_inputs: tuple, *params):
        by_name = dict(zip(names, params))
        m = rank_graph.micro_batches
        device = user_inputs[0].device
        # every graph of the step has the same leading placeholders: their shapes, read once
        holders = [n for n in rank_graph.gm.graph.nodes if n.op == "placeholder"]
        # the seed in the loss's dtype (a bf16 model's loss is bf16)
        dtype = next((h.meta["val"].dtype for h, (kind, _) in zip(holders, rank_graph.inputs)
                      if kind == "tangent"), torch.float32)
        weights, denominators = _seeds(rank_graph, user_inputs, buffers, device)
        # read before the step: the micro-batches update buffers in place
        shares = ratio_shares(rank_graph.other_join, user_inputs, buffers, m)
        seeds = [torch.full((), s, dtype=dtype, device=device) for s in weights]
        loss = None
        sums: dict[str, torch.Tensor] = {}
        others: list[list[torch.Tensor]] = []
        for micro in range(m):
            last = micro == m - 1
            early = rank_graph.accumulate_gm is not None and not last
            args = []
            for kind, name in rank_graph.inputs:
                if kind == "param":
                    p = by_name[name]
                    args.append(p.to_local() if isinstance(p, DTensor) else p)
                elif kind == "buffer":
                    args.append(buffers[name])
                elif kind == "input":
                    args.append(user_inputs[int(name)].chunk(m)[micro])
                elif kind == "tangent":  # the loss's seed gradient
                    args.append(seeds[micro])
                elif kind == DENOMINATOR:  # the loss's normaliser over the whole step, / (d m)
                    val = holders[len(args)].meta["val"]
                    args.append(denominators[int(name)].to(device=device, dtype=val.dtype))
                elif kind == "zero_tangent":  # another output's: returned, not differentiated
                    val = holders[len(args)].meta["val"]
                    args.append(torch.zeros(tuple(val.shape), dtype=val.dtype, device=device))
                elif not early:  # "accum": the earlier micro-batches' sums, reduced by this graph
                    args.append(loss if name == LOSS else sums.pop(name))
            if not early and rank_graph.accumulate_gm is not None:
                loss = None  # the last graph returns the total
            with torch.no_grad():
                out = (rank_graph.accumulate_gm if early else rank_graph.gm)(*args)
                # in place, before the next micro-batch reads them: eager's running statistics
                for name, index in rank_graph.buffer_index.items():
                    buffers[name].copy_(out[index])
            for name, index in rank_graph.grad_index.items():
                g = out[index]
                if g is not None:  # out of place: a gradient may be a view the graph shares
                    sums[name] = g if name not in sums else sums[name] + g
            part = out[rank_graph.loss_index].detach()  # weighted by its seed
            loss = part if loss is None else loss + part
            others.append([out[i] for i in rank_graph.other_index])
        _save_grads(ctx, _as_parameters(sums, names, params))
        merged = merge_micro_batches(others, rank_graph.other_join, shares)
        return _with_others(ctx, loss, step_wide_outputs(rank_graph, merged))

    @staticmethod
    def backward(ctx, grad_loss, *grad_others):
        # saved for backward: autograd frees them after it unless retain_graph=True, and a
        # second backward then hands them out again (accumulating, as eager does)
        grads = [None if missing else g for g, missing in zip(ctx.saved_tensors, ctx.missing)]
        scale = grad_loss.item()  # the loss is a scalar: 1 for a plain loss.backward()
        scaled = grads if scale == 1.0 else [None if g is None else g * scale for g in grads]
        return (None, None, None, None, *scaled)


class _PipelineStep(torch.autograd.Function):
    """A pipeline stage's step: the schedule runs in the forward (every micro-batch's forward
    and backward), the summed gradients are handed to the parameters by ``loss.backward()``.

    Data parallelism around the pipeline: ZeRO-1's rows are all-gathered before the schedule
    and the gradients (with the loss) averaged over the dp ranks after it, each ZeRO-1 rank
    keeping its rows (`runtime.pipeline.reduce_data_parallel`)."""

    @staticmethod
    def forward(ctx, rank_graph: RankGraph, names: list[str], buffers: dict, user_inputs: tuple, *params):
        plan = rank_graph.pipeline
        dp, group = rank_graph.dp, rank_graph.dp_group
        sharded = set(plan.zero_sharded) if dp > 1 else set()
        experts, owners, n_owners, owner_rank = rank_graph.expert_owners or (frozenset(), None, 1, 0)
        local = {}
        for name, p in zip(names, params):
            t = p.to_local() if isinstance(p, DTensor) else p
            if name in experts:  # ZeRO-1's rows of an expert: over its owners only
                local[name] = gather_rows(t, n_owners, owners) if name in sharded and n_owners > 1 else t
            else:
                local[name] = gather_rows(t, dp, group) if name in sharded else t
        seeds, denominators = _seeds(rank_graph, user_inputs, buffers, user_inputs[0].device)
        joins = rank_graph.other_join
        shares = ratio_shares(joins, user_inputs, buffers, rank_graph.micro_batches)
        loss, grads, others = run_pipeline_step(plan, local, buffers, user_inputs, seeds,
                                                merge=lambda values, k: join_micro_batches(
                                                    values, joins[k].how, shares.get(k)),
                                                denominators=() if denominators is None else denominators)
        if dp > 1:
            rank = torch.distributed.get_rank(group)
            mine = {p: g for p, g in grads.items() if p in experts}
            loss, grads = reduce_data_parallel({p: g for p, g in grads.items() if p not in experts}, loss,
                                               dp, group, sharded.__contains__, rank,
                                               partial=rank_graph.dp_partial,
                                               reduce_scatter=plan.reduce_scatter)
            grads.update(reduce_experts(mine, dp, owners, n_owners, owner_rank, sharded.__contains__,
                                        reduce_scatter=plan.reduce_scatter))
        _save_grads(ctx, _as_parameters(grads, names, params))
        return _with_others(ctx, loss, step_wide_outputs(rank_graph, others))

    backward = staticmethod(_JointStep.backward)


def merge_micro_batches(others: list[list[torch.Tensor]], joins: list[OutputJoin],
                        shares: dict[int, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The forward's other outputs over the step's micro-batches (one list per micro-batch),
    each joined by its entry of ``joins`` (`join_micro_batches`; ``shares``: `ratio_shares`)."""
    if len(others) == 1:
        return list(others[0])
    shares = shares or {}
    return [join_micro_batches(list(values), join.how, shares.get(k))
            for k, (values, join) in enumerate(zip(zip(*others), joins, strict=True))]


def step_wide_outputs(rank_graph: RankGraph, others: list[torch.Tensor]) -> list[torch.Tensor]:
    """The outputs over the loss's normalisers (`OutputJoin.step_wide`: the runtime feeds those
    step-wide, so a rank's value is d N_r / D, neither its slice's N_r / D_r nor the step's)
    averaged over the ``dp`` data-parallel ranks: N / D, the step's value, as the loss is."""
    if rank_graph.dp == 1 or not any(j.step_wide for j in rank_graph.other_join):
        return others
    out = []
    for value, join in zip(others, rank_graph.other_join, strict=True):
        if join.step_wide:
            total = value.detach().to(torch.float64)
            torch.distributed.all_reduce(total, group=rank_graph.dp_group)
            value = (total / rank_graph.dp).to(value.dtype)
        out.append(value)
    return out


def ratio_shares(joins: list[OutputJoin], user_inputs: tuple, buffers: dict, m: int) -> dict[int, torch.Tensor]:
    """Per output joined as a "ratio": each micro-batch's denominator D_k (float64), its join's
    counter run on the micro-batch's rows of the user inputs."""
    if m == 1:
        return {}
    return {k: torch.stack([join.counter(tuple(x.chunk(m)[i] for x in user_inputs), buffers)[0]
                            for i in range(m)])
            for k, join in enumerate(joins) if join.how == "ratio"}


def join_micro_batches(values: list[torch.Tensor], how: str,
                       denominators: torch.Tensor | None = None) -> torch.Tensor:
    """One output's values over the step's micro-batches, in its own dtype: "cat" concatenated
    on dim 0 (the batch), "mean" averaged (a mean over equally many samples per micro-batch, or
    a value every micro-batch computes alike), "sum" summed (a count, a sum over the batch),
    "ratio" N / D weighted by each micro-batch's D_k / D (``denominators``: the D_k; a
    micro-batch with D_k = 0 adds nothing, as its rows add nothing to N and D), as the planner
    proved (`autopar.capture.outputs.output_joins`, which refuses the rest)."""
    first = values[0]
    if len(values) == 1:
        return first
    if how == "cat":
        return torch.cat(values, dim=0)
    if first.dtype == torch.bool or how not in ("mean", "sum", "ratio"):
        raise ValueError(f"no {how!r} join of a {first.dtype} output over micro-batches")
    stacked = torch.stack(values)
    if how == "sum":
        return stacked.sum(0).to(first.dtype)
    if how == "ratio":
        d = denominators.to(device=stacked.device, dtype=torch.float64)
        parts = torch.where(d != 0, d * stacked.to(torch.float64), torch.zeros_like(d))
        return (parts.sum() / d.sum()).to(first.dtype)
    if first.is_floating_point() or first.is_complex():
        return stacked.mean(0)
    return stacked.double().mean(0).to(first.dtype)  # an integer alike in every micro-batch


def _with_others(ctx, loss: torch.Tensor, others: list[torch.Tensor]):
    """The Function's outputs: the loss alone, or (loss, *others) with the others not
    differentiable (only the loss is)."""
    if not others:
        return loss
    ctx.mark_non_differentiable(*others)
    return (loss, *others)


def _as_parameters(grads: dict[str, torch.Tensor], names: list[str], params) -> list:
    """Each parameter's local gradient (None where it has none), as a DTensor with the
    parameter's mesh and placements where the parameter is one."""
    out = []
    for name, p in zip(names, params):
        g = grads.get(name)
        if g is not None and isinstance(p, DTensor):
            g = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False,
                                   shape=p.shape, stride=p.stride())
        out.append(g)
    return out


def _save_grads(ctx, grads: list) -> None:
    """Keep the step's gradients for ``backward`` (None where a parameter has none)."""
    ctx.missing = [g is None for g in grads]
    ctx.save_for_backward(*grads)


def seed_weights(reduction, dp: int, m: int) -> list[float]:
    """The loss's seed gradient per micro-batch, d w_k, for a `LossReduction` (the
    data-parallel pass divides it by d again; the weights w_k of all pieces add up to 1 for a
    mean): "mean", "global" and None: w_k = 1 / (d m); "sum": w_k = 1. A "ratio" runs as
    "global" (`passes.loss_reduction.for_layout`)."""
    mode = getattr(reduction, "mode", None)
    if mode in (None, "mean", "global"):
        return [1.0 / m] * m
    if mode == "sum":
        return [float(dp)] * m
    raise ValueError(f"a {mode!r} loss reduction reaches the runtime: run it through "
                     "passes.loss_reduction.for_layout first")


def _seeds(rank_graph: RankGraph, user_inputs: tuple, buffers: dict,
           device) -> tuple[list[float], torch.Tensor | None]:
    """The loss's seed gradient per micro-batch (`seed_weights`) and, for a "global" reduction,
    the normalisers the graph reads: each summed over the step / (d m)."""
    m, reduction = rank_graph.micro_batches, rank_graph.reduction
    seeds = seed_weights(reduction, rank_graph.dp // rank_graph.dp_partial, m)
    if getattr(reduction, "counter", None) is None:
        return seeds, None
    counts = [reduction.counter(tuple(x.chunk(m)[k] for x in user_inputs), buffers) for k in range(m)]
    total = torch.stack(counts).sum(0).to(device)
    if rank_graph.dp > 1:  # float64: counts and class-weight sums add up exactly
        # (the ranks of one slice count alike: the sum over dp ranks / dp is the slices' mean)
        torch.distributed.all_reduce(total, group=rank_graph.dp_group)
    return seeds, total.cpu() / (rank_graph.dp * m)


def run_step(rank_graph: RankGraph, params: Sequence[tuple[str, torch.Tensor]], buffers: dict,
             user_inputs: tuple) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The step's loss, with gradients delivered to ``params`` by ``loss.backward()``; where
    the forward returns more (``rank_graph.other_index``), ``(loss, *others)``.

    ``buffers`` (name -> the module's tensor) feed the graph's buffer inputs; those named in
    ``rank_graph.buffer_index`` are updated in place with the step's new values.
    """
    names = [n for n, _ in params]
    step = _PipelineStep if rank_graph.pipeline is not None else _JointStep
    return step.apply(rank_graph, names, buffers, tuple(user_inputs), *[p for _, p in params])
