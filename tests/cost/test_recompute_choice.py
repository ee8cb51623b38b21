"""Partial recomputation priced as the pass runs it, and "auto" choosing it.

The cost model composes a partial choice (selective + some heavy groups) from one column per
group (`cost.terms.recompute.columns`); the composition must be what the recompute pass does
with that choice, read off the graph by the same rule the exact modes use
(`autopar.search.facts.recompute_marks`). "auto" must never be slower than none, selective or
full where they fit, and must fit a device where only some recomputation fits.
"""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pricing import priced
from torch import nn

import autopar
from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.search.facts import _fp8_roles, build_step_facts, recompute_marks
from cost.step import recompute_choice
from cost.terms.recompute import columns, rebuilt_peak
from passes.recompute import heavy_groups, values_to_recompute
from vocab.layout import LayoutError
from vocab.plan_types import PlanDecisions, RecomputeChoice


class _Block(nn.Module):
    """A plain-PyTorch residual block: attention-free, two matmul paths and a gate."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.a = nn.Linear(h, 2 * h)
        self.b = nn.Linear(h, 2 * h)
        self.out = nn.Linear(2 * h, h)

    def forward(self, x):
        y = self.norm(x)
        return x + self.out(nn.functional.silu(self.a(y)) * self.b(y))


class _Own(nn.Module):
    def __init__(self, h: int = 16, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(h) for _ in range(n))
        self.head = nn.Linear(h, 1)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


_CACHE: dict = {}


def _step(name: str):
    """(graph, analysis, facts, node -> group) of a small model, captured once."""
    if name not in _CACHE:
        if name == "own":
            import torch

            gen = torch.Generator().manual_seed(0)
            model, batch = _Own(), (torch.randn(2, 8, 16, generator=gen), torch.randn(2, 8, generator=gen))
        elif name.startswith("hf-"):
            import hf_tiny

            model, batch = hf_tiny.build(name[3:]), hf_tiny.batch(2, 16)
        else:
            model, batch = models.build(name), models.example_inputs(name, batch=2, seq=16)
        graph = capture(model, batch)
        analysis = analyze(graph)
        facts = build_step_facts(graph, analysis)
        layers = {n: i.layer for n, i in analysis.nodes.items()}
        weight_of = {n: w for n, (w, role) in _fp8_roles(graph)[0].items() if role == "forward"}
        groups = heavy_groups(graph.gm, layers, {n: i.module for n, i in analysis.nodes.items()}, weight_of)
        _CACHE[name] = (graph, analysis, facts, groups)
    return _CACHE[name]


MODELS = ("tiny-llama", "tiny-gpt2", "tiny-mixtral", "own", "hf-llama", "hf-gpt2")


@pytest.mark.parametrize("name", MODELS)
def test_groups_are_tied_across_blocks_and_full_is_selective_plus_all(name):
    graph, analysis, facts, groups = _step(name)
    layers = {n: i.layer for n, i in analysis.nodes.items()}
    assert facts.recompute_groups, "no heavy group found"
    n_blocks = facts.n_layers
    for key in facts.recompute_groups:  # one node per block
        assert sum(1 for g in groups.values() if g == key) == n_blocks, key
        assert "*" in key, key
    everything = values_to_recompute(graph.gm, layers, "selective", also=list(groups))
    assert everything == values_to_recompute(graph.gm, layers, "full")


@pytest.mark.parametrize("name", MODELS)
# 12 subsets of the heavy groups per model: each composes the columns and runs the pass's marking
@settings(derandomize=True, max_examples=12, deadline=None)
@given(data=st.data())
def test_partial_choice_composes_to_what_the_pass_runs(name, data):
    graph, analysis, facts, groups = _step(name)
    layers = {n: i.layer for n, i in analysis.nodes.items()}
    keys = facts.recompute_groups
    chosen = tuple(k for k, on in zip(keys, data.draw(st.lists(st.booleans(), min_size=len(keys),
                                                               max_size=len(keys)))) if on)
    also = [n for n, g in groups.items() if g in chosen]
    exact = recompute_marks(graph, analysis, {"c": values_to_recompute(graph.gm, layers, "selective", also=also)})["c"]
    cols = columns(facts, RecomputeChoice("selective", chosen))
    rows = set(facts.saved.name.tolist())
    assert exact.kept <= rows and set(exact.rebuilt) <= rows
    assert (np.array([n in exact.kept for n in facts.saved.name]) == cols.kept).all()
    assert (np.array([n in exact.copied for n in facts.nodes.name]) == cols.rerun).all()
    spans = np.array([exact.rebuilt.get(n, (-1, -1)) for n in facts.saved.name])
    peak, composed = (rebuilt_peak(facts.saved.bytes, s, facts.saved.layer) for s in (spans, cols.rebuilt))
    if "mixtral" in name:
        # experts accumulate into one buffer (index_add chains): a copy shared by two recomputed
        # experts lives longer than in either column alone; the composed spans are a lower bound
        assert composed <= peak * 1.0001
    else:
        assert composed == pytest.approx(peak, rel=0.15)


def _squeezed(cluster, memory_bytes: float):
    cluster.gpu = dataclasses.replace(cluster.gpu, memory_bytes=memory_bytes)
    return cluster


def test_named_groups_are_priced_between_selective_and_full_and_checked():
    _, _, facts, _ = _step("tiny-llama")
    cluster = autopar.Cluster("h100", nodes=1, gpus_per_node=1)
    group = "layers.*.mlp.up_proj.weight"
    layouts = {m: autopar.Layout(microbatch=2, precision="fp32", recompute=m)
               for m in ("selective", (group,), ("layers.1.mlp.up_proj.weight",), "full")}
    pred = {k: priced(facts, cluster, lay) for k, lay in layouts.items()}
    acts = [p.memory_breakdown["activations"] for p in pred.values()]
    assert acts[0] > acts[1] == acts[2] > acts[3]  # a block's weight name means its group
    rec = [p.time_breakdown["recompute_s"] for p in pred.values()]
    assert rec[0] < rec[1] < rec[3]
    assert recompute_choice(facts, cluster, layouts[(group,)]) == RecomputeChoice("selective", (group,))
    with pytest.raises(LayoutError, match="layers.*.mlp.gate_proj.weight"):
        priced(facts, cluster, autopar.Layout(microbatch=2, recompute=("layers.*.mlp.nope.weight",)))


def test_plan_shows_and_round_trips_the_choice():
    model, batch = models.build("tiny-llama"), models.example_inputs("tiny-llama", batch=2, seq=16)
    plan = autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=1),
                        layout=autopar.Layout(recompute=("layers.*.mlp.up_proj.weight",)))
    assert "recompute layers.*.mlp.up_proj.weight -> selective + the outputs of" in plan.summary()
    assert "element-wise forward values and the outputs of layers.*.mlp.up_proj.weight" in plan.recompute[0]
    again = autopar.Plan.from_json(plan.to_json())
    assert again.decisions.recompute_choice == plan.decisions.recompute_choice
    old = plan.decisions.to_dict()
    del old["recompute_choice"]  # a plan written before the choice was recorded
    old["layout"]["recompute"] = "full"
    assert PlanDecisions.from_dict(old).recompute_choice == RecomputeChoice("full")
