"""Helpers the step's terms share: resolving a layout, the stage of a block, overlap,
and the parameters each pipeline stage holds."""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.step_facts import StepFacts
from vocab.layout import Layout


def default_precision(cluster: Cluster) -> str:
    """The precision a layout without one is priced in: bf16 where the devices have bf16 tensor
    cores (mixed precision, fp32 master weights), fp32 elsewhere (CPU ranks)."""
    return "fp32" if cluster.gpu.is_cpu or "bf16" not in cluster.gpu.peak_flops else "bf16"


def resolved(facts: StepFacts, cluster: Cluster, layout: Layout) -> Layout:
    """``layout`` with its omitted fields derived for this step (`Layout.resolve`)."""
    return layout if layout.resolved else layout.resolve(facts.batch, default_precision(cluster))


def comm_overlap(cluster: Cluster) -> float:
    """Fraction of communication that can hide behind compute (data-parallel syncs and
    gathers, and the TP collectives Megatron overlaps with matmuls).

    GPUs: 1 (NCCL runs on its own SMs and copy engines while kernels run; FSDP/DDP overlap).
    CPU ranks: 0, measured: gloo's transport runs on the cores that compute, and 4 ranks on a
    2-core host already oversubscribe them; `bench runtime` measured ZeRO-3 1.27x slower than
    DP there where full overlap predicted it 3 % faster.
    """
    return 0.0 if cluster.gpu.is_cpu else 1.0


def exposed_beside(transfer, compute, cluster: Cluster):
    """Seconds a transfer of ``transfer`` seconds adds beside ``compute`` seconds it may hide
    behind (floats or arrays): h = min(transfer, `comm_overlap` x compute) of it hidden, each
    hidden second costing `CostParams.overlap_slowdown` s, so transfer - h + s h."""
    hidden = np.minimum(transfer, comm_overlap(cluster) * compute)
    return transfer - hidden + cluster.params.overlap_slowdown * hidden


def zero_reduction(cluster: Cluster) -> str:
    """The collective that reduces ZeRO's gradients: reduce-scatter, except on CPU ranks, where
    the runtime all-reduces (gloo's reduce-scatter is no faster: passes/data_parallel.py)."""
    return "all_reduce" if cluster.gpu.is_cpu else "reduce_scatter"


def block_params(facts: StepFacts, lay: Layout, n_layers: int) -> float:
    """Parameters of one block on one device (what ZeRO-3 gathers at a time), memoised."""

    def build() -> float:
        params = facts.params
        in_blocks = sum(  # a rank stores E/ep of the experts (passes/expert_parallel.py)
            n / (lay.tp if params.tp_sharded[p] else 1) / (lay.ep if params.expert[p] else 1)
            for p, n in params.numel.items()
            if all(0 <= layer < n_layers for layer in params.stages_layer[p])
        )
        largest = max(
            (n / (lay.tp if params.tp_sharded[p] else 1) for p, n in params.numel.items()),
            default=0.0,
        )
        return in_blocks / facts.n_layers if facts.n_layers else largest
    return facts.cache.get("block_params", (lay.tp, lay.ep), build)
