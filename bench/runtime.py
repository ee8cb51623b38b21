"""`python -m autopar bench runtime`: measured step time of executed layouts on local gloo ranks,
next to the cost model's prediction (`Cluster.local()`) and the same layout written by hand
with PyTorch's own APIs (DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard, and
torchtitan's Megatron plan with `parallelize_module` for TP+SP and DP x TP).

Layouts: DP, ZeRO-1, ZeRO-2, ZeRO-3, TP+SP, DP x TP, pipelines (1F1B over every rank, and
PP x DP; by hand: `torch.distributed.pipelining` with an even split of the blocks), context
parallelism over every rank, load-balanced and in contiguous blocks (no hand-written twin:
PyTorch's context_parallel runs CUDA SDPA kernels only; its exposed ring time is measured
against the predicted, the two step times side by side) and the
solver's own plan, on a small Llama-style GPT (grouped-query attention, SwiGLU). Everything is measured in one run, side by
side, on the same ranks; the steps of every layout, autopar's and the hand-written one, take turns
round-robin, so that all see the same machine state. Both use
the same optimizer, AdamW with foreach=True (one dispatch per op for all parameters: the
default per-parameter loop costs DTensor parameters, autopar's and fully_shard's, about 2x).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from autopar.report import fmt_time, json_ready, table
from runtime.launch import spawn
from runtime.profiling import quiet_profile

# The cost model's CPU_ADAM_BYTES_PER_PARAM (cost/step.py) was fitted on the optimizer step of
# 4.2 M fp32 parameters, the full run's 4-layer model, and `cost.cluster.rank_share` was set
# from that model's step at 4x128 tokens per rank: the full run's predictions are partly
# in-sample. The quick run's 2-layer model was not fitted on.
FITTED_PARAMS = 4_196_608
FITTED_BY = ("CPU_ADAM_BYTES_PER_PARAM (68 B/param) was fitted on this model's optimizer step "
             "and cost.cluster.rank_share set from its step time, on the 2-core dev box")


# a layout entry's key: build it with the overlap pass switched off (its environment switch)
OVERLAP_OFF = "no_overlap"


def _sample(num_params: int) -> tuple[str, str | None]:
    """(label, what was fitted) of predictions for a model of ``num_params`` parameters."""
    if num_params == FITTED_PARAMS:
        return "partly in-sample (fitted)", FITTED_BY
    return "held out", None


def _layouts(world: int, n_layers: int) -> dict[str, dict | None]:
    layouts: dict[str, dict | None] = {
        "DP": {"dp": world}, "ZeRO-1": {"dp": world, "zero": 1}, "ZeRO-2": {"dp": world, "zero": 2},
        "ZeRO-3": {"dp": world, "zero": 3},
        # its overhead over ZeRO-3, measured against predicted (`recompute_overhead`)
        "ZeRO-3 + full recompute": {"dp": world, "zero": 3, "recompute": "full"},
        "TP+SP": {"tp": world, "sp": True}}
    if world >= 4:  # a real product of both axes
        layouts["DP x TP"] = {"dp": 2, "tp": world // 2}
    if world >= 4:  # the bench's run: the TP layouts also without the overlap pass (`passes.overlap`)
        for label in ("TP+SP", "DP x TP"):
            layouts[f"{label} no overlap"] = {**layouts[label], OVERLAP_OFF: True}
    # pipelines (1F1B), against torch.distributed.pipelining with an even split written by hand
    if n_layers >= world:
        layouts[f"PP{world} 1F1B"] = {"pp": world, "grad_accum": 2 * world}
    if world >= 4:
        layouts["PP x DP"] = {"pp": 2, "dp": world // 2, "grad_accum": 4}
        layouts[f"CP{world}"] = {"cp": world}  # the sequence over every rank, ring attention
        # the same with contiguous blocks: the causal imbalance the balanced chunks remove
        layouts[f"CP{world} contiguous"] = {"cp": world, "cp_balance": False}
    layouts["solver"] = None
    return layouts


def _time_pair(steps: list, warmup: int, repeat: int) -> list[list[float]]:
    """Every timed step of each step function (``repeat`` rounds), the functions interleaved
    step by step so that all see the same machine state (the other ranks, the second core's
    load): round i of one function and round i of another ran seconds apart."""
    import torch.distributed as dist

    for _ in range(warmup):
        for step in steps:
            step()
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeat):
        for i, step in enumerate(steps):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[i].append(time.perf_counter() - t0)
    return times


def _hand_written(layout, model, batch, world: int):
    """The same layout written by hand with PyTorch's own APIs; returns a step function."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    if layout.cp > 1:
        return None  # PyTorch's context_parallel runs only CUDA SDPA kernels
    if layout.tp > 1:
        return _hand_written_tp(layout, model, batch)
    if layout.pp > 1:
        return _hand_written_pp(layout, model, batch)
    rank = dist.get_rank()
    local = tuple(x.chunk(world)[rank] for x in batch)
    if layout.recompute == "full":  # torchtitan's full activation checkpointing, per block
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for i, block in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(block)
    if layout.zero == 3:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        net = model
    else:
        net = DistributedDataParallel(model)
        if layout.zero == 0:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3, foreach=True)
        else:  # ZeRO-1/2 by hand: DDP gradients with a sharded optimizer
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3, foreach=True)

    def step():
        net(*local).backward()
        opt.step()
        opt.zero_grad()

    return step


def _hand_written_tp(layout, model, batch):
    """torchtitan's Llama plan: Megatron column/row linears, SP norms, parallel loss; over DP,
    gradients all-reduced in one flat bucket after the backward (what DDP would do)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        loss_parallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    tp, sp = mesh["tp"], layout.sp
    seq_layout = Shard(1) if sp else Replicate()
    norm = SequenceParallel() if sp else None
    plan = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_layout),
            "lm_head": ColwiseParallel(input_layouts=seq_layout, output_layouts=Shard(-1), use_local_output=False)}
    if norm:
        plan["norm"] = norm
    parallelize_module(model, tp, plan)
    for block in model.layers:
        block_plan = {
            "attn": PrepareModuleInput(input_layouts=(seq_layout,), desired_input_layouts=(Replicate(),)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(), "attn.v_proj": ColwiseParallel(),
            "attn.o_proj": RowwiseParallel(output_layouts=seq_layout),
            "mlp": PrepareModuleInput(input_layouts=(seq_layout,), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq_layout),
        }
        if norm:
            block_plan.update({"attn_norm": norm, "mlp_norm": norm})
        parallelize_module(block, tp, block_plan)
        block.attn.n_heads //= layout.tp  # each rank runs its own heads
        block.attn.n_kv_heads //= layout.tp
    # foreach cannot mix DTensors (the parallelised linears) and plain tensors (the norms
    # without SP): one optimizer for each kind
    kinds = [[p for p in model.parameters() if hasattr(p, "to_local") == dt] for dt in (True, False)]
    opts = [torch.optim.AdamW(ps, lr=1e-3, foreach=True) for ps in kinds if ps]
    local = tuple(x.chunk(layout.dp)[mesh.get_local_rank("dp")] for x in batch)
    dp_group = mesh["dp"].get_group()

    def step():
        with loss_parallel():
            model(*local).backward()
        if layout.dp > 1:
            _mean_over(dp_group, layout.dp,
                       [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in model.parameters()])
        for opt in opts:
            opt.step()
            opt.zero_grad()

    return step


def _mean_over(group, n: int, grads: list) -> None:
    """The hand-written layouts' DP: the gradients averaged over ``group`` in one flat
    all-reduce after the backward, in place (what DDP would do, unbucketed)."""
    import torch.distributed as dist

    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


class _EvenStage(torch.nn.Module):
    """Blocks ``first..last`` of the bench's Llama, with the embedding on the first stage and
    the final norm and head on the last: the split a person writes by hand."""

    def __init__(self, model, first: int, last: int, is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.embed = model.embed if is_first else None
        self.layers = torch.nn.ModuleList(model.layers[first:last + 1])
        self.norm = model.norm if is_last else None
        self.lm_head = model.lm_head if is_last else None

    def forward(self, x):
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def _hand_written_pp(layout, model, batch):
    """The same pipeline with `torch.distributed.pipelining` by hand: an even split of the
    blocks, the plan's schedule and micro-batches; over DP, the gradients all-reduced in one
    flat bucket after the schedule (what autopar's runtime does too)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = init_device_mesh("cpu", (layout.dp, layout.pp), mesh_dim_names=("dp", "pp"))
    s, pp = mesh.get_local_rank("pp"), layout.pp
    n = len(model.layers)
    first, last = s * n // pp, (s + 1) * n // pp - 1
    stage_module = _EvenStage(model, first, last, s == 0, s == pp - 1)
    m = layout.grad_accum
    micro = batch[0].shape[0] // layout.dp // m
    hidden = model.config.hidden
    seq = batch[0].shape[1]
    # activations require grad: their gradients travel back
    example_in = (batch[0][:micro],) if s == 0 else (torch.empty(micro, seq, hidden, requires_grad=True),)
    example_out = (torch.empty(micro, seq, model.config.vocab if s == pp - 1 else hidden,
                               requires_grad=True),)
    stage = PipelineStage(stage_module, s, pp, torch.device("cpu"), input_args=example_in,
                          output_args=example_out, group=mesh["pp"].get_group())

    def loss_fn(logits, labels):
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

    schedule = (Schedule1F1B if layout.schedule == "1f1b" and m >= pp else ScheduleGPipe)(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage_module.parameters(), lr=1e-3, foreach=True)
    local = tuple(x.chunk(layout.dp)[mesh.get_local_rank("dp")] for x in batch)
    dp_group = mesh["dp"].get_group()

    def step():
        if s == 0:
            schedule.step(local[0])
        elif s == pp - 1:
            schedule.step(target=local[1])
        else:
            schedule.step()
        if layout.dp > 1:
            _mean_over(dp_group, layout.dp, [p.grad for p in stage_module.parameters()])
        opt.step()
        opt.zero_grad()

    return step


def _worker(rank: int, world: int, cfg, batch_size: int, seq: int, warmup: int, repeat: int,
            only: tuple[str, ...] | None = None) -> list[dict]:
    import warnings

    import autopar
    from autopar import models

    warnings.filterwarnings("ignore")
    batch = models.example_inputs(cfg, batch=batch_size, seq=seq)
    built = []
    for label, degrees in _layouts(world, cfg.n_layers).items():
        if only is not None and label not in only:
            continue
        model = models.build(cfg, seed=0)
        ref = copy.deepcopy(model)
        layout, no_overlap = None, False
        if degrees is not None:
            degrees = dict(degrees)
            no_overlap = degrees.pop(OVERLAP_OFF, False)
            per_rank = batch_size // degrees.get("dp", 1)
            layout = autopar.Layout(**degrees, microbatch=per_rank // degrees.get("grad_accum", 1),
                                    precision="fp32")
        with _overlap(not no_overlap):
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)

        def step(pm=pm, opt=opt, optimizer=True):
            pm(*batch).backward()
            if optimizer:
                opt.step()
            opt.zero_grad()

        # the hand-written twin once per layout, not again for the no-overlap row
        hand = None if no_overlap else _hand_written(pm.plan.layout, ref, batch, world)
        built.append((label, pm.plan, step, hand))
    # every layout's steps and the hand-written ones round-robin: all see the same machine state
    fns = [fn for _, _, step, hand in built for fn in (step, hand) if fn is not None]
    timed = iter(_time_pair(fns, warmup, repeat))
    rows = []
    for label, plan, step, hand_fn in built:
        samples = next(timed)
        measured = statistics.median(samples)
        hand_s = statistics.median(next(timed)) if hand_fn is not None else None
        row = {"layout": label, "degrees": plan.layout.short(), "predicted_s": plan.predicted.step_time_s,
               "measured_s": measured, "hand_written_s": hand_s,
               "autopar_over_hand": measured / hand_s if hand_s else None, "samples_s": samples}
        if plan.layout.pp == 1:  # a pipeline's p2p and reduction are not functional collectives
            tb = plan.predicted.time_breakdown
            row["comm_waits_s"] = _comm_waits(step, repeat)
            row["comm_exposed_predicted_s"] = exposed = sum(tb[k] for k in EXPOSED_COMM)
            # with the DP sync whole (the breakdown keeps no hidden part of the other terms)
            row["comm_total_predicted_s"] = exposed - tb["dp_comm_exposed_s"] + tb["dp_comm_total_s"]
        if plan.layout.cp > 1:
            row["ring_exposed_measured_s"] = _ring_exposed(step, repeat)
            row["ring_exposed_predicted_s"] = plan.predicted.time_breakdown["cp_comm_exposed_s"]
        if plan.layout.pp > 1:
            tb = plan.predicted.time_breakdown
            row["idle_measured_s"] = _pipeline_idle(step, repeat)
            # outside the stage's graphs: the bubble, the transfers and (around a pipeline, after
            # its schedule) the data-parallel reduction
            row["idle_predicted_s"] = tb["pp_bubble_s"] + tb["pp_p2p_s"] + tb["dp_comm_exposed_s"]
        rows.append(row)
    return rows


def _ring_exposed(step, repeat: int) -> float:
    """Seconds per step the slowest rank waited for ring attention's transfers (K/V blocks,
    their gradients), the median over ``repeat`` steps (`runtime.ring_attention.measure_waits`)."""
    import torch.distributed as dist

    from runtime.ring_attention import measure_waits

    per_step = []
    for _ in range(repeat):
        dist.barrier()
        with measure_waits() as waits:
            step()
        slowest = torch.tensor([sum(waits)])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        per_step.append(float(slowest))
    return statistics.median(per_step)


@contextlib.contextmanager
def _overlap(on: bool):
    """The overlap pass switched on or off (`passes.overlap.ENV_SWITCH`) while a layout is built."""
    from passes.overlap import ENV_SWITCH

    before = os.environ.get(ENV_SWITCH)
    os.environ[ENV_SWITCH] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV_SWITCH]
        else:
            os.environ[ENV_SWITCH] = before


# the predicted step's communication terms that no compute hides (dp: the exposed part of its
# whole sync, `dp_comm_total_s`; on CPU ranks the two are equal: `cost.terms.common.comm_overlap`),
# those the collectives' waits measure: the ring's point-to-point sends are not functional
# collectives (its exposed time is set against its own waits, `_ring_exposed`)
EXPOSED_COMM = ("dp_comm_exposed_s", "tp_comm_s", "ep_comm_s")


def _comm_waits(step, repeat: int) -> float:
    """Seconds per step the slowest rank spent blocked in the collectives' waits
    (``_c10d_functional::wait_tensor``, under `torch.profiler`), the median over ``repeat``
    steps: the communication the step did not hide (under TP, TP's and DP's collectives)."""
    import torch.distributed as dist

    per_step = []
    for _ in range(repeat):
        dist.barrier()
        with quiet_profile() as prof:
            step(optimizer=False)
        waits = sum(e.cpu_time_total for e in prof.key_averages() if e.key == "_c10d_functional::wait_tensor")
        slowest = torch.tensor([waits / 1e6])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        per_step.append(float(slowest))
    return statistics.median(per_step)


def _pipeline_idle(step, repeat: int) -> float:
    """Median seconds per step that this rank's stage spends outside its own graphs (bubble,
    point-to-point and the schedule's bookkeeping), the optimizer step excluded: the step's
    wall time less the time in the stage's forward and backward graphs."""
    import torch.distributed as dist

    import runtime.pipeline as pipeline

    busy = [0.0]
    names = ("run_forward", "run_backward", "run_backward_input", "run_backward_weight")
    originals = {name: getattr(pipeline, name) for name in names}

    def timed(run):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return run(*args, **kwargs)
            finally:
                busy[0] += time.perf_counter() - t0
        return call

    for name in names:
        setattr(pipeline, name, timed(originals[name]))
    idle = []
    try:
        for _ in range(repeat):
            busy[0] = 0.0
            dist.barrier()
            t0 = time.perf_counter()
            step(optimizer=False)
            idle.append(time.perf_counter() - t0 - busy[0])
    finally:
        for name, run in originals.items():
            setattr(pipeline, name, run)
    return statistics.median(idle)


def _spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation; equal values share their average rank."""
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        start = 0
        while start < len(order):
            end = start
            while end + 1 < len(order) and v[order[end + 1]] == v[order[start]]:
                end += 1
            for pos in range(start, end + 1):
                r[order[pos]] = (start + end) / 2
            start = end + 1
        return r

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def _per_layout(rows: list[dict]) -> tuple[list[float], list[float]]:
    """Predicted and measured step time per distinct layout: rows that run the same layout
    (the solver often picks one of the hand-named ones) count once, their times averaged."""
    by_layout: dict[str, list[dict]] = {}
    for row in rows:
        by_layout.setdefault(row["degrees"], []).append(row)
    same = list(by_layout.values())
    return ([statistics.fmean(r["predicted_s"] for r in group) for group in same],
            [statistics.fmean(r["measured_s"] for r in group) for group in same])


def _calibrate(world: int, progress) -> tuple[dict, Path]:
    """This machine's numbers, measured now with ``world`` ranks: predictions and measurements
    then see the same load (a calibration taken while other work ran makes every prediction
    off by the same unknown factor)."""
    from autopar.calibrate.local import calibrate

    progress(f"calibrating this machine with {world} gloo ranks (autopar calibrate) ...")
    path = Path(tempfile.mkdtemp(prefix="autopar-bench-")) / "calibration.json"
    return calibrate(world_sizes=(world,), path=path, progress=None), path


def _num_params(cfg) -> int:
    """Parameters of ``cfg``'s model, counted on the meta device (no memory)."""
    from autopar import models

    return int(sum(p.numel() for p in models.build(cfg, device="meta").parameters()))


def run_runtime_bench(quick: bool = False, world: int = 4, progress=print, calibration: str | None = None,
                      layouts: tuple[str, ...] | None = None) -> dict:
    """Measure every executable layout of a small GPT on ``world`` gloo ranks.

    ``calibration``: an `autopar calibrate` file for the predictions; default: calibrate now.
    ``layouts``: only these rows (their labels, e.g. ("TP+SP", "TP+SP no overlap")); default all.
    """
    from autopar import models

    cfg = dataclasses.replace(models.config("tiny-llama"), name="bench-llama", hidden=256, n_heads=8,
                              n_kv_heads=4, ffn=768, n_layers=2 if quick else 4, vocab=2048, max_seq=256)
    batch, seq = (8, 64) if quick else (16, 128)
    measured_now = calibration is None
    if measured_now:
        cal, calibration = _calibrate(world, progress)
    else:
        cal = json.loads(Path(calibration).read_text())
    progress(f"bench runtime: {cfg.n_layers}-layer GPT (h {cfg.hidden}), batch {batch} x seq {seq}, {world} gloo ranks")
    t0 = time.perf_counter()
    try:
        rows = spawn(_worker, world, args=(cfg, batch, seq, 2, 5 if quick else 11, layouts), timeout_s=1800,
                     env={"AUTOPAR_CALIBRATION": str(calibration)})[0]
    finally:
        if measured_now:  # its numbers are kept in the result
            shutil.rmtree(Path(calibration).parent, ignore_errors=True)
    ranked = [r for r in rows if not r["layout"].endswith(" no overlap")]  # a layout once
    predicted, measured = _per_layout(ranked)
    flat = _per_layout([r for r in ranked if "idle_measured_s" not in r])  # the pp = 1 layouts
    sample, fitted_by = _sample(_num_params(cfg))
    by = {r["layout"]: r for r in rows}
    overhead = _recompute_overhead(by)
    return json_ready({"sample": sample, "fitted_by": fitted_by,"world": world, "model": dataclasses.asdict(cfg), "batch": batch, "seq": seq, "rows": rows,
                       "spearman_predicted_vs_measured": _spearman(predicted, measured),
                       "spearman_without_pipelines": _spearman(*flat),
                       "distinct_layouts": len(predicted), "calibration": cal,
                       "recompute_overhead": overhead,
                       "time_s": time.perf_counter() - t0})


def _recompute_overhead(by: dict[str, dict]) -> dict | None:
    """Full recompute's measured and predicted overhead over ZeRO-3 (None without both rows)."""
    if "ZeRO-3" not in by or "ZeRO-3 + full recompute" not in by:
        return None
    base, full = by["ZeRO-3"], by["ZeRO-3 + full recompute"]
    # the median of the rounds' differences: round i of both ran seconds apart, so a slow
    # stretch of the machine cancels (the difference of two medians does not pair them)
    paired = [f - b for f, b in zip(full["samples_s"], base["samples_s"])]
    overhead = {"measured_s": statistics.median(paired),
                "measured_difference_of_medians_s": full["measured_s"] - base["measured_s"],
                "predicted_s": full["predicted_s"] - base["predicted_s"]}
    # noise can leave no measured overhead at all: no ratio then
    overhead["predicted_over_measured"] = (overhead["predicted_s"] / overhead["measured_s"]
                                           if overhead["measured_s"] > 0 else float("nan"))
    return overhead


def _overlap_lines(result: dict) -> str:
    """Each TP layout with and without the overlap pass: step time (the median of the rounds'
    ratios) and the time blocked in collective waits."""
    by = {r["layout"]: r for r in result["rows"]}
    lines = ""
    for label, off in ((k, by[f"{k} no overlap"]) for k in by if f"{k} no overlap" in by):
        on = by[label]
        paired = statistics.median(a / b for a, b in zip(on["samples_s"], off["samples_s"]))
        lines += (f"\n{label}: overlap on {fmt_time(on['measured_s'])}, off {fmt_time(off['measured_s'])} "
                  f"(on / off {paired:.2f}, median of the rounds' ratios); blocked in collective waits "
                  f"{fmt_time(on['comm_waits_s'])} on, {fmt_time(off['comm_waits_s'])} off (slowest rank)")
    return lines


def format_runtime_bench(result: dict) -> str:
    """The table: measured, predicted and hand-written step times per layout."""
    rows = [[r["layout"], r["degrees"], fmt_time(r["measured_s"]), fmt_time(r["predicted_s"]),
             fmt_time(r["hand_written_s"]) if r.get("hand_written_s") else "-",
             f"{r['autopar_over_hand']:.2f}" if r.get("autopar_over_hand") else "-"] for r in result["rows"]]
    head = ["layout", "degrees", "measured", "predicted (Cluster.local)", "hand-written", "autopar / hand"]
    return (f"runtime bench on {result['world']} gloo ranks, batch {result['batch']} x seq {result['seq']}\n"
            + table(head, rows, "llrrrr")
            + f"\nSpearman rank correlation, predicted vs measured, over {result['distinct_layouts']} distinct "
            f"layouts: {result['spearman_predicted_vs_measured']:.2f} "
            f"({result.get('spearman_without_pipelines', float('nan')):.2f} without the pipelines)"
            + _overhead_line(result)
            + _exposed_lines(result)
            + _overlap_lines(result)
            + _idle_lines(result)
            + _ring_lines(result)
            + _sample_line(result))


def _exposed_lines(result: dict) -> str:
    """Per layout without a pipeline: the communication the step did not hide, measured (the
    slowest rank's time blocked in collective waits) against predicted, and the share of the
    predicted communication the prediction hides."""
    rows = [r for r in result["rows"] if "comm_exposed_predicted_s" in r and "no overlap" not in r["layout"]]
    if not rows:
        return ""
    body = [[r["layout"], fmt_time(r["comm_waits_s"]), fmt_time(r["comm_exposed_predicted_s"]),
             _ratio(r["comm_exposed_predicted_s"] / r["comm_waits_s"] if r["comm_waits_s"] > 0 else None),
             _ratio(1 - r["comm_exposed_predicted_s"] / r["comm_total_predicted_s"]
                    if r["comm_total_predicted_s"] > 0 else None)] for r in rows]
    return ("\n\nexposed communication per step (measured: the slowest rank blocked in collective waits)\n"
            + table(["layout", "measured", "predicted", "predicted / measured", "predicted hidden share"],
                    body, "lrrrr"))


def _ring_lines(result: dict) -> str:
    """Context parallelism's exposed ring time (waits for K/V and their gradients), measured
    on the slowest rank against the cost model's exposed CP communication."""
    rows = [r for r in result["rows"] if "ring_exposed_measured_s" in r]
    lines = "".join(
        f"\n{r['layout']}: exposed ring time {fmt_time(r['ring_exposed_measured_s'])} per step (slowest rank's "
        f"waits for K/V blocks and their gradients), predicted {fmt_time(r['ring_exposed_predicted_s'])}"
        for r in rows)
    balanced = [r for r in rows if "cp-contiguous" not in r["degrees"]]
    contiguous = [r for r in rows if "cp-contiguous" in r["degrees"]]
    if balanced and contiguous:  # the same layout, sequence chunks balanced or not
        b, c = balanced[0], contiguous[0]
        lines += (f"\ncausal load balance: step {fmt_time(b['measured_s'])} balanced (chunks r, 2cp-1-r) against "
                  f"{fmt_time(c['measured_s'])} contiguous (measured contiguous / balanced "
                  f"{c['measured_s'] / b['measured_s']:.2f}, predicted {c['predicted_s'] / b['predicted_s']:.2f})")
    return lines


def _idle_lines(result: dict) -> str:
    """Each pipeline's time outside its stage's graphs, measured against the predicted bubble,
    point-to-point and exposed data-parallel communication."""
    return "".join(
        f"\n{r['layout']}: rank 0 idle {fmt_time(r['idle_measured_s'])} per step (bubble, "
        f"point-to-point, data-parallel reduction), predicted {fmt_time(r['idle_predicted_s'])} (predicted / measured "
        f"{r['idle_predicted_s'] / r['idle_measured_s']:.2f})"
        for r in result["rows"] if "idle_measured_s" in r)


def _overhead_line(result: dict) -> str:
    """Full recompute's step-time overhead over ZeRO-3, measured and predicted."""
    o = result.get("recompute_overhead")
    if not o:
        return ""
    return (f"\nfull recompute over ZeRO-3: measured +{fmt_time(o['measured_s'])} (median of the rounds' "
            f"differences; difference of the medians +{fmt_time(o['measured_difference_of_medians_s'])}), "
            f"predicted +{fmt_time(o['predicted_s'])} (predicted / measured {_ratio(o['predicted_over_measured'])})")


def _ratio(value) -> str:
    """A ratio to 2 decimals; "n/a" where there is none (JSON keeps NaN as null)."""
    return "n/a" if value is None or value != value else f"{value:.2f}"


def _sample_line(result: dict) -> str:
    """The predictions' label, with what was fitted on them where they are in-sample."""
    if "sample" not in result:
        return ""
    return f"\npredictions: {result['sample']}" + (
        f" ({result['fitted_by']})" if result.get("fitted_by") else "")
