"""The context-parallel pass (passes/context_parallel.py) on captured graphs, traced for one
rank of a fake cp world: attention becomes ring attention, gradients and the loss are
all-reduced over cp, nothing else gathers the sequence on the zoo's llama; what the ring cannot
split is refused by name, what mixes positions otherwise is listed as a gather."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from cp_models import RopeLM, rope_batch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import autopar
from autopar.capture.joint import capture
from autopar.execution.parallelize import _signature
from passes.context_parallel import ContextParallelError, apply_context_parallel, data_only
from runtime import ring_attention  # noqa: F401  (registers the ring ops)
from runtime.mesh import fake_world


def _captured(model, batch):
    g = capture(model, batch)
    sig = _signature(g.gm, [(i.kind, i.name) for i in g.inputs],
                     {o.name: o.index for o in g.outputs if o.kind == "grad"},
                     next(o.index for o in g.outputs if o.kind == "loss"),
                     {o.name: o.index for o in g.outputs if o.kind == "buffer"})
    shapes = [tuple(n.meta["val"].shape) for n in g.gm.graph.nodes if n.op == "placeholder"]
    return g.gm, sig, shapes


def _traced(model, batch, cp: int = 2):
    gm, sig, shapes = _captured(model, batch)
    with fake_world(cp):
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        return apply_context_parallel(gm, sig, shapes, mesh), gm, sig, shapes


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


@pytest.mark.parametrize("cp", [2, 4])
def test_tiny_llama_runs_ring_attention_and_reduces_gradients(cp):
    model = autopar.models.build("tiny-llama")
    out, gm, sig, shapes = _traced(model, autopar.models.example_inputs("tiny-llama", batch=2, seq=16), cp)
    ops = _ops(out.gm)
    assert ops["autopar.ring_attention.default"] == 2 and ops["autopar.ring_attention_backward.default"] == 2
    assert not any("flash_attention" in op for op in ops)
    assert not any("all_gather" in op or "all_to_all" in op for op in ops), ops
    assert out.gathered == [] and out.ring_attention == 2
    # one all-reduce per gradient, two for the loss's token sum and count
    assert ops["_c10d_functional.all_reduce.default"] == len(sig.grad_index) + 2
    # the rank's graph keeps the step's placeholders: whole inputs, whole parameters
    holders = [tuple(n.meta["val"].shape) for n in out.gm.graph.nodes if n.op == "placeholder"]
    assert holders == shapes
    reasons = [n.meta.get("autopar", "") for n in out.gm.graph.nodes if "ring_attention" in str(n.target)]
    assert all(r.startswith("CP: ring attention") for r in reasons), reasons
    # tiny-llama's 8 query heads repeat 4 kv heads (`passes.kv_expansion`): the ring sends those
    assert _kv_groups(out.gm) == {2}


def _kv_groups(gm) -> set:
    """The ``kv_group`` argument of every ring op of a graph (its default, 1, where the
    recorded call leaves it out)."""
    out = set()
    for n in gm.graph.nodes:
        if "ring_attention" in str(n.target):
            i = [a.name for a in n.target._schema.arguments].index("kv_group")
            out.add(n.args[i] if len(n.args) > i else n.kwargs.get("kv_group", 1))
    return out


def test_own_model_gathers_nothing():
    """Its labels are shifted inside the model: a value of the data only, computed whole."""
    out, gm, sig, _ = _traced(RopeLM(), rope_batch())
    assert out.gathered == [] and out.ring_attention == 2
    assert _kv_groups(out.gm) == {1}  # as many kv heads as query heads
    assert not any("all_gather" in op for op in _ops(out.gm))


def test_data_only_nodes():
    gm, sig, _ = _captured(RopeLM(), rope_batch())
    data = data_only(gm, sig)
    by_name = {n.name: n for n in gm.graph.nodes}
    assert any(by_name[d].target is torch.ops.aten.constant_pad_nd.default for d in data if d in by_name)
    assert not any(by_name[d].target is torch.ops.aten.mm.default for d in data if d in by_name)


class _Cumulative(nn.Module):
    """Mixes positions of activations without attention: a running mean along the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        x = x.cumsum(1) / torch.arange(1, x.shape[1] + 1)[:, None]
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_other_position_mixing_is_gathered_and_named():
    tokens = torch.randint(0, 16, (2, 8))
    out, *_ = _traced(_Cumulative(), (tokens, tokens))
    assert out.gathered and any("cumsum" in why for _, why in out.gathered), out.gathered


class _Masked(nn.Module):
    """Attention under a mask: of the data only (causal and padding, from the ids), or from
    the activations themselves."""

    def __init__(self, from_activations: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.from_activations = from_activations

    def forward(self, tokens):
        x = self.embed(tokens)[:, None]
        s = x.shape[2]
        if self.from_activations:
            mask = (x @ x.transpose(-1, -2)) > 0
        else:
            mask = torch.ones(s, s, dtype=torch.bool).tril() & (tokens != 0)[:, None, None, :]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=mask).pow(2).mean()


def test_a_mask_of_the_data_runs_on_the_ring():
    out, *_ = _traced(_Masked(), (torch.randint(1, 16, (2, 8)),))
    assert out.ring_attention == 1 and out.gathered == []


def test_refusals_name_the_problem_and_the_fix():
    with pytest.raises(ContextParallelError, match="mask computed from activations.*cp=1"):
        _traced(_Masked(from_activations=True), (torch.randint(0, 16, (2, 8)),))
    with pytest.raises(ContextParallelError, match="15 positions does not split into 2"):
        _traced(autopar.models.build("tiny-llama"), autopar.models.example_inputs("tiny-llama", batch=2, seq=15))


def test_layouts_cp_does_not_run_with_are_named():
    from vocab.layout import unsupported_decisions

    assert unsupported_decisions(autopar.Layout(cp=2, dp=2)) == []
    assert unsupported_decisions(autopar.Layout(cp=2, dp=2, zero=3)) == []  # sharded over dp x cp
    assert unsupported_decisions(autopar.Layout(cp=2, dp=2, zero=1, pp=2)) == []  # rows over dp x cp
    assert unsupported_decisions(autopar.Layout(cp=2, recompute="full")) == []
    assert unsupported_decisions(autopar.Layout(cp=2, fp8="all")) == []  # FP8 on the rank's tokens
