"""The overlap pass on TP graphs traced in a fake 2-rank world: the backward's weight-gradient
matmuls run between an input gradient's reduction and its wait, the collectives keep their order,
values and peak memory do not change (run on real tensors, the fake group answering the
collectives with the local values)."""

import copy

import pytest
import torch
from torch import fx, nn
from torch.distributed.device_mesh import init_device_mesh
from tp_graphs import local_args, plain_case, signature, zoo_case

from autopar import models
from passes.overlap import is_collective, is_wait, overlap_communication
from passes.tensor_parallel import apply_tensor_parallel
from runtime.memory import peak_live_bytes
from runtime.mesh import fake_world
from vocab.plan_types import TensorParallelPlan

aten = torch.ops.aten


def _traced(case, sp: bool, tp: int = 2):
    """The rank's TP graph before and after the overlap pass, and both runs' memory profiles."""
    model, batch, graph, placements = case
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    with fake_world(tp):
        mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
        traced = apply_tensor_parallel(graph.gm, signature(graph), [tuple(n.meta["val"].shape) for n in holders],
                                       TensorParallelPlan(placements, sequence_parallel=sp), mesh)
        before = copy.deepcopy(traced.gm)
        after = traced.gm
        report = overlap_communication(after)
        args = local_args(graph, before, model, batch, tp)
        profiles = (peak_live_bytes(before, *args), peak_live_bytes(after, *args))
    return before, after, report, profiles


def _collectives(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """(group, op) of every collective issue, in graph order."""
    return [(str(n.args[-1]), n.target.__name__) for n in gm.graph.nodes if is_collective(n)]


def _bytes(node: fx.Node) -> int:
    val = node.meta["val"]
    return val.numel() * val.element_size()


def _between(c: fx.Node) -> list[fx.Node]:
    wait = next(u for u in c.users if is_wait(u))
    nodes, n = [], c.next
    while n is not wait:
        nodes.append(n)
        n = n.next
    return nodes


def _is_mm(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (aten.mm.default, aten.bmm.default)


def _check(before: fx.GraphModule, after: fx.GraphModule, report, profiles, min_overlapped: int) -> None:
    assert _collectives(after) == _collectives(before)  # same collectives, same order per group
    assert sorted(n.name for n in after.graph.nodes) == sorted(n.name for n in before.graph.nodes)
    first, second = profiles
    for x, y in zip(first.outputs, second.outputs, strict=True):
        assert (x is None and y is None) or torch.equal(x, y)  # the same ops on the same inputs
    # the reorder moves waits and a collective's producers only: the peak grows by at most one
    # collective's result, in flight while the independent compute runs
    assert second.peak_bytes <= first.peak_bytes + max(_bytes(c) for c in after.graph.nodes if is_collective(c))
    reductions = [n for n in after.graph.nodes if is_collective(n) and n.meta.get("partitioner_tag") == "is_backward"
                  and n.target.__name__.split(".")[0] in ("reduce_scatter_tensor", "all_reduce")]
    hidden = [c for c in reductions if any(_is_mm(n) for n in _between(c))]
    assert len(hidden) >= min_overlapped
    for c in hidden:
        wait = next(u for u in c.users if is_wait(u))
        assert report.overlapped[c.name] == wait.meta["overlap_ops"] > 0
        assert wait.meta["autopar"].endswith(f"overlapped with {wait.meta['overlap_ops']} ops")
    # before the pass, no collective had a matmul in flight
    assert not any(_is_mm(n) for c in before.graph.nodes if is_collective(c) for n in _between(c))


@pytest.mark.parametrize("sp", [True, False])
def test_tiny_llama_weight_gradients_run_while_input_gradients_reduce(sp):
    case = zoo_case("tiny-llama")
    before, after, report, profiles = _traced(case, sp)
    blocks = models.config("tiny-llama").n_layers
    # each block's backward: the MLP's and attention's input-gradient reductions, and the head's
    _check(before, after, report, profiles, min_overlapped=2 * blocks + (1 if sp else 0))


def test_plain_gated_mlp_two_losses():
    before, after, report, profiles = _traced(plain_case(), sp=False)
    _check(before, after, report, profiles, min_overlapped=2)  # one per block's gate/up reduction


def _hand_graph(random_between: bool) -> fx.GraphModule:
    """a = x @ x (independent), [r = rand_like(x)], b = 2x, all-reduce(b) on group "0", then
    all-reduce(a) on group "1"; out = wait(b) + wait(a) [+ r]."""
    c10d = torch.ops._c10d_functional
    g = fx.Graph()

    def op(target, args, name):
        return g.create_node("call_function", target, args, name=name)

    x = g.placeholder("x")
    a = op(aten.mm.default, (x, x), "mm")
    r = op(aten.rand_like.default, (x,), "rand_like") if random_between else None
    b = op(aten.mul.Tensor, (x, 2.0), "mul")
    cb = op(c10d.all_reduce.default, (b, "sum", "0"), "all_reduce")
    wb = op(c10d.wait_tensor.default, (cb,), "wait_tensor")
    ca = op(c10d.all_reduce.default, (a, "sum", "1"), "all_reduce_1")
    wa = op(c10d.wait_tensor.default, (ca,), "wait_tensor_1")
    out = op(aten.add.Tensor, (wb, wa), "add")
    if r is not None:
        out = op(aten.add.Tensor, (out, r), "add_1")
    g.output(out)
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("random_between", [False, True])
def test_issue_early_wait_late_and_barriers(random_between):
    gm = _hand_graph(random_between)
    report = overlap_communication(gm)
    order = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    if random_between:  # the draw stays before everything after it: nothing moves over it
        assert order[:4] == ["mm", "rand_like", "mul", "all_reduce"]
    else:  # the independent matmul runs while b is reduced
        assert order[:4] == ["mul", "all_reduce", "mm", "all_reduce_1"]
        assert report.overlapped["all_reduce"] == 1
    # the collectives keep their order (group "0" then "1"); both waits sit at their first use
    assert [n for n in order if n.startswith("all_reduce")] == ["all_reduce", "all_reduce_1"]
    assert order.index("wait_tensor") > order.index("all_reduce_1")


def test_parallelize_runs_it_under_tp_unless_switched_off(monkeypatch):
    from types import SimpleNamespace

    from autopar.execution.rewrite import PASSES
    from vocab.layout import Layout

    names = [p.name for p in PASSES]
    # after every pass that inserts TP's collectives, before the pipeline split and DP
    assert names.index("recompute") < names.index("overlap") < names.index("pipeline_split")
    assert names.index("overlap") < names.index("data_parallel")
    step = PASSES[names.index("overlap")]
    state = SimpleNamespace(layout=Layout(tp=2))
    assert step.runs(state)
    assert not step.runs(SimpleNamespace(layout=Layout(dp=2)))
    monkeypatch.setenv("AUTOPAR_OVERLAP", "0")
    assert not step.runs(state)
