"""The facts' cache (`cost.facts_cache.FactsCache`) and the all-stages-at-once recompute rules:
the same answers as pricing each stage alone, what a copy of the facts shares (nothing)."""

import dataclasses

from pricing import priced

from cost import Cluster, Layout


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
    first = priced(facts, cluster, lay)
    assert facts.cache.keys("times") and facts.cache.keys("recompute_choices")
    assert len(facts.rebatch(facts.batch * 2).cache) == 0
    facts.clear_cache()  # what depends on the cluster goes; the graph's own values stay
    assert not facts.cache.keys("times") and not facts.cache.keys("recompute_choices")
    assert facts.cache.keys("block_params") and facts.cache.keys("columns")
    assert priced(facts, cluster, lay).step_time_s == first.step_time_s
