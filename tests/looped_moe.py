"""A top-2 mixture-of-experts language model in plain PyTorch whose experts run in a Python loop.

Not a zoo model: dense gating (every expert runs on every token, its result weighted by the
token's renormalised top-2 probability, zero elsewhere), GELU experts with biases in an
``nn.Sequential``, the layer's output the sum over experts. The loop is what a capture groups
(`autopar.capture.experts`); ``distinct=True`` gives the experts different widths, so they are
not alike and each is traced as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LoopedMoE(nn.Module):
    """h + sum_e gate_e(x) * expert_e(x), x = norm(h); gate = top-2 of softmax(router(x))."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int = 2, distinct: bool = False) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, ffn + (4 * e if distinct else 0)), nn.GELU(),
                          nn.Linear(ffn + (4 * e if distinct else 0), hidden))
            for e in range(experts))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = self.norm(h)
        weight, chosen = torch.topk(self.router(x).softmax(-1), self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        gates = torch.zeros_like(self.router(x)).scatter(-1, chosen, weight)
        out = h
        for e, expert in enumerate(self.experts):
            out = out + gates[..., e:e + 1] * expert(x)
        return out


class LoopedMoELM(nn.Module):
    """(ids, labels) -> mean next-token cross-entropy; or, with labels=None, the logits."""

    def __init__(self, vocab: int = 64, hidden: int = 32, ffn: int = 64, experts: int = 8,
                 layers: int = 2, distinct: bool = False, moe: type[nn.Module] | None = None) -> None:
        """``moe(hidden, ffn, experts)`` builds each layer (default: `LoopedMoE`)."""
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            moe(hidden, ffn, experts) if moe is not None else LoopedMoE(hidden, ffn, experts, distinct=distinct)
            for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        if labels is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(experts: int = 8, seed: int = 0, **kwargs) -> LoopedMoELM:
    torch.manual_seed(seed)
    return LoopedMoELM(experts=experts, **kwargs)


def batch(size: int = 4, seq: int = 8, vocab: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (size, seq), generator=gen)
    return ids, torch.roll(ids, -1, dims=1)
