"""Predicted step time and memory of layouts, on a captured llama3-8b-wide step (2 blocks)."""

import pytest
from pricing import priced, priced_memory

from autopar.search.facts import build_step_facts
from cost import Cluster, Layout, LayoutError

H100_8 = Cluster("h100", nodes=1, gpus_per_node=8)


def test_model_state_memory_follows_the_zero_formulas(llama_step):
    _, model, _, step = llama_step
    facts = step.facts()
    psi = sum(p.numel() for p in model.parameters())
    for zero, (params, grads, opt) in {
        0: (2, 6, 12),  # bf16 weights; bf16 grads + fp32 accumulation; fp32 master + Adam m, v
        1: (2, 6, 12 / 8),
        2: (2, 6 / 8, 12 / 8),
        3: (2 / 8, 6 / 8, 12 / 8),
    }.items():
        mem = priced(facts, H100_8, Layout(dp=8, zero=zero, microbatch=1, grad_accum=2)).memory_breakdown
        assert mem["params"] == pytest.approx(params * psi, rel=1e-6)
        assert mem["grads"] == pytest.approx(grads * psi, rel=1e-6)
        assert mem["optimizer"] == pytest.approx(opt * psi, rel=1e-6)
        assert set(mem) == {"params", "grads", "optimizer", "activations", "buffers", "reserve",
                            "headroom"}


def test_activations_scale_with_microbatch_and_shrink_with_tp_sp_and_recompute(llama_step):
    facts = llama_step[3].facts()

    def act(**kw):
        base = dict(dp=8, microbatch=1, grad_accum=2)
        base.update(kw)
        return priced_memory(facts, H100_8, Layout(**base)).activations

    # (the rotary tables are the same for any batch: linear up to them)
    assert act(microbatch=2, grad_accum=1) == pytest.approx(2 * act(), rel=1e-2)
    sp = act(dp=1, tp=8, sp=True, microbatch=2, grad_accum=8)
    no_sp = act(dp=1, tp=8, microbatch=2, grad_accum=8)
    assert sp < no_sp < 2 * act()
    assert act(recompute="full") < act(recompute="selective") < act()


def test_fits_reports_the_memory_wall(llama_step):
    facts = llama_step[3].facts()
    small = priced(facts, H100_8, Layout(dp=8, zero=1, microbatch=1, grad_accum=2))
    assert small.fits and small.memory_per_device_bytes < H100_8.gpu.memory_bytes
    big = priced(facts.rebatch(64), Cluster("h100", nodes=1, gpus_per_node=1), Layout(microbatch=64))
    assert not big.fits and big.memory_per_device_bytes > H100_8.gpu.memory_bytes


def test_more_data_parallelism_shortens_the_step_and_tp_costs_communication(llama_step):
    facts = llama_step[3].facts()
    one = priced(facts, Cluster("h100", nodes=1, gpus_per_node=1), Layout(microbatch=1, grad_accum=16))
    eight = priced(facts, H100_8, Layout(dp=8, microbatch=1, grad_accum=2))
    assert eight.step_time_s < one.step_time_s / 4
    tp = priced(facts, H100_8, Layout(tp=8, sp=True, microbatch=1, grad_accum=16))
    assert tp.time_breakdown["tp_comm_s"] > 0
    assert tp.time_breakdown["dp_comm_total_s"] == 0


def test_pipeline_bubble_shrinks_with_more_microbatches(llama_step):
    facts = llama_step[3].facts()
    cluster = Cluster("h100", nodes=1, gpus_per_node=2)
    few = priced(facts, cluster, Layout(pp=2, microbatch=8, grad_accum=2))
    many = priced(facts, cluster, Layout(pp=2, microbatch=1, grad_accum=16))
    frac = lambda p: p.time_breakdown["pp_bubble_s"] / p.step_time_s  # noqa: E731
    assert frac(few) > frac(many) > 0


def test_rebatch_is_linear(llama_step):
    facts = llama_step[3].facts()
    a = priced(facts, H100_8, Layout(dp=8, microbatch=1, grad_accum=2))
    b = priced(facts.rebatch(32), H100_8, Layout(dp=8, microbatch=1, grad_accum=4))
    assert b.time_breakdown["compute_s"] == pytest.approx(2 * a.time_breakdown["compute_s"], rel=1e-6)
    assert b.memory_breakdown["activations"] == pytest.approx(a.memory_breakdown["activations"], rel=1e-3)


def test_fp8_speeds_up_matmuls_where_the_gpu_has_it(llama_step):
    facts = llama_step[3].facts()
    lay = Layout(dp=8, microbatch=2, grad_accum=1)
    bf16 = priced(facts, H100_8, lay)
    fp8 = priced(facts, H100_8, lay.replace(precision="fp8"))
    assert fp8.step_time_s < bf16.step_time_s
    with pytest.raises(LayoutError, match="FP8"):
        priced(facts, Cluster("a100", nodes=1, gpus_per_node=8), lay.replace(precision="fp8"))


def test_fused_kernels_move_fewer_bytes_than_eager(llama_step):
    _, _, _, step = llama_step

    eager = build_step_facts(step.graph, step.analysis, step.config, fused=False)
    lay = Layout(dp=8, microbatch=1, grad_accum=2)
    assert priced(step.facts(), H100_8, lay).step_time_s < priced(eager, H100_8, lay).step_time_s


@pytest.mark.parametrize(
    "layout, cluster, message",
    [
        (Layout(dp=4, microbatch=2, grad_accum=2), H100_8, "multiply to 8"),
        (Layout(dp=1, tp=8, microbatch=2, grad_accum=8), Cluster("h100", nodes=1, gpus_per_node=8), None),
        (Layout(dp=8, microbatch=3, grad_accum=1), H100_8, "batch of 16"),
        (Layout(dp=2, tp=3, microbatch=8, grad_accum=1), Cluster("h100", nodes=1, gpus_per_node=6), "attention heads"),
        (Layout(pp=4, microbatch=1, grad_accum=16), Cluster("h100", nodes=1, gpus_per_node=4), "repeated blocks"),
    ],
)
def test_bad_layouts_name_the_problem(llama_step, layout, cluster, message):
    facts = llama_step[3].facts()
    if message is None:
        priced(facts, cluster, layout)  # a valid layout: no error
        return
    with pytest.raises(LayoutError, match=message):
        priced(facts, cluster, layout)


def test_layout_validates_its_own_fields():
    with pytest.raises(LayoutError, match="ZeRO stage"):
        Layout(zero=4)
    Layout(pp=4, grad_accum=2)  # fewer micro-batches than stages: allowed (a large bubble)
    with pytest.raises(LayoutError, match="schedule"):
        Layout(schedule="gpipe-ish")


def test_cpu_ranks_expose_all_communication(llama_step):
    """CPU ranks hide nothing behind compute (gloo shares their cores): TP collectives cost what
    they take, and under SP the norms' gradient all-reduces and the parallel loss's three
    all-reduces (latency-bound) are priced as well."""
    from cost.step import axis_group, collective_time, tp_small_collectives

    facts = llama_step[3].facts()
    cpu = Cluster("cpu", nodes=1, gpus_per_node=4)
    lay = Layout(tp=4, sp=True, microbatch=facts.batch, precision="fp32")
    group = axis_group(cpu, 4, 1)
    small = tp_small_collectives(facts, cpu, lay, 1.0, facts.n_layers, group)
    replicated = [p for p, sharded in facts.param_tp_sharded.items() if not sharded]
    assert len(replicated) == 2 * facts.n_layers + 1  # two norms per block and the final one
    assert small.sum() > 3 * collective_time("all_reduce", 4.0 * facts.batch * facts.seq, group, cpu)
    no_sp = Layout(tp=4, microbatch=facts.batch, precision="fp32")
    assert tp_small_collectives(facts, cpu, no_sp, 1.0, facts.n_layers, group).sum() < small.sum()
    cpu_tp = priced(facts, cpu, lay).time_breakdown["tp_comm_s"]
    assert cpu_tp >= small.sum()


def test_keeping_the_sp_gathers_trades_a_gather_for_memory(llama_step):
    """TP+SP under recomputation: regathering the sequence in the backward (the default) or
    keeping the forward's gathered matmul inputs: no backward gather, the inputs held whole.
    On the fitted h100-efa profile a hidden gather still slows the matmul it hides behind."""
    _, _, _, step = llama_step
    facts = step.facts()
    efa = Cluster("h100-efa", nodes=1)
    common = dict(tp=4, dp=2, sp=True, microbatch=2, grad_accum=4, precision="bf16")
    redo = priced(facts, efa, Layout(**common, recompute="selective"))
    keep = priced(facts, efa, Layout(**common, recompute="selective", regather=False))
    assert keep.time_breakdown["recompute_s"] < redo.time_breakdown["recompute_s"]
    assert keep.step_time_s < redo.step_time_s
    # two gathered inputs per block (attention's and the MLP's) whole, bf16 [mb * seq, hidden]
    extra = keep.memory_breakdown["activations"] - redo.memory_breakdown["activations"]
    gathered = facts.n_layers * 2 * (2 * 1024 * 4096 * 2)
    assert extra == pytest.approx(gathered * efa.params.activation_fragmentation, rel=0.01)
    # nothing to keep without recomputation or without SP: the same layout
    assert Layout(**common, regather=False).regather and Layout(tp=4, dp=2, recompute="full",
                                                                regather=False).regather
    assert Layout(**common, recompute="full", regather=False).short() == \
        "dp2 tp4 sp keep-gathers mb2 ga4 rc-full"
    assert Layout.from_dict(Layout(**common, recompute="full", regather=False).to_dict()).regather is False


def test_zero3_keeping_the_gathered_weights_trades_a_gather_for_memory(llama_step):
    """ZeRO-3 without resharding after the forward: one all-gather of the weights per block and
    micro-batch instead of two, and the device's whole weights held from the forward to the
    backward (beside its shard)."""
    _, model, _, step = llama_step
    facts = step.facts()
    common = dict(dp=8, zero=3, microbatch=1, grad_accum=2, precision="bf16", recompute="none")
    reshard = priced(facts, H100_8, Layout(**common))
    kept = priced(facts, H100_8, Layout(**common, reshard=False))
    gathers = reshard.time_breakdown["dp_comm_total_s"] - kept.time_breakdown["dp_comm_total_s"]
    assert gathers > 0 and kept.step_time_s <= reshard.step_time_s
    weights = sum(p.numel() for p in model.parameters()) * 2  # bf16
    # the whole weights in place of the two blocks' worth ZeRO-3 gathers at a time
    assert kept.memory_breakdown["buffers"] >= weights > reshard.memory_breakdown["buffers"]
    assert kept.memory_breakdown["params"] == reshard.memory_breakdown["params"]  # the shard
    assert Layout(**common, reshard=False).short().startswith("dp8 zero3 no-reshard")
    assert Layout(dp=8, zero=1, reshard=False).reshard  # only ZeRO-3 drops gathered weights
    assert Layout.from_dict(Layout(**common, reshard=False).to_dict()).reshard is False


def test_zero_gathers_pay_the_copies_around_them():
    from cost.precision import recipe
    from cost.terms.data_parallel import dp_comm, gather_copy_s

    cluster = Cluster("h100", nodes=1)
    gpu = cluster.gpu
    # the shards concatenated (1/8 of the bytes) and the gathered rows copied out (all of them),
    # each read and written, at the memory bandwidth
    assert gather_copy_s(cluster, 1e9, 8) == pytest.approx(
        2 * (1 + 1 / 8) * 1e9 / (gpu.memory_bw * gpu.memory_efficiency))
    rec = recipe("bf16")
    for lay, copies in ((Layout(dp=8, zero=3, microbatch=1, grad_accum=4), 4 * 2),  # fwd + bwd
                        (Layout(dp=8, zero=1, microbatch=1, grad_accum=4), 1)):  # once per step
        args = (cluster, lay, rec, 1e9, 32, 0.1, 0.2, 0.0)
        exposed, total = dp_comm(*args)
        none_copied = dp_comm(*args, copied_params=0.0)
        half = dp_comm(*args, copied_params=5e8)
        one = gather_copy_s(cluster, 1e9 * rec.param_bytes, 8)
        # the copies are exposed (no overlap hides them) and scale with the weights copied
        assert exposed - none_copied[0] == pytest.approx(copies * one)
        assert total - none_copied[1] == pytest.approx(copies * one)
        assert exposed - half[0] == pytest.approx(copies * one / 2)


def test_a_pipelines_gradient_reduction_is_exposed_as_the_runtime_runs_it(llama_step):
    """autopar's pipelines reduce the gradients over dp after the schedule (runtime.pipeline):
    nothing hides that reduction. Measured runs of Megatron-LM overlap it with the last
    micro-batch's backward (`StepFacts.pipeline_reduce_hidden`), and so does a step without
    a pipeline (DDP's buckets)."""
    import dataclasses

    facts = llama_step[3].facts()
    cluster = Cluster("h100", nodes=1, gpus_per_node=8)
    piped = Layout(pp=2, dp=4, microbatch=1, grad_accum=4)
    ours = priced(facts, cluster, piped).time_breakdown
    assert ours["dp_comm_exposed_s"] == pytest.approx(ours["dp_comm_total_s"])
    megatron = priced(dataclasses.replace(facts, pipeline_reduce_hidden=True), cluster, piped).time_breakdown
    assert megatron["dp_comm_total_s"] == pytest.approx(ours["dp_comm_total_s"])
    assert megatron["dp_comm_exposed_s"] < 0.5 * ours["dp_comm_exposed_s"]
    flat = priced(facts, cluster, Layout(dp=8, microbatch=1, grad_accum=2)).time_breakdown
    assert flat["dp_comm_exposed_s"] < 0.9 * flat["dp_comm_total_s"]
