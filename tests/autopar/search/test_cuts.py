"""Pipeline cuts (`autopar.search.cuts`, `choices.choose_chunks`): the balanced contiguous split is exact (equals brute force), keeps the even
split when the blocks are equal, and moves blocks off a heavy last stage."""

import dataclasses
import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from meta_steps import llama_like
from pricing import priced

from autopar.search.choices import choose
from autopar.search.cuts import balanced_cuts, fitting_cuts
from cost import Cluster, Layout
from cost.stages import StageMemory
from cost.step import predict
from cost.terms.compute import slot_memory, slot_stages
from vocab.choices import Choices


def _brute_force(cost, pp, before, after):
    n = len(cost)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        stages = [sum(cost[a:b]) for a, b in zip(bounds, bounds[1:])]
        stages[0] += before
        stages[-1] += after
        best = min(best, max(stages))
    return best


# 150 examples: the solver and its brute force take microseconds on up to 7 blocks
@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=7), st.data(),
       st.floats(0.0, 20.0), st.floats(0.0, 20.0))
def test_balanced_cuts_equal_brute_force(cost, data, before, after):
    pp = data.draw(st.integers(1, len(cost)))
    stages = balanced_cuts(np.array(cost), pp, before, after)
    assert list(stages) == sorted(stages) and set(stages) == set(range(pp))  # contiguous, none empty
    per = np.bincount(stages, weights=cost, minlength=pp)
    per[0] += before
    per[-1] += after
    assert per.max() <= _brute_force(cost, pp, before, after) * (1 + 1e-9)


def _brute_force_memory(cost, pp, before, after, memory):
    n = len(cost)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), pp - 1):
        stages = np.repeat(np.arange(pp), np.diff((0, *cuts, n)))
        if not memory.fits(stages, pp):
            continue
        per = np.bincount(stages, weights=cost, minlength=pp)
        per[0] += before
        per[-1] += after
        best = min(best, per.max())
    return best


@settings(derandomize=True, max_examples=150, deadline=None)
@given(st.lists(st.floats(0.1, 10.0), min_size=2, max_size=7), st.data(), st.floats(0.0, 5.0),
       st.floats(0.0, 20.0), st.floats(1.0, 40.0))
def test_cuts_under_memory_equal_brute_force(cost, data, before, after, budget):
    """Each stage: its blocks' state plus its micro-batches in flight (1F1B: pp - k) of their
    activations, within the budget; the heaviest stage as light as brute force finds."""
    n = len(cost)
    pp = data.draw(st.integers(2, n))
    act = np.array(data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n)))
    memory = StageMemory(static=np.full(n, 1.0), act=act, static_before=2.0, act_before=0.5,
                         static_after=2.0, act_after=1.0, flight=[pp - k for k in range(pp)], budget=budget)
    stages = balanced_cuts(np.array(cost), pp, before, after, memory)
    assert list(stages) == sorted(stages) and set(stages) == set(range(pp))
    best = _brute_force_memory(cost, pp, before, after, memory)
    if best == float("inf"):  # nothing fits: the cut that balances time
        assert list(stages) == list(balanced_cuts(np.array(cost), pp, before, after))
        assert fitting_cuts(np.array(cost), pp, before, after, memory) is None
        return
    assert list(fitting_cuts(np.array(cost), pp, before, after, memory)) == list(stages)
    assert memory.fits(stages, pp)
    per = np.bincount(stages, weights=cost, minlength=pp)
    per[0] += before
    per[-1] += after
    assert per.max() <= best * (1 + 1e-9)


def test_a_tight_device_moves_blocks_off_the_first_stage():
    """1F1B's first stage holds pp micro-batches of activations: where the cut that balances
    time does not fit there, the solver's cut gives the first stage fewer blocks and fits."""
    _, step = llama_like(16, 2048, n_layers=8, hidden=1024, n_heads=8, n_kv_heads=8, ffn=3072,
                         vocab=32000)
    facts = step.facts()
    lay = Layout(pp=4, microbatch=2, grad_accum=8, precision="bf16", recompute="none")
    roomy = Cluster("h100", nodes=1, gpus_per_node=4)
    balanced = slot_stages(facts, roomy, choose(facts, roomy, lay))[1:-1]
    memory = slot_memory(facts, roomy, lay)
    first = memory.stage_bytes(0, 0, int(np.bincount(balanced)[0]), 4)
    shared = roomy.gpu.memory_bytes - memory.budget  # reserve, buffers, transient
    assert first == max(memory.stage_bytes(k, *np.searchsorted(balanced, [k, k + 1]), 4) for k in range(4))
    tight = Cluster("h100", nodes=1, gpus_per_node=4,
                    gpu=dataclasses.replace(roomy.gpu, memory_bytes=shared + 0.95 * first))
    cut = slot_stages(facts, tight, choose(facts, tight, lay))[1:-1]
    assert not slot_memory(facts, tight, lay).fits(balanced, 4)  # time's cut overflows stage 0
    assert np.bincount(cut)[0] < np.bincount(balanced)[0] and len(cut) == 8
    assert priced(facts, tight, lay).fits


def test_equal_blocks_keep_the_even_split():
    assert list(balanced_cuts(np.ones(8), 4)) == [0, 0, 1, 1, 2, 2, 3, 3]
    heavy_head = balanced_cuts(np.ones(8), 4, after=3.0)
    assert np.bincount(heavy_head)[-1] == 1  # 3 + 1 on the last stage, 2 or 3 on the others


def test_a_heavy_head_gets_a_short_last_stage():
    """A large vocabulary: the head and loss weigh about two blocks, so the last stage holds
    fewer blocks than a middle one, and the step is shorter than the even split's (the cut
    weighs each block by its step seconds, kernel floors and memory-bound ops included)."""
    _, step = llama_like(8, 1024, n_layers=8, hidden=512, n_heads=8, n_kv_heads=8, ffn=1536,
                         vocab=131072)
    facts = step.facts()
    cluster = Cluster("h100", nodes=1, gpus_per_node=4)
    lay = Layout(pp=4, microbatch=1, grad_accum=8, precision="bf16")
    chosen = choose(facts, cluster, lay)
    stages = slot_stages(facts, cluster, chosen)
    blocks = np.bincount(stages[1:-1], minlength=4)
    assert blocks[-1] < blocks[1] and blocks.sum() == 8
    balanced = predict(facts, cluster, chosen)
    assert balanced.time_breakdown["compute_s"] > 0
    # the even split, priced as a layout that carries it
    even_cut = Choices(fp8=(), chunks=(0, 0, 0, 1, 1, 2, 2, 3, 3, 3), recompute=())
    even = predict(facts, cluster, chosen.with_choices(even_cut))
    assert balanced.step_time_s < even.step_time_s
