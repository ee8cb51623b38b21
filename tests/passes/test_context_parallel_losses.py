"""The context-parallel pass on losses and shapes the review found wrong, traced for one rank
of a fake cp=2 world: cross-entropy over [b, V, s] logits (nll_loss2d) computed as the exact
token mean, per-token losses kept split, other mean-reduced losses refused, attention over a
length the ring cannot split refused by name, a constant buffer's mask run on the ring, and a
returned logits tensor not counted as a sequence gather; random ops refused."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autopar.capture.joint import capture
from autopar.execution.parallelize import _signature
from passes.context_parallel import ContextParallelError, apply_context_parallel
from runtime import ring_attention  # noqa: F401  (registers the ring ops)
from runtime.mesh import fake_world

V, H = 32, 16


class _Lm(nn.Module):
    """Embedding, one causal attention, a vocabulary head; ``mode`` picks the loss / variant."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mode = mode
        self.embed = nn.Embedding(V, H)
        self.qkv = nn.Linear(H, 3 * H)
        self.head = nn.Linear(H, V)
        if mode == "prefix":
            self.cls = nn.Parameter(torch.randn(1, 1, H))
        self.register_buffer("causal", torch.ones(64, 64, dtype=torch.bool).tril(), persistent=False)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        if self.mode == "prefix":  # a learned token prepended: attention over S + 1 positions
            x = torch.cat([self.cls.expand(x.shape[0], 1, -1), x], 1)
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, h // 2).permute(2, 0, 3, 1, 4)
        if self.mode == "bufmask":  # nanoGPT: the causal mask a slice of a constant buffer
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.causal[:s, :s])
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + y.transpose(1, 2).reshape(b, s, h)
        logits = self.head(x[:, 1:] if self.mode == "prefix" else x)
        if self.mode.startswith("dropout"):
            logits = F.dropout(logits, 0.0 if self.mode == "dropout0" else 0.1, training=True)
        if self.mode == "ce3d":
            return F.cross_entropy(logits.transpose(1, 2), labels)
        if self.mode == "none":
            per = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            w = (labels.flatten() != -100).float()
            return (per * w).sum() / w.sum()
        if self.mode == "mse":
            return F.mse_loss(logits, torch.zeros_like(logits)) + F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return (loss, logits) if self.mode == "logits" else loss


def _batch():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, V, (2, 8), generator=g)
    labels = tokens.clone()
    labels[0, :5] = -100
    return tokens, labels


def _traced(mode: str, cp: int = 2):
    g = capture(_Lm(mode), _batch())
    sig = _signature(g.gm, [(i.kind, i.name) for i in g.inputs],
                     {o.name: o.index for o in g.outputs if o.kind == "grad"},
                     next(o.index for o in g.outputs if o.kind == "loss"),
                     {o.name: o.index for o in g.outputs if o.kind == "buffer"})
    shapes = [tuple(n.meta["val"].shape) for n in g.gm.graph.nodes if n.op == "placeholder"]
    with fake_world(cp):
        mesh = init_device_mesh("cpu", (cp,), mesh_dim_names=("cp",))
        return apply_context_parallel(g.gm, sig, shapes, mesh), sig


def _ops(gm) -> Counter:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_cross_entropy_over_classes_dim_1_is_the_exact_token_mean():
    """nll_loss2d on the rank's tokens with reduction sum; the sum and the weight all-reduced."""
    out, sig = _traced("ce3d")
    ops = _ops(out.gm)
    assert ops["aten.nll_loss2d_forward.default"] == 1 and out.gathered == []
    assert ops["_c10d_functional.all_reduce.default"] == len(sig.grad_index) + 2
    (fwd,) = [n for n in out.gm.graph.nodes if n.target is torch.ops.aten.nll_loss2d_forward.default]
    assert fwd.args[3] == 2  # reduction sum: the mean is the ratio of the all-reduced sums


def test_per_token_losses_stay_split():
    out, _ = _traced("none")
    assert out.gathered == [] and out.ring_attention == 1
    assert not any("all_gather" in op for op in _ops(out.gm))


def test_other_mean_losses_over_the_split_sequence_are_refused():
    with pytest.raises(ContextParallelError, match=r"mse_loss.*mean over a sequence split.*reduction='sum'.*cp=1"):
        _traced("mse")


def test_attention_over_a_length_the_ring_cannot_split_is_refused():
    with pytest.raises(ContextParallelError, match=r"lengths q=9, k=9, v=9.*divisible by cp=2.*or cp=1"):
        _traced("prefix")


def test_a_mask_sliced_from_a_constant_buffer_runs_on_the_ring():
    out, _ = _traced("bufmask")
    assert out.ring_attention == 1 and out.gathered == []


def test_returned_logits_are_not_a_sequence_gather():
    out, _ = _traced("logits")
    assert out.gathered == []
    notes = [n.meta.get("autopar", "") for n in out.gm.graph.nodes if "all_gather" in str(n.target)]
    assert any("forward output returned whole" in w for w in notes), notes


def test_random_ops_are_refused_and_dropout_zero_runs():
    with pytest.raises(ContextParallelError, match=r"random op .*native_dropout.*dropout 0.*or cp=1"):
        _traced("dropout")
    out, _ = _traced("dropout0")
    assert out.gathered == [] and out.ring_attention == 1


def test_failure_text_names_the_cp_fix():
    from passes.context_parallel import _cp_words

    text = _cp_words("TP: cumsum (cumsum) in the forward of m cannot run on its inputs' placements "
                     "['S(1)'] (RuntimeError: x); fix: use tp=1 for this model, or keep the weights "
                     "that feed this op replicated")
    assert text.startswith("CP: ") and "use cp=1" in text
    assert "tp=" not in text and "weights" not in text
