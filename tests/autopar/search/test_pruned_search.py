"""The pruned search gives the un-pruned search's answer, its bound never exceeds a price, and
a global batch too small for the cluster is said with the batch that fills it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import autopar
from autopar import models
from autopar.search.batch import filling_batch, small_batch_note
from autopar.search.bound import rules_out, step_time_lower_bound
from autopar.search.choices import choose
from autopar.search.solver import candidate_layouts, search, solve
from autopar.search.step import captured_step
from cost import Cluster, LayoutError
from cost.step import check_layout, predict


def _step(name: str, batch: int, seq: int, **shape):
    """A zoo model's bf16 step on the meta device (``shape`` overrides its config)."""
    cfg = dataclasses.replace(models.config(name), **shape)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs(cfg, batch=batch, seq=seq, device="meta")
    return captured_step(model, inputs, None, torch.bfloat16)


# (zoo model, config overrides, batch, seq, cluster): dense and MoE, one node and several,
# a memory-tight device (a100-40gb) where recomputation and ZeRO-3 twins come into play
CASES = [
    ("llama3-8b", {"n_layers": 4}, 16, 512, Cluster("h100", nodes=2, gpus_per_node=4)),
    ("llama3-8b", {"n_layers": 4, "hidden": 2048, "vocab": 8192}, 8, 1024,
     Cluster("a100-40gb", nodes=1, gpus_per_node=8)),
    ("tiny-mixtral", {}, 8, 64, Cluster("h100", nodes=1, gpus_per_node=4)),
]


class _Block(nn.Module):
    """A plain-PyTorch residual block: a gated two-matmul path, no attention."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.a, self.b, self.out = nn.Linear(h, 4 * h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        y = self.norm(x)
        return x + self.out(nn.functional.silu(self.a(y)) * self.b(y))


class _Own(nn.Module):
    """A model of our own: a stack of `_Block` and a regression head under an MSE loss."""

    def __init__(self, h: int = 512, n: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block(h) for _ in range(n))
        self.head = nn.Linear(h, 1)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def _own_step(batch: int = 16, seq: int = 256, h: int = 512):
    model = _Own(h).to(device="meta", dtype=torch.bfloat16)
    inputs = (torch.empty(batch, seq, h, device="meta", dtype=torch.bfloat16),
              torch.empty(batch, seq, device="meta", dtype=torch.bfloat16))
    return captured_step(model, inputs, None, torch.bfloat16)


@pytest.mark.parametrize("name,shape,batch,seq,cluster",
                         [*CASES, ("own", {}, 16, 256, Cluster("h100", nodes=2, gpus_per_node=4))],
                         ids=["llama4L-2x4", "llama-tight-a100", "moe-1x4", "own-mse-2x4"])
def test_pruned_search_matches_the_reference(name, shape, batch, seq, cluster):
    step = _own_step(batch, seq) if name == "own" else _step(name, batch, seq, **shape)
    ref = search(step, cluster, prune=False)
    got = search(step, cluster)
    assert ref[0] is not None
    assert got[0] == ref[0]
    assert got[1].step_time_s == ref[1].step_time_s
    assert got[3]["considered"] == ref[3]["considered"]
    # every layout either priced or skipped by the bound, never both, never neither
    assert got[3]["fit"] <= ref[3]["fit"] and got[3]["pruned_by_bound"] > 0
    # the bound is below the price of every layout of the space (and it prunes)
    facts = step.facts()
    priced = 0
    layouts = list(candidate_layouts(facts, cluster, [1, 2]))
    assert any(lay.pp > 1 for lay in layouts)
    for layout in layouts[::max(1, len(layouts) // 60)]:  # spread over degrees and schedules
        try:
            check_layout(facts, cluster, layout)
        except LayoutError:
            continue
        bound = step_time_lower_bound(facts, cluster, layout)
        step_s = predict(facts, cluster, choose(facts, cluster, layout)).step_time_s
        assert 0 < bound <= step_s
        # a best the layout would beat is never ruled out; one it equals may be
        assert not rules_out(facts, cluster, layout, step_s * (1 + 1e-7))
        priced += 1
    assert priced > 20


def test_small_batch_is_said_with_the_batch_that_fills_the_cluster():
    cluster = Cluster("h100", nodes=4, gpus_per_node=2)
    assert filling_batch(cluster) == 4
    assert small_batch_note(4, 128, cluster) is None
    note = small_batch_note(2, 128, cluster, "dp1 tp2 pp4", 123.0)
    assert note and "2 sequences (256 tokens)" in note and "at least 4 sequences (512 tokens" in note
    assert "dp1 tp2 pp4 at 123 tok/s/GPU" in note
    # through the solver: a plan of 2 sequences on 4 nodes carries it, one of 4 does not
    for batch, said in ((2, True), (4, False)):
        sol = solve(_step("llama3-8b", batch, 256, n_layers=4), cluster, compare_manual=False)
        assert ("batch_note" in sol.stats) is said
        if said:
            assert "--global-batch-tokens 1024" in sol.stats["batch_note"]


def test_small_batch_note_reaches_the_plan():
    cluster = Cluster("h100", nodes=4, gpus_per_node=2)
    model = models.build("tiny-llama", device="meta", dtype=torch.bfloat16)
    inputs = models.example_inputs("tiny-llama", batch=2, seq=64, device="meta")
    result = autopar.plan(model, inputs, cluster=cluster, compare_manual=False)
    assert "too small for 8 devices" in result.solve["batch_note"]


def test_manual_grid_keeps_its_best_under_the_bound():
    """`best_of` skips layouts by the bound; each family's best is still the brute-force best."""
    from autopar.search.manual import FAMILIES, best_manual, family_layouts
    from cost.step import predict_memory

    name, shape, batch, seq, cluster = CASES[1]
    step = _step(name, batch, seq, **shape)
    got = best_manual(step, cluster)
    for family in FAMILIES:
        brute = None
        for layout in family_layouts(family, cluster, step.facts()):
            try:
                facts = step.facts_for(cluster, layout)
                check_layout(facts, cluster, layout)
            except LayoutError:
                continue
            chosen = choose(facts, cluster, layout)
            if predict_memory(facts, cluster, chosen, check=False).total > cluster.gpu.memory_bytes:
                continue
            pred = predict(facts, cluster, chosen)
            if brute is None or pred.step_time_s < brute[1].step_time_s:
                brute = (layout, pred)
        assert (got[family.name] is None) == (brute is None), family.name
        if brute is not None:
            assert got[family.name][0] == brute[0], family.name
