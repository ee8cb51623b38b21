"""Llama 3: RMSNorm, rotary grouped-query attention, SwiGLU MLP, pre-norm residual blocks.

    RMSNorm(x)  = x * rsqrt(mean(x^2) + eps) * weight         (in fp32, cast back)
    RoPE        : angle(p, i) = p * theta^(-2i/d);  x -> x*cos + rotate_half(x)*sin
    GQA         : n_kv_heads k/v heads, each shared by n_heads / n_kv_heads query heads
    SwiGLU(x)   = down(silu(gate(x)) * up(x))
    per block   : x = x + o_proj(attn(RMSNorm(x)));  x = x + mlp(RMSNorm(x))
    logits      = lm_head(RMSNorm(x))                       (weight shared with embed if tied)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .configs import ModelConfig
from .gpt import CausalLM, lm_output

__all__ = ["RMSNorm", "rope_cos_sin", "apply_rope", "LlamaAttention", "SwiGLU", "LlamaBlock",
           "Llama"]


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in fp32."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()  # bf16 mean-of-squares loses too much precision
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


def rope_cos_sin(seq: int, head_dim: int, theta: float, device: torch.device,
                 dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and sin tables ``[seq, head_dim]`` for positions ``0..seq-1``.

    Computed per call from ``arange(seq)`` rather than stored: no max_seq-sized buffer, and it
    works unchanged on meta and fake tensors.
    """
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                         / head_dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half layout: both halves share freqs
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [b, heads, s, d]`` by position (rotate-half convention, as HF Llama)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaAttention(nn.Module):
    """Causal grouped-query attention with rotary positions; projections have no bias."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.rope_theta is not None
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.attn_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, kv_dim, bias=False)
        self.o_proj = nn.Linear(cfg.attn_dim, cfg.hidden, bias=False)

    def _repeat_kv(self, t: Tensor) -> Tensor:
        # [b, kv, s, d] -> [b, heads, s, d]; expand+reshape keeps shapes static for export.
        b, kv, s, d = t.shape
        rep = self.n_heads // kv
        return t[:, :, None].expand(b, kv, rep, s, d).reshape(b, kv * rep, s, d)

    def forward(self, x: Tensor) -> Tensor:
        b, s, h = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # Tables are made inside each block so every block's forward is just f(x): identical
        # blocks for later repeated-block detection and pipeline stage splitting.
        cos, sin = rope_cos_sin(s, self.head_dim, self.theta, x.device, x.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, self._repeat_kv(k), self._repeat_kv(v),
                                           is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, -1))  # -1: local heads under hand-written TP


class SwiGLU(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``, no biases."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm residual block: RMSNorm -> GQA attention, RMSNorm -> MLP.

    ``mlp`` is a dense :class:`SwiGLU` here; Mixtral's block swaps in its MoE layer.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = self.make_mlp(cfg)

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        """The feed-forward sublayer (overridden by Mixtral)."""
        return SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(CausalLM):
    """Llama causal language model; ``forward(tokens, labels=None)`` -> logits or loss."""

    def __init__(self, cfg: ModelConfig,
                 block: Callable[[ModelConfig], nn.Module] = LlamaBlock) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.tie_weights()

    def forward(self, tokens: Tensor, labels: Tensor | None = None) -> Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return lm_output(self.lm_head(self.norm(x)), labels)
