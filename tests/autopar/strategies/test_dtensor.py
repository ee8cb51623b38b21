"""The adapter over DTensor's sharding strategies, and the replicate fallback."""

import logging

import torch
from torch import nn

from autopar import capture, models
from autopar.analysis.graph import analyze
from autopar.strategies import dtensor
from autopar.strategies.dtensor import admits_sharding, dtensor_strategies
from autopar.strategies.tp_recipe import find_tp_recipe


def _graph(model, inputs):
    graph = capture(model, inputs)
    return graph, analyze(graph)


def test_dtensor_rules_are_read_for_matmuls_and_pointwise_ops():
    graph, _ = _graph(models.build("tiny-llama", device="meta"),
                      models.example_inputs("tiny-llama", batch=2, seq=8, device="meta"))
    mm = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.mm.default)
    rows = dtensor_strategies(mm)
    assert rows and any("Partial" in type(p).__name__ for row in rows for p in row)
    mul = next(n for n in graph.gm.graph.nodes if n.target == torch.ops.aten.mul.Tensor)
    assert admits_sharding(mul) is True


def test_zoo_models_need_no_fallback():
    for name in ("tiny-gpt2", "tiny-llama", "tiny-mixtral"):
        graph, analysis = _graph(models.build(name, device="meta"),
                                 models.example_inputs(name, batch=2, seq=8, device="meta"))
        assert find_tp_recipe(graph, analysis).fallback_ops == set()


class _Odd(nn.Module):
    """A column/row pair with an op no strategy knows between them."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        h = torch.logcumsumexp(self.up(x), dim=0)
        return self.down(h).sum()


def test_unknown_op_falls_back_to_replication_loudly(caplog, monkeypatch):
    monkeypatch.setattr(dtensor, "_warned", set())  # once per op and process: an earlier test may have warned
    graph, analysis = _graph(_Odd(), (torch.randn(4, 8),))
    with caplog.at_level(logging.WARNING, logger="autopar.strategies.dtensor"):
        recipe = find_tp_recipe(graph, analysis)
    # logcumsumexp is in neither DTensor's single-dimension registry nor our own rules
    assert any("logcumsumexp" in op for op in recipe.fallback_ops)
    assert any(e.always and e.kind == "gather" for e in recipe.events)
    assert any("no sharding strategy" in r.message and "logcumsumexp" in r.message for r in caplog.records)
