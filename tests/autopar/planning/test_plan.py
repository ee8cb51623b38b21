"""autopar.plan: manual layouts as plans, the solver, inspection and bad input."""

import dataclasses
import json

import pytest
import torch

import autopar
from autopar import models
from autopar.search.solver import NoFeasiblePlanError


def _model(name, layers=2, batch=16, seq=1024, **changes):
    cfg = dataclasses.replace(models.config(name), n_layers=layers, **changes)
    return models.build(cfg, device="meta"), models.example_inputs(cfg, batch=batch, seq=seq, device="meta")


@pytest.fixture(scope="module")
def llama():
    return _model("llama3-8b")


def test_manual_layout_plan_is_inspectable_and_round_trips(llama):
    model, inputs = llama
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=8)
    layout = autopar.Layout(dp=2, tp=4, zero=1, sp=True, microbatch=2, grad_accum=4)
    plan = autopar.plan(model, inputs, cluster=cluster, layout=layout)
    assert plan.layout == layout.resolve(16, "bf16")  # the precision derived: bf16 on GPUs
    pred = plan.predicted
    assert pred["step_time_s"] == pred.step_time_s > 0
    assert pred.tokens_per_s == pytest.approx(16 * 1024 / pred.step_time_s)
    assert 0 < pred.mfu < 1 and pred.fits
    assert sum(pred.memory_breakdown.values()) == pytest.approx(pred.memory_per_device_bytes)
    text = plan.summary()
    for needle in ("dp2 tp4 zero1 sp", "activations", "optimizer", "tensor parallel", "Shard(0)", "Shard(1)"):
        assert needle in text
    # ZeRO-1 keeps 1/dp of the rows of the TP shard on each data-parallel rank, as it runs
    assert plan.placements["layers.0.attn.o_proj.weight"] == {"dp": "Shard(0)", "tp": "Shard(1)"}
    assert "runs     with autopar.parallelize" in text
    # a decision the runtime cannot run yet is said, not left to parallelize to find
    zero3 = autopar.plan(model, inputs, cluster=cluster, layout=autopar.Layout(
        dp=4, pp=2, zero=3, microbatch=1, grad_accum=4))
    assert "not yet with autopar.parallelize: ZeRO-3 inside a pipeline" in zero3.summary()
    again = autopar.Plan.from_json(plan.to_json())
    assert again.layout == plan.layout and again.placements == plan.placements
    assert again.predicted.step_time_s == pytest.approx(pred.step_time_s)
    json.loads(plan.to_json())  # plain JSON


def test_explain_compares_term_by_term(llama):
    model, inputs = llama
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=8)
    plan = autopar.plan(model, inputs, cluster=cluster, layout=autopar.Layout(dp=8, zero=1, microbatch=2, grad_accum=1))
    text = plan.explain()
    assert "this plan" in text and "zero3" in text and "tp+sp" in text
    one = plan.explain("zero3")
    assert "dp8 zero3" in one
    with pytest.raises(autopar.InputError, match="no standard layout"):
        plan.explain("nonsense")


def test_solver_picks_data_parallelism_for_a_small_model_on_one_node():
    model, inputs = _model("playbook-1b", layers=4, batch=64, seq=4096)
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=1))
    assert plan.layout.tp == 1 and plan.layout.pp == 1 and plan.layout.dp == 8
    # never slower than the best hand-written layout of the grid
    manual = [p.step_time_s for _, p in plan.alternatives]
    assert manual and plan.predicted.step_time_s <= min(manual) * (1 + 1e-9)
    assert "best manual layouts" in plan.compare_manual()
    # the same inputs give the same plan
    again = autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=1))
    assert again.layout == plan.layout


def test_solver_keeps_tensor_parallelism_inside_a_node_and_shards_a_big_model():
    model, inputs = _model("llama3-70b", layers=8, batch=16, seq=4096)
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=2))
    assert plan.predicted.fits
    assert plan.layout.tp <= 8 and not plan.solve["cross_node_tp"]
    lay = plan.layout
    assert lay.zero == 3 or lay.tp > 1 or lay.pp > 1  # 9B parameters do not replicate on 80 GB


def test_too_small_a_cluster_reports_the_shortfall():
    model, inputs = _model("llama3-70b", layers=16, batch=8, seq=4096)
    with pytest.raises(NoFeasiblePlanError, match="short by"):
        autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=1))


def test_impossible_global_batch_is_a_clear_error():
    model, inputs = _model("llama3-8b", layers=2, batch=1, seq=4096)
    with pytest.raises(NoFeasiblePlanError, match="global batch of 1"):
        autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=64))


def test_plan_of_a_layout_that_does_not_match_the_cluster_is_an_error(llama):
    model, inputs = llama
    with pytest.raises(autopar.LayoutError, match="ranks but the cluster has 16"):
        autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=2),
                     layout=autopar.Layout(dp=8, microbatch=2, grad_accum=1))


def test_unknown_model_and_cluster_names_suggest_the_fix():
    with pytest.raises(KeyError, match="llama3-70b"):
        models.config("llama3-7b")
    with pytest.raises(ValueError, match="h100"):
        autopar.Cluster("h10", nodes=1)


def test_generic_model_with_a_loss_fn_plans():
    net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
    x, y = torch.randn(64, 256), torch.randint(0, 16, (64,))
    plan = autopar.plan(net, (x, y), cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=2),
                        loss_fn=torch.nn.functional.cross_entropy)
    assert plan.predicted.fits and plan.layout.world_size == 2


def test_the_summary_counts_alike_recompute_groups_of_a_block():
    """Eight experts' projections in a block are eight groups (``...up_proj.weight#k``): the
    plan's recompute line counts them rather than listing each."""
    from autopar.search.step import captured_step

    model = models.build("tiny-mixtral", device="meta")
    inputs = models.example_inputs("tiny-mixtral", batch=4, seq=32, device="meta")
    groups = captured_step(model, inputs, None, torch.float32).facts().recompute_groups
    experts = tuple(g for g in groups if ".experts." in g)
    assert len(experts) >= 8 and any("#" in g for g in experts)
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=2),
                        layout=autopar.Layout(dp=2, recompute=experts))
    line = next(x for x in plan.summary().splitlines() if "recompute" in x and "->" in x)
    assert "#" not in line and "per block)" in line, line
