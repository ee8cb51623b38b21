"""Recompute "auto" (`autopar.search.recompute_choice`): the fastest choice that fits, per
pipeline stage; the all-stages-at-once rules give what each stage alone would choose."""

import dataclasses

import numpy as np
import pytest
from meta_steps import llama_like
from pricing import priced, priced_memory, priced_stages

import autopar
from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.search.choices import choose
from autopar.search.facts import build_step_facts
from autopar.search.recompute_choice import choose_auto
from cost import Cluster, Layout
from cost.step import fixed_bytes_per_stage, in_flight, recompute_choice, recompute_choices
from cost.terms.compute import compute_per_stage, node_stages, stage_of, step_node_times
from cost.terms.recompute import columns, local_saved_bytes, staged_activation_memory
from cost.terms.tensor_parallel import kept_sp_gathers
from vocab.plan_types import PlanDecisions, RecomputeChoice


@pytest.fixture(scope="module")
def deep_step():
    _, step = llama_like(16, 1024, n_layers=4, hidden=512, n_heads=8, n_kv_heads=8, ffn=1536,
                         vocab=4000)
    return step


def _stage_by_stage(facts, cluster, layout) -> tuple[RecomputeChoice, ...]:
    """"auto"'s choices with `choose_auto` called on each stage's rows alone (the rule the
    all-stages path must reproduce bit for bit)."""
    lay = choose(facts, cluster, layout, through="chunks")
    none = (RecomputeChoice("none"),) * lay.pp
    room = cluster.gpu.memory_bytes - fixed_bytes_per_stage(facts, cluster, lay)
    times = step_node_times(facts, cluster, lay)
    fwd, bwd = compute_per_stage(facts, cluster, lay, times)
    local = local_saved_bytes(facts, cluster, lay)
    saved_stage = stage_of(facts, facts.saved.layer, cluster, lay)
    node_stage = node_stages(facts, cluster, lay)
    kept, transient = staged_activation_memory(facts, local, saved_stage, none)
    flight = np.array([in_flight(lay, s) for s in range(lay.pp)])
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
        need = max(b.total for b in priced_stages(facts, roomy, Layout(**base, recompute="none")))
        for share in np.linspace(0.45, 1.05, 13):
            tight = Cluster("h100", nodes=1, gpus_per_node=4,
                            gpu=dataclasses.replace(roomy.gpu, memory_bytes=share * need))
            for zero in (0, 1, 3):
                lay = Layout(**base, zero=zero, recompute="auto").resolve(facts.batch, "bf16")
                got = recompute_choices(facts, tight, choose(facts, tight, lay))
                assert got == _stage_by_stage(facts, tight, lay), (pp, share, zero)
                seen |= {c.mode + ("+groups" if c.outputs else "") for c in got}
    assert seen == {"none", "selective", "selective+groups", "full"}, seen


def _squeezed(cluster, memory_bytes: float):
    cluster.gpu = dataclasses.replace(cluster.gpu, memory_bytes=memory_bytes)
    return cluster


def test_auto_is_the_fastest_choice_that_fits():
    cfg = dataclasses.replace(models.config("tiny-llama"), name="llama-4x256", n_layers=4, hidden=256,
                              n_heads=8, n_kv_heads=4, ffn=768, vocab=512, max_seq=256)
    graph = capture(models.build(cfg, device="meta"), models.example_inputs(cfg, batch=8, seq=256, device="meta"))
    facts = build_step_facts(graph, analyze(graph), cfg)
    base = dict(dp=1, microbatch=8, precision="fp32")
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=1)
    mem = {m: priced_memory(facts, cluster, autopar.Layout(**base, recompute=m)).total
           for m in ("none", "selective", "full")}
    assert mem["full"] < mem["selective"] < mem["none"]
    for room, expect in ((mem["none"] * 1.01, "none"), ((mem["none"] + mem["selective"]) / 2, "selective"),
                         ((mem["selective"] + mem["full"]) / 2, "partial"), (mem["full"] * 0.99, "full")):
        squeezed = _squeezed(autopar.Cluster("h100", nodes=1, gpus_per_node=1), room)
        times = {m: priced(facts, squeezed, autopar.Layout(**base, recompute=m))
                 for m in ("none", "selective", "full", "auto")}
        choice = recompute_choice(facts, squeezed, choose(facts, squeezed, autopar.Layout(**base, recompute="auto")))
        kind = "partial" if choice.mode == "selective" and choice.outputs else choice.mode
        assert kind == expect, (room, choice)
        fitting = [times[m].step_time_s for m in ("none", "selective", "full") if times[m].fits]
        if fitting:  # never slower than a manual mode that fits, and it fits itself
            assert times["auto"].fits
            assert times["auto"].step_time_s <= min(fitting) + 1e-12
        if kind == "partial":  # strictly faster than full, the only manual mode that fits
            assert fitting == [times["full"].step_time_s]
            assert times["auto"].step_time_s < times["full"].step_time_s


def test_pipeline_stages_choose_apart():
    """1F1B's first stage holds pp micro-batches of activations, the last one: on a device
    squeezed below the first stage's need, "auto" recomputes there and keeps everything on the
    later stages, a shorter step than any one choice for all stages that fits; the plan lists
    each stage's choice and its JSON keeps them."""
    from meta_steps import llama_like

    from cost import Cluster, Layout
    from cost.step import recompute_choices

    model, step = llama_like(16, 2048, n_layers=8, hidden=1024, n_heads=8, n_kv_heads=8, ffn=3072,
                             vocab=4000)
    facts = step.facts()
    roomy = Cluster("h100", nodes=1, gpus_per_node=8)
    base = dict(pp=8, microbatch=2, grad_accum=8, precision="bf16")  # one block a stage: no cut helps
    need = [b.total for b in priced_stages(facts, roomy, Layout(**base, recompute="none"))]
    assert need[0] == max(need)
    tight = Cluster("h100", nodes=1, gpus_per_node=8,
                    gpu=dataclasses.replace(roomy.gpu, memory_bytes=0.9 * need[0]))
    auto = Layout(**base, recompute="auto")
    choices = recompute_choices(facts, tight, choose(facts, tight, auto))
    assert choices[0].mode != "none" and choices[-1].mode == "none"
    staged = priced(facts, tight, auto)
    assert staged.fits
    uniform = [Layout(**base, recompute=c.outputs if c.outputs else c.mode) for c in set(choices)]
    uniform += [Layout(**base, recompute=m) for m in ("selective", "full")]
    fitting = [priced(facts, tight, lay) for lay in uniform if priced(facts, tight, lay).fits]
    assert fitting and staged.step_time_s < min(p.step_time_s for p in fitting)
    plan = autopar.plan(model, models.example_inputs(model.config, batch=16, seq=2048, device="meta"),
                        cluster=tight, layout=auto)
    assert plan.decisions.recompute_per_stage == choices
    assert "stage 0: selective" in plan.summary() and "stage 7: none" in plan.summary()
    again = PlanDecisions.from_dict(plan.decisions.to_dict())
    assert again.recompute_per_stage == choices and again.stage_recompute(7).mode == "none"
