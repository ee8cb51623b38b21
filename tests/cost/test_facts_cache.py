"""The facts' cache (`cost.facts_cache.FactsCache`) and the all-stages-at-once recompute rules:
the same answers as pricing each stage alone, what a copy of the facts shares (nothing)."""

import dataclasses

import numpy as np
import pytest
from meta_steps import llama_like

from cost import Cluster, Layout
from cost.precision import recipe
from cost.step import _flight, _memory, predict, recompute_choices, stage_memory
from cost.terms.common import resolved
from cost.terms.compute import (
    compute_per_stage,
    node_stages,
    params_per_stage,
    stage_of,
    step_node_times,
)
from cost.terms.recompute import choose_auto, columns, local_saved_bytes, staged_activation_memory
from cost.terms.tensor_parallel import kept_sp_gathers
from vocab.plan_types import RecomputeChoice


@pytest.fixture(scope="module")
def deep_step():
    _, step = llama_like(16, 1024, n_layers=4, hidden=512, n_heads=8, n_kv_heads=8, ffn=1536,
                         vocab=4000)
    return step


def _stage_by_stage(facts, cluster, layout) -> tuple[RecomputeChoice, ...]:
    """"auto"'s choices with `choose_auto` called on each stage's rows alone (the rule the
    all-stages path must reproduce bit for bit)."""
    lay = resolved(facts, cluster, layout)
    none = (RecomputeChoice("none"),) * lay.pp
    fixed = [b.total - b.activations for b in _memory(facts, cluster, lay, recipe(lay.precision, lay.fp32_grad_accum),
                                                      params_per_stage(facts, cluster, lay), none, transient=False)]
    room = cluster.gpu.memory_bytes - np.array(fixed)
    times = step_node_times(facts, cluster, lay)
    fwd, bwd = compute_per_stage(facts, cluster, lay, times)
    local = local_saved_bytes(facts, cluster, lay)
    saved_stage = stage_of(facts, facts.saved.layer, cluster, lay)
    node_stage = node_stages(facts, cluster, lay)
    kept, transient = staged_activation_memory(facts, local, saved_stage, none)
    flight = np.array([_flight(lay, s) for s in range(lay.pp)])
    if np.all(kept * flight + transient <= room):
        return none
    largest = np.zeros(lay.pp)
    np.maximum.at(largest, saved_stage, local * columns(facts, none[0]).kept)
    room = room - 2.0 * (largest.max() - largest) - kept_sp_gathers(facts, cluster, lay, lay.pp) * flight
    return tuple(choose_auto(facts, local * (saved_stage == s), np.zeros_like(saved_stage), flight[s:s + 1],
                             room[s:s + 1], np.zeros_like(node_stage), times * (node_stage == s),
                             (fwd + bwd)[s:s + 1]) for s in range(lay.pp))


def test_all_stages_at_once_choose_as_stage_by_stage(deep_step):
    """Under memories from roomy to too small, every rule of "auto" (none, selective, the
    knapsack's groups, full) is taken, and each layout's choices equal `choose_auto`'s stage
    by stage; a second layout sharing the knapsack's cache (another ZeRO stage) too."""
    facts = deep_step.facts()
    roomy = Cluster("h100", nodes=1, gpus_per_node=4)
    seen = set()
    for pp, schedule in ((1, "1f1b"), (2, "1f1b"), (4, "1f1b"), (2, "zero-bubble")):
        base = dict(dp=4 // pp, pp=pp, microbatch=2, schedule=schedule, precision="bf16")
        need = max(b.total for b in stage_memory(facts, roomy, Layout(**base, recompute="none")))
        for share in np.linspace(0.45, 1.05, 13):
            tight = Cluster("h100", nodes=1, gpus_per_node=4,
                            gpu=dataclasses.replace(roomy.gpu, memory_bytes=share * need))
            for zero in (0, 1, 3):
                lay = Layout(**base, zero=zero, recompute="auto").resolve(facts.batch, "bf16")
                got = recompute_choices(facts, tight, lay)
                assert got == _stage_by_stage(facts, tight, lay), (pp, share, zero)
                seen |= {c.mode + ("+groups" if c.outputs else "") for c in got}
    assert seen == {"none", "selective", "selective+groups", "full"}, seen


def test_the_cache_builds_once_and_a_copy_starts_empty(llama_step):
    *_, step = llama_step
    facts = dataclasses.replace(step.facts())  # a copy: its own, empty cache
    assert len(facts.cache) == 0
    calls = []
    key = (999, 999)  # a degree no layout here asks for
    assert facts.cache.get("block_params", key, lambda: calls.append(1) or 7.0) == 7.0
    assert facts.cache.get("block_params", key, lambda: calls.append(1) or 8.0) == 7.0
    assert calls == [1] and facts.cache.keys("block_params") == [key]
    cluster = Cluster("h100", nodes=1, gpus_per_node=8)
    lay = Layout(dp=8, microbatch=2, precision="bf16", recompute="auto")
    first = predict(facts, cluster, lay)
    assert facts.cache.keys("times") and facts.cache.keys("recompute_choices")
    assert len(facts.rebatch(facts.batch * 2).cache) == 0
    facts.clear_cache()  # what depends on the cluster goes; the graph's own values stay
    assert not facts.cache.keys("times") and not facts.cache.keys("recompute_choices")
    assert facts.cache.keys("block_params") and facts.cache.keys("columns")
    assert predict(facts, cluster, lay).step_time_s == first.step_time_s
