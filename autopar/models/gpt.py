"""GPT-2: learned positions, pre-norm LayerNorm blocks, fused-qkv attention, GELU MLP.

    x = embed(tokens) + pos_embed(arange(S))
    per block:  x = x + o_proj(attn(qkv(LN(x))))        causal softmax(q k^T / sqrt(d)) v
                x = x + proj(gelu_tanh(fc(LN(x))))
    logits = lm_head(LN(x))                             lm_head.weight is embed.weight (tied)
    loss = mean cross-entropy(logits, labels), in fp32
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .configs import ModelConfig

__all__ = ["CausalLM", "GPT", "GPTBlock", "GPTAttention", "GPTMLP", "lm_output"]


def lm_output(logits: Tensor, labels: Tensor | None) -> Tensor:
    """Logits when ``labels`` is None, else the mean cross-entropy computed in fp32."""
    if labels is None:
        return logits
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.float().view(-1, vocab), labels.view(-1))


class CausalLM(nn.Module):
    """Base of the zoo's language models: keeps a tied ``lm_head`` tied across conversions.

    Subclasses set ``config``, ``embed`` and ``lm_head`` and call :meth:`tie_weights`.
    """

    config: ModelConfig
    embed: nn.Embedding
    lm_head: nn.Linear

    def tie_weights(self) -> None:
        """Share ``lm_head.weight`` with ``embed.weight`` when the config is tied."""
        if self.config.tied:
            self.lm_head.weight = self.embed.weight

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> CausalLM:
        # Module._apply may replace each module's parameters separately (e.g. to_empty from
        # meta), which silently unties a shared weight; re-tie after every conversion.
        out = super()._apply(fn, recurse)
        self.tie_weights()
        return out


class GPTAttention(nn.Module):
    """Multi-head causal self-attention with one fused ``qkv`` projection (with biases)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.attn_dim, bias=True)
        self.o_proj = nn.Linear(cfg.attn_dim, cfg.hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        b, s, _ = x.shape
        # [b, s, 3*heads*head_dim] -> 3 x [b, heads, s, head_dim]
        q, k, v = self.qkv(x).view(b, s, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class GPTMLP(nn.Module):
    """GELU MLP: ``proj(gelu_tanh(fc(x)))`` (GPT-2 uses the tanh approximation)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn, bias=True)
        self.proj = nn.Linear(cfg.ffn, cfg.hidden, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    """Pre-norm residual block: attention then MLP, each behind a LayerNorm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(CausalLM):
    """GPT-2 causal language model; ``forward(tokens, labels=None)`` -> logits or loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_embed = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.tie_weights()

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(pos)
        for layer in self.layers:
            x = layer(x)
        return lm_output(self.lm_head(self.norm(x)), labels)
