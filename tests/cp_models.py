"""A causal transformer of our own in plain PyTorch for the context-parallel tests: rotary
positions made from ``arange`` inside the model, ``F.scaled_dot_product_attention(is_causal=True)``,
labels shifted inside the model (a slice of the data), and a choice of loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, h, s, d]`` by position (interleaved halves), tables from arange(s)."""
    s, d = x.shape[-2:]
    inv = 1000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class CausalBlock(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.out = nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(_rope(q), _rope(k), v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class RopeLM(nn.Module):
    """``forward(tokens, labels)`` -> loss. loss="mean": token-mean cross-entropy of the next
    token (labels shifted inside, the last position and -100 labels ignored); "mixed": that
    plus 0.01 x the mean square of the final hidden states (a second, unweighted mean);
    "classes": (cross-entropy over [b, V, s] logits plus a per-token loss's masked mean, logits)."""

    def __init__(self, vocab: int = 48, hidden: int = 32, heads: int = 4, layers: int = 2,
                 loss: str = "mean", seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.loss = loss
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(CausalBlock(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits = self.head(x)
        # next-token labels: shift left, the last position ignored
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        if self.loss == "classes":  # [b, V, s] cross-entropy (nll_loss2d) + a per-token masked mean
            per = F.cross_entropy(logits.flatten(0, 1), shifted.flatten(), reduction="none")
            kept = (shifted.flatten() != -100).float()
            return F.cross_entropy(logits.transpose(1, 2), shifted) + (per * kept).sum() / kept.sum(), logits
        ce = F.cross_entropy(logits.view(-1, logits.shape[-1]), shifted.reshape(-1), ignore_index=-100)
        if self.loss == "mixed":
            return ce + 0.01 * x.pow(2).mean()
        return ce


def rope_batch(batch: int = 4, seq: int = 16, vocab: int = 48, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels, some labels ignored (-100) unevenly along the sequence."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = tokens.clone()
    labels[torch.rand(batch, seq, generator=g) < 0.3] = -100
    labels[0, : seq // 2] = -100  # the first half of one sequence: one cp rank holds fewer labels
    return tokens, labels
