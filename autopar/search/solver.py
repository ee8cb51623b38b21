"""The solver: the fastest layout of a training step that fits the cluster's memory.

Search space, per the playbook's decision procedure: the mesh factorisation world = dp*cp*pp*tp
(TP inside a node first; across nodes only when nothing else fits), expert parallelism for MoE
models, ZeRO stage 0-3, sequence parallelism, micro-batch size and gradient accumulation for the
requested global batch, activation recomputation, the pipeline schedule, and optionally FP8.
Each candidate is priced by `cost.step` (memory first), unless its compute alone cannot beat
the best found so far (`autopar.search.bound`: a proven lower bound, so pruning never changes
the answer);
the tensor-parallel placement of every weight comes from `tp_ilp` (an OR-tools ILP over the
graph's matmuls, tied across repeated blocks) or the Megatron recipe, whichever predicts faster.
The same inputs always give the same plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from autopar.errors import AutoparError
from autopar.search.batch import small_batch_note
from autopar.search.bound import rules_out
from autopar.search.choices import choose
from autopar.search.executable import refusals
from autopar.search.manual import best_manual, divisors
from autopar.search.step import CapturedStep
from cost import Cluster, Layout, LayoutError
from cost.step import (
    Prediction,
    StepFacts,
    check_layout,
    default_precision,
    predict,
    predict_memory,
)
from cost.terms.tensor_parallel import regather_exposed_share


class NoFeasiblePlanError(AutoparError):
    """No layout fits the cluster's memory: the message gives the shortfall and what to try."""


def tp_degrees(facts: StepFacts, cluster: Cluster, cross_node_tp: bool = False) -> list[int]:
    """TP degrees to try: inside a node, or (only when nothing else fits) whole nodes."""
    world = cluster.world_size
    heads = facts.heads or world
    gpn = min(cluster.gpus_per_node, world)
    tps = [t for t in divisors(world) if heads % t == 0 and (t <= gpn) != cross_node_tp]
    return [t for t in tps if t % gpn == 0] if cross_node_tp else tps


# (ZeRO stage, reshard): ZeRO-3 gathers the weights again for the backward, or keeps the
# forward's (a collective recomputed or kept: the solver weighs one gather against the memory)
ZERO_CHOICES = ((0, True), (1, True), (2, True), (3, True), (3, False))
# Layout.regather: under TP+SP with recomputation, the backward gathers the sequence again
# (Megatron-SP) or keeps the forward's gathered matmul inputs; the regathering twin first
REGATHER_CHOICES = (True, False)


def candidate_layouts(
    facts: StepFacts,
    cluster: Cluster,
    tps: list[int],
    allow_fp8: bool = False,
    max_virtual_stages: int = 2,
    precision: str | None = None,
    recompute: tuple[str, ...] = ("auto",),
) -> Iterator[Layout]:
    """Every well-formed layout of the search space with a TP degree in ``tps``, in order.
    ``recompute``: the recompute modes searched ("auto": the cheapest choice that fits, per
    layout, `autopar.search.recompute_choice`; it is never slower than none, selective or full)."""
    world, batch, seq = cluster.world_size, facts.batch, facts.seq
    layers = max(facts.n_layers, 1)
    cps = [1] + [c for c in (2, 4, 8) if seq % c == 0 and seq // c >= 2048]
    eps = [e for e in divisors(facts.n_experts)] if facts.n_experts else [1]
    # the model's precision (`autopar.planning.planner.model_precision`), FP8 matmuls on request
    base = precision or default_precision(cluster)
    # FP8: the per-matmul choice by cost ("auto", `autopar.search.choices.choose_fp8`)
    fp8s = ("none", "auto") if allow_fp8 and "fp8" in cluster.gpu.peak_flops else ("none",)
    for tp in tps:
        for cp in cps:
            for pp in divisors(world // (tp * cp)) if world % (tp * cp) == 0 else []:
                if pp > layers:
                    continue
                dp = world // (tp * cp * pp)
                if batch % dp:
                    continue
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules.append(("zero-bubble", 1))
                    for v in range(2, max_virtual_stages + 1):
                        if layers % (v * pp) == 0:
                            schedules.append(("interleaved-1f1b", v))
                for ep in eps:
                    if (dp * cp) % ep:
                        continue
                    for mb in divisors(batch // dp):
                        ga = batch // (dp * mb)
                        if pp > 1 and ga < pp:
                            continue  # a pipeline that never fills: priced, but not searched
                        # the choices below are independent of each other
                        choices = itertools.product(
                            (False, True) if tp > 1 else (False,),
                            fp8s,
                            schedules,
                            # ZeRO shards over dp*cp; ZeRO-3 also keeping the forward's weights
                            ZERO_CHOICES if dp * cp > 1 else ((0, True),),
                            recompute,
                            REGATHER_CHOICES,
                        )
                        for sp, fp8, (schedule, v), (zero, reshard), rc, regather in choices:
                            if not regather and (not sp or rc == "none"):
                                continue  # nothing regathered to keep: the twin's layout
                            try:
                                yield Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero=zero, sp=sp,
                                             microbatch=mb, grad_accum=ga, schedule=schedule,
                                             virtual_stages=v, recompute=rc,
                                             precision=base, fp8=fp8, reshard=reshard,
                                             regather=regather)
                            except LayoutError:
                                continue


# Pipelines are not searched on CPU ranks (a manual pp layout is still priced and runs). The
# price runs the schedule slot by slot, the busy ranks of a slot sharing the cores the others
# leave (`shared_host_factor`), and charges each transfer the overhead `autopar calibrate`
# measures on loaded ranks, but PP2 x DP2 is priced 0.97-1.04x DP's step where it measures
# 1.01-1.06x (`python -m autopar bench runtime`): searched, a pipeline could win on a
# difference smaller than the price's error.


def search(
    step: CapturedStep,
    cluster: Cluster,
    allow_fp8: bool = False,
    progress: Callable[[str], None] | None = None,
    executable_only: bool = False,
    precision: str | None = None,
    recompute: tuple[str, ...] = ("auto",),
    prune: bool = True,
) -> tuple[Layout | None, Prediction | None, StepFacts | None, dict]:
    """Best fitting layout, its prediction and cost facts, and search statistics.

    prune: skip the layouts whose compute alone cannot beat the best found so far
    (`autopar.search.bound`: a proven lower bound, so the answer is the un-pruned search's);
    False prices every layout (the reference the tests compare with)."""
    base = step.facts()
    state = _SearchState(cluster, prune)
    last_report = time.perf_counter()
    for cross in (False, True):
        for tp in tp_degrees(base, cluster, cross):
            variants = [("megatron", base)] if tp == 1 else step.tp_variants(cluster, tp)
            for recipe_name, facts in variants:
                for layout in candidate_layouts(facts, cluster, [tp], allow_fp8=allow_fp8,
                                                precision=precision, recompute=recompute):
                    state.stats["considered"] += 1
                    if executable_only and refusals(facts, cluster, layout):
                        continue  # autopar.parallelize searches only what it runs
                    if layout.pp > 1 and cluster.gpu.is_cpu:
                        continue  # see the note above search()
                    state.visit(facts, layout, recipe_name)
                    best = state.best
                    if progress and best and time.perf_counter() - last_report > 1.0:
                        last_report = time.perf_counter()
                        progress(
                            f"  searched {state.stats['considered']:,} layouts, "
                            f"{state.stats['fit']:,} fit; best {best[0].short()} at "
                            f"{best[1].step_time_s:.3g} s/step"
                        )
        if state.best is not None:
            state.stats["cross_node_tp"] = cross
            break  # TP across nodes only when nothing inside a node fits
    stats = state.stats
    stats["closest_misses"] = [
        (m, lay.short()) for m, lay in sorted(state.smallest, key=lambda x: x[0])[:5]
    ]
    if state.best is None:
        return None, None, None, stats
    stats["tp_recipe"] = state.best[3]
    return state.best[0], state.best[1], state.best[2], stats


class _SearchState:
    """The search's running best and what its pruning rules remember.

    Twins: a ZeRO-3 layout that keeps the forward's gathered weights (``reshard=False``) is
    priced only when its resharding twin fits and keeping may pay (`_keeping_may_pay`); a TP+SP
    layout that keeps its gathers (``regather=False``) only when its regathering twin fits and
    recomputes. A twin skipped by the bound is priced when its partner needs its price and the
    partner's own bound does not rule the partner out (cuts under memory may differ between
    twins, so their bounds may too)."""

    def __init__(self, cluster: Cluster, prune: bool):
        self.cluster, self.prune = cluster, prune
        self.capacity = cluster.gpu.memory_bytes
        self.best: tuple[Layout, Prediction, StepFacts, str] | None = None
        self.stats = {"considered": 0, "fit": 0, "cross_node_tp": False, "pruned_by_bound": 0}
        self.smallest: list[tuple[float, Layout]] = []  # for the infeasible report
        self.resharded: dict[Layout, Prediction] = {}  # ZeRO-3 layouts that fit
        self.regathered: dict[Layout, Prediction] = {}  # TP+SP layouts that fit and recompute
        self.bounded: dict[Layout, StepFacts] = {}  # skipped by the bound (twins priced on demand)
        # else a regather is free (only with overlap_slowdown 0: every default profile prices twins)
        self.keeping_gathers_may_pay = regather_exposed_share(cluster) > 0

    def visit(self, facts: StepFacts, layout: Layout, recipe_name: str) -> None:
        """Price ``layout`` unless a rule shows it cannot be the answer; keep the best."""
        if not layout.reshard:
            twin = dataclasses.replace(layout, reshard=True)
            if not self._twin_priced(twin, layout, facts) or not _keeping_may_pay(
                    self.resharded.get(twin), self.cluster):
                return
        if not layout.regather:
            twin = dataclasses.replace(layout, regather=True)
            if not self.keeping_gathers_may_pay or not self._twin_priced(twin, layout, facts) \
                    or twin not in self.regathered:
                return  # its twin did not fit or regathered nothing: keeping cannot pay
        try:
            check_layout(facts, self.cluster, layout)
        except LayoutError:
            return
        if self.prune and rules_out(facts, self.cluster, layout,
                                    self.best[1].step_time_s if self.best else None):
            self.stats["pruned_by_bound"] += 1
            self.bounded[layout] = facts
            return
        pred = self._price(facts, layout)
        if pred is not None and (self.best is None
                                 or pred.step_time_s < self.best[1].step_time_s - 1e-12):
            self.best = (layout, pred, facts, recipe_name)

    def _twin_priced(self, twin: Layout, layout: Layout, facts: StepFacts) -> bool:
        """False when ``layout`` cannot be the answer on its own bound; else ``twin`` priced
        (if the bound had skipped it), so that its price decides as without pruning."""
        if twin not in self.bounded:
            return True
        if rules_out(facts, self.cluster, layout, self.best[1].step_time_s):
            self.stats["pruned_by_bound"] += 1
            return False
        self._price(self.bounded.pop(twin), twin)
        return True

    def _price(self, facts: StepFacts, layout: Layout) -> Prediction | None:
        """Memory first (cheap, prunes); the full price of a layout that fits, else None
        (``layout`` as searched: its choices are made here, `autopar.search.choices`)."""
        chosen = choose(facts, self.cluster, layout)
        mem = predict_memory(facts, self.cluster, chosen, check=False)
        if mem.total > self.capacity:
            self.smallest.append((mem.total, layout))
            if len(self.smallest) > 64:
                self.smallest = sorted(self.smallest, key=lambda x: x[0])[:8]
            return None
        self.stats["fit"] += 1
        pred = predict(facts, self.cluster, chosen, memory=mem)
        if layout.zero == 3 and layout.reshard:
            self.resharded[layout] = pred
        if layout.sp and layout.regather and pred.time_breakdown["recompute_s"] > 0:
            self.regathered[layout] = pred
        return pred


def _keeping_may_pay(resharded: Prediction | None, cluster: Cluster) -> bool:
    """Whether ZeRO-3 keeping the forward's gathered weights can beat its resharding twin
    (``resharded``: the twin's price, None when it did not fit): keeping needs more memory
    than the twin, and saves only the backward's gathers: their exposed seconds and, where
    overlap slows compute (`CostParams.overlap_slowdown`), their hidden ones."""
    if resharded is None:
        return False
    return resharded.time_breakdown["dp_comm_exposed_s"] > 0 or cluster.params.overlap_slowdown > 0


@dataclass
class Solution:
    """What the search found: the layout, its price and facts, the manual grid, statistics."""

    layout: Layout
    prediction: Prediction
    facts: StepFacts
    manual: dict[str, tuple[Layout, Prediction] | None]
    stats: dict


def solve(
    step: CapturedStep,
    cluster: Cluster,
    model: str = "",
    allow_fp8: bool = False,
    compare_manual: bool = True,
    progress: Callable[[str], None] | None = None,
    executable_only: bool = False,
    precision: str | None = None,
    recompute: tuple[str, ...] = ("auto",),
) -> Solution:
    """The fastest layout of ``step`` that fits ``cluster``; raises `NoFeasiblePlanError`.

    executable_only: search only what `autopar.parallelize` executes
    (`autopar.search.executable.refusals` is empty), as parallelize asks. recompute: the recompute modes
    searched (by default "auto", the cost model's choice per layout).
    """
    t0 = time.perf_counter()
    base = step.facts()
    # The model state alone, sharded as thinly as ZeRO-3 can (bf16 weights and gradients, fp32
    # master and Adam: 16 bytes per parameter), must fit beside the reserve.
    floor = base.num_params * 16 / cluster.world_size + cluster.params.memory_reserve_bytes
    if floor > cluster.gpu.memory_bytes:
        raise NoFeasiblePlanError(
            f"{model or 'the model'} has {base.num_params / 1e9:.1f} B parameters: even sharded "
            f"over all {cluster.world_size} devices its weights, gradients and Adam state need "
            f"{floor / 2**30:.1f} GiB per device (with the runtime reserve) and "
            f"{cluster.gpu.name} has {cluster.gpu.memory_bytes / 2**30:.1f} GiB, short by "
            f"{(floor - cluster.gpu.memory_bytes) / 2**30:.1f} GiB; fix: at least "
            f"{int(base.num_params * 16 // (cluster.gpu.memory_bytes - cluster.params.memory_reserve_bytes)) + 1} devices"
        )
    if progress:
        progress(f"searching layouts of {model or 'the model'} on {cluster.world_size} devices ...")
    layout, pred, facts, stats = search(step, cluster, allow_fp8=allow_fp8, progress=progress,
                                        executable_only=executable_only, precision=precision,
                                        recompute=tuple(recompute))
    if layout is None:
        raise NoFeasiblePlanError(_infeasible_message(step.facts(), cluster, stats))
    manual = best_manual(step, cluster) if compare_manual else {}
    stats.update({
        "method": "search over layouts (bound- and memory-pruned) x TP placement ILP",
        "ilp": step.ilp_stats(),
        "time_s": time.perf_counter() - t0,
        "evaluated": stats["fit"],  # priced and fits: the rest fail memory or the bound
        "manual_best": {k: (v[0].short(), v[1].step_time_s) if v else None for k, v in manual.items()},
    })
    note = small_batch_note(base.batch, base.seq, cluster, layout.short(), pred.tokens_per_s_per_gpu)
    if note:
        stats["batch_note"] = note  # `Plan.solve["batch_note"]`: the batch leaves devices idle
        if progress:
            progress(f"note: {note}")
    if progress:
        progress(f"done in {stats['time_s']:.1f} s: {layout.short()}")
    return Solution(layout, pred, facts, manual, stats)


def _infeasible_message(facts: StepFacts, cluster: Cluster, stats: dict) -> str:
    capacity = cluster.gpu.memory_bytes
    misses = stats.get("closest_misses") or []
    if not misses:
        return (
            f"no layout can split a global batch of {facts.batch} sequence(s) of {facts.seq} over "
            f"{cluster.world_size} devices: data parallelism must divide the batch, and tensor, "
            f"pipeline and context parallelism are bounded by the heads, the "
            f"{facts.n_layers} blocks and the sequence; raise the global batch (a multiple of "
            f"{cluster.world_size} sequences always works) or plan for fewer devices"
        )
    lines = [
        f"no layout of this step fits {cluster.gpu.name} memory ({capacity / 2**30:.1f} GiB per "
        f"device) on {cluster.world_size} devices; {stats['considered']:,} layouts tried."
    ]
    for mem, short in misses:
        lines.append(
            f"  {short}: needs {mem / 2**30:.1f} GiB, short by {(mem - capacity) / 2**30:.1f} GiB"
        )
    state = facts.num_params * 18 / cluster.world_size  # bf16 + fp32 master + Adam, fully sharded
    lines.append(
        f"  the model state alone needs {state / 2**30:.1f} GiB per device when sharded over all "
        f"{cluster.world_size} devices; fix: more nodes, a smaller global batch per device, or a "
        "smaller model"
    )
    return "\n".join(lines)
