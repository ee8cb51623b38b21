"""Causal transformers of our own in plain PyTorch for the context-parallel tests: `RopeLM`
(rotary positions made from ``arange`` inside the model, ``F.scaled_dot_product_attention(
is_causal=True)``, labels shifted inside the model, a choice of loss) and `GqaLM` (grouped-query
attention, RoPE from precomputed buffers, RMSNorm, SwiGLU; mean or label-smoothed
cross-entropy), and `cp_parity_failures`, the parity loop both cp test files run."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

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


class GqaBlock(nn.Module):
    """Pre-norm block: grouped-query causal attention with RoPE, then a SwiGLU MLP."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, seq: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.dim, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.gate = nn.Linear(hidden, 2 * hidden, bias=False)
        self.up = nn.Linear(hidden, 2 * hidden, bias=False)
        self.down = nn.Linear(2 * hidden, hidden, bias=False)
        inv = 10000.0 ** (-torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim)
        ang = torch.arange(seq, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", torch.cat((ang.cos(), ang.cos()), -1), persistent=False)
        self.register_buffer("sin", torch.cat((ang.sin(), ang.sin()), -1), persistent=False)

    def _rope(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * self.cos + rotated * self.sin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, s, self.kv_heads, self.dim).transpose(1, 2)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(self._rope(q), self._rope(k), v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class GqaLM(nn.Module):
    """``forward(tokens, labels)`` -> loss: next-token cross-entropy (labels shifted inside,
    -100 ignored), "mean" or "smooth" (label smoothing 0.1)."""

    def __init__(self, loss: str = "mean", vocab: int = 64, hidden: int = 32, heads: int = 4,
                 kv_heads: int = 2, layers: int = 2, seq: int = 16, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.smoothing = {"mean": 0.0, "smooth": 0.1}[loss]
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(GqaBlock(hidden, heads, kv_heads, seq) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        shifted = F.pad(labels, (0, 1), value=-100)[:, 1:]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                               ignore_index=-100, label_smoothing=self.smoothing)


def gqa_batch(batch: int = 4, seq: int = 16, vocab: int = 64, seed: int = 5):
    """Tokens and labels, labels ignored unevenly (the first cp rank's chunk holds fewer)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = tokens.clone()
    labels[torch.rand(batch, seq, generator=g) < 0.25] = -100
    labels[1, : seq // 3] = -100
    return tokens, labels


def cp_parity_failures(world: int, cases: Callable[[], Iterable[tuple]], layouts: list[dict],
                       only: tuple[str, ...] = (), check: Callable | None = None) -> list[tuple]:
    """Every case of ``cases()`` (``only``: those named) under every layout against one device
    (loss, every gradient, parameters after 2 SGD steps), after checking that attention ran as
    ring attention (two blocks: forward and backward of each) and ``check(pm, label)``'s own
    failures."""
    from parity_checks import contract, sgd, train_and_compare

    import autopar

    failures = []
    for degrees in layouts:
        for name, build, batch in cases():
            if only and name not in only:
                continue
            model = build()
            ref = copy.deepcopy(model)
            pm = autopar.parallelize(model, world, example_inputs=batch, layout=autopar.Layout(**degrees))
            label = (name, pm.plan.layout.short())
            rings = [n for n in pm._rank_graph.gm.graph.nodes if "ring_attention" in str(n.target)]
            if len(rings) != 4:
                failures.append((*label, "ring attention ops", len(rings)))
            if check is not None:
                failures += check(pm, label)
            failures += contract(pm, label)
            failures += train_and_compare(pm, ref, batch, label, steps=2, optimizers=(sgd,))
    return failures
