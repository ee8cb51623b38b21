"""Compute: every node's roofline time, and the forward, backward and recompute time of each
pipeline stage for one micro-batch on one device."""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.compute import gemm_efficiency
from cost.hardware import GPUSpec
from cost.layout import Layout
from cost.stages import balanced_cuts
from cost.step_facts import StepFacts
from cost.terms.common import resolved

# A training framework reaches less than the sum of its kernels' times: host overhead between
# kernels, gradient clipping, data loading, stragglers. The default of
# `cost.params.CostParams.framework_efficiency` (fitted profiles carry their own): calibrated on
# the playbook's measured DP=8 throughput of its 1.34B model (nanotron on 8xH100, 40,150
# tok/s/GPU), where the kernel roofline alone predicts 47,124: 40,150 / 47,124 = 0.85.
FRAMEWORK_EFFICIENCY = 0.85
# fp8 matmuls first cast their bf16 inputs: read 2 bytes, write 1 per element, i.e. 1.5 bytes
# moved per input byte (torchao's Float8 recipe: a cast kernel per input, tensorwise scales).
FP8_CAST_BYTES_PER_INPUT_BYTE = 1.5


def compute_dtype(gpu: GPUSpec, precision: str) -> str:
    """The tensor-core dtype matmuls of ``precision`` run in on ``gpu`` (fp8 applies to weight
    matmuls only: see `_node_times`)."""
    return "fp32" if precision == "fp32" or "bf16" not in gpu.peak_flops else "bf16"


def roofline_times(gpu: GPUSpec, flops: np.ndarray, vflops: np.ndarray, nbytes: np.ndarray,
                   is_matmul: np.ndarray, launch: np.ndarray, dtype: np.ndarray,
                   half_scale: float = 1.0) -> np.ndarray:
    """Kernel seconds of nodes with these local FLOPs and bytes (arrays, one entry per node).

    Matmuls run at the GEMM efficiency curve of `cost.compute.gemm_efficiency` for their local
    size in ``dtype``; element-wise work at the fp32 vector peak; either is at least its bytes
    over the memory bandwidth; a node that launches a kernel costs at least the GPU's floor.
    This is the one place a node is priced: `node_times` and the TP ILP both call it.
    half_scale: the GEMM curve's F_half relative to the H200 fit (`CostParams.gemm_half_scale`).
    """
    rate = np.ones(flops.shape)
    for d in set(dtype.tolist()):
        sel = dtype == d
        rate[sel] = gpu.peak(d) * gemm_efficiency(np.maximum(flops[sel], 1.0), gpu, d, half_scale)
    t_mm = np.where(is_matmul, flops / rate, vflops / gpu.peak("fp32"))
    times = np.maximum(t_mm, nbytes / (gpu.memory_bw * gpu.memory_efficiency))
    floor = np.where(launch, gpu.kernel_floor_s, 0.0)
    return np.where((flops + vflops + nbytes) > 0, np.maximum(times, floor), 0.0)


def node_times(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Kernel seconds of every node for one micro-batch on one device (`roofline_times` at the
    node's local size: batch / dp / grad_accum, sequence / cp, TP and SP shards).

    Memoised per (cluster, tp, cp, sp, micro-batch, precision): the search re-uses it.
    """
    layout = resolved(facts, cluster, layout)
    key = _times_key(facts, cluster, layout)
    if key not in facts._memo:
        facts._memo[key] = _node_times(facts, cluster, layout)
    return facts._memo[key]


def _times_key(facts: StepFacts, cluster: Cluster, layout: Layout) -> tuple:
    return ("times", cluster.gpu.name, cluster.gpu.memory_bw, cluster.params.gemm_half_scale,
            layout.tp, layout.cp, layout.sp, layout.microbatch, layout.precision, facts.batch)


def _node_times(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    gpu, lay, n = cluster.gpu, layout, facts.nodes
    tp, cp = lay.tp, lay.cp
    scale = lay.microbatch / facts.batch
    act_scale = np.where(n.batch_dep, scale / cp, 1.0)
    div = np.where(n.tp_div, tp, 1) * np.where(n.sp_div & lay.sp, tp, 1)
    flops = n.flops * act_scale / div
    vflops = n.vflops * act_scale / div
    nbytes = (n.bytes_act * scale / cp + n.bytes_const) / div
    dtype = np.full(flops.shape, compute_dtype(gpu, lay.precision))
    if lay.precision == "fp8":
        # only weight matmuls run in FP8, after casting their inputs; attention stays bf16
        fp8 = (n.fp8_act_bytes + n.fp8_const_bytes) > 0
        dtype = np.where(fp8, "fp8", dtype)
        cast = (n.fp8_act_bytes * scale / cp + n.fp8_const_bytes) / div
        nbytes = nbytes + np.where(fp8, cast * FP8_CAST_BYTES_PER_INPUT_BYTE, 0.0)
    return roofline_times(gpu, flops, vflops, nbytes, n.is_matmul, n.launch, dtype,
                          cluster.params.gemm_half_scale)


def step_node_times(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """`node_times` as the step sees them: slowed by the cluster's framework efficiency
    (`CostParams.framework_efficiency`)."""
    return node_times(facts, cluster, layout) / cluster.params.framework_efficiency


def host_overhead_per_stage(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Host seconds of each stage for one micro-batch: `CostParams.layer_overhead_s` per block
    it runs (forward and backward together)."""
    n_layers = max(facts.n_layers, 1)
    blocks = np.bincount(stage_of(facts, np.arange(n_layers), cluster, layout),
                         minlength=layout.pp)
    return blocks * cluster.params.layer_overhead_s


def slot_stages(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Stage of every slot (index = block index + 1: 0 before the blocks, L + 1 after): the
    contiguous cut of `cost.stages.balanced_cuts` on each slot's step seconds for one
    micro-batch under ``layout`` (memoised with the node times)."""
    layout = resolved(facts, cluster, layout)
    n_layers = max(facts.n_layers, 0)
    key = ("stage_map", layout.pp, *_times_key(facts, cluster, layout))
    if key not in facts._memo:
        if n_layers == 0 or layout.pp == 1:
            facts._memo[key] = np.zeros(n_layers + 2, dtype=int)
        else:
            slot = np.clip(facts.nodes.layer, -1, n_layers) + 1
            cost = np.bincount(slot, weights=node_times(facts, cluster, layout),
                               minlength=n_layers + 2)
            blocks = balanced_cuts(cost[1:n_layers + 1], layout.pp, float(cost[0]),
                                   float(cost[-1]))
            facts._memo[key] = np.concatenate([[0], blocks, [layout.pp - 1]]).astype(int)
    return facts._memo[key]


def stage_of(facts: StepFacts, layer: np.ndarray, cluster: Cluster, layout: Layout) -> np.ndarray:
    """The pipeline stage of each block index in ``layer`` (-1 before the blocks, L after)."""
    if layout.pp == 1:
        return np.zeros(np.shape(layer), dtype=int)
    return slot_stages(facts, cluster, layout)[np.clip(layer, -1, max(facts.n_layers, 0)) + 1]


def params_per_stage(facts: StepFacts, cluster: Cluster, lay: Layout) -> np.ndarray:
    """Parameters held by each pipeline stage after TP and EP sharding (memoised)."""
    key = ("stage_params", lay.tp, lay.ep, lay.pp,
           tuple(slot_stages(facts, cluster, lay).tolist()))
    if key not in facts._memo:
        params = facts.params
        out = np.zeros(lay.pp)
        for name, numel in params.numel.items():
            local = numel / (lay.tp if params.tp_sharded[name] else 1)
            local /= lay.ep if params.expert[name] else 1
            layers = np.array(params.stages_layer[name])
            for s in set(stage_of(facts, layers, cluster, lay).tolist()):
                out[s] += local  # a tied embedding lives on the first and the last stage
        facts._memo[key] = out
    return facts._memo[key]


def node_stages(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """The pipeline stage of every node."""
    return stage_of(facts, facts.nodes.layer, cluster, layout)


def compute_per_stage(facts: StepFacts, cluster: Cluster, layout: Layout, times: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of each pipeline stage for one micro-batch."""
    stage, fwd = node_stages(facts, cluster, layout), facts.nodes.forward
    pp = layout.pp
    return (np.bincount(stage, weights=times * fwd, minlength=pp),
            np.bincount(stage, weights=times * ~fwd, minlength=pp))


def recompute_per_stage(facts: StepFacts, cluster: Cluster, layout: Layout, times: np.ndarray
                        ) -> np.ndarray:
    """Seconds of each stage's recomputed forward for one micro-batch: the nodes the recompute
    pass copies into the backward under the layout's mode (`NodeTable.rerun_full` /
    `rerun_selective`: full reruns the blocks' forward but what it keeps, selective the
    element-wise chains between kept matmul and attention outputs); none reruns nothing."""
    n, pp = facts.nodes, layout.pp
    if layout.recompute == "full":
        rerun = n.rerun_full
    elif layout.recompute == "selective":
        rerun = n.rerun_selective
    else:
        return np.zeros(pp)
    return np.bincount(node_stages(facts, cluster, layout), weights=times * rerun, minlength=pp)
