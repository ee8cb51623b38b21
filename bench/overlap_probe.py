"""Can this machine hide communication behind compute? Measured side by side on gloo ranks.

`bench runtime` compares the exposed communication autopar's runtime leaves with what the cost
model prices as hidden; that comparison means something only where a collective in flight and
a matmul can progress at once. This probe measures it directly, with nothing of autopar in the
way: on every rank, for each message size,

    comm    = an all-reduce of the message alone (issued and waited for)
    compute = k matmuls alone (k chosen so that they take about as long as the all-reduce)
    both    = the all-reduce issued, the k matmuls, then the wait

    hidden share = (comm + compute - both) / min(comm, compute)

1 where the shorter of the two hides wholly behind the other (a GPU with NCCL: its copy and
reduction kernels run beside the matmuls on their own SMs and links), 0 where the two only
take turns (a CPU whose cores run both the gloo transport and the matmuls: every rank's cores
are busy with one or the other), below 0 where running both at once costs more than running
them apart. Each time is the median of ``repeats`` runs, every rank timing the same steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from runtime.launch import spawn

SIZES_MB = (1, 4, 16)


def hidden_share(comm_s: float, compute_s: float, both_s: float) -> float:
    """(comm + compute - both) / min(comm, compute): the share of the shorter that the other hid."""
    return (comm_s + compute_s - both_s) / min(comm_s, compute_s)


def _median_time(fn, repeats: int) -> float:
    import torch.distributed as dist

    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, sizes_mb: tuple[int, ...], repeats: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(rank)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    one_mm = _median_time(lambda: torch.mm(a, b), repeats)
    rows = []
    for mb in sizes_mb:
        message = torch.randn(mb * (1 << 20) // 4)
        comm = _median_time(lambda message=message: dist.all_reduce(message), repeats)
        # every rank runs as many matmuls as rank 0 finds fill the all-reduce
        k = torch.tensor([max(1, round(comm / one_mm))])
        dist.broadcast(k, 0)
        k = int(k)

        def compute(k=k):
            for _ in range(k):
                torch.mm(a, b)

        def both(k=k, message=message):
            work = dist.all_reduce(message, async_op=True)
            compute(k)
            work.wait()

        compute_s = _median_time(compute, repeats)
        both_s = _median_time(both, repeats)
        rows.append({"message_mb": mb, "matmuls": k, "comm_s": comm, "compute_s": compute_s,
                     "both_s": both_s, "hidden_share": hidden_share(comm, compute_s, both_s)})
    return {"threads_per_rank": torch.get_num_threads(), "rows": rows}


def run_overlap_probe(quick: bool = False, world: int = 2) -> dict:
    """The probe on ``world`` gloo ranks of this machine: one row per message size (rank 0's
    times; every rank times the same steps between barriers)."""
    sizes = SIZES_MB[:2] if quick else SIZES_MB
    repeats = 5 if quick else 11
    measured = spawn(_worker, world, args=(sizes, repeats), timeout_s=600)[0]
    rows = measured["rows"]
    return {"world": world, "threads_per_rank": measured["threads_per_rank"], "repeats": repeats,
            "rows": rows,
            "hidden_share_median": statistics.median(r["hidden_share"] for r in rows)}


def format_overlap_probe(result: dict) -> str:
    """The probe's table: each size's times side by side and the share the overlap hid."""
    lines = [f"overlap probe: {result['world']} gloo ranks of {result['threads_per_rank']} thread(s), "
             f"median of {result['repeats']} runs",
             f"{'message':>9} {'matmuls':>8} {'comm':>10} {'compute':>10} {'both':>10} {'hidden share':>13}"]
    for r in result["rows"]:
        lines.append(f"{r['message_mb']:>6} MB {r['matmuls']:>8} {r['comm_s'] * 1e3:>7.2f} ms "
                     f"{r['compute_s'] * 1e3:>7.2f} ms {r['both_s'] * 1e3:>7.2f} ms {r['hidden_share']:>13.2f}")
    lines.append(f"hidden share, median over sizes: {result['hidden_share_median']:.2f} "
                 "(1: the shorter hides wholly; 0: the two take turns)")
    return "\n".join(lines)
