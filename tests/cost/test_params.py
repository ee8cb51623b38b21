"""The cost model's free parameters: bounded, carried by the cluster, loaded from profiles, and
each one moves the prediction the way its docstring says."""

import json

import numpy as np
import pytest
from pricing import priced

from cost.cluster import H100_EFA_FIT, Cluster
from cost.comm import Group, bus_bandwidth, collective_time
from cost.params import PARAMETERS, CostParams
from cost.profile import CostProfile, coverage_notes, coverage_within, load_profile, save_profile
from cost.terms.compute import host_bound
from vocab.layout import Layout


def test_params_are_bounded_and_round_trip():
    with pytest.raises(ValueError, match="outside its bounds"):
        CostParams(framework_efficiency=1.2)
    with pytest.raises(ValueError, match="unknown cost parameters"):
        CostParams.from_dict({"speed": 2})
    p = CostParams(inter_bw_scale=0.5)
    assert CostParams.from_dict(p.to_dict()) == p
    for spec in PARAMETERS:  # every default inside its own bounds, with a named source
        assert spec.lower <= getattr(CostParams(), spec.name) <= spec.upper
        assert spec.default_source and spec.unit
        assert spec.prior is None or spec.lower <= spec.prior <= spec.upper


def test_the_shipped_h100_efa_profile_is_the_fit(tmp_path):
    profile = load_profile(H100_EFA_FIT)
    assert profile.base == "h100-efa" and profile.fit["runs"] > 1000
    assert Cluster("h100-efa", nodes=8).params == profile.params
    assert Cluster("h100", nodes=8).params == CostParams()  # parametric profiles: defaults
    assert set(profile.fit["coverage"]["zero"]) == {0, 1}
    assert json.loads(H100_EFA_FIT.read_text())["fit"]["sample"].startswith("in-sample")


def test_from_profile_and_its_errors(tmp_path):
    path = tmp_path / "p.json"
    save_profile(CostProfile("h100", CostParams(framework_efficiency=0.6),
                             {"coverage": {"zero": [0]}}), path)
    c = Cluster.from_profile(path, nodes=4)
    assert c.nodes == 4 and c.params.framework_efficiency == 0.6
    assert c.fit_coverage == {"zero": [0]}
    assert Cluster.from_dict(c.to_dict()).params == c.params
    with pytest.raises(FileNotFoundError, match="autopar calibrate"):
        Cluster.from_profile(tmp_path / "none.json")
    path.write_text('{"kind": "something else"}')
    with pytest.raises(ValueError, match="not an autopar cost profile"):
        Cluster.from_profile(path)


def test_coverage_notes_name_what_the_data_cannot_judge():
    cov = {"zero": [0, 1], "recompute": ["none"], "schedule": ["1f1b"]}
    notes = coverage_notes(Layout(dp=8, zero=3, recompute="full"), cov)
    assert len(notes) == 2 and "zero=3" in notes[0] and "recompute='full'" in notes[1]
    assert coverage_notes(Layout(dp=8, zero=1), cov) == []
    assert coverage_notes(Layout(dp=8, zero=3), None) == []
    # beyond the node counts the runs had
    cov["nodes"] = [1, 2, 64]
    assert coverage_notes(Layout(dp=8, zero=1), cov, nodes=128)[0].startswith(
        "the fitted profile was fitted on runs of 1-64 nodes, none on 128")
    assert coverage_notes(Layout(dp=8, zero=1), cov, nodes=8) == []


def test_a_layout_inside_the_fit_says_so_and_whether_its_model_was_measured():
    cov = {"zero": [0, 1], "recompute": ["none"], "cp": [1], "ep": [1], "precision": ["bf16"],
           "fp8": ["none"], "schedule": ["1f1b"], "nodes": [1, 64],
           "models": ["playbook-1b", "playbook-8b"]}
    lay = Layout(dp=8, zero=1, precision="bf16")
    within = coverage_within(lay, cov, "the h100-efa cost profile", nodes=8, model="playbook-8b")
    assert within == ("the h100-efa cost profile was fitted on measured runs of playbook-1b, "
                      "playbook-8b with zero=1, recompute='none', cp=1, ep=1, precision='bf16', "
                      "fp8='none' on 1-64 nodes: this layout lies inside them")
    other = coverage_within(lay, cov, "the h100-efa cost profile", nodes=8, model="llama3-70b")
    assert other.endswith("this layout lies inside them; llama3-70b was not among their models")
    assert coverage_within(Layout(dp=8, zero=3, precision="bf16"), cov) is None
    assert coverage_within(Layout(dp=8, zero=1, precision="bf16", fp8="all"), cov) is None
    assert coverage_within(lay, cov, nodes=128) is None
    assert coverage_within(lay, None) is None
    # a profile whose coverage lacks a field (fitted before it was recorded) cannot say
    assert coverage_within(lay, {k: v for k, v in cov.items() if k != "fp8"}) is None


def test_collective_params_move_step_collectives_not_nccl_tests():
    base = Cluster("h100", nodes=2)
    slow = Cluster("h100", nodes=2, params=CostParams(inter_bw_scale=0.5,
                                                      inter_collective_overhead_s=1e-3))
    group = Group(16, 8)
    t0 = collective_time("all_reduce", 2**28, group, base)
    t1 = collective_time("all_reduce", 2**28, group, slow)
    assert t1 > 1.9 * t0 - 1e-3 and t1 > t0 + 1e-3
    # nccl-tests' view of the links is the same: the parameters are what a training step sees
    assert bus_bandwidth("all_reduce", group, slow) == bus_bandwidth("all_reduce", group, base)


def test_each_time_parameter_moves_the_step(llama_step):
    facts = llama_step[3].facts()
    lay = Layout(dp=4, tp=2, pp=2, sp=True, zero=1, microbatch=2, grad_accum=2)
    base = priced(facts, Cluster("h100", nodes=2), lay)

    def step(**kw):
        return priced(facts, Cluster("h100", nodes=2, params=CostParams(**kw)), lay)

    assert step(framework_efficiency=0.5).time_breakdown["compute_s"] == pytest.approx(
        base.time_breakdown["compute_s"] * 0.85 / 0.5)
    # a GPU's host launches ahead of its kernels: 1 ms per block is hidden under the stage's
    # device time (~15 ms per micro-batch here), not added to it
    hidden = step(layer_overhead_s=1e-3)
    assert hidden.step_time_s == pytest.approx(base.step_time_s, rel=1e-9)
    assert hidden.time_breakdown["host_overhead_s"] == 0.0
    # two transfers per micro-batch of 1e-2 s per node of the 2-node cluster beyond the first
    assert step(p2p_node_overhead_s=1e-2).time_breakdown["pp_p2p_s"] == pytest.approx(
        base.time_breakdown["pp_p2p_s"] + 2 * 2 * 1e-2, rel=1e-6)
    assert step(tp_overlap=0.0).time_breakdown["tp_comm_s"] >= base.time_breakdown["tp_comm_s"]
    mem = step(memory_reserve_bytes=3e9, activation_fragmentation=1.5).memory_breakdown
    assert mem["reserve"] == 3e9
    assert mem["activations"] == pytest.approx(1.5 * base.memory_breakdown["activations"])


def test_a_launch_bound_step_pays_the_host_and_its_terms_add_up(llama_step):
    facts = llama_step[3].facts()
    lay = Layout(tp=8, sp=True, microbatch=1, grad_accum=16)
    base = priced(facts, Cluster("h100"), lay)
    bound = priced(facts, Cluster("h100", params=CostParams(layer_overhead_s=5e-3)), lay)
    host = bound.time_breakdown["host_overhead_s"]
    # 2 blocks x 5 ms of host per micro-batch outlast the tp8 device's work: the excess is paid
    assert host > 0.05 and bound.step_time_s == pytest.approx(base.step_time_s + host, rel=1e-9)
    summed = sum(v for k, v in bound.time_breakdown.items() if k != "dp_comm_total_s")
    assert summed == pytest.approx(bound.step_time_s, rel=1e-9)


def test_host_overhead_is_a_floor_on_gpus_and_adds_on_cpus():
    device, host = np.array([10e-3, 2e-3]), np.array([4e-3, 4e-3])
    # asynchronous launches: a micro-batch takes the longer of the host's and the device's work
    assert host_bound(Cluster("h100"), device, host).tolist() == [10e-3, 4e-3]
    # a CPU rank runs its kernels on the host: the two add
    assert host_bound(Cluster.local(ranks=1), device, host) == pytest.approx([14e-3, 6e-3])
