"""The recompute pass: the backward rebuilds the marked forward values from the kept ones.

On the zoo (tiny-llama, tiny-gpt2, tiny-mixtral) and a plain-PyTorch block model with dropout,
"full", "selective" and a partial choice (selective plus some matmul outputs, by group) give
the loss and every gradient of the original graph (rtol 1e-5, atol 1e-6); dropout masks are drawn once, in the forward, never by a copy. The zoo configs have
no dropout field (`autopar.models.config('tiny-gpt2')`), so the own model carries the dropout.
On a 4-block model (hidden 512, sequence 512, batch 4, fp32) the measured peak of live bytes
(runtime/memory.py) orders full < selective < none, and full's extra memory (peak minus
parameters and inputs) is at most 35 % of none's.
"""

import copy
import dataclasses

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from passes.recompute import apply_recompute, heavy_groups, is_backward, values_to_recompute
from runtime.memory import peak_live_bytes

MODES = ("selective", "full")


class Block(nn.Module):
    """Pre-norm MLP block with dropout: x + drop(fc2(gelu(fc1(norm(x)))))."""

    def __init__(self, hidden: int, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.fc2(nn.functional.gelu(self.fc1(self.norm(x)))))


class BlockMLP(nn.Module):
    """``n`` blocks and a scalar head; returns the MSE loss."""

    def __init__(self, hidden: int = 32, n: int = 3, p: float = 0.1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, p) for _ in range(n))
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), y)


def _step(name: str):
    if name == "block-mlp":
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(1)
        return BlockMLP(), (torch.randn(4, 16, 32, generator=gen), torch.randn(4, 16, generator=gen))
    return models.build(name, seed=0), models.example_inputs(name, batch=2, seq=16)


def _layers(graph) -> dict[str, int | None]:
    return {name: info.layer for name, info in analyze(graph).nodes.items()}


def _recomputed(graph, mode: str):
    """A copy of the captured step with the pass applied, and the pass's result. "partial":
    selective plus every other heavy group's outputs (named by module here)."""
    out = copy.copy(graph)
    out.gm = copy.deepcopy(graph.gm)
    layers, also = _layers(graph), []
    if mode == "partial":
        modules = {name: info.module for name, info in analyze(graph).nodes.items()}
        groups = heavy_groups(out.gm, layers, modules, {})
        chosen = sorted(set(groups.values()))[::2]
        also = [n for n, g in groups.items() if g in chosen]
        assert also
    result = apply_recompute(out.gm, values_to_recompute(out.gm, layers, "selective" if also else mode,
                                                         also=also))
    return out, result


def _random_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if "dropout" in str(n.target) or "bernoulli" in str(n.target)
            or str(n.target).startswith("aten.rand")]


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-mixtral", "block-mlp"])
def test_recomputed_graph_gives_the_same_loss_and_gradients(name):
    model, batch = _step(name)
    graph = capture(model, batch)
    params = dict(model.named_parameters())
    torch.manual_seed(7)
    ref_loss, ref_grads = graph.run(params, *batch)
    for mode in (*MODES, "partial"):
        rec, result = _recomputed(graph, mode)
        copies = [n for n in rec.gm.graph.nodes if "recomputes" in n.meta]
        assert result.recomputed and len(copies) == result.copied > 0
        assert all(is_backward(n) for n in copies)
        # masks are drawn once, in the forward: the same number of random ops, none a copy
        assert len(_random_nodes(rec.gm)) == len(_random_nodes(graph.gm))
        assert not any(n in copies for n in _random_nodes(rec.gm))
        torch.manual_seed(7)  # the same RNG state: the forward draws the same masks
        loss, grads = rec.run(params, *batch)
        assert torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-6), (mode, loss, ref_loss)
        for pname, g in ref_grads.items():
            assert torch.allclose(grads[pname], g, rtol=1e-5, atol=1e-6), (mode, pname)
    if name == "block-mlp":
        assert _random_nodes(graph.gm), "the own model's dropout did not reach the graph"


def test_marking_rule():
    """full marks every in-block forward value but the block outputs, selective the same minus
    matmul and attention outputs; no backward node, random op or value outside the blocks."""
    model, batch = _step("block-mlp")
    graph = capture(model, batch)
    layers = _layers(graph)
    full = values_to_recompute(graph.gm, layers, "full")
    selective = values_to_recompute(graph.gm, layers, "selective")
    assert values_to_recompute(graph.gm, layers, "none") == frozenset()
    assert selective < full
    nodes = {n.name: n for n in graph.gm.graph.nodes}
    for name in full:
        node = nodes[name]
        assert layers[name] is not None and not is_backward(node) and node not in _random_nodes(graph.gm)
        assert all(is_backward(u) or layers.get(u.name) == layers[name] for u in node.users)
    assert {nodes[n].target for n in full - selective} == {torch.ops.aten.addmm.default}
    with pytest.raises(ValueError, match="recompute mode"):
        values_to_recompute(graph.gm, layers, "auto")


def test_peak_live_bytes_counts_storages_until_their_last_use():
    def f(x):
        a = x * 2  # 400 bytes, dies after b
        b = a + 1
        v = b.view(-1)  # a view: no new bytes
        return (v.sum(),)

    gm = make_fx(f)(torch.ones(10, 10))
    profile = peak_live_bytes(gm, torch.ones(10, 10))
    assert profile.input_bytes == 400
    assert profile.peak_bytes == 400 + 400 + 400  # x, a and b while b is made
    assert profile.outputs[0].item() == 300.0
    assert profile.boundary_bytes is None  # no backward node


def _extra_bytes(model, batch) -> dict[str, int]:
    """Measured peak live bytes minus the inputs, per mode, of one capture of the step."""
    graph = capture(model, batch)
    params = dict(model.named_parameters())
    primals = [params[i.name] if i.kind == "param" else batch[int(i.name[len("input"):])]
               for i in graph.inputs if i.kind in ("param", "input")]
    seeds = [torch.ones(()) for i in graph.inputs if i.kind == "tangent"]
    extra = {}
    for mode in ("none", *MODES):
        rec = _recomputed(graph, mode)[0] if mode != "none" else graph
        torch.manual_seed(0)
        extra[mode] = peak_live_bytes(rec.gm, *primals, *seeds).extra_bytes
    return extra


def test_measured_peak_full_below_selective_below_none():
    cfg = dataclasses.replace(models.config("tiny-llama"), name="llama-4x512", n_layers=4, hidden=512,
                              n_heads=8, n_kv_heads=8, ffn=1408, vocab=256, max_seq=512)
    extra = _extra_bytes(models.build(cfg, seed=0), models.example_inputs(cfg, batch=4, seq=512))
    assert extra["full"] < extra["selective"] < extra["none"], extra
    assert extra["full"] <= 0.35 * extra["none"], extra  # the acceptance
    torch.manual_seed(0)
    extra = _extra_bytes(BlockMLP(hidden=512, n=4), (torch.randn(4, 512, 512), torch.randn(4, 512)))
    assert extra["full"] < extra["selective"] < extra["none"], extra
