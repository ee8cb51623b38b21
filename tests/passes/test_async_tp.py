"""Async TP (`passes.async_tp`) on TP+SP graphs traced in a fake 2-rank world: every forward
sequence gather that feeds matmuls is cut into chunks, each chunk's matmuls run before the next
chunk's wait (after the overlap pass: while it is in flight), and the graph computes what it
did (run on real tensors, the fake group answering a gather with the local value tiled, so a
chunk put back in the wrong place changes the outputs)."""

import copy

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from tp_graphs import local_args, plain_case, signature, zoo_case

from passes.async_tp import SP_GATHER, chunk_sequence_gathers
from passes.overlap import is_collective, is_wait, overlap_communication
from passes.recompute import is_backward
from passes.tensor_parallel import apply_tensor_parallel
from runtime.memory import peak_live_bytes
from runtime.mesh import fake_world
from vocab.plan_types import TensorParallelPlan

aten = torch.ops.aten


def _sp_graph(case, tp: int = 2):
    model, batch, graph, placements = case
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    return apply_tensor_parallel(graph.gm, signature(graph), [tuple(n.meta["val"].shape) for n in holders],
                                 TensorParallelPlan(placements, sequence_parallel=True), mesh).gm


def _forward_gathers(gm) -> list:
    return [n for n in gm.graph.nodes if is_collective(n) and not is_backward(n)
            and str(n.meta.get("autopar", "")).startswith(SP_GATHER)]


def _chunk_waits(gm) -> list:
    return [n for n in gm.graph.nodes if is_wait(n) and str(n.meta.get("autopar", "")).startswith("TP+SP, async TP")]


def _is_mm(node) -> bool:
    return node.op == "call_function" and node.target in (aten.mm.default, aten.addmm.default)


@pytest.mark.parametrize("name", ["tiny-llama", "plain", "tiny-gpt2"])
def test_sequence_gathers_are_chunked_and_compute_the_same(name):
    case = plain_case() if name == "plain" else zoo_case(name)
    model, batch, graph, _ = case
    with fake_world(2):
        before = _sp_graph(case)
        after = copy.deepcopy(before)
        gathers = _forward_gathers(before)
        report = chunk_sequence_gathers(after, 2)
        assert sorted(report.chunked) == sorted(g.name for g in gathers), report.left
        assert all(k == 2 and matmuls >= 1 for k, matmuls in report.chunked.values())
        # two gathers in place of each; the backward's collectives are untouched
        assert len([n for n in after.graph.nodes if is_collective(n)]) == \
            len([n for n in before.graph.nodes if is_collective(n)]) + len(gathers)
        overlap_communication(after)
        # every chunk's matmuls run before the next chunk's wait: after the first chunk, each
        # chunk's gather is in flight while the previous chunk's matmuls compute
        waits = _chunk_waits(after)
        assert len(waits) == 2 * len(gathers)
        order = {n: i for i, n in enumerate(after.graph.nodes)}
        for second in waits[1::2]:
            issue = second.args[0]
            between = [n for n in after.graph.nodes if order[issue] < order[n] < order[second]]
            assert any(_is_mm(n) for n in between), f"nothing computes while {issue} is gathered"
        args = local_args(graph, before, model, batch, 2)
        one, two = peak_live_bytes(before, *args), peak_live_bytes(after, *args)
    for x, y in zip(one.outputs, two.outputs, strict=True):
        assert (x is None and y is None) or torch.allclose(x, y, rtol=1e-6, atol=1e-7)


def test_a_sequence_that_does_not_split_is_left_whole():
    case = plain_case()  # 8 positions, 4 per rank: 3 chunks do not divide them, 2 do
    with fake_world(2):
        gm = _sp_graph(case)
        report = chunk_sequence_gathers(gm, 3)
    assert all(k == 2 for k, _ in report.chunked.values())
    assert chunk_sequence_gathers(copy.deepcopy(gm), 1).chunked == {}


def test_the_plan_chunks_where_it_hides_the_gathers():
    import autopar
    from autopar import models

    model = models.build("tiny-llama", seed=0)
    batch = models.example_inputs("tiny-llama", batch=4, seq=16)
    gpu = autopar.plan(model, batch, cluster=autopar.Cluster("h100", nodes=1, gpus_per_node=2),
                       layout=autopar.Layout(tp=2, sp=True))
    cpu = autopar.plan(model, batch, cluster=autopar.Cluster("cpu", nodes=1, gpus_per_node=2),
                       layout=autopar.Layout(tp=2, sp=True))
    assert gpu.decisions.comm.sp_gather_chunks == 2
    assert cpu.decisions.comm.sp_gather_chunks == 1
