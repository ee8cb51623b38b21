"""The FP8 pass computes what an eager FP8 linear computes (tests/fp8_reference.py, written
from the math): loss and every gradient, for each recipe, on zoo models, a Hugging Face model
and a plain PyTorch model; it finds each weight's three matmuls, shares casts, and names its
decisions. On a fake 4-rank TP world a sharded amax is all-reduced (max) and no FP8 matmul is
gathered."""

import copy

import pytest
import torch
from fp8_reference import fp8_layer_weights, to_fp8
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.models.configs import config
from autopar.strategies.tp_recipe import find_tp_recipe
from passes.fp8 import RECIPES, apply_fp8, cast_shares, group_of, reduce_scales, weight_matmuls
from passes.tensor_parallel import apply_tensor_parallel
from runtime.mesh import fake_world
from vocab.layout import FP8_RECIPES
from vocab.plan_types import AxisGroup, AxisPlacement, GraphSignature, TensorParallelPlan


class PlainMLP(nn.Module):
    """A model of our own: biased linears, GELU, a residual, an MSE loss."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(12, 32)
        self.hidden = nn.Linear(32, 32)
        self.out = nn.Linear(32, 6)

    def forward(self, x, y):
        h = torch.nn.functional.gelu(self.inp(x))
        h = h + self.hidden(h)
        return ((self.out(h) - y) ** 2).mean()


def _signature(graph):
    holders = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]
    return GraphSignature(inputs=[(i.kind, i.name) for i in graph.inputs], placeholders=holders,
                          grad_index={o.name: o.index for o in graph.outputs if o.kind == "grad"},
                          loss_index=next(o.index for o in graph.outputs if o.kind == "loss"))


def _case(name):
    if name == "plain":
        torch.manual_seed(0)
        return PlainMLP(), (torch.randn(4, 5, 12), torch.randn(4, 5, 6))
    if name.startswith("hf-"):
        import hf_tiny
        return hf_tiny.build(name[3:]), hf_tiny.batch(size=2)
    return models.build(name, seed=0), models.example_inputs(name, batch=2, seq=16)


MODELS = ["tiny-llama", "tiny-gpt2", "tiny-mixtral", "plain", "hf-llama", "hf-gpt2", "hf-qwen2",
          "hf-phi3", "hf-mixtral"]
# every zoo model and HF llama under tensorwise, every recipe on a zoo, a plain and a Conv1D
# model; the rest (the other HF families, other recipes) slow
FAST = {(m, "tensorwise") for m in MODELS[:5]} | {(m, r) for m in ("tiny-llama", "plain", "hf-gpt2")
                                                 for r in RECIPES}


@pytest.mark.parametrize("name, recipe", [
    (m, r) if (m, r) in FAST else pytest.param(m, r, marks=pytest.mark.slow)
    for m in MODELS for r in sorted(RECIPES)])
def test_pass_equals_eager_fp8_linears(name, recipe):
    model, inputs = _case(name)
    graph = capture(model, inputs)
    sig = _signature(graph)
    layers = fp8_layer_weights(model)  # the reference's: nn.Linear and Conv1D weights
    assert layers <= set(weight_matmuls(graph.gm, sig))  # (the pass finds others: Mixtral's router)
    result = apply_fp8(graph.gm, sig, sorted(layers), RECIPES[recipe])
    assert set(result.matmuls) == layers
    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    loss, grads = graph.run(params, *inputs, buffers=buffers)

    ref = to_fp8(copy.deepcopy(model), recipe)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    high = model(*inputs)
    assert torch.allclose(loss, ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert not torch.equal(loss, high.detach())  # FP8 really ran: the loss moved
    named = dict(ref.named_parameters())
    bad = [n for n, g in grads.items() if not torch.allclose(g, named[n].grad, rtol=1e-5, atol=1e-6)]
    assert bad == []


def test_each_weight_has_its_three_matmuls_and_casts_are_shared():
    model, inputs = _case("tiny-llama")
    graph = capture(model, inputs)
    sig = _signature(graph)
    found = weight_matmuls(graph.gm, sig)
    q = found["layers.1.attn.q_proj.weight"]
    assert (len(q.forward), len(q.input_grad), len(q.weight_grad)) == (1, 1, 1)
    # the cost model's view of the sharing: q, k and v each pay a third of x's forward cast
    shares = cast_shares(graph.gm, found)
    x_share = [s for op, s in shares[q.forward[0]].items() if not op.startswith("t")]
    assert x_share == [pytest.approx(1 / 3)]
    assert "embed.weight" not in found  # untied: its gather is no matmul
    result = apply_fp8(graph.gm, sig, ["layers.*.attn.q_proj.weight", "layers.*.attn.k_proj.weight"],
                       RECIPES["tensorwise"])
    layers = config("tiny-llama").n_layers
    # per block: x (shared by q and k, each views it on its own), Wq, Wk forward; dY of q and
    # of k (each shared by its input and weight gradients), Wq, Wk and x in the backward
    assert result.casts == layers * 8
    reasons = [n.meta["autopar"] for n in graph.gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert len(reasons) == layers * 6 and all("FP8 (tensorwise)" in r for r in reasons)


def test_unknown_weight_is_an_error_naming_the_candidates():
    model, inputs = _case("plain")
    graph = capture(model, inputs)
    with pytest.raises(ValueError, match=r"candidates are \['hidden.weight', 'inp.weight', 'out.weight'\]"):
        apply_fp8(graph.gm, _signature(graph), ["nope.weight"], RECIPES["tensorwise"])


def test_recipe_names_agree_with_the_layout():
    assert set(RECIPES) == set(FP8_RECIPES)


@pytest.mark.parametrize("recipe, sp", [("tensorwise", False), ("rowwise", True)])
def test_tp_reduces_sharded_amaxes_and_shards_fp8_matmuls(recipe, sp):
    model, inputs = models.build("tiny-llama", seed=0), models.example_inputs("tiny-llama", batch=4, seq=16)
    graph = capture(model, inputs)
    sig = _signature(graph)
    tp_recipe = find_tp_recipe(graph, analyze(graph))
    placements = {p: (AxisPlacement.shard(d) if (d := tp_recipe.param_shard_dim(p)) is not None
                      else AxisPlacement.replicate()) for p in graph.param_names}
    apply_fp8(graph.gm, sig, sorted({group_of(w) for w in weight_matmuls(graph.gm, sig)}), RECIPES[recipe])
    holders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        traced = apply_tensor_parallel(graph.gm, sig, [tuple(n.meta["val"].shape) for n in holders],
                                       TensorParallelPlan(placements, sequence_parallel=sp), mesh)
    collectives = [n for n in traced.gm.graph.nodes if str(n.target).startswith("_c10d_functional.")
                   and "wait" not in str(n.target)]
    maxes = [n for n in collectives if "max" in n.args and "FP8 scale" in n.meta["autopar"]]
    assert maxes  # the row-parallel inputs' and the sharded weights' amaxes
    assert not any("cannot run" in n.meta["autopar"] for n in collectives)  # no FP8 matmul gathered
    scaled = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten._scaled_mm.default]
    assert scaled and all(n.meta.get("autopar", "").startswith("FP8") for n in scaled)


@pytest.mark.parametrize("recipe, per_block", [("tensorwise", 4), ("rowwise", 3)])
def test_dp_reduces_the_amaxes_over_tokens_only(recipe, per_block):
    # q and k of each block, tensorwise: the activation x (shared), the gradients dY of q and
    # of k, x again in the backward (4); rowwise, only the weight gradients' operands, whose
    # amax runs along the tokens: dY^T of q and of k, and x (shared) (3); never a weight's
    model, inputs = _case("tiny-llama")
    graph = capture(model, inputs)
    apply_fp8(graph.gm, _signature(graph), ["layers.*.attn.q_proj.weight", "layers.*.attn.k_proj.weight"],
              RECIPES[recipe])
    count = reduce_scales(graph.gm, AxisGroup("dp-group", 2, 0))
    assert count == per_block * config("tiny-llama").n_layers
    reduced = [n for n in graph.gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default]
    assert all(n.args[1] == "max" and "DP ranks' tokens" in n.meta["autopar"] for n in reduced)
    assert not any("the weight" in n.meta["autopar"] for n in reduced)


def test_recompute_composes_with_fp8():
    # the casts belong to their matmul's block: full recompute still rebuilds each block from
    # its input (before: casts outside the blocks made every matmul input a kept block output)
    from autopar.execution.parallelize import _recompute
    from runtime.memory import peak_live_bytes
    from vocab.plan_types import RecomputeChoice

    model = models.build("tiny-llama", seed=0)
    batch = models.example_inputs("tiny-llama", batch=4, seq=64)
    extra = {}
    for mode in ("none", "full"):
        graph = capture(model, batch)
        layers = {name: info.layer for name, info in analyze(graph).nodes.items()}
        sig = _signature(graph)
        apply_fp8(graph.gm, sig, sorted({group_of(w) for w in weight_matmuls(graph.gm, sig)}),
                  RECIPES["tensorwise"])
        if mode == "full":
            assert _recompute(graph.gm, layers, {}, [RecomputeChoice(mode)], {}, retraced=False)
        params = dict(model.named_parameters())
        primals = [params[i.name] if i.kind == "param" else batch[int(i.name[len("input"):])]
                   for i in graph.inputs if i.kind in ("param", "input")]
        with torch.no_grad():
            extra[mode] = peak_live_bytes(graph.gm, *primals, torch.ones(())).extra_bytes
    assert extra["full"] <= 0.6 * extra["none"], extra
