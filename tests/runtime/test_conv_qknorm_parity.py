"""Models no zoo entry names train as on one device: a QK-norm over all heads (a LayerNorm of
the whole column-parallel q / k projection, before the head split) under tp=2, and a 1-D conv
net over embedded tokens (its activations transposed to [b, h, s]) under tp=2 (with and
without SP: under SP a convolution over the sharded sequence runs whole, a listed fallback)
and pp=2.

Before: the QK-norm died inside DTensor, the conv net under TP in the reduction of the
vocabulary-sharded embedding (its partial sum read through a view and directly), and under
pp=2 in gloo ("input tensor has to be contiguous": the stage boundary sent a transposed view).
Loss, every gradient and the parameters after 2 SGD steps match one device (fp32, rtol 1e-5).
"""

import copy

import torch
import torch.nn.functional as F
from parity_checks import sgd, train_and_compare
from torch import nn

from runtime.launch import spawn

VOCAB, HIDDEN = 64, 32


class QKNormLM(nn.Module):
    """One attention block whose q and k are normalised across all heads before the split."""

    def __init__(self, heads: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.q, self.k, self.v, self.o = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids, labels):
        x = self.embed(ids)
        b, s, h = x.shape
        q = self.q_norm(self.q(x)).view(b, s, self.heads, -1).transpose(1, 2)
        k = self.k_norm(self.k(x)).view(b, s, self.heads, -1).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
        logits = self.head(x + self.o(y))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


class ConvLM(nn.Module):
    """Embedding, residual 1-D convolutions over the sequence, a linear head."""

    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.convs = nn.ModuleList(nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1) for _ in range(layers))
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids, labels):
        x = self.embed(ids).transpose(1, 2)
        for conv in self.convs:
            x = x + F.relu(conv(x))
        logits = self.head(x.transpose(1, 2))
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


CASES = [(QKNormLM, {"tp": 2}), (QKNormLM, {"tp": 2, "sp": True}), (ConvLM, {"tp": 2}),
         (ConvLM, {"tp": 2, "sp": True}), (ConvLM, {"pp": 2, "grad_accum": 2})]


def _worker(rank: int, world: int) -> list[tuple]:
    import autopar

    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(0, VOCAB, (4, 16), generator=g), torch.randint(0, VOCAB, (4, 16), generator=g))
    failures = []
    for make, degrees in CASES:
        model = make()
        ref = copy.deepcopy(model)
        pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
        label = (make.__name__, pm.plan.layout.short())
        failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd,))
        unexpected = [f.op for f in pm.plan.fallbacks if "convolution" not in f.op]
        if unexpected:
            failures.append((*label, "fallbacks", unexpected))
    return failures


def test_qk_norm_and_conv_nets_match_one_device():
    assert spawn(_worker, 2, timeout_s=900) == [[], []]
