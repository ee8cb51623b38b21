"""The layouts a person writes by hand, as nanotron or torchtitan configure them.

`manual_families` lists the standard recipes (DP, ZeRO-1/2/3, Megatron TP+SP, PP and their
combinations); `best_manual` grid-searches each family's free knobs (micro-batch, degrees,
recomputation, schedule) on the same cost model the solver uses, which is what a careful
engineer with a spreadsheet of the cost model would find. Every layout here is also in the
solver's search space and priced the same way, so "the solver is never slower than the best
manual layout" holds by construction: the comparison shows coverage and what the solver's extra
freedom buys, it is not evidence that the cost model is right.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from autopar.search.bound import rules_out
from autopar.search.choices import choose
from autopar.search.step import CapturedStep
from cost import Cluster, Layout, LayoutError
from cost.step import Prediction, StepFacts, check_layout, predict, predict_memory


@dataclass(frozen=True)
class Family:
    """A hand-written recipe: fixed choices, and the knobs a person would sweep."""

    name: str
    tp: str  # "1" or "node" (TP over the GPUs of a node, up to the heads)
    pp: bool
    zero: int


FAMILIES = (
    Family("DP", "1", False, 0),
    Family("ZeRO-1", "1", False, 1),
    Family("ZeRO-2", "1", False, 2),
    Family("ZeRO-3 (FSDP)", "1", False, 3),
    Family("TP+SP (Megatron)", "node", False, 1),
    Family("FSDP+TP (torchtitan 2D)", "node", False, 3),
    Family("PP+DP", "1", True, 1),
    Family("TP+PP+DP (Megatron 3D)", "node", True, 1),
)


def divisors(n: int) -> list[int]:
    """Positive divisors of n, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _tp_options(cluster: Cluster, facts: StepFacts, mode: str) -> list[int]:
    if mode == "1":
        return [1]
    heads = facts.heads or cluster.gpus_per_node
    kv = facts.kv_heads or heads  # Megatron as people run it: K/V heads split evenly too
    return [t for t in divisors(cluster.gpus_per_node) if t > 1 and heads % t == 0 and kv % t == 0] or [1]


def family_layouts(family: Family, cluster: Cluster, facts: StepFacts) -> Iterator[Layout]:
    """Every layout of one family that is well-formed for this step and cluster."""
    world, batch = cluster.world_size, facts.batch
    layers = max(facts.n_layers, 1)
    for tp in _tp_options(cluster, facts, family.tp):
        pps = [p for p in divisors(world // tp) if 1 < p <= layers] if family.pp else [1]
        for pp in pps:
            if world % (tp * pp):
                continue
            dp = world // (tp * pp)
            if batch % dp:
                continue
            for mb in divisors(batch // dp):
                ga = batch // (dp * mb)
                if pp > 1 and ga < pp:
                    continue  # people run at least pp micro-batches
                for recompute in ("none", "full"):
                    schedules = [("1f1b", 1)]
                    if pp > 1 and layers % (2 * pp) == 0:
                        schedules.append(("interleaved-1f1b", 2))
                    for schedule, v in schedules:
                        try:
                            yield Layout(dp=dp, tp=tp, pp=pp, zero=family.zero, sp=tp > 1,
                                         microbatch=mb, grad_accum=ga, schedule=schedule,
                                         virtual_stages=v, recompute=recompute)
                        except LayoutError:
                            continue


def best_of(layouts, step: CapturedStep, cluster: Cluster) -> tuple[Layout, Prediction] | None:
    """The fastest layout that fits, or None; each priced as `--layout` prices it."""
    best = None
    for layout in layouts:
        try:
            facts = step.facts_for(cluster, layout)
            check_layout(facts, cluster, layout)
        except LayoutError:
            continue
        if rules_out(facts, cluster, layout, best[1].step_time_s if best else None):
            continue  # its compute alone is no faster (`autopar.search.bound`)
        chosen = choose(facts, cluster, layout)
        memory = predict_memory(facts, cluster, chosen, check=False)
        if memory.total > cluster.gpu.memory_bytes:
            continue
        pred = predict(facts, cluster, chosen, memory=memory)
        if best is None or pred.step_time_s < best[1].step_time_s:
            best = (layout, pred)
    return best


def best_manual(step: CapturedStep, cluster: Cluster) -> dict[str, tuple[Layout, Prediction] | None]:
    """The best layout of each standard family (None where none fits)."""
    facts = step.facts()
    return {f.name: best_of(family_layouts(f, cluster, facts), step, cluster) for f in FAMILIES}


def standard_layouts(cluster: Cluster, batch: int, hint: Layout | None = None) -> dict[str, Layout]:
    """Named standard layouts at the hint's micro-batch (for `Plan.explain`)."""
    world = cluster.world_size
    node = min(cluster.gpus_per_node, world)
    mb = hint.microbatch if hint else 1
    out: dict[str, Layout] = {}

    def add(name: str, dp: int, **kw) -> None:
        if dp < 1 or batch % (dp * mb):
            return
        try:
            out[name] = Layout(dp=dp, microbatch=mb, grad_accum=batch // (dp * mb), **kw)
        except LayoutError:
            pass

    add("dp", world)
    add("zero1", world, zero=1)
    add("zero3", world, zero=3)
    if node > 1:
        add("tp", world // node, tp=node, zero=1)
        add("tp+sp", world // node, tp=node, sp=True, zero=1)
        add("fsdp+tp", world // node, tp=node, sp=True, zero=3)
    return out
