"""Data parallelism and ZeRO: the gradient sync and the weight gathers, exposed and total."""

from __future__ import annotations

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.layout import Layout
from cost.precision import PrecisionRecipe
from cost.terms.common import comm_overlap, zero_reduction


def dp_comm(cluster: Cluster, lay: Layout, rec: PrecisionRecipe, stage_params: float,
            n_layers: int, fwd_s: float, bwd_s: float, recompute_s: float) -> tuple[float, float]:
    """(exposed, total) seconds of the data-parallel communication of one step (0 without DP).

    The group is the dp ranks (dp*cp with CP: CP ranks hold the same weights). DP reduces the
    whole gradients with an all-reduce once per step, after the last micro-batch (DDP's
    no_sync); ZeRO-1/2 reduce-scatter them (`zero_reduction`), ZeRO-2/3 every micro-batch
    (FSDP's default: gradients stay sharded), and ZeRO-1/2 all-gather the updated weights once
    per step, block by block. ZeRO-3 gathers every block's weights for the forward and the
    backward of every micro-batch, prefetched one block ahead. Reductions hide behind the
    backward (and recompute) of the slowest stage, ZeRO-3's gathers behind the whole
    micro-batch, by `comm_overlap`. stage_params: TP/EP-local parameters of the fullest
    stage; fwd_s, bwd_s, recompute_s: that stage's seconds for one micro-batch.
    """
    dp_group_size = lay.dp * lay.cp
    if dp_group_size == 1:
        return 0.0, 0.0
    tp, cp, pp, m = lay.tp, lay.cp, lay.pp, lay.grad_accum
    group = (axis_group(cluster, lay.dp, tp * cp * pp) if cp == 1
             else axis_group(cluster, dp_group_size, tp))
    grad_bytes = stage_params * (4.0 if (rec.grad_accum_bytes or lay.precision == "fp32")
                                 else rec.grad_bytes)
    weight_bytes = stage_params * rec.param_bytes
    # blocks gathered one at a time (ZeRO-1/2 once per step, ZeRO-3 for the forward and the
    # backward of every micro-batch), plus the weights outside the blocks
    blocks = -(-n_layers // pp) + 1
    if lay.zero == 0:
        sync = collective_time("all_reduce", grad_bytes, group, cluster)
        after = 0.0
    else:
        sync = collective_time(zero_reduction(cluster), grad_bytes, group, cluster)
        after = blocks * collective_time("all_gather", weight_bytes / blocks, group, cluster) \
            if lay.zero < 3 else 0.0
    overlap = comm_overlap(cluster)
    hide = overlap * (bwd_s + recompute_s)
    # whole gradients (DP, ZeRO-1) are reduced once per step, after the last micro-batch
    # (DDP's no_sync); sharded ones (ZeRO-2/3) by every micro-batch, each behind its backward
    syncs = m if lay.zero >= 2 else 1
    exposed = syncs * max(0.0, sync - hide) + after
    total = syncs * sync + after
    if lay.zero == 3:
        # prefetched one block ahead: hidden behind that micro-batch's compute
        gather = 2 * blocks * collective_time("all_gather", weight_bytes / blocks, group, cluster)
        per_mb = overlap * (fwd_s + bwd_s + recompute_s)
        exposed += m * max(0.0, gather - per_mb)
        total += m * gather
    return exposed, total
