"""Predict the step time and per-device memory of a training step under a Layout.

The prediction is built from the captured graph, node by node, not from a closed formula:

1. `StepFacts` (`cost.step_facts`; built once per graph by
   `autopar.search.facts.build_step_facts`) records for every node its FLOPs and the bytes it
   touches, split into the batch-dependent part (activations) and the rest (weights), its TP
   state from `tp_recipe` (sharded t ways, sequence-shardable, or replicated), its repeated
   block; the forward values saved for the backward; the TP collectives; the parameters.
2. `predict` (per layout, vectorised, milliseconds) adds one term per technique, each in its
   module of `cost.terms`: compute and recompute per pipeline stage (`terms.compute`: each node
   at one micro-batch on one device, batch / dp / grad_accum, sequence / cp, TP shards, priced
   with the roofline of `cost.compute`), the exposed TP collectives (`terms.tensor_parallel`),
   CP's ring exchange (`terms.context_parallel`), EP's all-to-alls (`terms.expert_parallel`),
   the pipeline's transfers and bubble (`terms.pipeline_parallel`), the exposed part of the
   data-parallel gradient sync and ZeRO's gathers (`terms.data_parallel`), and the optimizer
   step (`terms.optimizer`); memory comes from `cost.memory` and the saved activations of the
   stage that holds the most.

All activations scale linearly with the batch, so one capture of the global batch serves every
micro-batch size. Assumptions are stated where they are made.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

import numpy as np

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.memory import MemoryBreakdown, buffer_bytes, headroom_bytes, model_state_bytes
from cost.pipeline import in_flight_microbatches
from cost.precision import fused_accum, recipe
from cost.step_facts import EventTable, NodeTable, ParamTable, SavedTable, StepFacts
from cost.terms.common import (
    block_params,
    comm_overlap,
    default_precision,
    resolved,
    zero_reduction,
)
from cost.terms.compute import (
    FP8_CAST_BYTES_PER_INPUT_BYTE,
    FRAMEWORK_EFFICIENCY,
    compute_per_stage,
    expert_params_per_stage,
    fp8_candidates,
    host_bound,
    host_overhead_per_stage,
    node_stages,
    node_times,
    params_per_stage,
    slot_stages,
    stage_of,
    step_node_times,
    virtual_stages,
)
from cost.terms.context_parallel import cp_exposed
from cost.terms.data_parallel import dp_comm, dp_step_syncs
from cost.terms.expert_parallel import ep_comm
from cost.terms.optimizer import ADAM_BYTES_PER_PARAM, CPU_ADAM_BYTES_PER_PARAM, optimizer_time
from cost.terms.pipeline_parallel import (
    loss_broadcast,
    p2p_exposed,
    p2p_time,
    pipeline_time,
    shared_host_factor,
)
from cost.terms.recompute import (
    fixed_choice,
    local_block_input_bytes,
    local_saved_bytes,
    rerun_per_stage,
    staged_activation_memory,
    staged_rerun,
)
from cost.terms.tensor_parallel import kept_sp_gathers, sp_regather, tp_small_collectives
from cost.terms.tensor_parallel import tp_comm as tp_comm_terms
from vocab.choices import ChoicesMissingError
from vocab.layout import Layout, LayoutError
from vocab.plan_types import RecomputeChoice, block_pattern, fp8_group

__all__ = [
    "ADAM_BYTES_PER_PARAM", "CPU_ADAM_BYTES_PER_PARAM", "FP8_CAST_BYTES_PER_INPUT_BYTE",
    "FRAMEWORK_EFFICIENCY", "EventTable", "NodeTable", "ParamTable", "Prediction", "SavedTable",
    "StepFacts", "axis_group", "check_layout", "collective_time", "comm_overlap",
    "default_precision", "node_times", "predict", "predict_memory", "recompute_choice", "recompute_choices", "resolved",
    "stage_memory", "stage_of",
    "tp_small_collectives", "zero_reduction",
]


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
    chunks = layout.pp * virtual_stages(layout)
    if chunks > max(facts.n_layers, 1):
        raise LayoutError(f"pp={layout.pp} x virtual_stages={layout.virtual_stages} = {chunks} chunks "
                          f"exceed the model's {facts.n_layers} repeated blocks: use fewer virtual stages")
    if layout.ep > 1 and (not facts.n_experts or facts.n_experts % layout.ep):
        raise LayoutError(
            f"ep={layout.ep} needs a mixture-of-experts model whose expert count it divides "
            f"(this model has {facts.n_experts} experts; experts are counted as a list of expert "
            "modules, one per expert, or as grouped matmuls over experts stacked in one parameter, "
            "as transformers' MoE blocks run them): use ep=1, or an ep that divides the expert count"
        )
    if isinstance(layout.recompute, tuple):
        known = set(facts.recompute_groups)
        unknown = [g for g in layout.recompute if block_pattern(g) not in known]
        if unknown:
            raise LayoutError(f"recompute={unknown}: no matmul output of a block has "
                              "that name; fix: use recompute='auto', or name groups among "
                              f"{sorted(known) or 'none (the model has no repeated blocks)'}")
    if isinstance(layout.fp8, tuple):
        weights = set(facts.nodes.fp8_weight[facts.nodes.fp8_weight != ""].tolist())
        known = weights | {fp8_group(w) for w in weights}
        unknown = [p for p in layout.fp8 if p not in known]
        if unknown:
            raise LayoutError(f"fp8={unknown}: no weight read by a matmul has that name; fix: use "
                              "fp8='auto' or 'all', or name FP8 candidates: "
                              f"{sorted({fp8_group(w) for w in weights}) or 'none'}")
        runnable = set(facts.nodes.fp8_weight[fp8_candidates(facts, layout)].tolist())
        excluded = [p for p in layout.fp8 if not any(p in (w, fp8_group(w)) for w in runnable)]
        if excluded:  # asked for by name, it would silently stay in high precision
            raise LayoutError(
                f"fp8={excluded} cannot run in FP8 under {layout.short()}: a fused projection "
                "split per part over TP (GPT-2's qkv) has no FP8 matmul rule, and a high-precision "
                "weight-gradient recipe leaves nothing of a matmul that reads no weight; fix: "
                "leave it out of fp8, or use tp=1")
    if layout.fp8 != "none" and layout.fp8 != "auto" and "fp8" not in cluster.gpu.peak_flops \
            and not cluster.gpu.is_cpu:
        raise LayoutError(f"fp8={layout.fp8!r} but {cluster.gpu.name} has no FP8 tensor cores: use "
                          "fp8='none' (or 'auto', which picks none there)")


def predict_memory(facts: StepFacts, cluster: Cluster, layout: Layout, check: bool = True) -> MemoryBreakdown:
    """Memory of the fullest device under ``layout`` (cheaper than `predict`: no timing)."""
    layout = resolved(facts, cluster, layout)
    if check:
        check_layout(facts, cluster, layout)
    return max(stage_memory(facts, cluster, layout), key=lambda b: b.total)


def stage_memory(facts: StepFacts, cluster: Cluster, layout: Layout) -> list[MemoryBreakdown]:
    """Memory of a device of every pipeline stage under ``layout`` (not checked)."""
    layout = resolved(facts, cluster, layout)
    rec = recipe(layout.precision, layout.fp32_grad_accum)
    params_stage = params_per_stage(facts, cluster, layout)
    return _memory(facts, cluster, layout, rec, params_stage)


def predict(
    facts: StepFacts, cluster: Cluster, layout: Layout, memory: MemoryBreakdown | None = None
) -> Prediction:
    """Step time, throughput, MFU and memory per device of ``layout`` on ``cluster``.

    The step is the pipeline's time for the slowest stage (compute, recompute and the TP, CP
    and EP communication of each micro-batch, the bubble and the stage-to-stage transfers),
    plus the exposed data-parallel communication and the optimizer step: one term per
    technique, from `cost.terms`. ``memory``: the fullest device's breakdown from
    `predict_memory`, if already computed.
    """
    lay = resolved(facts, cluster, layout)
    check_layout(facts, cluster, lay)
    gpu = cluster.gpu
    rec = recipe(lay.precision, lay.fp32_grad_accum)
    pp, m = lay.pp, lay.grad_accum
    scale = lay.microbatch / facts.batch
    n_layers = max(facts.n_layers, 1)

    # ---- per stage, one micro-batch
    times = step_node_times(facts, cluster, lay)
    fwd, bwd = compute_per_stage(facts, cluster, lay, times)
    host = host_overhead_per_stage(facts, cluster, lay)
    choices = recompute_choices(facts, cluster, lay)
    node_stage = node_stages(facts, cluster, lay)
    recomp = rerun_per_stage(node_stage, times, staged_rerun(facts, choices, node_stage), pp)
    # CPU ranks: the cores of ranks with nothing to do in a slot help the busy ones
    shared = shared_host_factor(cluster, lay, fwd + bwd + recomp)
    fwd, bwd, host, recomp = fwd * shared, bwd * shared, host * shared, recomp * shared
    recomputing = np.array([c.mode != "none" for c in choices])
    if recomputing.any():  # and the SP gathers the recomputed values start from
        recomp = recomp + sp_regather(facts, cluster, lay, scale, n_layers, pp) * recomputing
    tp_comm, tp_hidden_fwd, tp_hidden_bwd = tp_comm_terms(facts, cluster, lay, times, scale,
                                                          n_layers, pp)
    cp_comm = cp_exposed(facts, cluster, lay, times, scale)
    ep = ep_comm(facts, cluster, lay, scale)
    device_time = fwd + bwd + recomp + tp_comm + cp_comm + ep
    stage_time = host_bound(cluster, device_time, host)
    slowest = int(np.argmax(stage_time))

    # ---- the step: pipeline, data-parallel sync, optimizer
    slot_s = float(stage_time[slowest])
    p2p = p2p_exposed(facts, cluster, lay, p2p_time(facts, cluster, lay, scale, slot_s), slot_s)
    pipe_total, bubble = pipeline_time(slot_s, p2p, lay)
    pipe_total += loss_broadcast(cluster, lay)
    params_stage = params_per_stage(facts, cluster, lay)
    worst_params = float(params_stage.max())
    worst_experts = float(expert_params_per_stage(facts, cluster, lay)[int(np.argmax(params_stage))])
    # the blocks' weights are gathered several to a buffer and copied out; a model without
    # numbered blocks is gathered in pieces of several weights: all of it
    copied = worst_params if facts.n_layers == 0 else \
        min(worst_params, block_params(facts, lay, n_layers) * -(-n_layers // lay.pp))
    dp_exposed, dp_total = dp_comm(cluster, lay, rec, worst_params, n_layers, float(fwd[slowest]),
                                   float(bwd[slowest]), float(recomp[slowest]),
                                   float(tp_hidden_fwd[slowest]), float(tp_hidden_bwd[slowest]),
                                   copied, worst_experts, facts.pipeline_reduce_hidden,
                                   facts.param_gather_hidden)
    syncs = dp_step_syncs(cluster, lay, facts.counts_tokens)  # the token count, the loss
    dp_exposed, dp_total = dp_exposed + syncs, dp_total + syncs
    optimizer_s = optimizer_time(cluster, lay, worst_params, worst_experts)

    step = pipe_total + dp_exposed + optimizer_s
    tokens = facts.batch * facts.seq
    world = cluster.world_size
    tps = tokens / step
    # MFU against the dense bf16 peak, the playbook's convention (fp32 peak where no bf16)
    peak = gpu.peak("bf16") if "bf16" in gpu.peak_flops else gpu.peak("fp32")
    mfu = tps * (facts.total_flops / tokens) / (world * peak)

    # ---- memory of the fullest stage
    worst = memory or max(_memory(facts, cluster, lay, rec, params_stage), key=lambda b: b.total)
    time_breakdown = {
        "compute_s": m * float(fwd[slowest] + bwd[slowest]),
        "host_overhead_s": m * float(stage_time[slowest] - device_time[slowest]),
        "recompute_s": m * float(recomp[slowest]),
        "tp_comm_s": m * float(tp_comm[slowest]),
        "cp_comm_exposed_s": m * float(cp_comm[slowest]),
        "ep_comm_s": m * float(ep[slowest]),
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


def recompute_choice(facts: StepFacts, cluster: Cluster, layout: Layout) -> RecomputeChoice:
    """What the recompute pass rebuilds under ``layout``: `recompute_choices`' choice when every
    pipeline stage makes the same, else the first stage's (it holds the most in flight)."""
    return recompute_choices(facts, cluster, layout)[0]


def recompute_choices(facts: StepFacts, cluster: Cluster, layout: Layout) -> tuple[RecomputeChoice, ...]:
    """What the recompute pass rebuilds on each pipeline stage (one entry without a pipeline)
    under ``layout`` (`cost.terms.recompute`): its manual mode or groups on every stage, or for
    "auto" the search's choice per stage (`Layout.choices`)."""
    lay = resolved(facts, cluster, layout)
    if lay.recompute != "auto":
        return (fixed_choice(facts, lay),) * lay.pp
    if lay.choices is None or lay.choices.recompute is None:
        raise ChoicesMissingError(lay.short(), "recompute='auto'")
    return lay.choices.recompute


def fixed_bytes_per_stage(facts: StepFacts, cluster: Cluster, lay: Layout) -> np.ndarray:
    """Bytes each pipeline stage holds whatever it recomputes: model state, buffers, reserve
    and headroom (the memory breakdown without recompute, less its activations and the
    backward's transient); the room for activations is the device less these."""
    none = (RecomputeChoice("none"),) * lay.pp
    rec = recipe(lay.precision, lay.fp32_grad_accum)
    return np.array([b.total - b.activations for b in _memory(
        facts, cluster, lay, rec, params_per_stage(facts, cluster, lay), none, transient=False)])


def in_flight(lay: Layout, stage: int) -> float:
    """Micro-batches of activations ``stage`` holds at its peak."""
    if lay.pp == 1:
        return 1
    return in_flight_microbatches(lay.schedule, lay.pp, lay.grad_accum, stage, lay.virtual_stages)


def _memory(facts, cluster, lay, rec, params_stage, choices: tuple[RecomputeChoice, ...] | None = None,
            transient: bool = True) -> list[MemoryBreakdown]:
    """Memory breakdown of every pipeline stage under the recompute ``choices`` per stage (the
    layout's when None); ``transient=False`` leaves the backward's transient buffers out."""
    pp = lay.pp
    n_layers = max(facts.n_layers, 1)
    choices = choices or recompute_choices(facts, cluster, lay)
    # what the recompute pass keeps from the forward to the backward (autograd's saved values
    # without recompute; with it, the values the pass does not rebuild and the roots its chains
    # start from, block inputs included), and what each block's backward rebuilds
    per_stage, extra = staged_activation_memory(facts, local_saved_bytes(facts, cluster, lay),
                                                stage_of(facts, facts.saved.layer, cluster, lay), choices,
                                                local_block_input_bytes(facts, cluster, lay))
    recomputing = np.array([c.mode != "none" for c in choices])
    per_stage = per_stage + kept_sp_gathers(facts, cluster, lay, pp) * recomputing  # Layout.regather
    extra = extra if transient else np.zeros(pp)
    block_params_ = block_params(facts, lay, n_layers)
    stash = zb_stash_per_stage(facts, cluster, lay)
    held = fused_accum(rec) if facts.framework_memory else rec
    experts = expert_params_per_stage(facts, cluster, lay)
    out = []
    for s in range(pp):
        states = model_state_bytes(float(params_stage[s]), held, lay.zero, lay.dp * lay.cp,
                                   float(experts[s]), lay.ep)
        out.append(
            MemoryBreakdown(
                params=states["params"],
                grads=states["grads"],
                optimizer=states["optimizer"],
                activations=(float(per_stage[s]) + float(stash[s])) * in_flight(lay, s),
                buffers=buffer_bytes(lay.dp * lay.cp, lay.zero, block_params_, rec.param_bytes,
                                     kept_weight_params=None if lay.reshard else float(params_stage[s]))
                + float(extra[s]),
                reserve=cluster.params.memory_reserve_bytes,
                headroom=headroom_bytes(cluster),
            )
        )
    return out


def zb_stash_per_stage(facts: StepFacts, cluster: Cluster, lay: Layout) -> np.ndarray:
    """Bytes per stage and micro-batch that zero-bubble keeps from a backward's input half for
    its weight half (`StepFacts.zb_stash_bytes`, local shape); 0 under other schedules and on
    the first stage, whose backward is all weight half (it sends no gradient back). Under TP
    divided by tp (an approximation: a column matmul's output gradient is split over TP, a row
    matmul's over the sequence under SP only)."""
    stash = np.zeros(lay.pp)
    if lay.schedule != "zero-bubble" or lay.pp == 1 or not len(facts.zb_stash_bytes):
        return stash
    per_slot = facts.zb_stash_bytes * (lay.microbatch / facts.batch / lay.cp / lay.tp)
    stash += np.bincount(slot_stages(facts, cluster, lay), weights=per_slot, minlength=lay.pp)
    stash[0] = 0.0
    return stash * cluster.params.activation_fragmentation

