"""Pipeline parallelism: the point-to-point transfer between stages and the schedule's bubble."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cost.cluster import Cluster
from cost.comm import Group, axis_group, collective_time
from cost.pipeline import pipeline_step_time
from cost.step_facts import StepFacts
from cost.terms.common import exposed_beside
from cost.terms.compute import virtual_stages
from vocab.layout import Layout


def p2p_time(facts: StepFacts, cluster: Cluster, lay: Layout, scale: float,
             stage_s: float = 0.0) -> float:
    """Seconds of one stage-to-stage send of a micro-batch's block input (0 without PP).

    The boundary activation is the block input (sequence-sharded under SP, / cp). Adjacent
    stages sit tp*cp ranks apart (playbook rank order: TP innermost, then CP, PP, DP), so a
    pipeline of tp*cp*pp ranks wider than a node has a boundary that crosses nodes, and that
    boundary gates every micro-batch. Each transfer also pays `CostParams.p2p_overhead_s`
    plus `p2p_node_overhead_s` per node of the cluster beyond the first: the handshake and the
    stages' synchronisation with the rest of the job; and where ranks share a host's cores,
    `HostShare.wait_per_compute` times ``stage_s`` (a stage's seconds per micro-batch): the
    receiving peer descheduled while the others compute."""
    if lay.pp == 1:
        return 0.0
    boundary = facts.block_input_bytes * scale / lay.cp / (lay.tp if lay.sp else 1)
    crosses = lay.tp * lay.cp * lay.pp > cluster.gpus_per_node
    pair = Group(2, 1 if crosses else 2)
    params = cluster.params
    overhead = params.p2p_overhead_s + params.p2p_node_overhead_s * (cluster.nodes - 1)
    if cluster.host_share is not None:
        overhead += cluster.host_share.wait_per_compute * stage_s
    return collective_time("send_recv", boundary, pair, cluster) + overhead


def p2p_exposed(facts: StepFacts, cluster: Cluster, lay: Layout, p2p_s: float,
                stage_s: float) -> float:
    """Seconds of one stage-to-stage transfer (``p2p_s``, `p2p_time`) left on the critical path.

    All of it, unless the framework overlaps the interleaved schedule's transfers with compute
    (`StepFacts.p2p_hidden`, Megatron's ``overlap_p2p_comm``; only with interleave depth
    v > 1): a slot's 2v transfers then run behind the slot's compute ``stage_s``; what exceeds
    it stays exposed, and each hidden second costs `CostParams.overlap_slowdown`, as every
    overlapped collective does."""
    if not facts.p2p_hidden or lay.pp == 1 or lay.virtual_stages == 1:
        return p2p_s
    return float(exposed_beside(p2p_s, stage_s / (2 * lay.virtual_stages), cluster))


def pipeline_time(slowest_stage_s: float, p2p_s: float, lay: Layout) -> tuple[float, float]:
    """(total, bubble) seconds of the step's micro-batches through the pipeline.

    `cost.pipeline.pipeline_step_time` with the layout's schedule: bubble (p-1)/m of the
    useful time for 1F1B (also when m < p: the pipeline never fills), slots of the slowest
    stage plus its transfers. Without PP: grad_accum times the stage, no bubble.
    """
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    return pipeline_step_time(slowest_stage_s, p2p_s, lay.pp, lay.grad_accum, schedule,
                              lay.virtual_stages)


def shared_host_factor(cluster: Cluster, lay: Layout,
                       stage_s: Sequence[float] | None = None) -> float:
    """Factor (<= 1) on the slowest pipeline stage's compute seconds when the ranks time-share a
    host's cores (local CPU ranks, `cost.cluster.HostShare`): a rank with nothing to do lends
    its cores to the busy ones. 1 on devices and without a pipeline.

    The schedule runs slot by slot (1F1B's order, for every schedule): of
    n = m v + p - 1 slots (m micro-batches, p stages, v chunks per rank), stage i computes in
    slots i .. i + m v - 1, t_i / v seconds each (``stage_s``: seconds per micro-batch with
    every rank busy), its R / p ranks in step with it (R the host's ranks: the data-parallel
    pipelines fill and drain together). A slot's busy ranks share the C cores, each using at
    most c = ``threads_per_rank``: with k busy, a rank computes min(c, C / k) / min(c, C / R)
    times faster than with all busy, and a rank that finishes its share lends its cores to the
    rest (processor sharing). The factor is the slots' summed length over n t* / v (t* the
    slowest stage's t_i): where the fill and the drain leave cores idle, or a lighter stage
    waits for the slowest, the slowest computes faster, but only as fast as c cores allow; and
    a slot of lighter stages alone (the fill behind a light first stage) lasts as long as they
    do, where the price's bubble counts every slot at t*. A schedule whose price counts fewer
    bubble slots (zero-bubble) keeps at least all its work on the C cores.

    Without ``stage_s``: a floor no stage times go below, the slowest stage's m v slots at c
    cores and no bubble, (m v / n) min(c, C / R) / min(c, C) (the search's lower bound,
    `autopar.search.bound`).

    Measured (`python -m autopar bench runtime`, 4 gloo ranks on 2 cores): PP4's first rank
    computes no faster than with every rank busy, and PP2 x DP2 measures 1.01-1.06x DP's step:
    the bubble's idle cores spread evenly over every slot priced it 0.93-0.96x DP's (the
    fastest layout), these slots 0.97-1.04x; PP4 measures 1.06-1.12x DP's, priced 1.15-1.25x.
    """
    share = cluster.host_share
    if lay.pp == 1 or share is None:
        return 1.0
    v, p, m = virtual_stages(lay), lay.pp, lay.grad_accum
    slots = m * v + p - 1
    ranks = max(cluster.gpus_per_node, p)
    if stage_s is None:
        return m * v / slots / share.busy_speedup(ranks, 1.0 / ranks)
    times = [float(t) / v for t in stage_s]
    slowest = max(times)
    if slowest <= 0.0:
        return 1.0
    per_stage = ranks // p
    total = 0.0
    for slot in range(slots):
        busy = sorted(t for i, t in enumerate(times) if i <= slot < i + m * v and t > 0.0)
        total += _shared_makespan(busy, per_stage, ranks, share.busy_speedup)
    # a schedule priced with fewer bubble slots than 1F1B's (zero-bubble) keeps at least the
    # wall time of all its work on the host's cores
    all_busy_cores = min(share.threads_per_rank, share.cores / ranks)
    work_s = m * v * sum(times) * per_stage * all_busy_cores / share.cores
    return max(total / (slots * slowest), work_s / pipeline_time(slowest * v, 0.0, lay)[0])


def _shared_makespan(work_s: list[float], per_stage: int, ranks: int,
                     speedup: Callable[[int, float], float]) -> float:
    """Seconds until stages of ``work_s`` all-busy seconds each (ascending, ``per_stage`` ranks
    apiece) finish when the busy ranks share the host's cores (``speedup``:
    `HostShare.busy_speedup`): each stretch runs at the speed of the ranks still busy."""
    elapsed, done = 0.0, 0.0
    for k, work in enumerate(work_s):
        busy = (len(work_s) - k) * per_stage
        elapsed += (work - done) / speedup(ranks, busy / ranks)
        done = work
    return elapsed


def loss_broadcast(cluster: Cluster, lay: Layout) -> float:
    """Seconds of the loss's broadcast from the last stage to the pipeline's other ranks after
    the schedule (runtime/pipeline.py), priced as an all-reduce of one value (latency-bound);
    0 without a pipeline."""
    if lay.pp == 1:
        return 0.0
    return collective_time("all_reduce", 4.0, axis_group(cluster, lay.pp, lay.tp * lay.cp), cluster)
