"""The search's choices (`autopar.search.choices`): FP8 "auto" where it pays, the choices the
cost model prices are the ones the plan carries, and the cost model refuses a layout whose
choices are not made."""

import pytest
from pricing import priced

import autopar
from autopar import models
from autopar.search.choices import choose, choose_fp8
from cost import Cluster, Layout, LayoutError
from cost.step import predict
from cost.terms.common import resolved
from cost.terms.compute import fp8_nodes
from vocab.choices import ChoicesMissingError
from vocab.plan_types import fp8_group

H100_8 = Cluster("h100", nodes=1, gpus_per_node=8)


def test_fp8_auto_keeps_fp8_only_where_it_pays(llama_step):
    # llama3-8b widths at tp=8 and one 1024-token sequence per micro-batch: the attention
    # projections' local shapes are too small for the casts to pay, the MLP's are not
    facts = llama_step[3].facts()
    lay = Layout(tp=8, sp=True, microbatch=1)
    times = {f: priced(facts, H100_8, lay.replace(fp8=f)).step_time_s for f in ("none", "all", "auto")}
    assert times["auto"] < min(times["none"], times["all"])
    chosen = choose_fp8(facts, H100_8, resolved(facts, H100_8, lay.replace(fp8="auto")))
    assert "layers.*.mlp.up_proj.weight" in chosen and "layers.*.attn.k_proj.weight" not in chosen
    # CPU ranks have no FP8 tensor cores: "auto" picks nothing there, "all" is priced as asked
    cpu = Cluster.local(ranks=8)
    assert choose_fp8(facts, cpu, resolved(facts, cpu, lay.replace(fp8="auto"))) == ()
    assert priced(facts, cpu, lay.replace(fp8="all")).step_time_s > priced(facts, cpu, lay).step_time_s
    with pytest.raises(LayoutError, match="no weight read by a matmul"):
        priced(facts, H100_8, lay.replace(fp8=("layers.*.nope.weight",)))


@pytest.mark.parametrize("layout, what", [
    (Layout(dp=4, pp=2, microbatch=1, grad_accum=4), "cut into 2 pipeline chunks"),
    (Layout(dp=8, microbatch=2, recompute="auto"), "recompute='auto'"),
    (Layout(tp=8, sp=True, microbatch=1, fp8="auto"), "fp8='auto'"),
])
def test_the_cost_model_refuses_a_layout_whose_choices_are_not_made(llama_step, layout, what):
    """cost/ prices, the search chooses: a bare layout with an open choice is an error that
    names the choice and the fix, never a price with a choice made behind the caller's back."""
    facts = llama_step[3].facts()
    with pytest.raises(ChoicesMissingError, match="autopar.search.choices.choose") as info:
        predict(facts, H100_8, layout)
    assert what in str(info.value)
    assert predict(facts, H100_8, choose(facts, H100_8, layout)).step_time_s > 0


def test_a_plan_carries_the_choices_its_price_read():
    """The stages, per-stage recompute and FP8 weights of a plan are the choices `choose`
    made for the layout, and the plan's price is `predict` of that chosen layout; a second
    call gives the same object (memoised), and the choices never reach the plan's JSON layout."""
    from meta_steps import llama_like

    model, step = llama_like(8, 2048, n_layers=8, hidden=1024, n_heads=8, n_kv_heads=8, ffn=3072,
                             vocab=4000)
    cluster = Cluster("h100", nodes=1, gpus_per_node=8)
    layout = Layout(dp=2, pp=4, microbatch=1, grad_accum=4, precision="bf16", recompute="auto",
                    fp8="auto")
    plan = autopar.plan(model, models.example_inputs(model.config, batch=8, seq=2048, device="meta"),
                        cluster=cluster, layout=layout)
    facts = step.facts()
    chosen = choose(facts, cluster, layout)
    assert chosen is choose(facts, cluster, layout)
    blocks = chosen.choices.chunks[1:-1]  # the slots before and after the blocks left out
    assert plan.stages == [(blocks.index(k), len(blocks) - 1 - blocks[::-1].index(k)) for k in range(4)]
    assert plan.decisions.stage_choices() == chosen.choices.recompute
    assert chosen.choices.fp8 and plan.fp8  # H100 FP8 pays for some matmuls at this width
    assert plan.fp8 == sorted(set(facts.nodes.fp8_weight[fp8_nodes(facts, cluster, chosen)].tolist()))
    assert {fp8_group(w) for w in plan.fp8} == set(chosen.choices.fp8)
    assert plan.predicted.step_time_s == pytest.approx(predict(facts, cluster, chosen).step_time_s, rel=1e-12)
    assert "choices" not in plan.decisions.to_dict()["layout"]
