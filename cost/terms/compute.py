"""Compute: every node's roofline time, and the forward, backward and recompute time of each
pipeline stage for one micro-batch on one device."""

from __future__ import annotations

import dataclasses

import numpy as np

from cost.cluster import Cluster
from cost.compute import gemm_efficiency
from cost.hardware import FA2_HALF_HEAD_DIM, NATIVE_HALF_HEAD_DIM, GPUSpec
from cost.memory import buffer_bytes, headroom_bytes, model_state_bytes
from cost.pipeline import in_flight_microbatches
from cost.precision import recipe
from cost.routing import imbalance
from cost.stages import StageMemory
from cost.step_facts import StepFacts
from cost.terms.common import block_params, resolved
from cost.terms.recompute import activation_memory, fixed_choice, local_saved_bytes
from vocab.choices import ChoicesMissingError
from vocab.layout import Layout
from vocab.plan_types import RecomputeChoice, fp8_group

# A training framework reaches less than the sum of its kernels' times: host overhead between
# kernels, gradient clipping, data loading, stragglers. The default of
# `cost.params.CostParams.framework_efficiency` (fitted profiles carry their own): calibrated on
# the playbook's measured DP=8 throughput of its 1.34B model (nanotron on 8xH100, 40,150
# tok/s/GPU), where the kernel roofline alone predicts 47,124: 40,150 / 47,124 = 0.85.
FRAMEWORK_EFFICIENCY = 0.85
# FP8 matmuls first cast their inputs (passes/fp8.py): the amax reads the input once, the
# scale-and-cast reads it again and writes one byte per element (half a bf16 input's bytes):
# 2.5 bytes moved per input byte, as fused kernels run it (torchao's compiled casts).
FP8_CAST_BYTES_PER_INPUT_BYTE = 2.5
# Head dims the fused attention kernels are built for are multiples of 32 (FlashAttention-2's
# kernel instances: hdim 32, 64, 96, 128, 160, 192, 224, 256); a head dim of 80 runs as 96.
# Measured on an H200 (cost/profiles/h200_attention_heldout.json, rows the rates were not fitted
# on): head dim 80 predicted 0.77-0.86x its time without the rounding, 0.89-0.97x with it (the
# rounding was added after seeing them).
ATTENTION_HEAD_TILE = 32.0
# torch 2.13's CPU `_scaled_mm` (it runs the FP8 numerics on CPU ranks): measured on a 2-core
# host at 0.03-0.05 GFLOP/s for 128x64x64 to 512x256x256 (fp32 matmul there: 110-230 GFLOP/s). FP8 runs on CPU ranks when asked, and "auto" never picks it there.
CPU_FP8_MATMUL_FLOPS = 5e7


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
    return facts.cache.get("times", times_key(facts, cluster, layout),
                           lambda: _node_times(facts, cluster, layout))


def times_key(facts: StepFacts, cluster: Cluster, layout: Layout) -> tuple:
    """What `node_times` depends on: equal keys, equal node times."""
    return (cluster.gpu.name, cluster.gpu.memory_bw, cluster.params.gemm_half_scale,
            cluster.params.attention_efficiency, cluster.gpu.attention_efficiency,
            cluster.gpu.native_attention_efficiency, cluster.gpu.attention_half_seq,
            layout.tp, layout.cp, layout.sp, layout.ep, layout.microbatch, facts.batch, layout.precision,
            _chosen_fp8(layout) if layout.fp8 == "auto" else layout.fp8, layout.fp8_recipe)


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
    fp8 = fp8_nodes(facts, cluster, lay)
    if fp8.any():
        # the chosen weight matmuls run in FP8 after casting their inputs; attention stays
        if "fp8" not in gpu.peak_flops and gpu.is_cpu:
            gpu = dataclasses.replace(gpu, peak_flops={**gpu.peak_flops, "fp8": CPU_FP8_MATMUL_FLOPS})
        dtype = np.where(fp8, "fp8", dtype)
        cast = (n.fp8_act_bytes * scale / cp + n.fp8_const_bytes) / div
        nbytes = nbytes + np.where(fp8, cast * FP8_CAST_BYTES_PER_INPUT_BYTE, 0.0)
    if lay.ep > 1 and n.ep_rows.any():
        # stacked experts: the ops between their grouped matmuls run on the group's ep T rows,
        # the matmuls on the rank's experts' rows, as many as the busiest rank's
        rows = np.where(n.ep_rows, lay.ep, 1.0)
        flops, vflops, nbytes = flops * rows, vflops * rows, nbytes * rows
        flops = np.where(n.routed, flops * imbalance(
            facts.expert_routed_rows * scale / cp, lay.ep), flops)
    times = roofline_times(gpu, flops, vflops, nbytes, n.is_matmul, n.launch, dtype,
                           cluster.params.gemm_half_scale)
    native = facts.native_attention if cp == 1 else facts.ring_native_attention
    return attention_floor(times, flops, n.attention_seq / cp, cluster, compute_dtype(gpu, lay.precision),
                           native, n.attention_head_dim)


def attention_floor(times: np.ndarray, flops: np.ndarray, keys: np.ndarray, cluster: Cluster,
                    dtype: str, native: bool = False, head_dim: np.ndarray | None = None) -> np.ndarray:
    """``times`` with each attention node (forward or backward: ``keys`` > 0, its local keys, a
    language model's tokens, an image model's patches; ``head_dim`` its head dim, 128 where not
    given) no faster than ``flops`` at `attention_efficiency`'s rate; unchanged on CPU ranks
    (no flash-attention kernel)."""
    att = np.flatnonzero((keys > 0) & (flops > 0))
    gpu = cluster.gpu
    if not len(att) or gpu.is_cpu:
        return times
    dims = 128.0 if head_dim is None else np.where(head_dim[att] > 0, head_dim[att], 128)
    rate = gpu.peak(dtype) * attention_efficiency(gpu, keys[att], cluster.params.attention_efficiency,
                                                  dtype, native, dims)
    out = times.copy()
    out[att] = np.maximum(times[att], flops[att] / rate)
    return out


def attention_efficiency(gpu: GPUSpec, seq, scale: float, dtype: str = "bf16",
                         native: bool = False, head_dim=128.0):
    """Fraction of the dense peak a flash-attention kernel (forward and backward, causal, its
    FLOPs counted as the kernel runs them: half the square) reaches at ``seq`` local tokens
    and ``head_dim`` (numbers or arrays, one per attention node):

        eff(s, d) = scale * e * s / (s + S_half) * d (128 + D_half) / (128 (d + D_half))

    ``e`` the GPU's FlashAttention-2 rate at long sequences and head dim 128 run alone
    (`GPUSpec.attention_efficiency`), ``scale`` `CostParams.attention_efficiency` (what a
    training framework running it reaches of it); ``native`` (`StepFacts.native_attention`):
    the architecture's own fused attention at its rate run alone instead
    (`GPUSpec.native_attention_efficiency`, scale 1: no run of it was fitted; where the GPU has
    none, FlashAttention-2's scaled rate). S_half `GPUSpec.attention_half_seq`: the tiles on
    the causal diagonal, the per-(batch, head) prologue and the softmax rescaling weigh more at
    short sequences; D_half (`cost.hardware.FA2_HALF_HEAD_DIM`, `NATIVE_HALF_HEAD_DIM`): a
    smaller head does less matmul work per softmax element. Both fitted to the kernels
    measured on an H200 (`cost.hardware`); d is first rounded up to the kernels' tile
    (`ATTENTION_HEAD_TILE`), the rounding's FLOPs wasted. ``dtype``: the attention's (a fp32 attention runs
    at the fp32 peak's share)."""
    share = gpu.efficiency(dtype) / gpu.efficiency("bf16") if dtype != "bf16" and "bf16" in gpu.peak_flops else 1.0
    native = native and gpu.native_attention_efficiency > 0  # else FlashAttention-2's kernels
    rate = gpu.native_attention_efficiency if native else scale * gpu.attention_efficiency
    d_half = NATIVE_HALF_HEAD_DIM if native else FA2_HALF_HEAD_DIM
    # the kernels run a head dim rounded up to their tile (FlashAttention-2's are built for
    # 32, 64, 96, ..., 256): the padding's FLOPs are work not counted
    padded = np.ceil(np.asarray(head_dim, dtype=float) / ATTENTION_HEAD_TILE) * ATTENTION_HEAD_TILE
    head = padded * (128.0 + d_half) / (128.0 * (padded + d_half)) * head_dim / padded
    return rate * share * seq / (seq + gpu.attention_half_seq) * head


def fp8_candidates(facts: StepFacts, layout: Layout) -> np.ndarray:
    """Nodes that may run in FP8 under the layout's recipe: weight matmuls (the weight
    gradient's only where the recipe casts it)."""
    n = facts.nodes
    candidate = n.fp8_weight != ""
    if layout.fp8_recipe == "rowwise_with_gw_hp":
        candidate &= ~n.fp8_wgrad
    if layout.tp > 1:
        # a fused projection split per part (GPT-2's qkv: _StridedShard) has no FP8 matmul rule
        # under TP: DTensor would gather its FP8 operands; it stays in high precision
        fused = [w for w, parts in facts.param_tp_parts.items() if parts > 1]
        candidate &= ~np.isin(n.fp8_weight, fused)
    if layout.ep > 1:
        # under ep a list of experts runs as one grouped (vmapped) computation, which the FP8
        # pass does not rewrite: its weights stay in high precision
        candidate &= ~np.isin(n.fp8_weight, [w for w, e in facts.params.expert.items() if e])
    return candidate


def fp8_nodes(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Which nodes run in FP8 under ``layout`` (`fp8_groups`)."""
    chosen = fp8_groups(facts, resolved(facts, cluster, layout))
    if not chosen:
        return np.zeros(len(facts.nodes), dtype=bool)
    groups = np.array([fp8_group(w) for w in facts.nodes.fp8_weight], dtype=str)
    wanted = np.isin(facts.nodes.fp8_weight, list(chosen)) | np.isin(groups, list(chosen))
    return fp8_candidates(facts, layout) & wanted


def fp8_groups(facts: StepFacts, layout: Layout) -> tuple[str, ...]:
    """The weights or weight groups (`fp8_group`) whose matmuls run in FP8 under ``layout``:
    "none": none; "all": every candidate's group; a tuple: those; "auto": the search's choice
    (`Layout.choices`, `autopar.search.choices.choose_fp8`)."""
    if layout.fp8 == "auto":
        return _chosen_fp8(layout)
    if layout.fp8 == "none":
        return ()
    if layout.fp8 == "all":
        return fp8_candidate_groups(facts, layout)
    return tuple(layout.fp8)


def fp8_candidate_groups(facts: StepFacts, layout: Layout) -> tuple[str, ...]:
    """The weight groups (`fp8_group`) of the layout's FP8 candidates, sorted."""
    return tuple(sorted({fp8_group(w) for w in facts.nodes.fp8_weight[fp8_candidates(facts, layout)]}))


def _chosen_fp8(layout: Layout) -> tuple[str, ...]:
    if layout.choices is None or layout.choices.fp8 is None:
        raise ChoicesMissingError(layout.short(), "fp8='auto'")
    return layout.choices.fp8


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


def host_bound(cluster: Cluster, device_s: np.ndarray, host_s: np.ndarray) -> np.ndarray:
    """Seconds of a micro-batch on each stage given its device work and its host overhead
    (`host_overhead_per_stage`). A GPU's kernels are launched asynchronously: the host runs
    ahead while the device works, so a micro-batch takes the longer of the two (a step is
    launch-bound when its kernels are small: many TP ranks, small micro-batches). A CPU rank
    runs its kernels on the host itself: the two add."""
    if cluster.gpu.is_cpu:
        return device_s + host_s
    return np.maximum(device_s, host_s)


def slot_chunks(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Pipeline chunk of every slot (index = block index + 1: 0 before the blocks, L + 1
    after), read-only: one chunk without a pipeline, else the search's cut into ``pp * v``
    chunks (v virtual stages per rank under interleaved 1F1B, else 1; `Layout.choices`,
    `autopar.search.choices.choose_chunks`). Chunk c runs on rank c mod pp."""
    n_layers = max(facts.n_layers, 0)
    if layout.pp == 1 and virtual_stages(layout) == 1:
        # one chunk holds every slot, whatever the times (the search asks this most)
        return facts.cache.get("one_chunk", (n_layers,), lambda: _read_only(
            np.zeros(n_layers + 2, dtype=int)))
    chunks = layout.choices.chunks if layout.choices is not None else None
    if chunks is None:
        raise ChoicesMissingError(layout.short(), f"cut into {layout.pp * virtual_stages(layout)} "
                                                  "pipeline chunks")
    if len(chunks) != n_layers + 2:
        raise ValueError(f"layout {layout.short()}: its cut names {len(chunks)} slots, the step "
                         f"has {n_layers + 2} ({n_layers} blocks and the slots before and after)")
    return facts.cache.get("chunks", (chunks,), lambda: _read_only(np.array(chunks, dtype=int)))


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def slot_memory(facts: StepFacts, cluster: Cluster, layout: Layout) -> StageMemory:
    """Each slot's model state and saved activations on one device, for cuts under the memory
    (`cost.stages.StageMemory`), as `cost.step.predict_memory` counts them: the layout's
    recompute choice ("auto": none, the cut that fits without recomputing), zero-bubble's
    stash left out."""
    n = max(facts.n_layers, 0)
    rec = recipe(layout.precision, layout.fp32_grad_accum)
    per_param = sum(model_state_bytes(1.0, rec, layout.zero, layout.dp * layout.cp).values())
    if layout.zero == 3 and not layout.reshard and layout.dp * layout.cp > 1:
        per_param += rec.param_bytes  # the forward's gathered weights, kept to the backward
    static = _slot_params(facts, layout) * per_param
    if layout.ep > 1:  # ZeRO shards the experts over their dp/ep owners only
        per_expert = sum(model_state_bytes(1.0, rec, layout.zero, layout.dp * layout.cp, 1.0, layout.ep).values())
        static = static + _slot_params(facts, layout, experts=True) * (per_expert - per_param)
    choice = fixed_choice(facts, layout) if layout.recompute != "auto" else RecomputeChoice("none")
    act, transient = activation_memory(facts, local_saved_bytes(facts, cluster, layout),
                                       np.clip(facts.saved.layer, -1, n) + 1, n + 2, choice)
    flight = [in_flight_microbatches(layout.schedule, layout.pp, layout.grad_accum, k, layout.virtual_stages)
              for k in range(layout.pp)]
    shared = (cluster.params.memory_reserve_bytes + headroom_bytes(cluster) + transient
              + buffer_bytes(layout.dp * layout.cp, layout.zero, block_params(facts, layout, max(n, 1)),
                             rec.param_bytes))
    return StageMemory(static[1:n + 1], act[1:n + 1], float(static[0]), float(act[0]),
                       float(static[-1]), float(act[-1]), flight, cluster.gpu.memory_bytes - shared)


def _slot_params(facts: StepFacts, lay: Layout, experts: bool = False) -> np.ndarray:
    """Parameters each slot holds on one device after TP and EP sharding (a tied embedding on
    both ends); ``experts``: the experts' part only."""
    slots, weights, shared, expert = _param_slots(facts, lay)
    out = np.bincount(slots, weights=expert if experts else weights,
                      minlength=max(facts.n_layers, 0) + 2).astype(float)
    for local, where in () if experts else shared:
        out[where] += local
    return out


def virtual_stages(layout: Layout) -> int:
    """Chunks per rank: the layout's virtual stages under interleaved 1F1B, else 1."""
    return layout.virtual_stages if layout.schedule == "interleaved-1f1b" else 1


def slot_stages(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Pipeline rank of every slot (`slot_chunks` mod pp; memoised)."""
    chunks = slot_chunks(facts, cluster, layout)
    if virtual_stages(layout) == 1:
        return chunks
    # the chunks kept alive with it: their id is the key
    return facts.cache.get("stage_map", (layout.pp, id(chunks)), lambda: (chunks, chunks % layout.pp))[1]


def stage_of(facts: StepFacts, layer: np.ndarray, cluster: Cluster, layout: Layout) -> np.ndarray:
    """The pipeline stage of each block index in ``layer`` (-1 before the blocks, L after)."""
    if layout.pp == 1:
        return np.zeros(np.shape(layer), dtype=int)
    return slot_stages(facts, cluster, layout)[_slot_index(facts, layer)]


def _slot_index(facts: StepFacts, layer: np.ndarray) -> np.ndarray:
    """The slot of each block index in ``layer``; kept for the facts' own node and saved-value
    columns, which every pricing asks for."""
    def build() -> np.ndarray:
        return _read_only(np.clip(layer, -1, max(facts.n_layers, 0)) + 1)
    if layer is facts.nodes.layer or layer is facts.saved.layer:
        return facts.cache.get("slot_index", (layer is facts.nodes.layer,), build)
    return build()


def params_per_stage(facts: StepFacts, cluster: Cluster, lay: Layout) -> np.ndarray:
    """Parameters held by each pipeline stage after TP and EP sharding (memoised): under ep each
    rank stores E/ep of every list's experts (passes/expert_parallel.py)."""
    stage_map = slot_stages(facts, cluster, lay)

    def build() -> np.ndarray:
        slots, weights, shared, _ = _param_slots(facts, lay)
        out = np.bincount(stage_map[slots], weights=weights, minlength=lay.pp).astype(float)
        for local, where in shared:
            for s in set(stage_map[where].tolist()):
                out[s] += local  # a tied embedding lives on the first and the last stage
        return out
    return facts.cache.get("stage_params", (lay.tp, lay.ep, lay.pp, stage_map.tobytes()), build)


def expert_params_per_stage(facts: StepFacts, cluster: Cluster, lay: Layout) -> np.ndarray:
    """The experts' part of `params_per_stage` (EP-local: / tp where TP-sharded, / ep), whose
    gradients are reduced, and ZeRO-sharded, over their owners' dp/ep ranks; 0 at ep 1."""
    if lay.ep == 1:
        return np.zeros(lay.pp)
    stage_map = slot_stages(facts, cluster, lay)

    def build() -> np.ndarray:
        slots, _, _, experts = _param_slots(facts, lay)
        return np.bincount(stage_map[slots], weights=experts, minlength=lay.pp).astype(float)
    return facts.cache.get("stage_params", ("experts", lay.tp, lay.ep, lay.pp, stage_map.tobytes()), build)


def _param_slots(facts: StepFacts, lay: Layout) -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
    """Each parameter's local size (after TP and EP sharding) by the slots that use it: the
    one-slot parameters as (slots, sizes) arrays, the others (tied, shared) as a list of
    (size, slots), and the one-slot sizes' expert part (the size for an expert, else 0);
    memoised per (tp, ep)."""

    def build() -> tuple[np.ndarray, np.ndarray, list, np.ndarray]:
        params, n = facts.params, max(facts.n_layers, 0)
        slots, weights, shared, experts = [], [], [], []
        for name, numel in params.numel.items():
            local = numel / (lay.tp if params.tp_sharded[name] else 1) / (lay.ep if params.expert[name] else 1)
            where = sorted({int(np.clip(layer, -1, n)) + 1 for layer in params.stages_layer[name]})
            if len(where) == 1:
                slots.append(where[0])
                weights.append(local)
                experts.append(local if params.expert[name] else 0.0)
            else:
                shared.append((local, np.array(where)))
        return (np.array(slots, dtype=int), np.array(weights, dtype=float), shared,
                np.array(experts, dtype=float))
    return facts.cache.get("param_slots", (lay.tp, lay.ep), build)


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
