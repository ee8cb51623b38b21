"""Every choice a layout leaves open, made in one place: FP8 matmuls, pipeline cuts, recompute.

A `Layout` names degrees and recipes; `choose` returns it with its `vocab.choices.Choices`
made, in this order (each reads the ones before), for the cost model to price
(`cost.step.predict`) and the plan to carry to the passes (`autopar.search.decisions`):

1. **FP8** (`choose_fp8`, ``Layout.fp8 == "auto"``): each block-tied weight group
   (`fp8_group`) whose matmuls, casts included, are predicted faster in FP8 than in the
   layout's precision at their local shape, summed over the group's blocks, forward and
   backward. A GPU without FP8 tensor cores gets none; so does a CPU rank (its `_scaled_mm`
   rate, `cost.terms.compute.CPU_FP8_MATMUL_FLOPS`, never wins).
2. **Pipeline cuts** (`choose_chunks`, pp x virtual stages > 1): each slot weighed by the
   step's own seconds for it under the layout, the contiguous cut that minimises the slowest
   chunk (`autopar.search.cuts.balanced_cuts`); where that cut does not fit the memory
   (`StepFacts.memory_cuts`, one chunk per rank), the most balanced cut that fits
   (`fitting_cuts`), else the time cut (the layout does not fit, whatever the cut).
3. **Recompute** (``Layout.recompute == "auto"``): per pipeline stage, the fastest choice that
   fits (`autopar.search.recompute_choice.choose_recompute`).

The same layout, step and cluster always give the same choices (memoised in the facts' cache).
"""

from __future__ import annotations

import numpy as np

from autopar.search.cuts import balanced_cuts, fitting_cuts
from autopar.search.recompute_choice import choose_recompute
from cost import Cluster, Layout
from cost.step import StepFacts, check_layout
from cost.terms.common import resolved
from cost.terms.compute import (
    fp8_candidate_groups,
    node_times,
    slot_memory,
    times_key,
    virtual_stages,
)
from vocab.choices import Choices
from vocab.plan_types import fp8_group

# the choices in the order they are made: each reads the ones before
STEPS = ("fp8", "chunks", "recompute")


def choose(facts: StepFacts, cluster: Cluster, layout: Layout, through: str = "recompute") -> Layout:
    """``layout`` resolved for this step, with its open choices made (`Layout.choices`) up to
    and including ``through`` (one of `STEPS`): "fp8" is all a step's node times read, "chunks"
    all a compute bound reads, "recompute" all a price reads. Raises `LayoutError` for a
    layout that cannot run this step (`cost.step.check_layout`)."""
    lay = resolved(facts, cluster, layout)
    need = STEPS[:STEPS.index(through) + 1]
    if lay.choices is not None and all(getattr(lay.choices, s) is not None for s in need):
        return lay
    key = (lay, through, cluster.gpu.name, cluster.gpu.memory_bytes, cluster.gpu.memory_bw,
           cluster.params, cluster.world_size)
    return facts.cache.get("choices", key, lambda: _choose(facts, cluster, lay, need))


def _choose(facts: StepFacts, cluster: Cluster, lay: Layout, need: tuple[str, ...]) -> Layout:
    check_layout(facts, cluster, lay)  # a layout that cannot run this step has no choices
    fp8 = choose_fp8(facts, cluster, lay)
    lay = lay.with_choices(Choices(fp8=fp8))
    if "chunks" not in need:
        return lay
    lay = lay.with_choices(Choices(fp8=fp8, chunks=choose_chunks(facts, cluster, lay)))
    if "recompute" not in need:
        return lay
    rec = choose_recompute(facts, cluster, lay) if lay.recompute == "auto" else ()
    return lay.with_choices(Choices(fp8=fp8, chunks=lay.choices.chunks, recompute=rec))


def choose_fp8(facts: StepFacts, cluster: Cluster, layout: Layout) -> tuple[str, ...]:
    """The weight groups whose matmuls run in FP8 under ``layout`` (resolved): the module
    docstring's rule for "auto"; the named ones otherwise (`cost.terms.compute.fp8_groups`)."""
    if layout.fp8 != "auto":
        return ()  # nothing to choose: the cost model reads the layout's own fp8
    if "fp8" not in cluster.gpu.peak_flops and not cluster.gpu.is_cpu:
        return ()  # no FP8 tensor cores (A100): nothing to gain

    def build() -> tuple[str, ...]:
        groups = fp8_candidate_groups(facts, layout)
        if not groups:
            return ()
        high = node_times(facts, cluster, layout.replace(fp8="none"))
        low = node_times(facts, cluster, layout.replace(fp8="all"))
        of = np.array([fp8_group(w) for w in facts.nodes.fp8_weight], dtype=str)
        return tuple(g for g in groups if low[of == g].sum() < high[of == g].sum())
    return facts.cache.get("fp8_choice", times_key(facts, cluster, layout.with_choices(Choices(fp8=()))), build)


def choose_chunks(facts: StepFacts, cluster: Cluster, layout: Layout) -> tuple[int, ...]:
    """Pipeline chunk of every slot (0 before the blocks, block i at i + 1, the last slot after
    them) under ``layout`` (resolved, its FP8 choice made): the module docstring's rule."""
    n_layers = max(facts.n_layers, 0)
    chunks = layout.pp * virtual_stages(layout)
    if chunks == 1 or n_layers == 0:
        return (0,) * (n_layers + 2)

    def time_cut() -> tuple[np.ndarray, tuple[int, ...]]:
        slot = np.clip(facts.nodes.layer, -1, n_layers) + 1
        cost = np.bincount(slot, weights=node_times(facts, cluster, layout), minlength=n_layers + 2)
        blocks = balanced_cuts(cost[1:n_layers + 1], chunks, float(cost[0]), float(cost[-1]))
        return cost, _slot_map(blocks, chunks)

    cost, chunk_map = facts.cache.get("chunk_map", (chunks, *times_key(facts, cluster, layout)),
                                      time_cut)
    if virtual_stages(layout) > 1 or not facts.memory_cuts:
        return chunk_map

    def memory_cut() -> tuple[int, ...]:
        # the cut that balances time may not fit: 1F1B's first stage holds pp micro-batches
        memory = slot_memory(facts, cluster, layout)
        if memory.fits(np.array(chunk_map[1:-1]), chunks):
            return chunk_map
        blocks = fitting_cuts(cost[1:n_layers + 1], chunks, float(cost[0]), float(cost[-1]), memory)
        return chunk_map if blocks is None else _slot_map(blocks, chunks)

    key = (chunk_map, layout.with_choices(None), cluster.gpu.memory_bytes, cluster.params)
    return facts.cache.get("chunk_map_memory", key, memory_cut)


def _slot_map(blocks: np.ndarray, chunks: int) -> tuple[int, ...]:
    """The chunk of every slot from the chunk of every block."""
    return (0, *(int(b) for b in blocks), chunks - 1)
