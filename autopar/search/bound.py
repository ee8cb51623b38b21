"""A proven lower bound on a layout's predicted step time, from its compute alone.

`cost.step.predict` prices a step as

    step = pipeline(t*, p2p) + loss_broadcast + dp_exposed + optimizer,
    t* = max_s host_bound(fwd_s + bwd_s + recompute_s + tp_s + cp_s + ep_s, host_s)

with every term >= 0, and pipeline(t, p2p) = (m + bubble slots) * (t + 2 v p2p) >= (m + bubble
slots) * t, growing with t. Since t* >= fwd_s + bwd_s for every stage s (host_bound takes the
larger of device and host time, or their sum), and floating-point addition and multiplication
by non-negative numbers are monotone,

    step >= LB = pipeline(max_s (fwd_s + bwd_s), 0)

computed with the same functions (`step_node_times`, `compute_per_stage`) as the price. On
CPU ranks that share cores the price scales the stages' compute by `shared_host_factor` of
the stages' times; LB takes that function's floor (the slowest stage's slots at the most
cores a rank can use, no bubble), which no stage times go below, so LB stays below the
price. A layout with LB >= the best step found so far cannot replace it (the solver
replaces only on a strictly smaller step), so it need not be priced.
LB costs one bincount over the graph's nodes: the node times are memoised per (tp, cp, sp,
micro-batch, precision), shared by every layout that differs only in ZeRO, schedule or
recompute, while memory and recompute choice are priced per layout.
"""

from __future__ import annotations

from autopar.search.choices import choose
from cost import Cluster, Layout
from cost.step import StepFacts
from cost.terms.compute import compute_per_stage, step_node_times
from cost.terms.pipeline_parallel import pipeline_time, shared_host_factor

# relative slack on the bound: a layout is skipped only when LB exceeds the best by more
# than rounding could account for
SLACK = 1e-9


def step_time_lower_bound(facts: StepFacts, cluster: Cluster, layout: Layout) -> float:
    """LB (module docstring): seconds no price of ``layout`` can go below."""
    lay = choose(facts, cluster, layout, through="chunks")
    times = step_node_times(facts, cluster, lay)
    fwd, bwd = compute_per_stage(facts, cluster, lay, times)
    shared = shared_host_factor(cluster, lay)
    busiest = float((fwd * shared + bwd * shared).max())
    return pipeline_time(busiest, 0.0, lay)[0]


def rules_out(facts: StepFacts, cluster: Cluster, layout: Layout, best_s: float | None) -> bool:
    """Whether ``layout`` cannot beat a best step of ``best_s`` on its bound: first the bound
    with the busiest stage taken as the average one (sum_s (fwd_s + bwd_s) / pp <= the
    busiest; no pipeline cut needed), then, under a pipeline, LB itself."""
    if best_s is None:
        return False
    lay = choose(facts, cluster, layout, through="fp8")
    total = float(step_node_times(facts, cluster, lay).sum()) * shared_host_factor(cluster, lay)
    if cannot_beat(pipeline_time(total / lay.pp, 0.0, lay)[0], best_s):
        return True
    return lay.pp > 1 and cannot_beat(step_time_lower_bound(facts, cluster, lay), best_s)


def cannot_beat(bound: float, best_s: float | None) -> bool:
    """Whether a layout whose step is at least ``bound`` cannot replace a best of ``best_s``
    (the solver replaces on step < best - 1e-12)."""
    return best_s is not None and bound * (1.0 - SLACK) >= best_s
