"""A mixture-of-experts language model written in plain PyTorch around ``torch._grouped_mm``.

Not a zoo model and not transformers: top-1 routing, the tokens sorted by expert, each expert's
fused gate|up and down projections as one grouped matmul each, with the expert weights stored
[E, in, out] (transformers stores [E, out, in] and transposes): the other layout of the
sharding rules in `passes.grouped_matmul`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ExpertBlock(nn.Module):
    """Pre-norm residual block: h + experts(norm(h)), each token through its top expert."""

    def __init__(self, hidden: int, ffn: int, experts: int) -> None:
        super().__init__()
        self.experts = experts
        self.norm = nn.LayerNorm(hidden)
        self.router = nn.Linear(hidden, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, hidden, 2 * ffn) * hidden ** -0.5)  # gate | up
        self.w_out = nn.Parameter(torch.randn(experts, ffn, hidden) * ffn ** -0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, s, d = h.shape
        x = self.norm(h).reshape(b * s, d)
        weight, expert = self.router(x).softmax(-1).max(-1)
        _, order = torch.sort(expert, stable=True)
        counts = torch.histc(expert.float(), bins=self.experts, min=0, max=self.experts - 1)
        offs = counts.cumsum(0).to(torch.int32)
        gate, up = torch._grouped_mm(x[order], self.w_in, offs=offs).chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, self.w_out, offs=offs)[order.argsort()]
        return h + (y * weight.unsqueeze(-1)).reshape(b, s, d)


class GroupedMoE(nn.Module):
    """(ids, labels) -> mean next-token cross-entropy."""

    def __init__(self, vocab: int = 64, hidden: int = 32, ffn: int = 64, experts: int = 4,
                 layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(ExpertBlock(hidden, ffn, experts) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(seed: int = 0, **sizes) -> GroupedMoE:
    torch.manual_seed(seed)
    return GroupedMoE(**sizes)


def batch(size: int = 8, seq: int = 16, vocab: int = 64, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (size, seq), generator=g)
    return ids, torch.randint(0, vocab, (size, seq), generator=g)
