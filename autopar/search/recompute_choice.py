"""Recompute "auto": what each pipeline stage recomputes, chosen by speed under the memory.

A choice (`vocab.choices.RecomputeChoice`) is "none", or "selective" plus a set C of heavy
groups, "full" being selective plus every group; `cost.terms.recompute` prices any choice from
the facts' exact columns (its docstring has the composition).

"auto" takes the fastest choice that fits the device. Recompute seconds only add to a step
(the data-parallel sync they may hide behind is never longer than them), so: none if it fits;
else selective if it fits; else, among selective + C, the C with the fewest recompute seconds
on the slowest stage whose memory fits on every stage: a 0/1 knapsack (bytes freed against
seconds at the local shape), solved exactly by enumerating the subsets of the groups that free
memory (at most 2^12; beyond, groups are added greedily by seconds per byte freed); else full,
the least memory (the layout does not fit).

Pipeline stages choose apart (`choose_recompute`): a stage's memory and seconds depend on its
own choice only, so each stage's fastest choice that fits is the fastest step under the memory
(1F1B's first stage holds pp micro-batches in flight and may recompute what the last keeps).
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

from cost import Cluster, Layout
from cost.step import StepFacts, fixed_bytes_per_stage, in_flight
from cost.terms.compute import (
    compute_per_stage,
    node_stages,
    slot_stages,
    stage_of,
    step_node_times,
    times_key,
)
from cost.terms.recompute import (
    activation_memory,
    choice_sweep,
    columns,
    group_max,
    local_saved_bytes,
    rerun_per_stage,
    staged_activation_memory,
    transient_bytes,
)
from cost.terms.tensor_parallel import kept_sp_gathers
from vocab.choices import RecomputeChoice

MAX_EXACT_GROUPS = 12  # 2^12 subsets enumerated; more groups are added greedily
MAX_EXACT_CHECKS = 32  # candidates checked on their exact columns before falling back to full


def choose_recompute(facts: StepFacts, cluster: Cluster, lay: Layout) -> tuple[RecomputeChoice, ...]:
    """What each pipeline stage recomputes under "auto" (one entry without a pipeline): the
    module docstring's rule per stage. ``lay``: resolved, its FP8 and cut choices made
    (`autopar.search.choices`)."""
    key = (lay, cluster.gpu.name, cluster.gpu.memory_bytes, cluster.params, cluster.world_size)
    return facts.cache.get("recompute_choices", key, lambda: _choose(facts, cluster, lay))


def _choose(facts: StepFacts, cluster: Cluster, lay: Layout) -> tuple[RecomputeChoice, ...]:
    none = (RecomputeChoice("none"),) * lay.pp
    room = cluster.gpu.memory_bytes - fixed_bytes_per_stage(facts, cluster, lay)
    times = step_node_times(facts, cluster, lay)
    fwd, bwd = compute_per_stage(facts, cluster, lay, times)
    local = local_saved_bytes(facts, cluster, lay)
    saved_stage = stage_of(facts, facts.saved.layer, cluster, lay)
    node_stage = node_stages(facts, cluster, lay)
    kept, transient = staged_activation_memory(facts, local, saved_stage, none)
    flight = np.array([in_flight(lay, s) for s in range(lay.pp)])
    if np.all(kept * flight + transient <= room):  # no stage needs to recompute
        return none
    # each stage alone: its rows and nodes; the step's largest value counts on every stage
    # (`staged_activation_memory`), so a stage whose own largest is smaller has less room
    largest = group_max(local * columns(facts, none[0]).kept, saved_stage, lay.pp)
    room = room - 2.0 * (largest.max() - largest)
    # a recomputing stage that keeps its SP gathers holds them too (`Layout.regather`)
    room = room - kept_sp_gathers(facts, cluster, lay, lay.pp) * flight
    # the first rules for all stages at once; the knapsack for the stages they leave open
    easy = stage_choices_apart(facts, local, saved_stage, flight, room)
    # a stage's knapsack reads its rows, nodes and times: the same for every layout that
    # differs in room or flight only (ZeRO, schedule), which share its cache
    cut = slot_stages(facts, cluster, lay).tobytes() if lay.pp > 1 else b""
    shared = (times_key(facts, cluster, lay), cluster.params, lay.pp, cut)
    return tuple(
        easy[s] if easy[s] is not None else
        knapsack_choice(facts, local * (saved_stage == s), np.zeros_like(saved_stage),
                        np.array([in_flight(lay, s)]), room[s:s + 1], np.zeros_like(node_stage),
                        times * (node_stage == s), (fwd + bwd)[s:s + 1],
                        facts.cache.get("knapsack", (*shared, s), dict))
        for s in range(lay.pp))


def choose_auto(facts: StepFacts, local: np.ndarray, stage: np.ndarray, flight: np.ndarray,
                room: np.ndarray, node_stage: np.ndarray, times: np.ndarray,
                stage_base_s: np.ndarray) -> RecomputeChoice:
    """The choice "auto" makes (the module docstring's rule).

    ``room``: bytes per stage left for saved activations and transients (capacity less the
    model states, buffers and reserve); ``flight``: micro-batches of activations each stage
    holds; ``stage_base_s``: each stage's seconds per micro-batch without recompute."""
    pp = len(room)

    def fits(choice: RecomputeChoice) -> bool:
        per_stage, transient = activation_memory(facts, local, stage, pp, choice)
        return bool(np.all(per_stage * flight + transient <= room))

    for choice in (RecomputeChoice("none"), RecomputeChoice("selective")):
        if fits(choice):
            return choice
    if not facts.recompute_groups or not fits(RecomputeChoice("full")):
        return RecomputeChoice("full")
    return knapsack_choice(facts, local, stage, flight, room, node_stage, times, stage_base_s)


def stage_choices_apart(facts: StepFacts, local: np.ndarray, stage: np.ndarray,
                        flight: np.ndarray, room: np.ndarray) -> list[RecomputeChoice | None]:
    """`choose_auto`'s first rules for every pipeline stage s on its own (its rows of
    ``local`` alone, stage index ``stage``, ``flight[s]``, ``room[s]``), all stages at once:
    none if it fits s, else selective if it fits, else full when selective plus every group
    does not fit (or there are no groups); None where the knapsack must choose.

    Each stage's sums, maxima and running sums are taken over its own rows in the same order
    as `choose_auto` on the masked rows (the other rows add exact zeros), so the answer is
    bit for bit the one stage by stage."""
    pp = len(room)
    out: list[RecomputeChoice | None] = [None] * pp
    open_ = np.ones(pp, dtype=bool)
    for choice in (RecomputeChoice("none"), RecomputeChoice("selective")):
        ok = open_ & _fits_apart(facts, local, stage, flight, room, choice)
        for s in np.flatnonzero(ok):
            out[s] = choice
        open_ &= ~ok
        if not open_.any():
            return out
    full = RecomputeChoice("full")
    last = np.ones(pp, dtype=bool) if not facts.recompute_groups else \
        ~_fits_apart(facts, local, stage, flight, room, full)
    for s in np.flatnonzero(open_ & last):
        out[s] = full
    return out


def _fits_apart(facts: StepFacts, local: np.ndarray, stage: np.ndarray, flight: np.ndarray,
                room: np.ndarray, choice: RecomputeChoice) -> np.ndarray:
    """Per stage: whether ``choice`` fits it on its own rows (`stage_choices_apart`)."""
    pp = len(room)
    cols = columns(facts, choice)
    kept = local * cols.kept
    per_stage = np.bincount(stage, weights=kept, minlength=pp)
    transient = transient_bytes(facts, kept, stage, pp) if len(local) else np.zeros(pp)
    transient = transient + _rebuilt_peaks_apart(local, stage, pp, choice_sweep(facts, choice))
    return per_stage * flight + transient <= room


def _rebuilt_peaks_apart(local: np.ndarray, group: np.ndarray, groups: int,
                         sweep: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """`rebuilt_peak` of each group's rows alone: one running sum per group over its own
    events (`rebuilt_peaks` runs one sum over every group's)."""
    out = np.zeros(groups)
    rows, order = sweep
    if not len(rows):
        return out
    delta = np.concatenate([local[rows], -local[rows]])[order]
    owner = np.concatenate([group[rows], group[rows]])[order]
    if np.any(owner[1:] < owner[:-1]):  # the sweep runs block by block: in stage order already
        by = np.argsort(owner, kind="stable")  # each group's events, in sweep order
        owner, delta = owner[by], delta[by]
    starts = np.flatnonzero(np.concatenate([[True], owner[1:] != owner[:-1]]))
    for start, end in zip(starts, [*starts[1:], len(owner)]):
        out[owner[start]] = max(0.0, float(np.cumsum(delta[start:end]).max()))
    return out


def knapsack_choice(facts: StepFacts, local: np.ndarray, stage: np.ndarray, flight: np.ndarray,
                    room: np.ndarray, node_stage: np.ndarray, times: np.ndarray,
                    stage_base_s: np.ndarray, cache: dict | None = None) -> RecomputeChoice:
    """`choose_auto` where neither none nor selective fits and full does: the fastest
    selective + C that fits (the module docstring's knapsack), else full.

    ``cache``: a dict the caller keeps per (``local``, ``stage``, ``node_stage``, ``times``,
    ``stage_base_s``): it holds what is computed here from those alone (each choice's saved
    and transient bytes, each group's bytes freed and seconds added, the subsets ranked by
    their seconds), so that layouts that
    differ only in ``room`` and ``flight`` (ZeRO, schedule) share them; the same values."""
    pp = len(room)
    c = cache if cache is not None else {}

    def fits(choice: RecomputeChoice) -> bool:
        per_stage, transient = _stage_memory(facts, local, stage, pp, choice, c)
        return bool(np.all(per_stage * flight + transient <= room))

    groups = facts.recompute_groups
    if "freed" not in c:
        # each group's bytes freed per stage (before flight) and seconds added per stage
        sel = columns(facts, RecomputeChoice("selective"))
        kept_g, rerun_g = facts.saved.kept_groups, facts.nodes.rerun_groups
        freed_rows = (sel.kept[:, None] & ~kept_g) * local[:, None]
        added_rows = (kept_g & ~sel.kept[:, None]) * local[:, None]
        onehot = np.eye(pp)[stage]  # rows x stages
        extra_nodes = rerun_g & ~sel.rerun[:, None]
        c["freed"] = (freed_rows - added_rows).T @ onehot  # groups x stages
        c["seconds"] = (extra_nodes * times[:, None]).T @ np.eye(pp)[node_stage]  # groups x stages
        c["base_s"] = stage_base_s + rerun_per_stage(node_stage, times, sel.rerun, pp)
    freed, seconds, base_s = c["freed"] * flight, c["seconds"], c["base_s"]
    useful = [i for i in range(len(groups)) if freed[i].max() > 0]
    sel_per_stage, sel_transient = _stage_memory(facts, local, stage, pp, RecomputeChoice("selective"), c)
    need = sel_per_stage * flight + sel_transient - room  # bytes to free per stage (> 0 somewhere)
    # the additive estimate ranks the subsets; each is then checked on its exact columns
    # (rebuilt sets and shared roots do not add up), cheapest first
    if len(useful) <= MAX_EXACT_GROUPS:
        subsets = _all_subsets(len(useful))
        if ("ranked", *useful) not in c:  # the ranking reads the seconds alone: kept
            step_s = (base_s + subsets @ seconds[useful]).max(axis=1)
            c[("ranked", *useful)] = np.argsort(step_s, kind="stable")
        ranked = c[("ranked", *useful)]
    else:  # greedy prefixes by seconds per byte freed on the fullest stage
        worst = int(np.argmax(need))
        order = sorted(useful, key=lambda i: seconds[i].sum() / max(freed[i, worst], 1.0))
        subsets = np.tril(np.ones((len(order) + 1, len(order))), -1)
        useful = order
        ranked = np.argsort((base_s + subsets @ seconds[useful]).max(axis=1), kind="stable")
    enough = np.all(subsets @ freed[useful] >= need - 1e-6 * np.abs(room), axis=1)
    for row in ranked[enough[ranked]][:MAX_EXACT_CHECKS]:
        outputs = tuple(groups[useful[i]] for i in np.flatnonzero(subsets[row]))
        choice = _normalised(facts, RecomputeChoice("selective", outputs))
        if fits(choice):
            return choice
    return RecomputeChoice("full")


@functools.cache
def _all_subsets(n: int) -> np.ndarray:
    """Every subset of n items as 0/1 rows, in `itertools.product` order (read-only)."""
    out = np.array(list(itertools.product((0, 1), repeat=n)), dtype=float)
    out.flags.writeable = False
    return out


def _stage_memory(facts: StepFacts, local: np.ndarray, stage: np.ndarray, pp: int,
                  choice: RecomputeChoice, cache: dict) -> tuple[np.ndarray, float]:
    """`activation_memory` of ``choice``, kept in ``cache`` (`knapsack_choice`)."""
    if choice not in cache:
        cache[choice] = activation_memory(facts, local, stage, pp, choice)
    return cache[choice]


def _normalised(facts: StepFacts, choice: RecomputeChoice) -> RecomputeChoice:
    """Selective plus every group is full."""
    if choice.mode == "selective" and len(choice.outputs) == len(facts.recompute_groups) > 0:
        return RecomputeChoice("full")
    return choice
