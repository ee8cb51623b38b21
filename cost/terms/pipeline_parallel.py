"""Pipeline parallelism: the point-to-point transfer between stages and the schedule's bubble."""

from __future__ import annotations

from collections.abc import Callable

from cost.cluster import Cluster
from cost.comm import Group, axis_group, collective_time
from cost.pipeline import bubble_fraction, pipeline_step_time
from cost.step_facts import StepFacts
from cost.terms.common import comm_overlap
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
    transfers = 2 * lay.virtual_stages
    hidden = min(p2p_s, comm_overlap(cluster) * stage_s / transfers)
    return p2p_s - hidden + cluster.params.overlap_slowdown * hidden


def pipeline_time(slowest_stage_s: float, p2p_s: float, lay: Layout) -> tuple[float, float]:
    """(total, bubble) seconds of the step's micro-batches through the pipeline.

    `cost.pipeline.pipeline_step_time` with the layout's schedule: bubble (p-1)/m of the
    useful time for 1F1B (also when m < p: the pipeline never fills), slots of the slowest
    stage plus its transfers. Without PP: grad_accum times the stage, no bubble.
    """
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    return pipeline_step_time(slowest_stage_s, p2p_s, lay.pp, lay.grad_accum, schedule,
                              lay.virtual_stages)


def shared_host_factor(cluster: Cluster, lay: Layout, stage_s: float = 0.0,
                       transfer: Callable[[float], float] | None = None) -> float:
    """Factor (<= 1) on a pipeline stage's compute seconds when its ranks time-share a host's
    cores (local CPU ranks, `cost.cluster.HostShare`): a rank idle in the bubble or waiting at a
    hand-off lends its core to the busy ones, so a busy rank computes faster than with every
    rank busy. 1 on devices and without a pipeline.

    A rank computes in m of the schedule's m (1 + bubble) slots, each slot its stage's t
    seconds and 2v transfers of x(t) = ``transfer(t)`` (`p2p_time` at that stage time; v the
    interleave depth): busy fraction 1 / ((1 + bubble)(1 + 2v x(t) / t)), with t = ``stage_s``
    (seconds per micro-batch with every rank busy) times the factor itself: a fixed point
    (faster stages wait longer at each hand-off). Iterated from 1 the factor only falls, and it
    is bounded below by the cores a rank can use (`cost.cluster.rank_share`), so the iteration
    converges. Where the cores do not cap the speedup (f = busy), the slot t f + 2v x(t f)
    equals t / (1 + bubble), and where they do it is larger: the hand-offs cost at least what
    their idle cores lend (`autopar.search.bound` relies on it).

    Measured (`bench runtime`, 4 gloo ranks on 2 cores, three runs): PP4 1F1B (m=8) priced
    0.67-0.73x its measured step, the layouts without a pipeline 0.69-0.83x; with the bubble
    alone PP4 was priced 1.07x where those were 0.84-0.94x. PP2 x DP2 0.63-0.67x."""
    if lay.pp == 1 or cluster.host_share is None:
        return 1.0
    bubble = bubble_fraction(lay.schedule, lay.pp, lay.grad_accum, lay.virtual_stages)
    handoffs = 2 * virtual_stages(lay)
    factor = 1.0
    for _ in range(200):
        t = stage_s * factor
        waiting = handoffs * transfer(t) / t if transfer is not None and t > 0 else 0.0
        busy = 1.0 / ((1.0 + bubble) * (1.0 + waiting))
        new = 1.0 / cluster.host_share.busy_speedup(cluster.gpus_per_node, busy)
        if abs(new - factor) < 1e-9:
            break
        factor = new
    return new


def loss_broadcast(cluster: Cluster, lay: Layout) -> float:
    """Seconds of the loss's broadcast from the last stage to the pipeline's other ranks after
    the schedule (runtime/pipeline.py), priced as an all-reduce of one value (latency-bound);
    0 without a pipeline."""
    if lay.pp == 1:
        return 0.0
    return collective_time("all_reduce", 4.0, axis_group(cluster, lay.pp, lay.tp * lay.cp), cluster)
