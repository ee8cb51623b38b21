"""Expert parallelism for experts stacked in one parameter (passes/expert_parallel_stacked.py) on
captured transformers graphs, without ranks: the dispatch and combine it adds, the rows each rank
stores, what the planner counts and prices, and its refusals. Parity on gloo ranks is
tests/runtime/test_expert_parallel_parity.py (the transformers cases)."""

import copy

import grouped_moe
import hf_tiny
import pytest
import torch
import torch.nn.functional as F

import autopar
from autopar.capture.joint import capture
from cost import Cluster
from passes.expert_parallel_stacked import StackedExpertError, apply_stacked_expert_parallel
from vocab.layout import Layout, LayoutError
from vocab.plan_types import AxisGroup

C10D = torch.ops._c10d_functional


@pytest.fixture(scope="module", params=["mixtral", "qwen2-moe"])
def graph(request):
    return capture(hf_tiny.build(request.param, layers=2), hf_tiny.batch(size=4))


@pytest.mark.parametrize("rank", [0, 1])
def test_dispatch_combine_and_local_rows(graph, rank):
    """Each MoE layer gathers its routed rows, their experts and (backward) their gradients, and
    reduce-scatters its results and its inputs' gradients, each collective named in
    meta["autopar"]; the stacked parameters (4 experts) become the rank's 2 rows, and so do
    their gradient outputs; the grouped matmuls read 2 experts' offsets."""
    gm = copy.deepcopy(graph.gm)
    done = apply_stacked_expert_parallel(gm, AxisGroup("ep", 2, rank))
    assert len(done.experts) == 2 * 2 and set(done.experts.values()) == {4}
    nodes = list(gm.graph.nodes)
    gathers = [n for n in nodes if n.target is C10D.all_gather_into_tensor.default]
    scatters = [n for n in nodes if n.target is C10D.reduce_scatter_tensor.default]
    assert len(gathers) == 3 * 2 and len(scatters) == 2 * 2
    assert all(n.meta["autopar"].startswith(f"EP over 2 ranks: experts {2 * rank}..{2 * rank + 1}")
               for n in gathers + scatters)
    holders = {n.name: n for n in nodes if n.op == "placeholder"}
    for name in done.experts:
        assert holders[name].meta["val"].shape[0] == 2
    grouped = [n for n in nodes if "grouped_mm_fallback" in str(n.target)]
    assert grouped and all(n.args[2].meta["val"].shape == (2,) for n in grouped)
    # every rank's gradient outputs: the local rows of its stacked parameters, whole otherwise
    outs = next(n for n in nodes if n.op == "output").args[0]
    captured = next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]
    shrunk = [(a.meta["val"].shape, b.meta["val"].shape) for a, b in zip(outs, captured)
              if a is not None and a.meta["val"].shape != b.meta["val"].shape]
    assert len(shrunk) == len(done.experts)
    assert all(a[0] * 2 == b[0] and a[1:] == b[1:] for a, b in shrunk)


def test_planned_and_priced():
    """The planner counts the stacked experts (4), stores 1/ep of their weights per rank, and
    prices the dispatch: ep=2 adds EP time and each rank holds fewer parameter bytes."""
    model = hf_tiny.build("mixtral", layers=2)
    batch = hf_tiny.batch(size=4)
    cluster = Cluster("h100", nodes=1, gpus_per_node=2)
    dense = autopar.plan(model, batch, cluster=cluster, layout=Layout(dp=2)).predicted
    ep = autopar.plan(model, batch, cluster=cluster, layout=Layout(dp=2, ep=2)).predicted
    assert ep.time_breakdown["ep_comm_s"] > 0 == dense.time_breakdown["ep_comm_s"]
    assert ep.memory_breakdown["params"] < dense.memory_breakdown["params"]
    # the experts' values hold the group's rows: more activation memory than without ep
    assert ep.memory_breakdown["activations"] > dense.memory_breakdown["activations"]
    with pytest.raises(LayoutError, match="has 4 experts"):
        autopar.plan(model, hf_tiny.batch(size=8), cluster=Cluster("h100", nodes=1, gpus_per_node=8),
                     layout=Layout(dp=8, ep=8))


def test_expert_nodes_priced_as_they_run():
    """Under ep the ops between the grouped matmuls run on the ep group's rows, and the grouped
    matmuls compute the busiest rank's share (`cost.routing.imbalance`): their FLOPs are the
    dense ones times that factor."""
    from autopar.search.step import captured_step
    from cost.routing import imbalance
    from cost.terms.compute import node_times

    facts = captured_step(hf_tiny.build("mixtral", layers=2), hf_tiny.batch(size=4), None, None).facts()
    n = facts.nodes
    assert n.routed.sum() == 2 * 4 and n.ep_rows.any() and not (n.routed & n.ep_rows).any()
    assert facts.expert_routed_rows == 4 * 16 * 2  # tokens x top-2
    cluster = Cluster("h100", nodes=1, gpus_per_node=4)
    one, four = (node_times(facts, cluster, Layout(dp=4, ep=ep)) for ep in (1, 4))
    assert (four[n.ep_rows] >= one[n.ep_rows]).all() and (four[n.ep_rows] > one[n.ep_rows]).any()
    assert (four[n.routed] >= one[n.routed]).all()
    assert imbalance(facts.expert_routed_rows / 4, 4) > 1.1  # 32 rows per rank: far from even


class _ReadsGate(grouped_moe.ExpertBlock):
    """The test file's top-1 grouped block whose output also reads the experts' gate values."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        x = self.norm(h).reshape(b * s, d)
        weight, expert = self.router(x).softmax(-1).max(-1)
        _, order = torch.sort(expert, stable=True)
        offs = torch.histc(expert.float(), bins=self.experts, min=0, max=self.experts - 1).cumsum(0)
        offs = offs.to(torch.int32)  # one offsets value: both matmuls are one grouped computation
        gate, up = torch._grouped_mm(x[order], self.w_in, offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_out, offs=offs)[order.argsort()]
        return h + (y * weight.unsqueeze(-1)).reshape(b, s, d) + gate.mean()


def test_refusals(graph):
    """E not divisible by the group, and an expert value read outside the experts (the rows a
    rank computes are not its own tokens'), are refused naming the fix; aten's bf16 form of the
    grouped matmuls (a plain-PyTorch top-1 MoE) is rewritten like transformers' fp32 one."""
    with pytest.raises(StackedExpertError, match="4 experts, which do not split over ep=3"):
        apply_stacked_expert_parallel(copy.deepcopy(graph.gm), AxisGroup("ep", 3, 0))
    model = grouped_moe.build().to(torch.bfloat16)
    done = apply_stacked_expert_parallel(capture(model, grouped_moe.batch(size=2)).gm, AxisGroup("ep", 2, 0))
    assert len(done.experts) == 2 * 2
    model.blocks[1] = _ReadsGate(32, 64, 4).to(torch.bfloat16)
    leaky = capture(model, grouped_moe.batch(size=2))
    with pytest.raises(StackedExpertError, match="read 2 gradients.*cannot be dispatched.*use ep=1"):
        apply_stacked_expert_parallel(leaky.gm, AxisGroup("ep", 2, 0))


def test_fp8_names_the_experts_it_keeps_high():
    """FP8 "all" runs no expert weight in FP8 where the experts are grouped matmuls (stacked in
    one parameter, or a list of experts under ep) and the plan names them (``fp8_expert_high``
    and its summary line); without ep a list's experts run in FP8 and none is named."""
    from autopar import models

    cluster = Cluster("h100", nodes=1, gpus_per_node=2)
    cfg = models.config("tiny-mixtral")
    zoo, batch = models.build(cfg, seed=0), models.example_inputs(cfg, batch=4, seq=16)
    for degrees, in_fp8 in (({"dp": 2}, True), ({"dp": 2, "ep": 2}, False)):
        plan = autopar.plan(zoo, batch, cluster=cluster, layout=Layout(**degrees, fp8="all"))
        experts = {n for n in plan.placements if ".experts." in n}
        assert bool(experts & set(plan.fp8)) == in_fp8
        assert set(plan.decisions.fp8_expert_high) == (set() if in_fp8 else experts)
        assert ("experts run as grouped matmuls" in plan.summary()) != in_fp8
    stacked = autopar.plan(hf_tiny.build("mixtral", layers=2), hf_tiny.batch(size=4), cluster=cluster,
                           layout=Layout(dp=2, fp8="all"))
    assert stacked.decisions.fp8_expert_high == sorted(
        n for n in stacked.placements if n.endswith(("gate_up_proj", "down_proj")))
    assert not set(stacked.decisions.fp8_expert_high) & set(stacked.fp8)
