"""Recomputation: what the backward rebuilds under a layout, what that keeps in memory and what
it costs in time.

A choice (`RecomputeChoice`) is "none", or "selective" plus a set C of heavy groups
(`StepFacts.recompute_groups`: the matmul outputs of alike blocks, one node per block, as
`passes.recompute.heavy_groups` names them; attention kernels are always kept); "full" is
selective plus every group.
The facts hold exact columns (read off the graph by the pass's own rule) for none, selective,
full and selective + {g} for each group g. Any other C is composed from them:

    kept(C)    = kept_sel  - U_{g in C} (kept_sel - kept_g)  +  U_{g in C} (kept_g - kept_sel)
    rerun(C)   = rerun_sel + U_{g in C} rerun_g
    rebuilt(C) = rebuilt_sel + U_{g in C} rebuilt_g

where rebuilt is each row's (made, dead) span in the backward, composed as the earliest making
and the latest death. kept and rerun compose exactly when no group's chain roots on another
group's output (true of the zoo's blocks, Hugging Face's Llama and GPT-2 and a plain-PyTorch
model: tests/cost/test_recompute_choice.py compares the composition with the pass's marks for
random C); the spans are the pass's when at most one column rebuilds a row (within 15 % of the
pass's peak there; MoE experts accumulating into one buffer make it a lower bound).

"auto" is the search's choice (`autopar.search.recompute_choice`); this module prices a choice made.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost.cluster import Cluster
from cost.step_facts import StepFacts
from vocab.layout import Layout
from vocab.plan_types import RecomputeChoice, block_pattern

# A fused or vocabulary-parallel cross-entropy (`StepFacts.framework_memory`) computes its softmax in
# place in the fp32 buffer it keeps for the backward and writes the gradient in place too; the
# only new buffer its backward makes is the logits' gradient in the matmul's dtype: bf16, half
# the fp32 buffer's bytes (Megatron-LM's `VocabParallelCrossEntropy`, nanotron's
# `sharded_cross_entropy`; flash-attn's fused kernel keeps the bf16 logits, less still).
FUSED_LOSS_TRANSIENT = 0.5


@dataclass(frozen=True)
class RecomputeColumns:
    """Rows of `SavedTable` kept from the forward to the backward and rebuilt in it, and nodes
    of `NodeTable` the backward reruns, under one choice."""

    kept: np.ndarray
    rebuilt: np.ndarray  # rows x 2: the (made, dead) span of each rebuilt row, (-1, -1) if none
    rerun: np.ndarray


def fixed_choice(facts: StepFacts, layout: Layout) -> RecomputeChoice:
    """The choice a manual ``layout.recompute`` names ("auto" is the search's)."""
    mode = layout.recompute
    if isinstance(mode, tuple):
        groups, wanted = facts.recompute_groups, {block_pattern(g) for g in mode}
        chosen = tuple(g for g in groups if g in wanted)
        return RecomputeChoice("full") if len(chosen) == len(groups) else RecomputeChoice("selective", chosen)
    return RecomputeChoice(mode)


def columns(facts: StepFacts, choice: RecomputeChoice) -> RecomputeColumns:
    """The kept, rebuilt and rerun rows of ``choice`` (the module docstring's composition;
    memoised: they depend on the graph alone)."""
    return facts.cache.get("columns", (choice,), lambda: _columns(facts, choice))


def _columns(facts: StepFacts, choice: RecomputeChoice) -> RecomputeColumns:
    saved, nodes = facts.saved, facts.nodes
    if choice.mode == "none":
        return RecomputeColumns(saved.kept_none, np.full((len(saved), 2), -1), np.zeros(len(nodes), bool))
    if choice.mode == "full":
        return RecomputeColumns(saved.kept_full, saved.rebuilt_full, nodes.rerun_full)
    index = [facts.recompute_groups.index(g) for g in choice.outputs]
    kept_g = saved.kept_groups[:, index]
    base = saved.kept_selective
    freed = (base[:, None] & ~kept_g).any(axis=1)
    added = (kept_g & ~base[:, None]).any(axis=1)
    # a rebuilt row lives from its earliest making to its latest death over the columns
    spans = np.concatenate([saved.rebuilt_selective[:, None, :], saved.rebuilt_groups[:, index, :]], axis=1)
    made = np.where(spans[..., 0] >= 0, spans[..., 0], np.iinfo(np.int64).max).min(axis=1)
    rebuilt = np.stack([np.where(spans[..., 0].max(axis=1) >= 0, made, -1), spans[..., 1].max(axis=1)], axis=1)
    return RecomputeColumns((base & ~freed) | added, rebuilt,
                            nodes.rerun_selective | nodes.rerun_groups[:, index].any(axis=1))


def rebuilt_peak(local: np.ndarray, spans: np.ndarray, layer: np.ndarray,
                 sweep: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """The most bytes one block's backward holds in rebuilt copies at once: a sweep over each
    block's (made, dead) spans (a death at position t frees before a making at t + 1).
    ``sweep``: `rebuilt_sweep` of ``spans`` and ``layer``, when the caller keeps it."""
    return float(rebuilt_peaks(local, spans, layer, np.zeros(len(local), dtype=int), 1, sweep)[0])


def rebuilt_peaks(local: np.ndarray, spans: np.ndarray, layer: np.ndarray, group: np.ndarray,
                  groups: int, sweep: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """`rebuilt_peak` per group of rows (a block's rows all in one group: its pipeline stage).
    ``sweep``: `rebuilt_sweep` of ``spans`` and ``layer``, when the caller keeps it."""
    out = np.zeros(groups)
    rows, order = sweep if sweep is not None else rebuilt_sweep(spans, layer)
    if not len(rows):
        return out
    delta = np.concatenate([local[rows], -local[rows]])
    owner = np.concatenate([group[rows], group[rows]])
    return group_max(np.cumsum(delta[order]), owner[order], groups)


def group_max(values: np.ndarray, group: np.ndarray, groups: int) -> np.ndarray:
    """max(0, the largest of ``values`` in each group) for groups 0..groups-1: ``np.maximum.at``
    on zeros, with one group (a stage on its own) as a plain maximum, several times faster."""
    out = np.zeros(groups)
    if groups == 1:
        if len(values):
            out[0] = max(0.0, float(values.max()))
        return out
    np.maximum.at(out, group, values)
    return out


def rebuilt_sweep(spans: np.ndarray, layer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows rebuilt and the order of their (made, dead) events: by block, time, deaths
    first at a tie. Each block's events sum to zero, so one running sum in this order is each
    block's own."""
    rows = np.flatnonzero(spans[:, 0] >= 0)
    t = np.concatenate([spans[rows, 0], spans[rows, 1] + 1])
    kind = np.concatenate([np.ones(len(rows)), np.zeros(len(rows))])
    block = np.concatenate([layer[rows], layer[rows]])
    return rows, np.lexsort((kind, t, block))


def local_saved_bytes(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    """Bytes of each `SavedTable` row on one device for one micro-batch, as the caching
    allocator holds them (`CostParams.activation_fragmentation`); memoised, read-only."""
    key = (layout.tp, layout.sp, layout.microbatch, layout.cp, layout.ep, facts.batch,
           cluster.params.activation_fragmentation)

    def build() -> np.ndarray:
        local = _local_saved_bytes(facts, cluster, layout)
        local.flags.writeable = False
        return local
    return facts.cache.get("local_saved", key, build)


def _local_saved_bytes(facts: StepFacts, cluster: Cluster, layout: Layout) -> np.ndarray:
    saved, tp = facts.saved, layout.tp
    local = saved.bytes * np.where(saved.batch_dep, layout.microbatch / facts.batch / layout.cp, 1.0)
    local = local / np.where(saved.tp_div, tp, 1) / np.where(saved.sp_div & layout.sp, tp, 1)
    local = local * np.where(saved.ep_rows, layout.ep, 1)  # the ep group's rows, all gathered
    return local * cluster.params.activation_fragmentation


def activation_memory(facts: StepFacts, local: np.ndarray, stage: np.ndarray, pp: int,
                      choice: RecomputeChoice, block_input: float = 0.0) -> tuple[np.ndarray, float]:
    """(saved bytes of one micro-batch per stage, transient bytes) under ``choice``.

    ``local``: `local_saved_bytes`; ``stage``: the stage of each row. The transient: at the
    peak of the backward the largest activation and its gradient are live beside the saved
    ones (the fp32 logits and their gradient in a language model), a buffer the saved-tensor
    count misses (it made micro-batches 1.2-2.3x larger than the playbook could run look like
    they fit: `autopar bench cost-model`, section 4b); and under recompute, a block's backward
    first rebuilds its recomputed values, live beside the kept ones while that block's
    backward runs, one block at a time. ``block_input``: `local_block_input_bytes`, what a
    framework's block checkpoint keeps per block (`framework_kept`)."""
    cols = columns(facts, choice)
    kept = framework_kept(facts, local * cols.kept, choice, block_input)
    per_stage = np.bincount(stage, weights=kept, minlength=pp)
    transient = float(transient_bytes(facts, kept, np.zeros(len(kept), dtype=int), 1).max()) \
        if len(local) else 0.0
    transient += rebuilt_peak(local, cols.rebuilt, facts.saved.layer, choice_sweep(facts, choice))
    return per_stage, transient


def loss_rows(facts: StepFacts) -> np.ndarray:
    """Rows of `SavedTable` the loss holds when it is fused (`StepFacts.framework_memory`): the
    values saved after the last block (the log-probabilities over the vocabulary); none
    otherwise (autopar's runtime runs the captured, unfused loss)."""
    if not facts.framework_memory or facts.n_layers <= 0:
        return np.zeros(len(facts.saved), dtype=bool)
    return facts.saved.layer >= facts.n_layers


def transient_bytes(facts: StepFacts, kept: np.ndarray, stage: np.ndarray, pp: int) -> np.ndarray:
    """The backward's transient per stage from the values kept (bytes per row): twice the
    largest kept value (it and its gradient); a fused loss's values count
    `FUSED_LOSS_TRANSIENT` times instead (their gradient is written in place, and only the
    logits' low-precision gradient is new)."""
    loss = loss_rows(facts)
    largest = group_max(np.where(loss, 0.0, kept), stage, pp)
    held = group_max(np.where(loss, kept, 0.0), stage, pp)
    return np.maximum(2.0 * largest, FUSED_LOSS_TRANSIENT * held)


def framework_kept(facts: StepFacts, kept: np.ndarray, choice: RecomputeChoice,
                   block_input: float) -> np.ndarray:
    """``kept`` (bytes per row) as a framework's block checkpoint holds it under full
    recompute (`StepFacts.framework_memory`: Megatron-LM's and nanotron's full recompute,
    FSDP's per-block activation checkpointing): each block keeps only its input,
    ``block_input`` bytes (`local_block_input_bytes`), counted on the block's first kept row;
    its other values (autopar's pass also keeps the attention outputs) are rebuilt. Unchanged
    otherwise."""
    if not facts.framework_memory or choice.mode != "full" or block_input <= 0:
        return kept
    layer = facts.saved.layer
    inside = (layer >= 0) & (layer < facts.n_layers) & (kept > 0)
    rows = np.flatnonzero(inside)
    out = np.where(inside, 0.0, kept)
    if len(rows):
        _, first = np.unique(layer[rows], return_index=True)
        out[rows[first]] = block_input
    return out


def local_block_input_bytes(facts: StepFacts, cluster: Cluster, layout: Layout) -> float:
    """One block's input on one device for one micro-batch (sequence-sharded under SP), as
    the caching allocator holds it (`CostParams.activation_fragmentation`)."""
    scale = layout.microbatch / facts.batch / layout.cp / (layout.tp if layout.sp else 1)
    return facts.block_input_bytes * scale * cluster.params.activation_fragmentation


def choice_sweep(facts: StepFacts, choice: RecomputeChoice) -> tuple[np.ndarray, np.ndarray]:
    """`rebuilt_sweep` of ``choice``'s columns (memoised: it depends on the graph alone)."""
    return facts.cache.get("rebuilt_sweep", (choice,),
                           lambda: rebuilt_sweep(columns(facts, choice).rebuilt, facts.saved.layer))


def staged_activation_memory(facts: StepFacts, local: np.ndarray, stage: np.ndarray,
                             choices: tuple[RecomputeChoice, ...], block_input: float = 0.0
                             ) -> tuple[np.ndarray, np.ndarray]:
    """`activation_memory` with a choice per pipeline stage: (saved bytes of one micro-batch
    per stage, transient bytes per stage: the step's `transient_bytes` and the stage's
    backward's rebuilt peak); stage s's rows counted under ``choices[s]``.

    The largest value (the logits in a language model) counts on every stage, not only on the
    one that holds it: on the playbook's runs (`autopar bench playbook`, the shipped h100-efa
    profile) counting it per stage lowered the out-of-memory recall from 0.745 to 0.677, the
    pipeline runs that failed then predicted to fit; what it stands for on the other stages
    (the pipeline engine's buffers?) is not known."""
    pp = len(choices)
    per_stage, transient, rebuilt = np.zeros(pp), np.zeros(pp), np.zeros(pp)
    for choice in set(choices):
        cols = columns(facts, choice)
        mine = local if len(set(choices)) == 1 else \
            local * np.isin(stage, [s for s in range(pp) if choices[s] == choice])
        kept = framework_kept(facts, mine * cols.kept, choice, block_input)
        per_stage += np.bincount(stage, weights=kept, minlength=pp)
        # the step's largest transient counts on every stage (`.max()` below): one group, same value
        transient = np.maximum(transient, transient_bytes(facts, kept, np.zeros_like(stage), 1))
        rebuilt = np.maximum(rebuilt, rebuilt_peaks(mine, cols.rebuilt, facts.saved.layer, stage, pp,
                                                    choice_sweep(facts, choice)))
    return per_stage, transient.max() + rebuilt


def staged_rerun(facts: StepFacts, choices: tuple[RecomputeChoice, ...], node_stage: np.ndarray) -> np.ndarray:
    """Which nodes the backward runs again, each under its stage's choice. A framework's full
    recompute (`StepFacts.framework_memory`, `framework_kept`: a block checkpoint keeping only
    the block's input) runs every forward node of the blocks again, the attention included
    (autopar's pass keeps the attention outputs and does not)."""
    rerun = np.zeros(len(facts.nodes), dtype=bool)
    for choice in set(choices):
        on = np.isin(node_stage, [s for s in range(len(choices)) if choices[s] == choice])
        again = columns(facts, choice).rerun
        if facts.framework_memory and choice.mode == "full":
            nodes = facts.nodes
            again = again | (nodes.forward & (nodes.layer >= 0) & (nodes.layer < facts.n_layers))
        rerun |= again & on
    return rerun


def rerun_per_stage(stage_of_node: np.ndarray, times: np.ndarray, rerun: np.ndarray, pp: int
                    ) -> np.ndarray:
    """Seconds of each stage's recomputed forward for one micro-batch: the nodes the recompute
    pass copies into the backward (``rerun``)."""
    return np.bincount(stage_of_node, weights=times * rerun, minlength=pp)
