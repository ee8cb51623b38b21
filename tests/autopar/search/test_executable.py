"""What parallelize cannot run on a given model is said before anything runs: under context
parallelism in a pipeline, weights tied across stages (the rewrite would refuse them) are a
refusal of the plan, its summary says so, the solver planning for parallelize skips such
layouts, and a plan carrying it is refused by parallelize with the same words."""

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.execution.rewrite import UnsupportedLayoutError
from autopar.search.executable import refusals


class TiedLM(nn.Module):
    """Plain PyTorch: an embedding tied to the output head around 4 MLP blocks."""

    def __init__(self, vocab: int = 64, hidden: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU())
                                    for _ in range(blocks))
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _plan(model, batch, layout):
    return autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=4), layout=layout)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_weights_across_stages_are_refused_under_cp_in_a_pipeline(tied):
    with torch.device("meta"):  # Module.to("meta") would untie the head
        model = TiedLM().to(torch.bfloat16)
        if not tied:
            model.head.weight = nn.Parameter(torch.empty(64, 32, dtype=torch.bfloat16))
    assert (model.head.weight is model.embed.weight) == tied
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    plan = _plan(model, (ids, ids), autopar.Layout(dp=1, pp=2, cp=2, microbatch=1, grad_accum=8))
    runs = next(line for line in plan.summary().splitlines() if line.strip().startswith("runs"))
    if tied:
        assert any("embed.weight" in r and "tied" in r for r in plan.refused), plan.refused
        assert "not yet" in runs and "tied weights" in runs
        again = autopar.Plan.from_json(plan.to_json())
        assert again.refused == plan.refused
    else:
        assert plan.refused == [] and "runs     with autopar.parallelize" in runs


def test_the_zoo_gpt2_ties_its_head_and_only_cp_with_pp_refuses_it():
    model = models.build("tiny-gpt2", device="meta", dtype=torch.bfloat16)
    batch = models.example_inputs("tiny-gpt2", batch=8, seq=32, device="meta")
    plan = _plan(model, batch, autopar.Layout(dp=1, pp=2, cp=2, microbatch=1, grad_accum=8))
    step, cluster = plan._step, plan.cluster
    facts = step.facts_for(cluster, plan.layout)
    assert refusals(facts, cluster, plan.layout) == plan.refused != []
    for other in (autopar.Layout(dp=2, pp=2, microbatch=1, grad_accum=4),
                  autopar.Layout(dp=2, cp=2, microbatch=1, grad_accum=4)):
        assert refusals(facts, cluster, other.resolve(8, "bf16")) == []


def test_parallelize_refuses_such_a_plan_before_running(monkeypatch):
    import autopar.execution.parallelize as par

    model = TiedLM()
    ids = torch.zeros(8, 16, dtype=torch.long)
    plan = autopar.plan(model, (ids, ids), cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=4),
                        layout=autopar.Layout(dp=1, pp=2, cp=2, microbatch=1, grad_accum=8))
    assert plan.refused
    with pytest.raises(UnsupportedLayoutError, match="tied weights"):
        par._executable(plan.layout, "fp32", plan.refused)
