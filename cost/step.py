"""Predict the step time and per-device memory of a training step under a Layout.

The prediction is built from the captured graph, node by node, not from a closed formula:

1. `StepFacts` (built once per graph by `autopar.search.facts.build_step_facts`) records for every node its FLOPs and the bytes it
   touches, split into the batch-dependent part (activations) and the rest (weights), its TP
   state from `tp_recipe` (sharded t ways, sequence-shardable, or replicated), its repeated
   block, and the forward values saved for the backward.
2. `predict` (per layout, vectorised, milliseconds) scales each node to one micro-batch on one
   device (batch / dp / grad_accum, sequence / cp, TP shards), prices it with the roofline of
   `cost.compute`, adds the TP, CP, EP and pipeline collectives of `cost.comm`, the pipeline
   bubble of `cost.pipeline`, the exposed part of the data-parallel gradient sync, and the
   optimizer step; memory comes from `cost.memory` and the saved activations of the stage that
   holds the most.

All activations scale linearly with the batch, so one capture of the global batch serves every
micro-batch size. Assumptions are stated where they are made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import numpy as np

from cost.cluster import Cluster
from cost.comm import Group, axis_group, collective_time
from cost.compute import gemm_efficiency
from cost.layout import Layout, LayoutError
from cost.memory import RESERVE_BYTES, MemoryBreakdown, buffer_bytes, model_state_bytes
from cost.pipeline import in_flight_microbatches, pipeline_step_time
from cost.precision import recipe

# A training framework reaches less than the sum of its kernels' times: host overhead between
# kernels, gradient clipping, data loading, stragglers. Calibrated on the playbook's measured
# DP=8 throughput of its 1.34B model (nanotron on 8xH100, 40,150 tok/s/GPU), where the kernel
# roofline alone predicts 47,124: 40,150 / 47,124 = 0.85. Kernel times themselves were checked
# on an H200 (`autopar bench block-check`: blocks within 16 %).
FRAMEWORK_EFFICIENCY = 0.85
# Optimizer step: reads fp32 master, m, v, the gradient; writes master, m, v and the bf16 weight
# (AdamW, memory-bound: 4+4+4+4 read + 4+4+4+2 write = 30 bytes per parameter).
ADAM_BYTES_PER_PARAM = 30.0
# CPU ranks run torch.optim.AdamW(foreach=True): about ten elementwise passes, not one fused
# kernel. Calibration run (2026-11-30, dev box): 4.2 M fp32 parameters stepped in 21.3 ms on one
# thread, where `Cluster.local` gives a rank of 2 13.5 GB/s: 68 bytes per parameter.
CPU_ADAM_BYTES_PER_PARAM = 68.0
# fp8 matmuls first cast their bf16 inputs: read 2 bytes, write 1 per element, i.e. 1.5 bytes
# moved per input byte (torchao's Float8 recipe: a cast kernel per input, tensorwise scales).
FP8_CAST_BYTES_PER_INPUT_BYTE = 1.5


@dataclass
class StepFacts:
    """Layout-independent facts about one captured training step (plain arrays)."""

    batch: int  # sequences in the captured (global) step
    seq: int
    n_layers: int
    heads: int | None
    kv_heads: int | None
    n_experts: int
    total_flops: float  # tensor-core FLOPs of forward + backward for the whole batch
    # per node arrays
    flops: np.ndarray
    vflops: np.ndarray
    bytes_act: np.ndarray
    bytes_const: np.ndarray
    batch_dep: np.ndarray
    tp_div: np.ndarray
    sp_div: np.ndarray
    is_matmul: np.ndarray
    fp8_act_bytes: np.ndarray  # activation input bytes an fp8 weight matmul must cast
    fp8_const_bytes: np.ndarray  # weight bytes it must cast
    forward: np.ndarray
    launch: np.ndarray  # the node starts a kernel (first node of its fusion group)
    hides_gather: np.ndarray  # column matmul: an SP all-gather of its input overlaps it
    hides_reduce: np.ndarray  # weight-gradient matmul: the input-gradient reduction overlaps it
    layer: np.ndarray  # block index, pre-block nodes -1 (stage 0); post-block nodes L
    is_attention: np.ndarray
    attention_kv_bytes: np.ndarray
    # saved activations
    saved_bytes: np.ndarray
    saved_batch_dep: np.ndarray
    saved_tp_div: np.ndarray
    saved_sp_div: np.ndarray
    saved_layer: np.ndarray
    saved_heavy: np.ndarray  # produced by a matmul or attention (kept by selective recompute)
    block_input_bytes: float  # one block's input activation for the whole batch
    # TP collectives
    event_bytes: np.ndarray
    event_batch_dep: np.ndarray
    event_reduce: np.ndarray  # True: reduce (AR / RS), False: gather (AG under SP)
    event_layer: np.ndarray
    event_forward: np.ndarray
    event_always: np.ndarray  # a gather that is needed without SP too
    # EP all-to-all: activation bytes entering + leaving the experts, per layer
    expert_io_bytes: np.ndarray
    # parameters
    param_numel: dict[str, int] = field(default_factory=dict)
    param_tp_sharded: dict[str, bool] = field(default_factory=dict)
    param_expert: dict[str, bool] = field(default_factory=dict)
    param_stages_layer: dict[str, list[int]] = field(default_factory=dict)
    param_dtype_bytes: dict[str, int] = field(default_factory=dict)
    tp_roles: dict[str, str] = field(default_factory=dict)  # parameter -> TP role (col, row, vocab, ...)
    param_tp_dim: dict[str, int | None] = field(default_factory=dict)  # dim sharded over TP, None: replicated
    param_shape: dict[str, tuple[int, ...]] = field(default_factory=dict)  # global shapes
    param_tp_parts: dict[str, int] = field(default_factory=dict)  # fused projections: parts (q, k, v: 3)
    tp_fallbacks: list[str] = field(default_factory=list)  # ops the TP recipe runs replicated
    _memo: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_params(self) -> int:
        """Parameters counted once each."""
        return sum(self.param_numel.values())

    def rebatch(self, batch: int) -> StepFacts:
        """The same step with a global batch of ``batch`` sequences (no new capture needed:
        every batch-dependent quantity is linear in the batch)."""
        if batch < 1:
            raise LayoutError(f"batch={batch}: a step needs at least one sequence")
        r = batch / self.batch
        return dataclasses.replace(
            self,
            batch=batch,
            total_flops=self.total_flops * r,
            flops=np.where(self.batch_dep, self.flops * r, self.flops),
            vflops=np.where(self.batch_dep, self.vflops * r, self.vflops),
            bytes_act=self.bytes_act * r,
            fp8_act_bytes=self.fp8_act_bytes * r,
            attention_kv_bytes=self.attention_kv_bytes * r,
            saved_bytes=np.where(self.saved_batch_dep, self.saved_bytes * r, self.saved_bytes),
            block_input_bytes=self.block_input_bytes * r,
            event_bytes=np.where(self.event_batch_dep, self.event_bytes * r, self.event_bytes),
            expert_io_bytes=self.expert_io_bytes * r,
            _memo={},
        )


@dataclass
class Prediction:
    """What a layout costs: the numbers `plan.predicted` exposes, and their breakdown."""

    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    fits: bool
    memory_per_device_bytes: float
    memory_breakdown: dict[str, float]
    time_breakdown: dict[str, float]
    memory_capacity_bytes: float

    def as_dict(self) -> dict:
        """Plain dict (JSON-ready), with the contract's keys."""
        return asdict(self)

    # Mapping-style access too: plan.predicted["step_time_s"] reads like plan.predicted.step_time_s
    def __getitem__(self, key: str):
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def keys(self) -> list[str]:
        """Field names."""
        return [f.name for f in dataclasses.fields(self)]

    def get(self, key: str, default=None):
        """Field value or ``default``."""
        return getattr(self, key) if key in self.keys() else default

    def items(self):
        """(name, value) pairs."""
        return [(k, getattr(self, k)) for k in self.keys()]

    def __contains__(self, key: object) -> bool:
        return key in self.keys()

    def __iter__(self):
        return iter(self.keys())


# --------------------------------------------------------------------------------------------
# prediction


def default_precision(cluster: Cluster) -> str:
    """The precision a layout without one is priced in: bf16 where the devices have bf16 tensor
    cores (mixed precision, fp32 master weights), fp32 elsewhere (CPU ranks)."""
    return "fp32" if cluster.gpu.is_cpu or "bf16" not in cluster.gpu.peak_flops else "bf16"


def resolved(facts: StepFacts, cluster: Cluster, layout: Layout) -> Layout:
    """``layout`` with its omitted fields derived for this step (`Layout.resolve`)."""
    return layout if layout.resolved else layout.resolve(facts.batch, default_precision(cluster))


def check_layout(facts: StepFacts, cluster: Cluster, layout: Layout) -> None:
    """Raise `LayoutError` for a layout that cannot run this step on this cluster."""
    layout = resolved(facts, cluster, layout)
    if layout.world_size != cluster.world_size:
        raise LayoutError(
            f"layout {layout.short()} uses dp*cp*pp*tp = {layout.dp}*{layout.cp}*{layout.pp}*{layout.tp}"
            f" = {layout.world_size} ranks but the cluster has {cluster.world_size} "
            f"({cluster.nodes} nodes x {cluster.gpus_per_node}); change the degrees to multiply to "
            f"{cluster.world_size}"
        )
    if facts.heads and (layout.tp > facts.heads or facts.heads % layout.tp):
        raise LayoutError(
            f"tp={layout.tp} does not divide the model's {facts.heads} attention heads: tensor "
            f"parallelism splits heads; use a tp that divides {facts.heads}"
        )
    if layout.global_batch != facts.batch:
        per_rank = facts.batch / layout.dp
        hint = (
            f"with dp={layout.dp}, microbatch * grad_accum must be {per_rank:g}"
            if facts.batch % layout.dp == 0
            else f"dp={layout.dp} does not divide the batch of {facts.batch}"
        )
        raise LayoutError(
            f"the example inputs hold a batch of {facts.batch} sequences but the layout processes "
            f"dp*microbatch*grad_accum = {layout.dp}*{layout.microbatch}*{layout.grad_accum} = "
            f"{layout.global_batch}: {hint}"
        )
    if facts.seq % layout.cp:
        raise LayoutError(f"cp={layout.cp} does not divide the sequence length {facts.seq}")
    if layout.pp > max(facts.n_layers, 1):
        raise LayoutError(f"pp={layout.pp} exceeds the model's {facts.n_layers} repeated blocks")
    if layout.ep > 1 and (not facts.n_experts or facts.n_experts % layout.ep):
        raise LayoutError(
            f"ep={layout.ep} needs a mixture-of-experts model whose expert count it divides "
            f"(this model has {facts.n_experts} experts)"
        )
    if layout.precision == "fp8" and "fp8" not in cluster.gpu.peak_flops:
        raise LayoutError(f"precision='fp8' but {cluster.gpu.name} has no FP8 tensor cores; use bf16")


def predict_memory(facts: StepFacts, cluster: Cluster, layout: Layout, check: bool = True) -> MemoryBreakdown:
    """Memory of the fullest device under ``layout`` (cheaper than `predict`: no timing)."""
    layout = resolved(facts, cluster, layout)
    if check:
        check_layout(facts, cluster, layout)
    n_layers = max(facts.n_layers, 1)
    rec = recipe(layout.precision, layout.fp32_grad_accum)
    params_stage = _params_per_stage(facts, layout, n_layers)
    memory = _memory(facts, cluster, layout, rec, params_stage, layout.microbatch / facts.batch, n_layers)
    return max(memory, key=lambda b: b.total)


def comm_overlap(cluster: Cluster) -> float:
    """Fraction of communication that can hide behind compute (data-parallel syncs and
    gathers, and the TP collectives Megatron overlaps with matmuls).

    GPUs: 1 (NCCL runs on its own SMs and copy engines while kernels run; FSDP/DDP overlap).
    CPU ranks: 0, measured: gloo's transport runs on the cores that compute, and on this 2-core
    box 4 ranks already oversubscribe them; `bench runtime` (2026-11-30) measured ZeRO-3 1.27x
    slower than DP where full overlap predicted it 3 % faster.
    """
    return 0.0 if cluster.gpu.is_cpu else 1.0


def zero_reduction(cluster: Cluster) -> str:
    """The collective that reduces ZeRO's gradients: reduce-scatter, except on CPU ranks, where
    the runtime all-reduces (gloo's reduce-scatter is no faster: passes/data_parallel.py)."""
    return "all_reduce" if cluster.gpu.is_cpu else "reduce_scatter"


def predict(
    facts: StepFacts, cluster: Cluster, layout: Layout, memory: MemoryBreakdown | None = None
) -> Prediction:
    """Step time, throughput, MFU and memory per device of ``layout`` on ``cluster``.

    ``memory``: the fullest device's breakdown from `predict_memory`, if already computed.
    """
    layout = resolved(facts, cluster, layout)
    check_layout(facts, cluster, layout)
    gpu = cluster.gpu
    lay = layout
    rec = recipe(lay.precision, lay.fp32_grad_accum)
    tp, cp, pp, m = lay.tp, lay.cp, lay.pp, lay.grad_accum
    scale = lay.microbatch / facts.batch
    n_layers = max(facts.n_layers, 1)

    times = node_times(facts, cluster, lay) / FRAMEWORK_EFFICIENCY
    bw = gpu.memory_bw * gpu.memory_efficiency

    node_stage = stage_of(facts.layer, n_layers, pp)
    fwd = np.bincount(node_stage, weights=times * facts.forward, minlength=pp)
    bwd = np.bincount(node_stage, weights=times * ~facts.forward, minlength=pp)
    in_block = (facts.layer >= 0) & (facts.layer < n_layers)
    if lay.recompute == "full":
        recomp = np.bincount(node_stage, weights=times * (facts.forward & in_block), minlength=pp)
    elif lay.recompute == "selective":
        light = facts.forward & in_block & ~facts.is_matmul
        recomp = np.bincount(node_stage, weights=times * light, minlength=pp)
    else:
        recomp = np.zeros(pp)

    # ---- TP collectives, on the critical path except where Megatron overlaps them: the SP
    # all-gather with the column matmul it feeds (playbook), the backward reduction of a
    # column layer's input gradient with its weight-gradient matmul (Megatron's async TP)
    tp_comm = np.zeros(pp)
    if tp > 1:
        tp_comm = _tp_exposed(facts, cluster, lay, times, scale, n_layers, pp)

    # ---- CP: ring exchange of K/V shards, overlapped with the attention it feeds
    cp_exposed = np.zeros(pp)
    if cp > 1:
        group = axis_group(cluster, cp, tp)
        att = facts.is_attention
        kv_local = facts.attention_kv_bytes[att] * scale / cp / np.where(facts.tp_div[att], tp, 1)
        step = np.array([collective_time("send_recv", float(k), group, cluster) for k in kv_local])
        # forward: cp-1 steps of K,V; backward: K,V again plus dK,dV
        comm = 3 * (cp - 1) * step
        att_time = times[att] * 3  # forward attention + its backward (about twice)
        exposed = np.maximum(0.0, comm - att_time)
        np.add.at(cp_exposed, node_stage[att], exposed)

    # ---- EP: dispatch and combine all-to-all, forward and backward
    ep_comm = np.zeros(pp)
    if lay.ep > 1:
        group = axis_group(cluster, lay.ep, tp)
        for layer_index, nb in enumerate(facts.expert_io_bytes):
            if nb > 0:
                local = float(nb) * scale / cp / (tp if lay.sp else 1)
                t = 2 * collective_time("all_to_all", local, group, cluster)  # fwd + bwd
                ep_comm[stage_of(np.array([layer_index - 1]), n_layers, pp)[0]] += t

    stage_time = fwd + bwd + recomp + tp_comm + cp_exposed + ep_comm
    slowest = int(np.argmax(stage_time))
    p2p = 0.0
    if pp > 1:
        boundary = facts.block_input_bytes * scale / cp / (tp if lay.sp else 1)
        # adjacent stages sit tp*cp ranks apart: on one node unless that crosses a node boundary
        pair = Group(2, 2 if 2 * tp * cp <= cluster.gpus_per_node else 1)
        p2p = collective_time("send_recv", boundary, pair, cluster)
    pipe_total, bubble = pipeline_step_time(
        float(stage_time[slowest]), p2p, pp, m, lay.schedule if pp > 1 else "1f1b", lay.virtual_stages
    )

    # ---- data parallel: gradient sync (overlapped with the last backward), ZeRO gathers
    params_stage = _params_per_stage(facts, lay, n_layers)
    worst_params = float(params_stage.max())
    dp_group_size = lay.dp * cp
    dp_exposed = 0.0
    dp_total = 0.0
    if dp_group_size > 1:
        group = axis_group(cluster, lay.dp, tp * cp * pp) if cp == 1 else axis_group(cluster, dp_group_size, tp)
        grad_bytes = worst_params * (4.0 if (rec.grad_accum_bytes or lay.precision == "fp32") else rec.grad_bytes)
        weight_bytes = worst_params * rec.param_bytes
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
        hide = overlap * float(bwd[slowest] + recomp[slowest])
        # whole gradients (DP, ZeRO-1) are reduced once per step, after the last micro-batch
        # (DDP's no_sync); sharded ones (ZeRO-2/3) by every micro-batch, each behind its backward
        syncs = m if lay.zero >= 2 else 1
        dp_exposed = syncs * max(0.0, sync - hide) + after
        dp_total = syncs * sync + after
        if lay.zero == 3:
            # prefetched one block ahead: hidden behind that micro-batch's compute
            gather = 2 * blocks * collective_time("all_gather", weight_bytes / blocks, group, cluster)
            per_mb = overlap * float(fwd[slowest] + bwd[slowest] + recomp[slowest])
            dp_exposed += m * max(0.0, gather - per_mb)
            dp_total += m * gather
    opt_params = worst_params / (dp_group_size if lay.zero >= 1 else 1)
    adam_bytes = CPU_ADAM_BYTES_PER_PARAM if gpu.is_cpu else ADAM_BYTES_PER_PARAM
    optimizer_s = opt_params * adam_bytes / bw

    step = pipe_total + dp_exposed + optimizer_s
    tokens = facts.batch * facts.seq
    world = cluster.world_size
    tps = tokens / step
    # MFU against the dense bf16 peak, the playbook's convention (fp32 peak where no bf16)
    peak = gpu.peak("bf16") if "bf16" in gpu.peak_flops else gpu.peak("fp32")
    mfu = tps * (facts.total_flops / tokens) / (world * peak)

    # ---- memory of the fullest stage
    worst = memory or max(_memory(facts, cluster, lay, rec, params_stage, scale, n_layers),
                          key=lambda b: b.total)
    compute_s = m * float(fwd[slowest] + bwd[slowest])
    time_breakdown = {
        "compute_s": compute_s,
        "recompute_s": m * float(recomp[slowest]),
        "tp_comm_s": m * float(tp_comm[slowest]),
        "cp_comm_exposed_s": m * float(cp_exposed[slowest]),
        "ep_comm_s": m * float(ep_comm[slowest]),
        "pp_bubble_s": bubble,
        "pp_p2p_s": pipe_total - bubble - m * float(stage_time[slowest]),
        "dp_comm_exposed_s": dp_exposed,
        "dp_comm_total_s": dp_total,
        "optimizer_s": optimizer_s,
    }
    return Prediction(
        step_time_s=step,
        tokens_per_s=tps,
        tokens_per_s_per_gpu=tps / world,
        mfu=mfu,
        fits=worst.total <= gpu.memory_bytes,
        memory_per_device_bytes=worst.total,
        memory_breakdown=worst.as_dict(),
        time_breakdown=time_breakdown,
        memory_capacity_bytes=gpu.memory_bytes,
    )


def _tp_exposed(facts, cluster, lay, times, scale, n_layers, pp) -> np.ndarray:
    """Exposed TP communication per pipeline stage for one micro-batch (memoised)."""
    key = ("tp_exposed", cluster.describe(), tuple(sorted(cluster.gpu.peak_flops.items())), cluster.gpu.memory_bw,
           cluster.gpu.kernel_floor_s, lay.tp, lay.cp, lay.sp, lay.microbatch, lay.precision, pp, facts.batch)
    if key not in facts._memo:
        facts._memo[key] = _compute_tp_exposed(facts, cluster, lay, times, scale, n_layers, pp)
    return facts._memo[key]


def _compute_tp_exposed(facts, cluster, lay, times, scale, n_layers, pp) -> np.ndarray:
    tp, cp = lay.tp, lay.cp
    group = axis_group(cluster, tp, 1)
    ev_bytes = facts.event_bytes * np.where(facts.event_batch_dep, scale / cp, 1.0)
    cache: dict[tuple[str, float], float] = {}
    cost = np.zeros(len(ev_bytes))
    for i, (nb, is_reduce, always) in enumerate(zip(ev_bytes, facts.event_reduce, facts.event_always)):
        if lay.sp:
            kind = "reduce_scatter" if is_reduce else "all_gather"
        elif is_reduce:
            kind = "all_reduce"
        elif always:
            kind = "all_gather"
        else:
            continue
        key = (kind, float(nb))
        if key not in cache:
            cache[key] = collective_time(kind, float(nb), group, cluster)
        cost[i] = cache[key]
    # per block: overlappable collectives hide behind their matmuls, the rest is exposed
    slots = n_layers + 2  # -1 (before the blocks) .. n_layers (after)
    ev_slot = np.clip(facts.event_layer, -1, n_layers) + 1
    node_slot = np.clip(facts.layer, -1, n_layers) + 1
    gather_ov = ~facts.event_reduce & facts.event_forward
    reduce_ov = facts.event_reduce & ~facts.event_forward
    fixed = np.bincount(ev_slot, weights=cost * ~(gather_ov | reduce_ov), minlength=slots)
    g = np.bincount(ev_slot, weights=cost * gather_ov, minlength=slots)
    r = np.bincount(ev_slot, weights=cost * reduce_ov, minlength=slots)
    overlap = comm_overlap(cluster)
    hide_g = overlap * np.bincount(node_slot, weights=times * facts.hides_gather, minlength=slots)
    hide_r = overlap * np.bincount(node_slot, weights=times * facts.hides_reduce, minlength=slots)
    exposed = fixed + np.maximum(0.0, g - hide_g) + np.maximum(0.0, r - hide_r)
    exposed += _tp_small_collectives(facts, cluster, lay, scale, n_layers, group)
    slot_stage = stage_of(np.arange(slots) - 1, n_layers, pp)
    return np.bincount(slot_stage, weights=exposed, minlength=pp)


def _tp_small_collectives(facts, cluster, lay, scale, n_layers, group) -> np.ndarray:
    """TP collectives outside the recipe's activation events, per slot (as the TP pass emits
    them): under SP a replicated weight (a norm) sees only its sequence shard, so its gradient
    is all-reduced over TP; a vocabulary-parallel loss all-reduces the logits' max, the sum of
    exponentials and the target logit (one value per token each). Latency-bound: negligible
    on NVLink, milliseconds on gloo."""
    out = np.zeros(n_layers + 2)
    for name, sharded in facts.param_tp_sharded.items():
        layers = facts.param_stages_layer.get(name) or []
        if lay.sp and layers and not sharded and not facts.param_expert.get(name):
            nbytes = facts.param_numel[name] * facts.param_dtype_bytes.get(name, 4)
            out[min(max(layers), n_layers) + 1] += collective_time("all_reduce", nbytes, group, cluster)
    head = [p for p, layers in facts.param_stages_layer.items() if layers and max(layers) >= n_layers]
    if any(facts.param_tp_sharded.get(p) for p in head):
        token_bytes = 4.0 * facts.batch * facts.seq * scale / lay.cp
        out[n_layers + 1] += 3 * collective_time("all_reduce", token_bytes, group, cluster)
    return out


def node_times(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Seconds of every node for one micro-batch on one device (roofline per node).

    Matmuls run at the GEMM efficiency curve of `cost.compute.gemm_efficiency` for their local
    size; element-wise work is memory-bound; a kernel launch costs at least the GPU's floor.
    Memoised per (cluster, tp, cp, sp, micro-batch, precision): the search re-uses it.
    """
    layout = resolved(facts, cluster, layout)
    key = ("times", cluster.gpu.name, cluster.gpu.memory_bw, layout.tp, layout.cp, layout.sp, layout.microbatch,
           layout.precision, facts.batch)
    if key not in facts._memo:
        facts._memo[key] = _node_times(facts, cluster, layout)
    return facts._memo[key]


def _node_times(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    gpu, lay = cluster.gpu, layout
    tp, cp = lay.tp, lay.cp
    scale = lay.microbatch / facts.batch
    act_scale = np.where(facts.batch_dep, scale / cp, 1.0)
    div = np.where(facts.tp_div, tp, 1) * np.where(facts.sp_div & lay.sp, tp, 1)
    flops = facts.flops * act_scale / div
    vflops = facts.vflops * act_scale / div
    nbytes = (facts.bytes_act * scale / cp + facts.bytes_const) / div
    if lay.precision == "fp32" or "bf16" not in gpu.peak_flops:
        dtype = np.full(flops.shape, "fp32")
    else:
        dtype = np.full(flops.shape, "bf16")
    if lay.precision == "fp8":
        # only weight matmuls run in FP8, after casting their inputs; attention stays bf16
        fp8 = (facts.fp8_act_bytes + facts.fp8_const_bytes) > 0
        dtype = np.where(fp8, "fp8", dtype)
        cast = (facts.fp8_act_bytes * scale / cp + facts.fp8_const_bytes) / div
        nbytes = nbytes + np.where(fp8, cast * FP8_CAST_BYTES_PER_INPUT_BYTE, 0.0)
    rate = np.ones(flops.shape)
    for d in set(dtype.tolist()):
        sel = dtype == d
        rate[sel] = gpu.peak(d) * gemm_efficiency(np.maximum(flops[sel], 1.0), gpu, d)
    t_mm = np.where(facts.is_matmul, flops / rate, vflops / gpu.peak("fp32"))
    times = np.maximum(t_mm, nbytes / (gpu.memory_bw * gpu.memory_efficiency))
    floor = np.where(facts.launch, gpu.kernel_floor_s, 0.0)
    return np.where((flops + vflops + nbytes) > 0, np.maximum(times, floor), 0.0)


def stage_of(layer: np.ndarray, n_layers: int, pp: int) -> np.ndarray:
    """Even split of the blocks over pp stages; pre-block nodes on stage 0, post on the last."""
    clipped = np.clip(layer, 0, n_layers - 1)
    return np.minimum(clipped * pp // n_layers, pp - 1).astype(int)


def _params_per_stage(facts: StepFacts, lay: Layout, n_layers: int) -> np.ndarray:
    """Parameters held by each pipeline stage after TP and EP sharding (memoised)."""
    key = ("stage_params", lay.tp, lay.ep, lay.pp)
    if key not in facts._memo:
        facts._memo[key] = _compute_params_per_stage(facts, lay, n_layers)
    return facts._memo[key]


def _compute_params_per_stage(facts: StepFacts, lay: Layout, n_layers: int) -> np.ndarray:
    out = np.zeros(lay.pp)
    for name, numel in facts.param_numel.items():
        local = numel / (lay.tp if facts.param_tp_sharded[name] else 1)
        local /= lay.ep if facts.param_expert[name] else 1
        stages = set(stage_of(np.array(facts.param_stages_layer[name]), n_layers, lay.pp).tolist())
        for s in stages:  # a tied embedding lives on the first and the last stage
            out[s] += local
    return out


def _block_params(facts: StepFacts, lay: Layout, n_layers: int) -> float:
    """Parameters of one block on one device (what ZeRO-3 gathers at a time), memoised."""
    key = ("block_params", lay.tp, lay.ep)
    if key not in facts._memo:
        in_blocks = sum(
            n / (lay.tp if facts.param_tp_sharded[p] else 1) / (lay.ep if facts.param_expert[p] else 1)
            for p, n in facts.param_numel.items()
            if all(0 <= layer < n_layers for layer in facts.param_stages_layer[p])
        )
        largest = max(
            (n / (lay.tp if facts.param_tp_sharded[p] else 1) for p, n in facts.param_numel.items()),
            default=0.0,
        )
        facts._memo[key] = in_blocks / facts.n_layers if facts.n_layers else largest
    return facts._memo[key]


def _memory(facts, cluster, lay, rec, params_stage, scale, n_layers) -> list[MemoryBreakdown]:
    """Memory breakdown of every pipeline stage."""
    tp, cp, pp = lay.tp, lay.cp, lay.pp
    local = facts.saved_bytes * np.where(facts.saved_batch_dep, scale / cp, 1.0)
    local = local / np.where(facts.saved_tp_div, tp, 1) / np.where(facts.saved_sp_div & lay.sp, tp, 1)
    in_block = (facts.saved_layer >= 0) & (facts.saved_layer < n_layers)
    if lay.recompute == "full":
        keep = ~in_block
    elif lay.recompute == "selective":
        keep = ~in_block | facts.saved_heavy
    else:
        keep = np.ones_like(in_block)
    stage = stage_of(facts.saved_layer, n_layers, pp)
    per_stage = np.bincount(stage, weights=local * keep, minlength=pp)
    # At the peak of the backward the largest activation and its gradient are live beside the
    # saved ones (the fp32 logits and their gradient in a language model): a temporary buffer the
    # saved-tensor count misses; it made micro-batches 1.2-2.3x larger than the playbook could
    # run look like they fit (`autopar bench cost-model`, section 4b).
    transient = 2.0 * float(local.max()) if len(local) else 0.0
    if lay.recompute == "full":
        # each block keeps its input (sequence-sharded under SP)
        block_in = facts.block_input_bytes * scale / cp / (tp if lay.sp else 1)
        layers_per_stage = np.bincount(stage_of(np.arange(n_layers), n_layers, pp), minlength=pp)
        per_stage = per_stage + layers_per_stage * block_in
    block_params = _block_params(facts, lay, n_layers)
    out = []
    for s in range(pp):
        states = model_state_bytes(float(params_stage[s]), rec, lay.zero, lay.dp * cp)
        flight = in_flight_microbatches(lay.schedule, pp, lay.grad_accum, s, lay.virtual_stages) if pp > 1 else 1
        out.append(
            MemoryBreakdown(
                params=states["params"],
                grads=states["grads"],
                optimizer=states["optimizer"],
                activations=float(per_stage[s]) * flight,
                buffers=buffer_bytes(lay.dp * cp, lay.zero, block_params, rec.param_bytes) + transient,
                reserve=RESERVE_BYTES,
            )
        )
    return out
