"""The expert-parallel pass (passes/expert_parallel.py) on captured graphs, without ranks: where
it puts the all-to-alls, which experts' weights a rank reads, and its refusals. Parity on gloo
ranks is tests/runtime/test_expert_parallel_parity.py."""

import copy
import dataclasses

import pytest
import torch

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.execution.rewrite import captured_signature
from autopar.search.step import CapturedStep
from passes.expert_parallel import ExpertParallelError, apply_expert_parallel
from vocab.layout import Layout, unsupported_decisions
from vocab.plan_types import AxisGroup

A2A = torch.ops._c10d_functional.all_to_all_single.default


def _captured(name: str = "tiny-mixtral", layers: int = 2, experts: int = 4):
    cfg = dataclasses.replace(models.config(name), n_layers=layers, **({"n_experts": experts} if experts else {}))
    model = models.build(cfg, seed=0)
    return capture(model, models.example_inputs(cfg, batch=2, seq=16), min_experts=2)


def test_all_to_alls_and_local_weights():
    """Five layers (the capture repeats the middle block): every layer's list grouped on its own
    and rewritten with four all-to-alls (tokens, results, and their gradients), each named in
    meta["autopar"]; each rank's grouped computation reads its own experts' weights."""
    graph = _captured(layers=5)
    for rank in (0, 1):
        _check_rank(graph, copy.deepcopy(graph.gm), rank)
    # priced as sent: each block's stacked inputs and results ([4 experts, 2 x 10 slots, 64] fp32
    # each; `cost.terms.expert_parallel` doubles them for their gradients in the backward)
    facts = CapturedStep(graph, analyze(graph), None, fused=False).facts()
    assert list(facts.expert_io_bytes) == [0] + [2 * 4 * 20 * 64 * 4] * 5 + [0]
    assert facts.n_experts == 4  # counted from the graph (no config says so)


def _check_rank(graph, gm, rank: int) -> None:
    done = apply_expert_parallel(gm, AxisGroup("ep", 2, rank))
    assert sorted(done.paths) == [f"layers.{i}.mlp.experts" for i in range(5)]
    nodes = list(gm.graph.nodes)
    a2a = [n for n in nodes if n.target == A2A]
    assert len(a2a) == 4 * 5
    assert all(n.meta["autopar"].startswith("EP over 2 ranks") for n in a2a)
    # the grouped computation reads a stack of this rank's 2 experts' parameters, repeated over
    # the 2 ranks; the other 2 experts' parameters are no longer graph inputs
    stacks = [n for n in nodes if n.target == torch.ops.aten.stack.default and "EP over" in n.meta.get("autopar", "")]
    assert len(stacks) == 5 * 3 and all(len(n.args[0]) == 2 for n in stacks)
    assert all(list(u.args[1])[0] == 2 for n in stacks for u in n.users)
    holders = {n.name for n in nodes if n.op == "placeholder"}
    assert len(done.local) == len(done.dropped) == 5 * 3 * 2
    assert set(done.local) <= holders and not set(done.dropped) & holders
    name_of = {node: name for name, node in captured_signature(graph).placeholder_of("param").items()}
    expert = {name_of[node]: int(name_of[node].split(".experts.")[1].split(".")[0])
              for node in done.local + done.dropped}
    assert {e for n, e in expert.items() if n in {name_of[h] for h in done.local}} == {2 * rank, 2 * rank + 1}
    assert set(expert.values()) == {0, 1, 2, 3}
    # the dropped experts' gradients are no outputs: None in their places
    outs = next(n for n in nodes if n.op == "output").args[0]
    captured = next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]
    assert sum(o is None for o in outs) - sum(o is None for o in captured) == len(done.dropped)


def test_refusals():
    """E not divisible by ep, and a graph without grouped experts, are refused naming the fix."""
    graph = _captured()
    with pytest.raises(ExpertParallelError, match="4 experts, which do not split over ep=3"):
        apply_expert_parallel(graph.gm, AxisGroup("ep", 3, 0))
    dense = _captured("tiny-llama", experts=0)
    with pytest.raises(ExpertParallelError, match="ModuleList"):
        apply_expert_parallel(dense.gm, AxisGroup("ep", 2, 0))


def test_what_runs_under_ep():
    """ep runs with DP, ZeRO, TP, pipelines and FP8; with CP it is refused, naming the combination."""
    assert unsupported_decisions(Layout(dp=4, ep=2)) == []
    assert unsupported_decisions(Layout(dp=2, ep=2, zero=3)) == []
    assert unsupported_decisions(Layout(dp=2, ep=2, tp=2, sp=True, zero=1)) == []
    assert unsupported_decisions(Layout(dp=2, ep=2, pp=2, zero=1)) == []
    assert unsupported_decisions(Layout(dp=2, ep=2, fp8="all")) == []
    for extra, words in (({"cp": 2}, "context parallelism"), ({"pp": 2, "cp": 2}, "context parallelism")):
        (why,) = unsupported_decisions(Layout(dp=2, ep=2, **extra))
        assert "expert parallelism (ep=2) with" in why and words in why, why


def test_expert_meshes_of_a_pipeline_stay_in_the_stage():
    """Of a ("dp", "pp", "tp") mesh (dp4 pp2 tp2, rank (d, p, t) at 4d + 2p + t), the expert
    meshes are the rank's stage's: its ep group is ep consecutive dp ranks of its stage and TP
    index, its owners every ep-th of them; the stacked view puts "ep" first."""
    from runtime.mesh import expert_mesh, fake_world, init_mesh, stacked_expert_mesh

    with fake_world(16, rank=6):  # (d, p, t) = (1, 1, 0)
        mesh = init_mesh((4, 2, 2), ("dp", "pp", "tp"))
        by_ep = expert_mesh(mesh, 2)
        assert by_ep.mesh_dim_names == ("dp", "ep", "tp")
        assert by_ep["ep"].mesh.tolist() == [2, 6] and by_ep["dp"].mesh.tolist() == [6, 14]
        assert by_ep["dp", "tp"].mesh.tolist() == [[6, 7], [14, 15]]
        stacked = stacked_expert_mesh(mesh, 2)
        assert stacked.mesh_dim_names == ("ep", "dp", "tp")
        assert stacked.mesh.tolist() == by_ep.mesh.transpose(0, 1).tolist()


def test_local_experts_reduced_and_sharded_over_their_owners():
    """After the EP pass, the DP pass (dp 4, ep 2: the owners of a rank's experts are 2 ranks)
    reduces the local experts' gradients, and ZeRO gathers their weights, over the owners'
    group only, every other parameter over the dp group; an owners' group of one rank (ep = dp)
    gets no collective at all."""
    from passes.data_parallel import apply_data_parallel
    from vocab.plan_types import CommPlan, DataParallelPlan

    graph = _captured(layers=2)
    for owners in (2, 1):
        gm = copy.deepcopy(graph.gm)
        done = apply_expert_parallel(gm, AxisGroup("ep", 2, 1))
        signature = _without(captured_signature(graph), gm, done.dropped)
        name_of = {node: name for name, node in signature.placeholder_of("param").items()}
        experts = {name_of[node] for node in done.local}
        shapes = {n: s for n, s in graph.param_shapes.items() if n in name_of.values()}
        sharded = frozenset(n for n, s in shapes.items() if s[0] % 4 == 0)
        apply_data_parallel(gm, signature, shapes, DataParallelPlan(3, sharded, CommPlan()),
                            AxisGroup("dp", 4, 3), groups=dict.fromkeys(experts, AxisGroup("owners", owners, 1)))
        outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        for name, index in signature.grad_index.items():
            group = _first_collective(outs[index])
            want = ("owners" if owners > 1 else "ep") if name in experts else "dp"
            assert group == want, (name, group, want)
        gathers = {n.args[-1] for n in gm.graph.nodes
                   if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default}
        assert gathers == ({"dp", "owners"} if owners > 1 else {"dp"})


def _first_collective(value) -> str:
    """The group of the first collective (not a wait) met walking back from ``value``."""
    seen, todo = set(), [value]
    while todo:
        node = todo.pop(0)
        if node in seen:
            continue
        seen.add(node)
        if str(node.target).startswith("_c10d_functional.") and \
                node.target is not torch.ops._c10d_functional.wait_tensor.default:
            return node.args[-1]
        todo.extend(node.all_input_nodes)
    return ""


def _without(signature, gm, dropped):
    """``signature`` without the dropped placeholders and the gradients the graph no longer
    returns (as autopar.execution.rewrite does after the EP pass)."""
    from autopar.execution.rewrite import _signature

    gone = {name for (kind, name), node in zip(signature.inputs, signature.placeholders) if node in set(dropped)}
    inputs = [i for i, node in zip(signature.inputs, signature.placeholders) if node not in set(dropped)]
    outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    grads = {n: i for n, i in signature.grad_index.items() if n not in gone and outs[i] is not None}
    return _signature(gm, inputs, grads, signature.loss_index, signature.buffer_index)
