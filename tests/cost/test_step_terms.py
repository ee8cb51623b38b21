"""`predict` as a sum of one term per technique (`cost.terms`): the terms add up to the step,
each technique's price moves the way its physics says, the predictions of a set of layouts stay
near their reference values, and pipelines with fewer micro-batches than stages."""

import dataclasses
import math

import pytest
import torch
from pricing import priced, priced_stages

from autopar import models
from autopar.search.step import captured_step
from cost import Cluster, Layout
from cost.cluster import Link
from cost.terms.pipeline_parallel import loss_broadcast

H100_8 = Cluster("h100", nodes=1, gpus_per_node=8)

# Reference (step_time_s, memory_per_device_bytes) to 4 digits, on the `llama_step` fixture
# (llama3-8b widths, 2 blocks, batch 16 x 1024) and a tiny-mixtral step (2 blocks, batch 8 x 64).
# STEP_REL protects these predictions from drifting unnoticed: a refactor of the step model
# leaves them where they are, and a change to its pricing that moves one by more than 2 % must
# update the reference knowingly (saying why in its commit). MEMORY_REL does the same for the
# memory accounting at 1 % (bytes are counted, not fitted, so they move only by intent).
STEP_REL = 0.02
MEMORY_REL = 0.01
LLAMA_LAYOUTS = {
    "dp8_zero1": (H100_8, Layout(dp=8, zero=1, microbatch=1, grad_accum=2), 0.05923, 17.50e9),
    "tp8_sp": (H100_8, Layout(tp=8, sp=True, microbatch=1, grad_accum=16), 0.08539, 5.447e9),
    "tp8_nosp": (H100_8, Layout(tp=8, microbatch=2, grad_accum=8), 0.06114, 5.793e9),
    "dp2_tp2_pp2_z3_sel": (H100_8, Layout(dp=2, tp=2, pp=2, zero=3, recompute="selective",
                                          microbatch=2, grad_accum=4), 0.06979, 7.597e9),
    "cp2_tp4_full": (H100_8, Layout(cp=2, tp=4, sp=True, recompute="full", microbatch=2,
                                    grad_accum=8), 0.06618, 9.448e9),
    "dp8_fp8_z2": (H100_8, Layout(dp=8, zero=2, precision="fp8", microbatch=2, grad_accum=1),
                   0.04599, 11.52e9),
    "cpu_tp4": (Cluster("cpu", nodes=1, gpus_per_node=4),
                Layout(tp=4, sp=True, microbatch=16, precision="fp32"), 196.0, 14.74e9),
    "2node_dp4_tp2_pp2_afab": (Cluster("h100", nodes=2, gpus_per_node=8),
                               Layout(dp=4, tp=2, pp=2, schedule="afab", microbatch=1,
                                      grad_accum=4), 0.06145, 10.85e9),
    "dp4_pp2_ga1": (H100_8, Layout(dp=4, pp=2, microbatch=4, grad_accum=1), 0.1035, 23.19e9),
}
MOE_LAYOUTS = {
    "dp4_ep4": (Layout(dp=4, ep=4, microbatch=1, grad_accum=2), 0.01121, 1.555e9),
    "dp2_ep2_tp2_sp": (Layout(dp=2, ep=2, tp=2, sp=True, microbatch=2, grad_accum=2),
                       0.01175, 1.554e9),
}
# The breakdown of one layout that has every term but CP, EP and a host's share (to 4 digits):
# each term within TERM_REL, so a price moved from one technique to another is noticed even
# where the step stays inside STEP_REL.
PIPELINE_BREAKDOWN = {
    "compute_s": 0.04598, "recompute_s": 0.001279, "tp_comm_s": 0.001216,
    "pp_bubble_s": 0.01227, "pp_p2p_s": 0.0006023, "dp_comm_exposed_s": 0.006581,
    "dp_comm_total_s": 0.02730, "optimizer_s": 0.001858,
}
ABSENT_TERMS = ("host_overhead_s", "cp_comm_exposed_s", "ep_comm_s")
TERM_REL = 0.05
# the terms that make up the step; dp_comm_total_s is the whole sync, hidden part included
STEP_TERMS = ("compute_s", "host_overhead_s", "recompute_s", "tp_comm_s", "cp_comm_exposed_s",
              "ep_comm_s", "pp_bubble_s", "pp_p2p_s", "dp_comm_exposed_s", "optimizer_s")


def _step(name, layers, batch, seq):
    cfg = dataclasses.replace(models.config(name), n_layers=layers)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=batch, seq=seq, device="meta")
    return captured_step(model, inputs, None, torch.bfloat16)


def _moe_facts():
    return _step("tiny-mixtral", 2, 8, 64).facts()


def _faster_links(cluster: Cluster, factor: float) -> Cluster:
    """``cluster`` with every link ``factor`` times the bandwidth and 1/``factor`` the latency."""
    quicker = {k: Link(bandwidth=link.bandwidth * factor, latency=link.latency / factor,
                       source=link.source) for k, link in (("intra", cluster.intra), ("inter", cluster.inter))}
    return Cluster(cluster.name, nodes=cluster.nodes, gpus_per_node=cluster.gpus_per_node, **quicker)


def _assert_terms_add_up(pred) -> None:
    """step = the sum of its terms; the exposed DP sync is part of the whole one."""
    got = pred.time_breakdown
    assert set(got) == set(STEP_TERMS) | {"dp_comm_total_s"}
    assert all(v >= -1e-12 * pred.step_time_s for v in got.values()), got  # rounding aside
    assert sum(got[k] for k in STEP_TERMS) == pytest.approx(pred.step_time_s, rel=1e-9)
    assert got["dp_comm_exposed_s"] <= got["dp_comm_total_s"] * (1 + 1e-9)


@pytest.mark.parametrize("case", sorted(LLAMA_LAYOUTS))
def test_terms_add_up_and_stay_near_the_reference(llama_step, case):
    cluster, layout, step_s, memory = LLAMA_LAYOUTS[case]
    pred = priced(llama_step[3].facts(), cluster, layout)
    _assert_terms_add_up(pred)
    assert pred.step_time_s == pytest.approx(step_s, rel=STEP_REL)
    assert pred.memory_per_device_bytes == pytest.approx(memory, rel=MEMORY_REL)


def test_pipeline_breakdown_stays_near_the_reference(llama_step):
    cluster, layout, _, _ = LLAMA_LAYOUTS["dp2_tp2_pp2_z3_sel"]
    got = priced(llama_step[3].facts(), cluster, layout).time_breakdown
    assert set(got) == set(PIPELINE_BREAKDOWN) | set(ABSENT_TERMS)
    for key in ABSENT_TERMS:  # no CP, no EP, a GPU cluster: nothing priced for them
        assert got[key] == 0.0, key
    for key, value in PIPELINE_BREAKDOWN.items():
        assert got[key] == pytest.approx(value, rel=TERM_REL), key


def test_expert_parallel_terms_add_up_and_stay_near_the_reference():
    facts = _moe_facts()
    cluster = Cluster("h100", nodes=1, gpus_per_node=4)
    for layout, step_s, memory in MOE_LAYOUTS.values():
        pred = priced(facts, cluster, layout)
        assert pred.time_breakdown["ep_comm_s"] > 0
        _assert_terms_add_up(pred)
        assert pred.step_time_s == pytest.approx(step_s, rel=STEP_REL)
        assert pred.memory_per_device_bytes == pytest.approx(memory, rel=MEMORY_REL)


def test_faster_links_never_predict_a_slower_step(llama_step):
    """Twice the bandwidth and half the latency on every link: the compute is priced the same,
    no communication term grows, and so the step is no slower (for every reference layout,
    one node or two, GPU or CPU)."""
    facts = llama_step[3].facts()
    comm = ("tp_comm_s", "cp_comm_exposed_s", "ep_comm_s", "pp_p2p_s", "dp_comm_exposed_s",
            "dp_comm_total_s")
    for case, (cluster, layout, _, _) in sorted(LLAMA_LAYOUTS.items()):
        slow, fast = (priced(facts, c, layout) for c in (cluster, _faster_links(cluster, 2.0)))
        assert fast.step_time_s <= slow.step_time_s * (1 + 1e-12), case
        assert fast.time_breakdown["compute_s"] == pytest.approx(slow.time_breakdown["compute_s"],
                                                                 rel=1e-12), case
        for key in comm:
            assert fast.time_breakdown[key] <= slow.time_breakdown[key] * (1 + 1e-12), (case, key)
        if any(slow.time_breakdown[k] > 0 for k in comm):  # and some communication got cheaper
            assert fast.step_time_s < slow.step_time_s, case


@pytest.mark.parametrize("sp", [False, True])
def test_more_tp_never_reduces_tp_communication(llama_step, sp):
    """Each device's share of a TP all-reduce (or reduce-scatter + all-gather) is 2(t-1)/t of
    the activation it syncs, and that activation does not shrink with t: the TP term grows with
    t, and is zero at t=1."""
    facts = llama_step[3].facts()
    comm = []
    for tp in (1, 2, 4, 8):
        dp = 8 // tp
        layout = Layout(dp=dp, tp=tp, sp=sp and tp > 1, microbatch=2, grad_accum=16 // (2 * dp))
        comm.append(priced(facts, H100_8, layout).time_breakdown["tp_comm_s"])
    assert comm[0] == 0.0
    assert comm == sorted(comm) and len(set(comm)) == len(comm), comm


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_a_higher_zero_stage_never_holds_more_memory(llama_step, recompute):
    """ZeRO-1 shards the optimizer state over dp, ZeRO-2 the gradients too, ZeRO-3 the
    weights too: each stage holds no more per device than the one before (dp=8)."""
    facts = llama_step[3].facts()
    mem = [priced(facts, H100_8, Layout(dp=8, zero=z, microbatch=1, grad_accum=2,
                                         recompute=recompute)).memory_per_device_bytes
           for z in range(4)]
    assert mem == sorted(mem, reverse=True) and len(set(mem)) == 4, mem


def test_rebatched_facts_keep_their_tables_aligned(llama_step):
    facts = llama_step[3].facts()
    big = facts.rebatch(32)
    assert len(big.nodes) == len(facts.nodes) and len(big.saved) == len(facts.saved)
    batch_dep = facts.nodes.batch_dep
    assert (big.nodes.flops[batch_dep] == 2 * facts.nodes.flops[batch_dep]).all()
    assert (big.nodes.flops[~batch_dep] == facts.nodes.flops[~batch_dep]).all()
    assert big.events.bytes.sum() == pytest.approx(2 * facts.events.bytes.sum())
    assert len(big.cache) == 0 and big.param_numel is facts.param_numel


def test_tables_refuse_columns_of_different_lengths(llama_step):
    nodes = llama_step[3].facts().nodes
    with pytest.raises(ValueError, match="different lengths"):
        dataclasses.replace(nodes, flops=nodes.flops[:-1])


@pytest.fixture(scope="module")
def deep_llama():
    """llama3-8b widths, 8 blocks (pp up to 8), batch 8 x 512."""
    return _step("llama3-8b", 8, 8, 512).facts()


def test_fewer_microbatches_than_stages_leave_a_large_bubble(deep_llama):
    """1F1B at pp=8: the bubble is (p-1)/m of the useful time, so with m=1 the pipeline runs
    p-1 idle slots for one useful one; each stage holds min(m, p) micro-batches."""
    one = priced(deep_llama, H100_8, Layout(pp=8, microbatch=8, grad_accum=1))
    eight = priced(deep_llama, H100_8, Layout(pp=8, microbatch=1, grad_accum=8))
    for pred in (one, eight):
        assert math.isfinite(pred.step_time_s) and pred.step_time_s > 0
    assert one.time_breakdown["pp_bubble_s"] > eight.time_breakdown["pp_bubble_s"]
    # total = (m + p - 1) slots, bubble = p - 1 of them (no DP here: the rest is the optimizer)
    for pred, m in ((one, 1), (eight, 8)):
        pipe = (pred.step_time_s - pred.time_breakdown["optimizer_s"]
                - loss_broadcast(H100_8, Layout(pp=8)))  # after the schedule
        assert pred.time_breakdown["pp_bubble_s"] / pipe == pytest.approx(7 / (m + 7), rel=1e-9)
    # stage s holds min(m, p - s) micro-batches: stages 1 and 2 (one identical block each)
    # hold the same with m=1, 7:6 with m=8
    one_mem = priced_stages(deep_llama, H100_8, Layout(pp=8, microbatch=8, grad_accum=1))
    eight_mem = priced_stages(deep_llama, H100_8, Layout(pp=8, microbatch=1, grad_accum=8))
    assert one_mem[1].activations == pytest.approx(one_mem[2].activations, rel=1e-9)
    assert eight_mem[1].activations / eight_mem[2].activations == pytest.approx(7 / 6, rel=1e-9)
    # and 8 sequences in flight on stage 1 either way (activations are linear in the batch)
    # (up to the rotary tables, the same for any batch)
    assert one_mem[1].activations == pytest.approx(8 / 7 * eight_mem[1].activations, rel=1e-2)
