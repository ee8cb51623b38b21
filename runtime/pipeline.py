"""Run a pipeline-split training step (`passes.pipeline_split`) on the ranks of a pipeline.

Each rank runs one stage (v stages under interleaved 1F1B: stage c on rank c mod pp): its
forward graph F_s and backward graph B_s, once per micro-batch, in the order of a
`torch.distributed.pipelining` schedule, which also moves the activations and their gradients
between neighbouring stages (point-to-point; gloo on CPU).

How the graphs meet PyTorch's schedule runtime: the stage's module is a thin `nn.Module` whose
forward is an autograd Function; its forward runs F_s (keeping the saved values in the
Function's context) and returns the values sent on, its backward runs B_s on the gradient
slots the next stage sent and returns the gradients sent back. The schedule runtime sees an
ordinary module and runs its own ScheduleGPipe ("afab"), Schedule1F1B ("1f1b"),
ScheduleInterleaved1F1B ("interleaved-1f1b") and ScheduleInterleavedZeroBubble ("zero-bubble")
unchanged: no home-made scheduler. The parameters' gradients never pass through autograd: B_s
returns them and the stage adds them up over the micro-batches.

Every stage reads the micro-batch's user inputs (each rank has the batch: the labels reach the
last stage without travelling through the pipeline) and its seed gradient, both given to the
schedule as keyword arguments, which it splits into micro-batches for every stage. The last
stage's output is the loss weighted by its seed (`passes.token_count.weight_loss_by_seed`):
summed over the micro-batches it is the step's loss, sent to every stage of the pipeline.

A parameter read on several stages (a tied embedding and head) is held by each of them; after
the step their gradient parts are summed over those ranks (`PipelinePlan.shared_groups`).
Data parallelism around the pipeline reduces the step's summed gradients once, after the
schedule (`reduce_data_parallel`), as DDP's ``no_sync`` does over micro-batches: nothing hides
that reduction (the cost model prices it exposed).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from vocab.plan_types import PipelineGraphs, StageGraphs, StageInput


@dataclass
class StageFeeds:
    """What a stage's graphs read besides the pipeline's channels, for one micro-batch."""

    params: Mapping[str, torch.Tensor]  # this rank's local tensors of the stage's parameters
    buffers: Mapping[str, torch.Tensor]  # the module's buffers (updated in place)
    inputs: Sequence[torch.Tensor]  # the micro-batch's user inputs
    seed: torch.Tensor  # the loss's seed gradient (a 0-dim tensor)
    # the forward's other outputs this stage made (name -> value), written by `run_forward`
    outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    # the loss's normalisers over the whole step, / pieces ("global" `LossReduction`), by index
    denominators: Sequence[torch.Tensor] = ()


# a stage's "buffer update" of this name is one of the forward's other outputs (logits beside
# the loss: `passes.pipeline_split.OUTPUT`), returned by the step, not written to a buffer
OUTPUT = "autopar.output:"


def run_forward(stage: StageGraphs, feeds: StageFeeds, recv: Sequence[torch.Tensor]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor | None]:
    """Run F_s: (values sent on, saved values, the weighted loss on the last stage). The
    buffers the forward updates are written back into ``feeds.buffers``."""
    out = _run(stage.forward, stage.forward_inputs, feeds, recv=recv)
    k, n = stage.n_sends, stage.n_saved
    sends, saved, rest = out[:k], out[k:k + n], out[k + n:]
    loss = rest.pop(0) if stage.has_loss else None
    for name, value in zip(stage.buffers, rest):
        if name.startswith(OUTPUT):
            feeds.outputs[name] = value
        else:
            feeds.buffers[name].copy_(value)
    return sends, saved, loss


def run_backward(stage: StageGraphs, feeds: StageFeeds, saved: Sequence[torch.Tensor],
                 grads_in: Sequence[torch.Tensor | None]
                 ) -> tuple[list[torch.Tensor | None], dict[str, torch.Tensor]]:
    """Run B_s: (one value per slot of the previous channel, None where unused; the
    gradient, or for a shared parameter this stage's part, of each parameter it holds)."""
    out = _run(stage.backward, stage.backward_inputs, feeds, saved=saved, grads=grads_in)
    return out[:stage.n_grad_sends], _named(stage, out[stage.n_grad_sends:])


def run_backward_input(stage: StageGraphs, feeds: StageFeeds, saved: Sequence[torch.Tensor],
                       grads_in: Sequence[torch.Tensor | None]
                       ) -> tuple[list[torch.Tensor | None], list[torch.Tensor]]:
    """Zero-bubble's first half of B_s: (the gradient slots sent back, the values stashed for
    the weight half)."""
    split = stage.weight_split
    out = _run(split.input_grad, split.input_grad_inputs, feeds, saved=saved, grads=grads_in)
    return out[:stage.n_grad_sends], out[stage.n_grad_sends:]


def run_backward_weight(stage: StageGraphs, feeds: StageFeeds, saved: Sequence[torch.Tensor],
                        grads_in: Sequence[torch.Tensor | None], stash: Sequence[torch.Tensor]
                        ) -> dict[str, torch.Tensor]:
    """Zero-bubble's second half of B_s: the parameter gradients (as `run_backward`'s); it
    reads the received gradient slots too (a weight gradient's matmul reads its output's
    gradient)."""
    split = stage.weight_split
    return _named(stage, _run(split.weight_grad, split.weight_grad_inputs, feeds, saved=saved,
                              grads=grads_in, stash=stash))


def _named(stage: StageGraphs, grads: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The gradient outputs of a stage's backward by parameter name (None left out)."""
    return {p: g for p, g in zip(stage.grads, grads) if g is not None}


def add_gradients(sums: dict[str, torch.Tensor], parts: Mapping[str, torch.Tensor]) -> None:
    """Add one micro-batch's (or one stage's) parameter gradients to ``sums``, out of place."""
    for p, g in parts.items():
        sums[p] = sums[p] + g if p in sums else g


def _run(gm, inputs: list[StageInput], feeds: StageFeeds, **channels) -> list:
    """Run one of a stage's graphs on what feeds its placeholders."""
    args = _feed(gm, inputs, feeds, **channels)
    with torch.no_grad():
        return list(gm(*args))


def _feed(gm, inputs: list[StageInput], feeds: StageFeeds, recv=(), saved=(), grads=(), stash=()) -> list:
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    args = []
    for holder, source in zip(holders, inputs):
        kind = source.kind
        if kind == "recv":
            args.append(recv[source.index])
        elif kind == "saved":
            args.append(saved[source.index])
        elif kind == "stash":
            args.append(stash[source.index])
        elif kind == "grad":
            g = grads[source.index]
            if g is None:  # an unused slot arrives as zeros; a missing one is a bug upstream
                raise RuntimeError(f"no gradient arrived in slot {source.index} ({source.name})")
            args.append(g)
        elif kind == "param":
            args.append(feeds.params[source.name])
        elif kind == "buffer":
            args.append(feeds.buffers[source.name])
        elif kind == "input":
            args.append(feeds.inputs[int(source.name.removeprefix("input"))])
        elif kind == "tangent":
            args.append(feeds.seed)
        elif kind == "zero_tangent":
            val = holder.meta["val"]
            args.append(torch.zeros(tuple(val.shape), dtype=val.dtype, device=feeds.seed.device))
        elif kind == "denominator":  # the same on every micro-batch and stage
            val = holder.meta["val"]
            args.append(feeds.denominators[int(source.name)].to(device=feeds.seed.device, dtype=val.dtype))
        else:
            raise ValueError(f"unknown stage input kind {kind!r}")
    return args


def run_sequential(split: PipelineGraphs, feeds: StageFeeds, zero_bubble: bool = False
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """All stages in one process, one micro-batch: (weighted loss, gradients), shared
    parameters' parts summed. What the pipeline computes, without the schedule (for tests);
    ``zero_bubble``: each backward as its input half, then its weight half."""
    recv: Sequence[torch.Tensor] = ()
    saved_by_stage, loss = [], None
    for stage in split.stages:
        recv, saved, out_loss = run_forward(stage, feeds, recv)
        saved_by_stage.append(saved)
        loss = out_loss if out_loss is not None else loss
    grads: dict[str, torch.Tensor] = {}
    slots: list = []
    for stage in reversed(split.stages):
        grads_in = [None] * len(split.channels[stage.stage]) if stage.stage < split.pp - 1 else []
        for j, g in enumerate(slots):
            grads_in[j] = g
        if zero_bubble:
            slots, stash = run_backward_input(stage, feeds, saved_by_stage[stage.stage], grads_in)
            part = run_backward_weight(stage, feeds, saved_by_stage[stage.stage], grads_in, stash)
        else:
            slots, part = run_backward(stage, feeds, saved_by_stage[stage.stage], grads_in)
        add_gradients(grads, part)
    return loss, grads


@dataclass
class PipelinePlan:
    """This rank's part of a pipeline: the split graphs, the stages it runs, its groups."""

    graphs: PipelineGraphs
    rank: int  # this rank's place in its pipeline (0 .. pp - 1)
    pp: int  # ranks in the pipeline
    group: dist.ProcessGroup  # the ranks of this rank's pipeline, in order
    schedule: str  # "afab", "1f1b", "interleaved-1f1b" or "zero-bubble"
    # shared parameter -> the group of the ranks that hold it (this rank among them)
    shared_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    zero_sharded: list[str] = field(default_factory=list)  # ZeRO-1: rows over the dp ranks
    reduce_scatter: bool = False  # ZeRO-1's gradients reduce-scattered (`reduce_data_parallel`)

    @property
    def stages(self) -> list[int]:
        """The stages this rank runs: stage c on rank c mod pp (v of them when interleaved)."""
        return [c for c in range(self.graphs.pp) if c % self.pp == self.rank]

    @property
    def params(self) -> set[str]:
        """The parameters this rank holds: those its stages read."""
        return {p for c in self.stages for p in self.graphs.stages[c].params}


class _StageFunction(torch.autograd.Function):
    """One micro-batch of one stage, as autograd sees it (the module docstring)."""

    @staticmethod
    def forward(ctx, runner: _StageRunner, inputs: tuple, seed: torch.Tensor, anchor: torch.Tensor,
                *recv: torch.Tensor):
        feeds = runner.feeds(inputs, seed)
        sends, saved, loss = run_forward(runner.graphs, feeds, recv)
        ctx.runner, ctx.feeds, ctx.saved = runner, feeds, saved
        outs = [loss] if runner.graphs.has_loss else [s.view_as(s) for s in sends]
        ctx.mark_non_differentiable(*[o for o in outs if not o.is_floating_point()])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        runner = ctx.runner
        # the last stage's seed is the micro-batch's own (1 / m or its share of the valid
        # tokens), not the 1 that the schedule's loss.backward() passes in
        grads_in = [] if runner.graphs.has_loss else list(grads)
        feeds, saved = ctx.feeds, ctx.saved
        ctx.saved = ctx.feeds = None
        if runner.zero_bubble:  # the weight half waits for the schedule's W action
            sends, stash = run_backward_input(runner.graphs, feeds, saved, grads_in)
            runner.pending.append(
                lambda: runner.add(run_backward_weight(runner.graphs, feeds, saved, grads_in, stash)))
        else:
            sends, parts = run_backward(runner.graphs, feeds, saved, grads_in)
            runner.add(parts)
        return (None, None, None, None, *sends)


class _StageRunner(nn.Module):
    """The stage module the schedule runs: keyword arguments ``input0``... and ``seed``."""

    def __init__(self, graphs: StageGraphs, params: Mapping[str, torch.Tensor],
                 buffers: Mapping[str, torch.Tensor], n_inputs: int,
                 grads: dict[str, torch.Tensor], denominators: Sequence[torch.Tensor] = ()) -> None:
        super().__init__()
        self.denominators = denominators
        self.graphs = graphs
        self.params = params
        self.buffer_map = buffers
        self.n_inputs = n_inputs
        self.grads = grads  # shared by the rank's stages: a parameter's parts add up
        # makes the Function's outputs require grad on the first stage, whose inputs do not
        self.anchor = torch.zeros((), requires_grad=True)
        self.zero_bubble = graphs.weight_split is not None
        self.pending: list[Callable[[], None]] = []  # weight halves not yet run
        self.outputs: list[dict[str, torch.Tensor]] = []  # per micro-batch, in forward order

    def add(self, parts: Mapping[str, torch.Tensor]) -> None:
        """Add one micro-batch's parameter gradients to the step's sums."""
        add_gradients(self.grads, parts)

    def weight_step(self) -> Callable[[], None]:
        """PipelineStage's ``dw_builder``: the weight half of the backward that just ran."""
        return self.pending.pop()

    def feeds(self, inputs: tuple, seed: torch.Tensor) -> StageFeeds:
        feeds = StageFeeds(self.params, self.buffer_map, inputs, seed.reshape(()),
                           denominators=self.denominators)
        self.outputs.append(feeds.outputs)
        return feeds

    def forward(self, *recv: torch.Tensor, **kwargs: torch.Tensor):
        inputs = tuple(kwargs[f"input{i}"] for i in range(self.n_inputs))
        out = _StageFunction.apply(self, inputs, kwargs["seed"], self.anchor, *recv)
        return out[0] if self.graphs.has_loss else out


def schedule_class(schedule: str, pp: int, micro_batches: int):
    """The `torch.distributed.pipelining` schedule that runs ``schedule``: ScheduleGPipe for
    "afab", Schedule1F1B for "1f1b" (with fewer micro-batches than stages 1F1B's warm-up holds
    them all, which is GPipe's order: PyTorch's 1F1B refuses that case, so GPipe runs it),
    ScheduleInterleaved1F1B for "interleaved-1f1b" (several stages per rank), and
    ScheduleInterleavedZeroBubble (ZB1P, Qi et al. 2023) for "zero-bubble", its W actions
    running each backward's weight half (`BackwardSplit`) in the bubbles."""
    from torch.distributed.pipelining import (
        Schedule1F1B,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
    )

    if schedule == "interleaved-1f1b":
        return ScheduleInterleaved1F1B
    if schedule == "zero-bubble":
        return ScheduleInterleavedZeroBubble
    if schedule == "afab" or (schedule == "1f1b" and micro_batches < pp):
        return ScheduleGPipe
    if schedule == "1f1b":
        return Schedule1F1B
    raise ValueError(f"pipeline schedule {schedule!r} is not executed (runs: afab, 1f1b, "
                     "interleaved-1f1b, zero-bubble)")


def run_pipeline_step(plan: PipelinePlan, params: Mapping[str, torch.Tensor],
                      buffers: Mapping[str, torch.Tensor], inputs: Sequence[torch.Tensor],
                      seeds: Sequence[float], merge: Callable | None = None,
                      denominators: Sequence[torch.Tensor] = ()) -> tuple[torch.Tensor, dict[str, torch.Tensor], list[torch.Tensor]]:
    """One training step of this rank's stages over ``len(seeds)`` micro-batches.

    ``inputs``: the rank's user inputs for the whole step (dim 0 split into the micro-batches);
    ``params``: the local tensors of the rank's parameters; ``denominators``: the loss's
    normalisers over the step (a "global" `LossReduction`), read by the stages that divide by
    them. Returns the step's loss (the same on
    every rank of the pipeline), the rank's parameter gradients summed over the micro-batches
    (shared parameters summed over their ranks too), and the forward's other outputs
    (`pipeline_outputs`, the micro-batches' values joined by ``merge``) on every rank.
    """
    from torch.distributed.pipelining import PipelineStage

    m, n_stages = len(seeds), plan.graphs.pp
    device = inputs[0].device
    grads: dict[str, torch.Tensor] = {}
    stages, runners = [], []
    for c in plan.stages:
        graphs = plan.graphs.stages[c]
        runner = _StageRunner(graphs, params, buffers, len(inputs), grads, denominators)
        runners.append(runner)
        stages.append(PipelineStage(runner, c, n_stages, device,
                                    input_args=_channel_example(graphs.forward, graphs.forward_inputs, device),
                                    output_args=_output_example(graphs, device), group=plan.group,
                                    dw_builder=runner.weight_step if runner.zero_bubble else None))
    cls = schedule_class(plan.schedule, plan.pp, m)
    several = plan.schedule in ("interleaved-1f1b", "zero-bubble")
    schedule = cls(stages if several else stages[0], m, loss_fn=_weighted_loss, scale_grads=False)
    losses: list[torch.Tensor] = []
    seed = torch.tensor(list(seeds), dtype=torch.float32, device=device)
    kwargs = {f"input{i}": x for i, x in enumerate(inputs)}
    last = (n_stages - 1) % plan.pp
    with torch.enable_grad():
        if plan.rank == last:
            schedule.step(target=seed, losses=losses, return_outputs=False, seed=seed, **kwargs)
        else:
            schedule.step(return_outputs=False, seed=seed, **kwargs)
    loss = (torch.stack([x.detach().reshape(()) for x in losses]).sum() if losses
            else torch.zeros((), dtype=torch.float32, device=device))
    dist.broadcast(loss, group=plan.group, group_src=last)
    for p, group in plan.shared_groups.items():
        g = grads[p] if p in grads else torch.zeros_like(params[p])
        dist.all_reduce(g, group=group)
        grads[p] = g
    return loss, grads, pipeline_outputs(plan, runners, m, merge, device)


def pipeline_outputs(plan: PipelinePlan, runners: list[_StageRunner], m: int, merge: Callable | None,
                     device) -> list[torch.Tensor]:
    """The forward's other outputs (in their order), on every rank of the pipeline: each made
    on one stage, joined over its ``m`` micro-batches there by ``merge(values, k)`` (k the
    output's place) and broadcast from that stage's rank (shapes from the stage's graph)."""
    made: dict[str, list[torch.Tensor]] = {}
    for runner in runners:
        for micro in runner.outputs:
            for name, value in micro.items():
                made.setdefault(name, []).append(value)
    owner: dict[str, tuple[int, torch.Tensor]] = {}
    for c, graphs in enumerate(plan.graphs.stages):
        output = next(n for n in graphs.forward.graph.nodes if n.op == "output")
        tail = list(output.args[0])[graphs.n_sends + graphs.n_saved + int(graphs.has_loss):]
        for name, node in zip(graphs.buffers, tail):
            if name.startswith(OUTPUT):
                owner[name] = (c % plan.pp, node.meta["val"])
    result = []
    for k in range(len(owner)):
        name = f"{OUTPUT}{k}"
        rank, val = owner[name]
        # every rank knows the joined value's shape and dtype: the merge keeps the dtype and
        # joins dim 0, the batch (the planner refuses any other output, output_joins)
        shape = tuple(val.shape) if val.dim() == 0 or merge is None else (val.shape[0] * m, *val.shape[1:])
        if rank == plan.rank:
            value = merge(made[name], k) if merge else made[name][-1]
            value = value.to(val.dtype).contiguous()
            if tuple(value.shape) != shape:  # before the broadcast: the other ranks expect shape
                raise RuntimeError(f"pipeline output {name} joined to shape {list(value.shape)}, "
                                   f"not {list(shape)}")
        else:
            value = torch.empty(shape, dtype=val.dtype, device=device)
        dist.broadcast(value, group=plan.group, group_src=rank)
        result.append(value)
    return result


def _weighted_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # the last stage already returns loss x seed; the schedule's loss.backward() reaches
    # _StageFunction.backward, which reads the seed itself
    return output


def _channel_example(gm, inputs: list[StageInput], device) -> tuple[torch.Tensor, ...]:
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(_empty(h.meta["val"], device) for h, i in zip(holders, inputs) if i.kind == "recv")


def _output_example(graphs: StageGraphs, device) -> tuple[torch.Tensor, ...]:
    output = next(n for n in graphs.forward.graph.nodes if n.op == "output")
    outs = list(output.args[0])
    if graphs.has_loss:
        return (_empty(outs[graphs.n_sends + graphs.n_saved].meta["val"], device),)
    return tuple(_empty(o.meta["val"], device) for o in outs[:graphs.n_sends])


def _empty(val, device) -> torch.Tensor:
    t = torch.empty(tuple(val.shape), dtype=val.dtype, device=device)
    if t.is_floating_point():
        t.requires_grad_(True)
    return t


def reduce_data_parallel(grads: dict[str, torch.Tensor], loss: torch.Tensor, dp: int,
                         group: dist.ProcessGroup, sharded: Callable[[str], bool] = lambda p: False,
                         dp_rank: int = 0, partial: int = 1,
                         reduce_scatter: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean over the ``dp`` data-parallel pipelines of the step's loss and gradients (one
    all-reduce of all gradients, flattened; a ZeRO-sharded parameter keeps its rows).

    ``partial``: the ranks come in sets of that many sharing one batch slice (context
    parallelism's cp ranks), each holding a partial sum of the slice's gradients and the slice's
    whole loss: the gradients are summed over all ranks and divided by the dp / partial slices,
    the loss averaged over all dp ranks. ``reduce_scatter``: the ZeRO-sharded gradients are
    reduce-scattered instead (`reduce_rows`, half an all-reduce's traffic, as the cost model
    prices ZeRO-1 on GPUs: `CommPlan.reduce_scatter`), the rest all-reduced."""
    names = sorted(grads)
    rows = [p for p in names if reduce_scatter and dp > 1 and sharded(p)]
    whole = [p for p in names if p not in rows]
    flat = torch.cat([loss.reshape(1) / partial] + [grads[p].reshape(-1) for p in whole]) * (partial / dp)
    dist.all_reduce(flat, group=group)
    out = _unflatten(flat[1:], grads, whole, sharded, dp, dp_rank)
    if rows:
        out.update(reduce_rows({p: grads[p] * (partial / dp) for p in rows}, dp, dp_rank, group))
    return flat[0].clone(), out


def reduce_experts(grads: dict[str, torch.Tensor], dp: int, group: dist.ProcessGroup | None, owners: int,
                   owner_rank: int, sharded: Callable[[str], bool] = lambda p: False,
                   reduce_scatter: bool = False) -> dict[str, torch.Tensor]:
    """Expert parallelism's share of `reduce_data_parallel`: the gradients of the experts this
    rank stores, summed over their ``owners`` (the dp/ep ranks storing them: each gradient
    already sums its ep group's tokens) and divided by ``dp`` as the other gradients are (the
    mean over the dp pipelines' loss); a ZeRO-1 expert keeps its rows of the owners' shards
    (reduce-scattered to it with ``reduce_scatter``)."""
    if not grads:
        return {}
    names = sorted(grads)
    rows = [p for p in names if reduce_scatter and owners > 1 and sharded(p)]
    whole = [p for p in names if p not in rows]
    out = reduce_rows({p: grads[p] / dp for p in rows}, owners, owner_rank, group) if rows else {}
    if whole:
        flat = torch.cat([grads[p].reshape(-1) for p in whole]) / dp
        if owners > 1:
            dist.all_reduce(flat, group=group)
        out.update(_unflatten(flat, grads, whole, lambda p: sharded(p) and owners > 1, owners, owner_rank))
    return out


def reduce_rows(grads: dict[str, torch.Tensor], ranks: int, rank: int,
                group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Each gradient summed over the ``ranks`` of ``group``, this rank receiving only its rows:
    the dim-0 piece ``g.chunk(ranks)[rank]`` that ZeRO's ``Shard(0)`` stores (ceil(n / ranks)
    rows per piece, the last ones shorter or empty). One reduce-scatter of a buffer holding,
    for each rank in turn, its piece of every gradient padded to the full piece."""
    names = sorted(grads)
    piece = {p: -(-grads[p].shape[0] // ranks) for p in names}
    width = {p: grads[p][0].numel() if grads[p].shape[0] else 0 for p in names}
    send = []
    for r in range(ranks):
        for p in names:
            part = grads[p][r * piece[p]:(r + 1) * piece[p]].reshape(-1)
            send.append(nn.functional.pad(part, (0, piece[p] * width[p] - part.numel())))
    send = torch.cat(send)
    out = torch.empty(send.numel() // ranks, dtype=send.dtype, device=send.device)
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, send, group=group)
    result, offset = {}, 0
    for p in names:
        g = grads[p]
        n = max(0, min(piece[p], g.shape[0] - rank * piece[p]))
        result[p] = out[offset:offset + n * width[p]].view(n, *g.shape[1:])
        offset += piece[p] * width[p]
    return result


def _unflatten(flat: torch.Tensor, grads: dict[str, torch.Tensor], names: list[str],
               sharded: Callable[[str], bool], ranks: int, rank: int) -> dict[str, torch.Tensor]:
    """``grads``' shapes read back from ``flat`` (``names``' order); a ZeRO-sharded gradient
    keeps this rank's rows of ``ranks``."""
    out, offset = {}, 0
    for p in names:
        n = grads[p].numel()
        g = flat[offset:offset + n].view_as(grads[p])
        offset += n
        out[p] = g.chunk(ranks, dim=0)[rank].clone() if sharded(p) else g
    return out


def gather_rows(shard: torch.Tensor, dp: int, group: dist.ProcessGroup) -> torch.Tensor:
    """ZeRO-1: the whole (TP-local) parameter from every dp rank's rows (dim 0)."""
    out = torch.empty((shard.shape[0] * dp, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(out, shard.contiguous(), group=group)
    return out
