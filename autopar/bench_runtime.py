"""`python -m autopar bench runtime`: measured step time of executed layouts on local gloo ranks,
next to the cost model's prediction (`Cluster.local()`) and the same layout written by hand
with PyTorch's own APIs (DistributedDataParallel, ZeroRedundancyOptimizer, fully_shard).

Layouts executed today: DP, ZeRO-1, ZeRO-2, ZeRO-3 and the solver's own (executable) plan.
Everything is measured in one run, side by side, on the same ranks.
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

from autopar.report import fmt_time, json_ready, table
from runtime.launch import spawn

LAYOUTS = {"DP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3, "solver": None}


def _time_steps(step, warmup: int, repeat: int) -> float:
    import torch.distributed as dist

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _hand_written(name: str, zero: int, model, batch, world: int):
    """The same layout written by hand with PyTorch's own APIs; returns a step function."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    local = tuple(x.chunk(world)[rank] for x in batch)
    if zero == 3:
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        net = model
    else:
        net = DistributedDataParallel(model)
        if zero == 0:
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        else:  # ZeRO-1/2 by hand: DDP gradients with a sharded optimizer
            opt = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    def step():
        net(*local).backward()
        opt.step()
        opt.zero_grad()

    return step


def _worker(rank: int, world: int, cfg, batch_size: int, seq: int, warmup: int, repeat: int) -> list[dict]:
    import autopar
    from autopar import models

    batch = models.example_inputs(cfg, batch=batch_size, seq=seq)
    rows = []
    for label, zero in LAYOUTS.items():
        model = models.build(cfg, seed=0)
        ref = copy.deepcopy(model)
        layout = None if zero is None else autopar.Layout(dp=world, zero=zero, microbatch=batch_size // world,
                                                          precision="fp32")
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=layout)
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3)

        def step(pm=pm, opt=opt):
            pm(*batch).backward()
            opt.step()
            opt.zero_grad()

        measured = _time_steps(step, warmup, repeat)
        zero_used = pm.plan.layout.zero
        hand = _time_steps(_hand_written(label, zero_used, ref, batch, world), warmup, repeat)
        rows.append({"layout": label, "degrees": pm.plan.layout.short(), "predicted_s": pm.plan.predicted.step_time_s,
                     "measured_s": measured, "hand_written_s": hand, "autopar_over_hand": measured / hand})
    return rows


def _spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r

    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    if n < 2:
        return float("nan")
    d2 = sum((a - b) ** 2 for a, b in zip(rx, ry))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _ensure_calibration(world: int, progress) -> None:
    """Predictions need this machine's numbers: calibrate (quick) once if nobody has."""
    import os

    from cost.calibration import default_calibration_path

    if default_calibration_path().exists():
        return
    from autopar.calibrate import calibrate

    progress("no calibration of this machine yet: running `autopar calibrate --quick` first")
    calibrate(world_sizes=(world,), quick=True, progress=lambda _line: None)
    os.environ.setdefault("AUTOPAR_CALIBRATION", str(default_calibration_path()))


def run_runtime_bench(quick: bool = False, world: int = 4, progress=print) -> dict:
    """Measure every executable layout of a small GPT on ``world`` gloo ranks."""
    from autopar import models

    cfg = dataclasses.replace(models.config("tiny-gpt2"), name="bench-gpt", hidden=256, n_heads=8,
                              n_kv_heads=8, ffn=1024, n_layers=2 if quick else 4, vocab=2048, max_seq=256)
    batch, seq = (8, 64) if quick else (16, 128)
    _ensure_calibration(world, progress)
    progress(f"bench runtime: {cfg.n_layers}-layer GPT (h {cfg.hidden}), batch {batch} x seq {seq}, {world} gloo ranks")
    t0 = time.perf_counter()
    rows = spawn(_worker, world, args=(cfg, batch, seq, 1 if quick else 2, 3 if quick else 5), timeout_s=1800)[0]
    rho = _spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows])
    return json_ready({"world": world, "model": dataclasses.asdict(cfg), "batch": batch, "seq": seq, "rows": rows,
                       "spearman_predicted_vs_measured": rho, "time_s": time.perf_counter() - t0})


def format_runtime_bench(result: dict) -> str:
    """The table: measured, predicted and hand-written step times per layout."""
    rows = [[r["layout"], r["degrees"], fmt_time(r["measured_s"]), fmt_time(r["predicted_s"]),
             fmt_time(r["hand_written_s"]), f"{r['autopar_over_hand']:.2f}"] for r in result["rows"]]
    head = ["layout", "degrees", "measured", "predicted (Cluster.local)", "hand-written", "autopar / hand"]
    return (f"runtime bench on {result['world']} gloo ranks, batch {result['batch']} x seq {result['seq']}\n"
            + table(head, rows, "llrrrr")
            + f"\nSpearman rank correlation, predicted vs measured: {result['spearman_predicted_vs_measured']:.2f}"
            + "\n(not yet executed: TP+SP and DP x TP layouts; see NOTES.md)")
