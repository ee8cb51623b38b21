"""The memory headroom the planner keeps (`CostParams.memory_headroom`): counted in every
"does it fit" on a GPU, never on CPU ranks, left out when measured runs are priced, used by
`bench playbook` to rank, and said by `plan.summary()`; the shipped h100-efa refit."""

import dataclasses
import json

import numpy as np
import pytest

import autopar
from autopar import models
from autopar.calibrate.runs import Priced, Run, RunPricer
from bench.playbook import cell_scores, planner_fits
from cost.cluster import H100_EFA_FIT, Cluster
from cost.memory import headroom_bytes
from cost.params import HEADROOM, POLICY_PARAMETERS, TIME_PARAMETERS, CostParams
from cost.profile import load_profile
from cost.step import predict
from vocab.layout import Layout


def test_the_headroom_is_a_bounded_policy_never_fitted():
    # the playbook's cluster keeps it; the datasheet profiles keep none
    assert 0.0 < HEADROOM == Cluster("h100-efa").params.memory_headroom < 0.3
    assert CostParams().memory_headroom == 0.0 == Cluster("h100").params.memory_headroom
    assert "memory_headroom" in POLICY_PARAMETERS and "memory_headroom" not in TIME_PARAMETERS
    with pytest.raises(ValueError, match="outside its bounds"):
        CostParams(memory_headroom=0.5)


def test_a_gpu_plan_keeps_the_headroom_and_cpu_ranks_none(llama_step):
    facts = llama_step[3].facts()
    lay = Layout(dp=8, zero=1, microbatch=1, grad_accum=2)
    kept = predict(facts, Cluster("h100", params=CostParams(memory_headroom=0.1)), lay)
    none = predict(facts, Cluster("h100", params=CostParams(memory_headroom=0.0)), lay)
    cap = kept.memory_capacity_bytes
    assert kept.memory_breakdown["headroom"] == pytest.approx(0.1 * cap)
    assert none.memory_breakdown["headroom"] == 0.0
    assert kept.memory_per_device_bytes - none.memory_per_device_bytes == pytest.approx(0.1 * cap)
    assert sum(kept.memory_breakdown.values()) == pytest.approx(kept.memory_per_device_bytes)
    # a layout whose peak lies inside the headroom does not fit the planner
    tight = Cluster("h100", params=CostParams(memory_headroom=0.3),
                    overrides={"memory_bytes": none.memory_per_device_bytes / 0.85})
    loose = Cluster("h100", params=CostParams(memory_headroom=0.0),
                    overrides={"memory_bytes": none.memory_per_device_bytes / 0.85})
    assert predict(facts, loose, lay).fits and not predict(facts, tight, lay).fits
    assert headroom_bytes(Cluster("cpu", params=CostParams(memory_headroom=0.2))) == 0.0


def test_measured_runs_are_priced_without_the_headroom():
    run = Run(1, "tiny-llama", 1, Layout(dp=8, zero=1, microbatch=1, grad_accum=1,
                                         precision="bf16"), 64, 100.0, 1.0)
    pricer = RunPricer("h100", progress=None)
    a = pricer.price([run], CostParams(memory_headroom=0.2))
    b = pricer.price([run], CostParams(memory_headroom=0.0))
    assert a.memory_bytes[0] == b.memory_bytes[0] and a.fits[0]
    # a run's first pricing (its facts built then) uses the parameters asked for, not the
    # profile's: the same figures as every later pricing
    slow = CostParams(framework_efficiency=0.5, memory_reserve_bytes=3e9)
    fresh = RunPricer("h100-efa", progress=None)  # a fitted profile: its parameters differ
    first, again = fresh.price([run], slow), fresh.price([run], slow)
    assert first.tps[0] == again.tps[0] and first.memory_bytes[0] == again.memory_bytes[0]


def test_the_playbook_ranking_keeps_the_headroom():
    lay = Layout(dp=8, zero=1, microbatch=1, grad_accum=4, precision="bf16")
    runs = [Run(i, "playbook-1b", 1, lay, 4096, tps, None) for i, tps in enumerate((30.0, 90.0))]
    # run 0 is predicted fastest at 97 % of memory (it crawled at the allocator's limit)
    priced = Priced(tps=np.array([120.0, 100.0]), memory_bytes=np.array([77.6e9, 50e9]),
                    capacity_bytes=np.array([80e9, 80e9]), valid=np.array([True, True]))
    raw = cell_scores(runs, priced.tps, priced.fits)
    keep = cell_scores(runs, priced.tps, priced.fits, planner_fits(priced, 0.05))
    assert raw["regret"] == pytest.approx(30 / 90) and keep["regret"] == 1.0
    assert raw["fit_recall"] == keep["fit_recall"] == 1.0  # the memory model is judged alone


def test_the_shipped_h100_efa_profile_is_a_fit_of_every_time_parameter():
    profile = load_profile(H100_EFA_FIT)
    fit = json.loads(H100_EFA_FIT.read_text())["fit"]
    assert "date" not in fit and fit["runs_file"] == "bench/data/playbook-runs-1b-8b.csv"
    # fitted since the attention rate and framework memory: every time parameter in the report
    assert set(TIME_PARAMETERS) <= set(fit["parameters"])
    assert profile.params.memory_headroom == HEADROOM  # a policy the refit keeps


def test_the_plan_summary_says_the_headroom_it_keeps_and_whose_parameters():
    cfg = dataclasses.replace(models.config("llama3-8b"), n_layers=2)
    model = models.build(cfg, device="meta")
    inputs = models.example_inputs(cfg, batch=16, seq=1024, device="meta")
    layout = autopar.Layout(dp=8, zero=1, microbatch=1, grad_accum=2)
    for name, words, share in (("h100", "default", 0.0), ("h100-efa", "fitted", HEADROOM)):
        plan = autopar.plan(model, inputs, cluster=autopar.Cluster(name, nodes=1), layout=layout)
        keep = plan.predicted.memory_breakdown["headroom"]
        assert keep == pytest.approx(share * plan.predicted.memory_capacity_bytes)
        line = next(x for x in plan.summary().splitlines() if x.startswith("headroom kept"))
        assert f"({share:.0%} of the device)" in line and f"the profile's {words}" in line
