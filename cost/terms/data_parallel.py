"""Data parallelism and ZeRO: the gradient sync and the weight gathers, exposed and total."""

from __future__ import annotations

import math

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.memory import DDP_BUCKET_BYTES
from cost.precision import PrecisionRecipe
from cost.terms.common import comm_overlap, zero_reduction
from vocab.layout import Layout


def bucketed(kind: str, nbytes: float, group, cluster: Cluster) -> float:
    """Seconds of reducing ``nbytes`` of gradients in DDP's buckets (`DDP_BUCKET_BYTES`, as the
    DP pass issues them): one collective per bucket, each paying its latency; the framework's
    per-call overhead (`CostParams.*collective_overhead_s`) once, since the buckets are issued
    back to back while the previous one is on the wire."""
    if nbytes <= 0:
        return 0.0
    buckets = max(1, math.ceil(nbytes / DDP_BUCKET_BYTES))
    one = collective_time(kind, nbytes / buckets, group, cluster)
    params = cluster.params
    overhead = params.collective_overhead_s if group.nodes == 1 else params.inter_collective_overhead_s
    return buckets * one - (buckets - 1) * overhead


def gather_copy_s(cluster: Cluster, weight_bytes: float, ranks: int) -> float:
    """Seconds of the copies around all-gathering ``weight_bytes`` of weights over ``ranks``
    (passes/data_parallel.py `_gather_bucket`, as FSDP2 does too): each block's shards are
    concatenated into the send buffer (1/ranks of the bytes read and written) and the gathered
    rows copied out into each weight (all of them read and written), 2 (1 + 1/ranks) bytes
    moved per weight byte at the device's memory bandwidth, on the compute stream: not hidden
    by any overlap."""
    gpu = cluster.gpu
    return 2.0 * (1.0 + 1.0 / ranks) * weight_bytes / (gpu.memory_bw * gpu.memory_efficiency)


def dp_comm(cluster: Cluster, lay: Layout, rec: PrecisionRecipe, stage_params: float,
            n_layers: int, fwd_s: float, bwd_s: float, recompute_s: float,
            tp_hidden_fwd_s: float = 0.0, tp_hidden_bwd_s: float = 0.0,
            copied_params: float | None = None, expert_params: float = 0.0,
            pipeline_reduce_hidden: bool = False,
            param_gather_hidden: bool = False) -> tuple[float, float]:
    """(exposed, total) seconds of the data-parallel communication of one step (0 without DP).

    The group is the dp ranks (dp*cp with CP: CP ranks hold the same weights). DP reduces the
    whole gradients with an all-reduce once per step, after the last micro-batch (DDP's
    no_sync); ZeRO-1/2 reduce-scatter them (`zero_reduction`), ZeRO-2/3 every micro-batch
    (FSDP's default: gradients stay sharded), in 25 MiB buckets (`bucketed`), and ZeRO-1/2
    all-gather the updated weights once per step, block by block, after the optimizer
    (exposed). ZeRO-3 gathers every block's weights for the forward and the backward of every
    micro-batch (for the forward only with ``reshard`` False), prefetched one block ahead.
    Every gather of a block's several weights also copies them in and out (`gather_copy_s`,
    exposed): ``copied_params`` of the stage (all of ``stage_params`` when None; a lone weight
    outside the blocks is gathered in place).

    One budget of compute hides everything, counted once: the reductions hide behind the
    slowest stage's backward (and recompute) that the TP collectives do not already occupy
    (``tp_hidden_bwd_s``), ZeRO-3's gathers behind what is left of the whole micro-batch; of
    that compute only `CostParams.dp_overlap` can hide communication (the first blocks'
    backward runs before any bucket is full, the last gather waits for the optimizer), and
    every hidden second costs `CostParams.overlap_slowdown` seconds of the compute it hides
    behind. stage_params: TP/EP-local parameters of the fullest stage; fwd_s, bwd_s,
    recompute_s: that stage's seconds for one micro-batch. expert_params: the experts' part
    of stage_params under ep, reduced and gathered over their owners (`expert_owners`), not
    over the dp ranks: the two parts' collectives add up (none for owners of one rank).
    Under a pipeline the whole gradients (DP, ZeRO-1) are reduced after the schedule
    (`runtime.pipeline`), exposed, unless ``pipeline_reduce_hidden`` (measured runs of
    Megatron-LM, whose last micro-batch's backward hides it: `StepFacts.pipeline_reduce_hidden`).
    ZeRO-1/2's gather of the updated weights is exposed, unless ``param_gather_hidden``
    (Megatron-Core's ``overlap_param_gather``: each block's gather runs behind the next step's
    forward of the blocks before it, so the first micro-batch's forward that TP does not
    occupy hides it, at the same overlap share and slowdown).
    """
    dp_group_size = lay.dp * lay.cp
    if dp_group_size == 1:
        return 0.0, 0.0
    tp, cp, pp, m = lay.tp, lay.cp, lay.pp, lay.grad_accum
    dense_group = (axis_group(cluster, lay.dp, tp * cp * pp) if cp == 1
                   else axis_group(cluster, dp_group_size, tp))
    parts = [(stage_params - expert_params, dense_group)]  # (parameters, the group reducing them)
    if expert_params > 0 and lay.ep > 1:
        parts.append((expert_params, expert_owners(cluster, lay)))
    grad_per_param = 4.0 if (rec.grad_accum_bytes or lay.precision == "fp32") else rec.grad_bytes
    copied_bytes = (stage_params if copied_params is None else copied_params) * rec.param_bytes
    # blocks gathered one at a time (ZeRO-1/2 once per step, ZeRO-3 for the forward and the
    # backward of every micro-batch), plus the weights outside the blocks
    blocks = -(-n_layers // pp) + 1

    def gather_all() -> float:  # one all-gather of every block's weights, per group
        return sum(blocks * collective_time("all_gather", n * rec.param_bytes / blocks, g, cluster)
                   for n, g in parts if g is not None and n > 0)
    kind = "all_reduce" if lay.zero == 0 else zero_reduction(cluster)
    sync = sum(bucketed(kind, n * grad_per_param, g, cluster) for n, g in parts if g is not None)
    params = cluster.params
    overlap = comm_overlap(cluster) * params.dp_overlap
    after = after_total = 0.0
    if 0 < lay.zero < 3:
        gather = gather_all()
        hidden = min(gather, overlap * max(0.0, fwd_s - tp_hidden_fwd_s)) if param_gather_hidden else 0.0
        copies = gather_copy_s(cluster, copied_bytes, dp_group_size)
        after = gather - hidden + params.overlap_slowdown * hidden + copies
        after_total = gather + copies
    hideable = lay.pp == 1 or lay.zero >= 2 or pipeline_reduce_hidden
    hidden_sync = min(sync, overlap * max(0.0, bwd_s + recompute_s - tp_hidden_bwd_s)) if hideable else 0.0
    # whole gradients (DP, ZeRO-1) are reduced once per step, after the last micro-batch
    # (DDP's no_sync); sharded ones (ZeRO-2/3) by every micro-batch, each behind its backward
    syncs = m if lay.zero >= 2 else 1
    exposed = syncs * (sync - hidden_sync + params.overlap_slowdown * hidden_sync) + after
    total = syncs * sync + after_total
    if lay.zero == 3:
        # prefetched one block ahead: hidden behind what that micro-batch's compute has left;
        # for the forward and again for the backward unless the gathered weights are kept
        gathers = 2 if lay.reshard else 1
        gather = gathers * gather_all()
        left = fwd_s + bwd_s + recompute_s - tp_hidden_fwd_s - tp_hidden_bwd_s - hidden_sync
        hidden = min(gather, overlap * max(0.0, left))
        copies = gathers * gather_copy_s(cluster, copied_bytes, dp_group_size)
        exposed += m * (gather - hidden + params.overlap_slowdown * hidden + copies)
        total += m * (gather + copies)
    return exposed, total


def expert_owners(cluster: Cluster, lay: Layout):
    """The group over which an expert's gradients are reduced and ZeRO shards it: the dp/ep
    ranks that store the same experts (every ep-th data-parallel rank:
    `runtime.mesh.expert_mesh`); None where that is one rank (no collective)."""
    owners = lay.dp * lay.cp // lay.ep
    return axis_group(cluster, owners, lay.tp * lay.cp * lay.pp * lay.ep) if owners > 1 else None


def dp_step_syncs(cluster: Cluster, lay: Layout, counts_tokens: bool) -> float:
    """Seconds of the step's small all-reduces over the data-parallel ranks that carry no
    gradient, as the runtime issues them: the count of valid tokens when the loss is a mean
    over them (`StepFacts.counts_tokens`) and, without a pipeline, the reported loss's mean (a
    pipeline's loss rides with its gradients). Latency-bound: microseconds on NCCL; on gloo
    (4 ranks, 2 cores) the token count took 2.6 ms of a PP x DP step."""
    if lay.dp == 1:
        return 0.0
    group = axis_group(cluster, lay.dp, lay.tp * lay.cp * lay.pp)
    values = int(counts_tokens) + int(lay.pp == 1)
    return values * collective_time("all_reduce", 8.0, group, cluster)
