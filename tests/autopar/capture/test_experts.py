"""A loop over alike experts is captured once as a grouped computation (autopar.capture.experts):
the same step as eager, the experts' work once per layer whatever E, and planning at 128 experts."""

from __future__ import annotations

import dataclasses
import re

import looped_moe
import numpy as np
import pytest
import torch

import autopar
from autopar import models
from autopar.capture.experts import MIN_EXPERTS
from autopar.capture.joint import capture

aten = torch.ops.aten


def _mixtral(experts: int):
    return dataclasses.replace(models.config("tiny-mixtral"), name=f"tiny-mixtral-{experts}", n_experts=experts)


def _grouped(graph) -> dict[str, int]:
    return {n.meta["expert_group"][0]: n.meta["expert_group"][1] for n in graph.gm.graph.nodes
            if "expert_group" in n.meta}


def _per_expert_nodes(graph) -> list[str]:
    return [n.name for n in graph.gm.graph.nodes if re.search(r"experts\.\d+", n.meta.get("module", ""))]


def _matmuls(graph, path: str) -> int:
    return sum(n.target in (aten.bmm.default, aten.mm.default) for n in graph.gm.graph.nodes
               if n.meta.get("module") == f"{path}.*")


def _same_as_eager(model, batch, loss_fn=None):
    graph = capture(model, batch, loss_fn=loss_fn)
    params = dict(model.named_parameters())
    loss, grads = graph.run(params, *batch)
    model.zero_grad()
    out = model(*batch[:-1]) if loss_fn else model(*batch)
    ref = loss_fn(out, batch[-1]) if loss_fn else out
    ref.backward()
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    assert grads.keys() == params.keys()
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6, msg=name)
    return graph


@pytest.mark.slow  # grouping itself: the 8- and 16-expert cases below
def test_128_experts_capture_once_and_plan():
    cfg = _mixtral(128)
    model = models.build(cfg, device="meta")
    inputs = models.example_inputs(cfg, batch=2, seq=16, device="meta")
    graph = capture(model, inputs)
    assert "once each as a grouped computation" in graph.capture_note
    paths = [f"layers.{i}.mlp.experts" for i in range(cfg.n_layers)]
    assert _grouped(graph) == dict.fromkeys(paths, 128)  # E recorded on each layer's group
    assert not _per_expert_nodes(graph)  # no expert traced on its own
    # the experts' work is one batched matmul per projection: 3 forward, 6 backward per layer
    assert [_matmuls(graph, p) for p in paths] == [9, 9]
    names = dict(model.named_parameters())
    assert set(graph.param_names) == set(names)
    assert graph.num_params == sum(p.numel() for p in names.values())
    plan = autopar.plan(model, inputs, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=8))
    assert plan.num_params == graph.num_params
    assert set(plan.placements) == set(names)


@pytest.mark.parametrize("experts", [8, 16])
def test_zoo_mixtral_step_equals_eager(experts):
    cfg = _mixtral(experts)
    graph = _same_as_eager(models.build(cfg, seed=3), models.example_inputs(cfg, batch=2, seq=16))
    if experts < MIN_EXPERTS:  # few experts: each traced, keeping its TP shards and FP8 casts
        assert not _grouped(graph) and _per_expert_nodes(graph)
    else:
        assert set(_grouped(graph).values()) == {experts} and not _per_expert_nodes(graph)


def test_plain_looped_moe_equals_eager_with_two_losses():
    model = looped_moe.build(16)
    ids, labels = looped_moe.batch()
    graph = _same_as_eager(model, (ids, labels))
    assert _grouped(graph) == {"layers.0.experts": 16, "layers.1.experts": 16}

    def mse(logits, target):  # a second loss, through loss_fn
        return (logits.softmax(-1) - torch.nn.functional.one_hot(target, logits.shape[-1])).pow(2).mean()

    graph = _same_as_eager(model, (ids, labels), loss_fn=mse)
    assert _grouped(graph) == {"layers.0.experts": 16, "layers.1.experts": 16}


def test_experts_that_differ_are_traced_one_by_one():
    model = looped_moe.build(MIN_EXPERTS, distinct=True)  # each expert its own width: not alike
    graph = _same_as_eager(model, looped_moe.batch())
    assert not _grouped(graph)
    assert _per_expert_nodes(graph)


class _Scaled(torch.nn.Module):
    """An expert that multiplies by a per-layer constant: lists alike in shapes, not in code."""

    def __init__(self, h: int, scale: float, private: float = 1.0) -> None:
        super().__init__()
        self.fc, self.scale, self._private = torch.nn.Linear(h, h), scale, private

    def forward(self, x):
        return self.fc(x) * self.scale * self._private


class _Layer(torch.nn.Module):
    def __init__(self, h: int, scale: float, privates=None) -> None:
        super().__init__()
        privates = privates or [1.0] * MIN_EXPERTS
        self.experts = torch.nn.ModuleList(_Scaled(h, scale, p) for p in privates)

    def forward(self, x):  # x [E, n, h]: expert e takes row e
        return torch.stack([e(r) for r, e in zip(x.unbind(0), self.experts)])


class _TwoLayers(torch.nn.Module):
    def __init__(self, privates=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_Layer(8, 1.0, privates), _Layer(8, 0.5, privates)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x).tanh()
        return x.pow(2).mean()


def test_lists_alike_in_shapes_run_their_own_code():
    # each layer's experts are grouped from their own trace, not from another layer's template
    graph = _same_as_eager(_TwoLayers(), (torch.randn(MIN_EXPERTS, 3, 8),))
    assert _grouped(graph) == {"layers.0.experts": MIN_EXPERTS, "layers.1.experts": MIN_EXPERTS}


def test_hooked_or_privately_different_experts_are_traced_one_by_one():
    x = (torch.randn(MIN_EXPERTS, 3, 8),)
    model = _TwoLayers()
    model.layers[0].experts[3].register_forward_hook(lambda m, i, o: o * 2)  # on one expert only
    graph = _same_as_eager(model, x)
    assert "layers.0.experts" not in _grouped(graph)
    privates = [1.0 + e / 10 for e in range(MIN_EXPERTS)]  # a private attribute per expert
    graph = _same_as_eager(_TwoLayers(privates), x)
    assert not _grouped(graph)


def test_a_stack_run_in_sequence_is_not_grouped():
    # the layers are alike modules in a ModuleList too, but each reads the previous one's result
    graph = capture(models.build("tiny-llama", device="meta"),
                    models.example_inputs("tiny-llama", batch=2, seq=8, device="meta"))
    assert not _grouped(graph) and "experts" not in graph.capture_note


def test_grouped_experts_cost_what_the_loop_costs():
    """The cost facts of the grouped capture and of the loop traced expert by expert agree:
    FLOPs, and the EP all-to-all volume of the tokens entering the experts (sent once); the
    grouped capture also counts the results leaving them, as the expert-parallel pass sends them."""
    from autopar.analysis.graph import analyze
    from autopar.search.facts import build_step_facts

    cfg = _mixtral(16)
    model = models.build(cfg, device="meta")
    inputs = models.example_inputs(cfg, batch=2, seq=16, device="meta")
    facts = []
    for group in (True, False):
        graph = capture(model, inputs, group_experts=group)
        assert bool(_grouped(graph)) == group
        analysis = analyze(graph)
        facts.append((analysis.forward_flops, build_step_facts(graph, analysis, cfg)))
    (flops, grouped), (loop_flops, loop) = facts
    assert flops == pytest.approx(loop_flops, rel=1e-9)
    # the tokens entering the experts, counted alike by the loop's accounting (which misses the
    # results leaving them, read through per-expert views); the grouped one counts both: the
    # stacked inputs and results, of one shape here
    assert loop.expert_io_bytes.sum() > 0
    assert np.all(grouped.expert_io_bytes == 2 * loop.expert_io_bytes)
