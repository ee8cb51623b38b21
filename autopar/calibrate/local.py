"""Measure this machine for the cost model: matmul FLOP/s, memory bandwidth, per-op floor,
collective latency / bus bandwidth over local gloo ranks, a pipeline transfer's overhead, and
what a collective overlapped with compute costs that compute.

``calibrate()`` writes one JSON file (``$AUTOPAR_CALIBRATION`` or
``~/.cache/autopar/calibration.json``) that ``cost.Cluster.local()`` reads. Its top-level format
is a contract with that reader and must not change shape::

    {"version": 1, "host": str, "date": ISO-8601, "torch": str, "world_size": int,
     "matmul_flops": {"fp32": FLOP/s, "bf16": FLOP/s},
     "memory_bw": bytes/s, "kernel_floor_s": s,
     "collectives": {kind: {"latency_s": s, "busbw": bytes/s}
                     for kind in all_reduce, all_gather, reduce_scatter, all_to_all, send_recv},
     "pipeline": {"overhead_s": s,    # per stage-to-stage transfer beyond send/recv (optional),
                  "wait_per_compute": s/s},  # and per second of the stages' compute between hand-offs
     "overlap": {"slowdown": s/s},  # step seconds an all-reduce issued beside compute adds, per
                                    # second it takes alone (optional)
     "raw": {... every individual measurement ...}}

Collective times follow the nccl-tests conventions so the numbers are comparable with the
published ones the cost model also uses: the time of a collective on a K-byte tensor is modelled
as ``latency_s + factor * K / busbw`` with ``factor`` = 2(n-1)/n for all-reduce, (n-1)/n for
all-gather / reduce-scatter / all-to-all and 1 for point-to-point, where K is the full tensor
(the all-reduce operand, the all-gather output, the reduce-scatter input).

Only torch, the standard library and ``runtime.launch`` are imported here, so that importing
this module (also done by every spawned rank) stays cheap and free of the solver's dependencies.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from runtime.launch import spawn

__all__ = ["COLLECTIVES", "calibrate", "default_calibration_path", "format_calibration"]

CALIBRATION_VERSION = 1
COLLECTIVES: tuple[str, ...] = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
    "send_recv",
)

_KB = 1024
_MB = 1024 * 1024

Progress = Callable[[str], Any] | None


def default_calibration_path() -> Path:
    """The calibration file: ``$AUTOPAR_CALIBRATION`` or ``~/.cache/autopar/calibration.json``."""
    env = os.environ.get("AUTOPAR_CALIBRATION")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "autopar" / "calibration.json"


def _bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busbw factor: bytes each link carries per byte of the full tensor."""
    if kind == "all_reduce":
        return 2.0 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if kind == "send_recv":
        return 1.0
    raise ValueError(f"unknown collective {kind!r}")


def _timed(fn: Callable[[], Any], warmup: int, repeats: int, inner: int = 1) -> list[float]:
    """Seconds per call of ``fn`` over ``repeats`` samples, each averaging ``inner`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return times


# --- single-process measurements ------------------------------------------------------------


def _measure_matmul(quick: bool, say: Callable[[str], None]) -> tuple[dict[str, float], list]:
    """Median FLOP/s of square ``mm`` per dtype; the best size counts (the achievable peak).

    Each (dtype, size) gets a time budget: a dtype can be ~100x slower than fp32 on a CPU
    without native kernels for it (bf16 ran at ~1 GFLOP/s on a 2-core host), so repeats
    shrink to fit, and a larger size is skipped when the smaller one predicts it would not fit.
    """
    sizes = (
        {"fp32": (1024,), "bf16": (512,)} if quick else {"fp32": (1024, 2048), "bf16": (512, 1024)}
    )
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16}
    budget_s, max_repeats = (1.0, 3) if quick else (3.0, 7)
    min_calls = 4  # one warm-up + three timed repeats: the least that still gives a median
    best: dict[str, float] = {}
    raw: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for name, ns in sizes.items():
        prev: tuple[int, float] | None = None
        for n in ns:
            if prev is not None:
                predicted = prev[1] * (n / prev[0]) ** 3
                if predicted * min_calls > budget_s:
                    say(f"matmul {name} {n}: skipped (~{predicted:.1f} s per call)")
                    raw.append({"dtype": name, "n": n, "skipped": True, "predicted_s": predicted})
                    continue
            a = torch.randn(n, n, generator=gen).to(dtypes[name])
            b = torch.randn(n, n, generator=gen).to(dtypes[name])
            c = torch.empty(n, n, dtype=dtypes[name])
            # The first call is the warm-up, and its time sizes the number of repeats.
            (first,) = _timed(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), 0, 1)
            repeats = max(3, min(max_repeats, int((budget_s - first) / max(first, 1e-9))))
            times = _timed(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), 0 if quick else 1, repeats)
            med = statistics.median(times)
            flops = 2.0 * n**3 / med
            best[name] = max(best.get(name, 0.0), flops)
            prev = (n, med)
            raw.append({"dtype": name, "n": n, "times_s": times, "median_s": med, "flops": flops})
            say(f"matmul {name} {n}: {flops / 1e9:.1f} GFLOP/s")
    return best, raw


def _measure_memory_bw(quick: bool, say: Callable[[str], None]) -> tuple[float, dict]:
    """Bytes/s of a large ``copy_``, counting the bytes read plus the bytes written, from the
    fastest of the repeats (as STREAM reports): another process only slows a copy, and half
    of five copies slowed 1.3-3.7x by the ranks of a run that had just ended made the median
    half the rate (DP's optimizer step then priced 2x)."""
    nbytes = (64 if quick else 256) * _MB
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    # Written once up front so page faults of first touch are not timed.
    dst = torch.zeros_like(src)
    warmup, repeats = (1, 3) if quick else (1, 7)
    times = _timed(lambda: dst.copy_(src), warmup, repeats)
    best = min(times)
    bw = 2.0 * nbytes / best
    say(f"memory copy {nbytes // _MB} MB: {bw / 1e9:.1f} GB/s (read + write)")
    return bw, {
        "bytes_copied": nbytes,
        "bytes_moved": 2 * nbytes,
        "times_s": times,
        "best_s": best,
        "median_s": statistics.median(times),
    }


def _measure_kernel_floor(quick: bool, say: Callable[[str], None]) -> tuple[float, dict]:
    """Median seconds of a tiny eager op: the fixed per-op cost that no FLOP count explains."""
    a = torch.ones(16)
    b = torch.ones(16)
    # Batches amortise the timer's own overhead; the median rejects scheduler hiccups.
    inner, repeats = (100, 20) if quick else (200, 50)
    times = _timed(lambda: torch.add(a, b), warmup=2 * inner, repeats=repeats, inner=inner)
    med = statistics.median(times)
    say(f"kernel floor (add of 16 floats): {med * 1e6:.2f} us")
    return med, {"op": "add 16 fp32", "inner": inner, "times_s": times, "median_s": med}


# --- collectives (run on spawned gloo ranks) --------------------------------------------------


def _collective_worker(
    rank: int, world_size: int, sizes: Sequence[int], warmup: int, repeats: int
) -> dict[str, list[dict[str, float]]]:
    """One rank's median seconds per collective and size (run under ``runtime.launch.spawn``)."""
    import torch.distributed as dist

    # torch 2.13 deprecates the *_tensor names (a FutureWarning per call) in favour of *_single
    # with the same (output, input) signature; keep the old ones for older torch.
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    n = world_size
    out: dict[str, list[dict[str, float]]] = {}
    for kind in COLLECTIVES:
        rows = []
        for size in sizes:
            # Full-tensor element count, divisible by n so every shard is equal.
            numel = max(n, (size // 4) // n * n)
            full = torch.ones(numel)
            shard = torch.ones(numel // n)
            if kind == "all_reduce":
                op = lambda full=full: dist.all_reduce(full)  # noqa: E731
            elif kind == "all_gather":
                op = lambda full=full, shard=shard: all_gather(full, shard)  # noqa: E731
            elif kind == "reduce_scatter":
                op = lambda full=full, shard=shard: reduce_scatter(shard, full)  # noqa: E731
            elif kind == "all_to_all":
                dst = torch.empty_like(full)
                op = lambda full=full, dst=dst: dist.all_to_all_single(dst, full)  # noqa: E731
            else:  # send_recv: rank 0 -> rank 1, the others idle (their ~0 s loses the max)
                if rank == 0:
                    op = lambda full=full: dist.send(full, dst=1)  # noqa: E731
                elif rank == 1:
                    op = lambda full=full: dist.recv(full, src=0)  # noqa: E731
                else:
                    op = lambda: None  # noqa: E731
            # Small messages are timed in batches after one barrier: a single 4 KB op is
            # shorter than the skew with which ranks leave the barrier.
            inner = 10 if size <= 64 * _KB else 1
            for _ in range(warmup):
                op()
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(inner):
                    op()
                times.append((time.perf_counter() - t0) / inner)
            rows.append({"bytes": numel * 4, "median_s": statistics.median(times)})
        out[kind] = rows
    dist.barrier()
    return out


def _fit_latency_busbw(xs: Sequence[float], ts: Sequence[float]) -> tuple[float, float]:
    """Fit ``t = latency + x / busbw`` (x = factor * K bytes); return (latency_s >= 0, busbw).

    Least squares on the relative error (weights 1/t^2): plain least squares lets the
    milliseconds of the 16 MB points swamp the microseconds that determine the latency.
    """
    ws = [1.0 / (t * t) for t in ts]
    sw = sum(ws)
    sx = sum(w * x for w, x in zip(ws, xs))
    st = sum(w * t for w, t in zip(ws, ts))
    sxx = sum(w * x * x for w, x in zip(ws, xs))
    sxt = sum(w * x * t for w, x, t in zip(ws, xs, ts))
    det = sw * sxx - sx * sx
    slope = (sw * sxt - sx * st) / det if det > 0 else 0.0
    latency = (st - slope * sx) / sw if det > 0 else min(ts)
    if latency < 0:
        # A negative intercept is noise; clamp it and refit the slope through the origin.
        latency = 0.0
        slope = sxt / sxx if sxx > 0 else 0.0
    if slope <= 0:
        # Large messages no slower than small ones (noise-dominated): report the best
        # bandwidth actually observed rather than an infinite one.
        return latency, max(x / t for x, t in zip(xs, ts))
    return latency, 1.0 / slope


def _measure_collectives(
    n: int, quick: bool, say: Callable[[str], None]
) -> tuple[dict[str, dict[str, float]], dict]:
    sizes = [4 * _KB, 1 * _MB, 4 * _MB] if quick else [4 * _KB, 1 * _MB, 4 * _MB, 16 * _MB]
    warmup, repeats = (1, 3) if quick else (2, 5)
    say(f"collectives: starting {n} gloo ranks ...")
    t0 = time.perf_counter()
    per_rank = spawn(
        _collective_worker, n, args=(sizes, warmup, repeats), timeout_s=60.0 if quick else 180.0
    )
    say(f"collectives: measured in {time.perf_counter() - t0:.1f} s (start-up included)")
    fitted: dict[str, dict[str, float]] = {}
    raw: dict[str, Any] = {"sizes_requested": sizes, "warmup": warmup, "repeats": repeats}
    for kind in COLLECTIVES:
        factor = _bus_factor(kind, n)
        rows = []
        for i in range(len(sizes)):
            k = per_rank[0][kind][i]["bytes"]
            ranks = [r[kind][i]["median_s"] for r in per_rank]
            # The collective is done when its slowest rank is.
            rows.append(
                {"bytes": k, "bus_bytes": factor * k, "time_s": max(ranks), "per_rank_s": ranks}
            )
        latency, busbw = _fit_latency_busbw(
            [r["bus_bytes"] for r in rows], [max(r["time_s"], 1e-9) for r in rows]
        )
        # A clamped 0 would read as "free small messages" and breaks ratios/logs downstream;
        # 1 ns is far below anything measurable here, so it changes no prediction.
        latency = max(latency, 1e-9)
        fitted[kind] = {"latency_s": latency, "busbw": busbw}
        raw[kind] = {"factor": factor, "points": rows}
        say(f"{kind} x{n}: latency {latency * 1e6:.1f} us, busbw {busbw / 1e9:.2f} GB/s")
    return fitted, raw


# --- pipeline transfers (run on spawned gloo ranks) -------------------------------------------

_PIPE_ROWS, _PIPE_WIDTH = 64, 1024  # one micro-batch's activation: 256 KiB of fp32


class _Matmul(torch.autograd.Function):
    """y = x @ w, adding the seconds of its forward and backward to ``busy[0]``."""

    @staticmethod
    def forward(ctx, x, w, busy):
        t0 = time.perf_counter()
        ctx.save_for_backward(x, w)
        ctx.busy = busy
        y = x @ w
        busy[0] += time.perf_counter() - t0
        return y

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter()
        x, w = ctx.saved_tensors
        out = grad @ w.t(), x.t() @ grad, None
        ctx.busy[0] += time.perf_counter() - t0
        return out


class _Stage(torch.nn.Module):
    """A stage that computes about as long per micro-batch as a small model's block does."""

    def __init__(self, busy: list[float]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(_PIPE_WIDTH, _PIPE_WIDTH) / _PIPE_WIDTH**0.5)
        self.busy = busy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Matmul.apply(x, self.w, self.busy)


def _pipeline_worker(rank: int, world_size: int, microbatches: int, warmup: int,
                     repeats: int, rows: int = _PIPE_ROWS) -> list[tuple[float, float]]:
    """(step seconds, seconds in the stage's own compute) per 1F1B step of ``world_size``
    stages, one per rank, on PyTorch's pipelining runtime (the one autopar's pipelines run on)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(rank)
    busy = [0.0]
    example = torch.zeros(rows, _PIPE_WIDTH)
    # the metadata says what needs a gradient: every activation after the first stage's input
    received = example.clone().requires_grad_(rank > 0)
    sent = example.clone().requires_grad_(True)
    stage = PipelineStage(_Stage(busy), rank, world_size, torch.device("cpu"), input_args=(received,),
                          output_args=(sent,))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda out, target: out.mean())
    x = torch.randn(rows * microbatches, _PIPE_WIDTH)
    times = []
    for i in range(warmup + repeats):
        dist.barrier()
        busy[0] = 0.0
        t0 = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        elif rank == world_size - 1:
            schedule.step(target=x, losses=[])
        else:
            schedule.step()
        if i >= warmup:
            times.append((time.perf_counter() - t0, busy[0]))
    dist.barrier()
    return times


def _measure_pipeline(n: int, quick: bool, send_recv: dict[str, float],
                      say: Callable[[str], None]) -> tuple[dict[str, float], dict]:
    """Seconds per stage-to-stage transfer beyond the raw send/recv, on loaded ranks, at two
    stage weights: ({"overhead_s": a, "wait_per_compute": b}, raw), the overhead of a stage
    computing c seconds per micro-batch being a + b c.

    The cost model prices a 1F1B step of m micro-batches on p stages as (m + p - 1) slots of
    (stage compute t + 2 transfers) (`cost.pipeline.pipeline_step_time`), so the first stage's
    time outside its compute is (p - 1) t + 2 (m + p - 1) transfers. Measured with stages of a
    64 x 1024 x 1024 matmul and of eight times that (a few ms and some tens of ms per
    micro-batch, as small models' stages compute on CPU ranks), as the pipeline runs: gloo, PyTorch's
    schedule bookkeeping, and on a host with fewer cores than ranks, the wait for a descheduled
    peer at every hand-off, longer when the peers compute longer between hand-offs (the second
    weight). Less the fitted send/recv of its bytes, the rest is the transfer's overhead.
    """
    microbatches = 2 * n
    warmup, repeats = (1, 3) if quick else (2, 9)
    points = []
    for rows in (_PIPE_ROWS, 8 * _PIPE_ROWS):
        per_rank = spawn(_pipeline_worker, n, args=(microbatches, warmup, repeats, rows),
                         timeout_s=60.0 if quick else 180.0)
        step, busy = (statistics.median(v) for v in zip(*per_rank[0]))  # the first stage, as bench runtime
        idle = step - busy
        transfer = max(0.0, idle - (n - 1) * busy / microbatches) / (2 * (microbatches + n - 1))
        nbytes = rows * _PIPE_WIDTH * 4
        raw_send = send_recv["latency_s"] + nbytes / send_recv["busbw"]
        points.append({"rows": rows, "step_s": step, "busy_s": busy, "compute_s": busy / microbatches,
                       "bytes": nbytes, "transfer_s": transfer, "send_recv_s": raw_send,
                       "overhead_s": max(0.0, transfer - raw_send)})
    light, heavy = points
    slope = max(0.0, (heavy["overhead_s"] - light["overhead_s"])
                / max(heavy["compute_s"] - light["compute_s"], 1e-9))
    base = max(0.0, light["overhead_s"] - slope * light["compute_s"])
    say(f"pipeline x{n} (1F1B, {microbatches} micro-batches): "
        + ", ".join(f"{p['overhead_s'] * 1e3:.2f} ms per transfer beyond send/recv at "
                    f"{p['compute_s'] * 1e3:.1f} ms of stage compute" for p in points))
    return ({"overhead_s": base, "wait_per_compute": slope},
            {"points": points, "microbatches": microbatches, "repeats": repeats})


# --- a collective beside compute (run on spawned gloo ranks) ----------------------------------

_OVERLAP_BYTES = 16 * _MB  # about a DDP bucket of gradients (25 MiB); the largest size timed above


def _overlap_worker(rank: int, world_size: int, warmup: int, repeats: int
                    ) -> list[tuple[float, float, float]]:
    """(compute alone, all-reduce alone, both) seconds per repeat, every rank at once: a loop of
    matmuls about four times as long as the all-reduce, a 16 MiB all-reduce, and the all-reduce
    issued asynchronously before the same loop (as DDP issues a bucket during the backward)."""
    import torch.distributed as dist

    torch.manual_seed(rank)
    a, w = torch.randn(256, 1024), torch.randn(1024, 1024)
    buf = torch.zeros(_OVERLAP_BYTES // 4)  # zeros: summed every repeat, they stay finite

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    reduce_alone = statistics.median(timed(lambda: dist.all_reduce(buf)) for _ in range(3))
    one = statistics.median(timed(lambda: a @ w) for _ in range(5))
    # rank 0's count for everyone: the ranks must run the same loop
    count = torch.tensor([max(2, math.ceil(4 * reduce_alone / max(one, 1e-6)))])
    dist.broadcast(count, 0)
    iters = int(count.item())

    def compute() -> None:
        for _ in range(iters):
            a @ w

    def both() -> None:
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()

    out = []
    for i in range(warmup + repeats):
        point = (timed(compute), timed(lambda: dist.all_reduce(buf)), timed(both))
        if i >= warmup:
            out.append(point)
    dist.barrier()
    return out


def _measure_overlap(n: int, quick: bool, say: Callable[[str], None]) -> tuple[dict[str, float], dict]:
    """({"slowdown": s}, raw): the step seconds a collective issued beside compute adds, per
    second it takes alone, on ``n`` loaded ranks ((both - compute) / all-reduce, each the
    slowest rank's median, within [0, 1]): `cost.params.CostParams.overlap_slowdown` of the local
    cluster. On a host whose ranks share its cores the collective's copies and reductions run on
    the same cores as the compute: hiding it behind compute saves little (a GPU's copy engines
    and spare SMs make it 0.19 there)."""
    warmup, repeats = (1, 3) if quick else (2, 7)
    per_rank = spawn(_overlap_worker, n, args=(warmup, repeats), timeout_s=60.0 if quick else 180.0)
    compute, reduce, both = (max(statistics.median(p[k] for p in rank) for rank in per_rank)
                             for k in range(3))
    slowdown = min(1.0, max(0.0, (both - compute) / max(reduce, 1e-9)))
    say(f"overlap x{n}: a {_OVERLAP_BYTES // _MB} MiB all-reduce ({reduce * 1e3:.1f} ms alone) "
        f"beside {compute * 1e3:.1f} ms of compute adds {(both - compute) * 1e3:.1f} ms: "
        f"slowdown {slowdown:.2f} s per s hidden")
    return ({"slowdown": slowdown},
            {"compute_s": compute, "all_reduce_s": reduce, "both_s": both, "repeats": repeats,
             "per_rank": per_rank})


# --- entry points ---------------------------------------------------------------------------


def calibrate(
    world_sizes: Sequence[int] = (2, 4),
    path: str | os.PathLike[str] | None = None,
    quick: bool = False,
    progress: Progress = print,
) -> dict[str, Any]:
    """Measure this machine, write the calibration JSON and return it as a dict.

    Args:
        world_sizes: collective benchmarks use ``max(world_sizes)`` gloo ranks (capped at 2 when
            ``quick``); must be >= 2.
        path: output file; default ``$AUTOPAR_CALIBRATION`` or
            ``~/.cache/autopar/calibration.json``. Parent directories are created.
        quick: 2 ranks, fewer sizes and repeats (~5-10 s, not ~13-20 s, on a 2-core host).
        progress: called with one short human-readable line per measurement; ``None`` = silent.

    Returns:
        The calibration (see the module docstring for the format); also written to ``path``.
    """
    say: Callable[[str], None] = progress if progress is not None else (lambda _line: None)
    n = max(world_sizes)
    if quick:
        n = min(n, 2)
    if n < 2:
        raise ValueError(f"collectives need at least 2 ranks, got world_sizes={tuple(world_sizes)}")
    out_path = Path(path).expanduser() if path is not None else default_calibration_path()
    start = time.perf_counter()

    # Threads left at torch's default on purpose: the cost model wants what a single process
    # gets here, and we record what that was.
    threads = torch.get_num_threads()
    say(f"compute: torch {torch.__version__}, {threads} intra-op threads")
    matmul, matmul_raw = _measure_matmul(quick, say)
    memory_bw, memory_raw = _measure_memory_bw(quick, say)
    floor, floor_raw = _measure_kernel_floor(quick, say)
    collectives, coll_raw = _measure_collectives(n, quick, say)
    pipe_overhead, pipe_raw = _measure_pipeline(n, quick, collectives["send_recv"], say)
    overlap, overlap_raw = _measure_overlap(n, quick, say)

    data: dict[str, Any] = {
        "version": CALIBRATION_VERSION,
        "host": socket.gethostname(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "world_size": n,
        "matmul_flops": matmul,
        "memory_bw": memory_bw,
        "kernel_floor_s": floor,
        "collectives": collectives,
        "pipeline": pipe_overhead,
        "overlap": overlap,
        "raw": {
            "quick": quick,
            "threads": {
                "intra_op": threads,
                "inter_op": torch.get_num_interop_threads(),
                "collective_ranks_omp": 1,
                "cpu_count": os.cpu_count(),
            },
            "matmul": matmul_raw,
            "memory_bw": memory_raw,
            "kernel_floor": floor_raw,
            "collectives": coll_raw,
            "pipeline": pipe_raw,
            "overlap": overlap_raw,
            "wall_s": time.perf_counter() - start,
        },
    }
    _write_json(out_path, data)
    say(f"wrote {out_path} ({data['raw']['wall_s']:.1f} s)")
    return data


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically, so a reader never sees half a file (or a crash leaves the old one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {prefix}{unit}"
    return f"{value:.2f} {unit}"


def _seconds(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.2f} ms"
    return f"{value * 1e6:.2f} us"


def format_calibration(data: dict[str, Any]) -> str:
    """Render a calibration dict (as returned or loaded from JSON) as a small readable table."""
    threads = data.get("raw", {}).get("threads", {}).get("intra_op", "?")
    lines = [
        f"autopar calibration v{data.get('version')}: host {data.get('host')}, "
        f"torch {data.get('torch')}, {data.get('date')}",
        "",
        f"compute ({threads} threads)",
    ]
    for dtype, flops in data.get("matmul_flops", {}).items():
        lines.append(f"  {'matmul ' + dtype:<22}{_si(flops, 'FLOP/s'):>14}")
    lines.append(f"  {'memory bandwidth':<22}{_si(data['memory_bw'], 'B/s'):>14}")
    lines.append(f"  {'kernel floor':<22}{_seconds(data['kernel_floor_s']):>14}")
    lines.append("")
    header = f"collectives ({data.get('world_size')} ranks)"
    lines.append(f"{header:<24}{'latency':>14}{'busbw':>14}")
    for kind, c in data.get("collectives", {}).items():
        lines.append(f"  {kind:<22}{_seconds(c['latency_s']):>14}{_si(c['busbw'], 'B/s'):>14}")
    if "pipeline" in data:
        pipe = data["pipeline"]
        lines.append(f"  {'pipeline transfer':<22}{_seconds(pipe['overhead_s']):>14}"
                     f"  beyond send/recv, + {pipe.get('wait_per_compute', 0.0):.3f} s per s of "
                     "stage compute (waits for descheduled peers)")
    if "overlap" in data:
        lines.append(f"  {'overlap slowdown':<22}{data['overlap']['slowdown']:>12.2f}  s of step per s of "
                     "all-reduce issued beside compute (0: free, 1: not hidden at all)")
    return "\n".join(lines)
