"""Mixtral: Llama attention with a top-k mixture-of-experts SwiGLU MLP.

Routing (per token t, as Mixtral):
    p = softmax(router(x_t));  (w, e) = top_k(p);  w = w / sum(w)
    y_t = sum_j w_j * expert_{e_j}(x_t),   expert(x) = down(silu(gate(x)) * up(x))

Dispatch with static shapes (GShard-style capacity), per sequence of T tokens (a group), E
experts, k choices:
    C = min(T, ceil(capacity_factor * k * T / E)) slots per expert and group
    a (token, choice)'s slot in its expert = number of earlier assignments to that expert,
    by a cumsum over one-hot assignments ordered choice-major (every token's first choice
    beats any second choice); slots >= C are dropped to a trash row E*C.
    tokens are scattered into a [E*C + 1, h] buffer, expert e runs on rows e*C:(e+1)*C,
    results are gathered back by slot and combined with w (a dropped choice gives 0).
Expert FLOPs scale with E*C ~ capacity_factor * k * T; no shape depends on routing values.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .configs import ModelConfig
from .llama import Llama, LlamaBlock, SwiGLU

__all__ = ["MoE", "MixtralBlock", "Mixtral", "expert_capacity"]


def expert_capacity(n_tokens: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(capacity_factor * top_k * T / E)``, at most T (an expert can
    take each token once) and at least 1."""
    return max(1, min(n_tokens, math.ceil(capacity_factor * top_k * n_tokens / n_experts)))


class MoE(nn.Module):
    """Top-k routed mixture of SwiGLU experts with capacity-limited, static-shape dispatch."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.router = nn.Linear(cfg.hidden, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg.hidden, cfg.ffn) for _ in range(cfg.n_experts))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        # Each sequence is a dispatch group with its own capacity (GShard's groups): the layer
        # is then a function of each sequence alone, so splitting the batch over data-parallel
        # ranks computes exactly what one device computes on the whole batch.
        groups = math.prod(shape[:-2]) if x.dim() > 2 else 1
        x = x.reshape(groups, -1, shape[-1])  # [G, S, h]
        _, n_tok, hidden = x.shape
        E, k = self.n_experts, self.top_k
        cap = expert_capacity(n_tok, E, k, self.capacity_factor)

        # Routing weights in fp32 (softmax), renormalised over the chosen k as Mixtral does.
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weight, expert = torch.topk(probs, k, dim=-1)  # [G, S, k]
        weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)

        # Choice-major order [G, k*S]: all first choices claim slots before any second choice.
        expert = expert.transpose(1, 2).reshape(groups, k * n_tok)
        weight = weight.transpose(1, 2).reshape(groups, k * n_tok)
        # One-hot via comparison (not F.one_hot) so no op needs to inspect values.
        onehot = (expert[..., None] == torch.arange(E, device=x.device)).to(torch.int64)
        pos = ((torch.cumsum(onehot, dim=1) - 1) * onehot).sum(-1)  # slot within its expert
        keep = pos < cap
        trash = groups * E * cap
        group = torch.arange(groups, device=x.device)[:, None] * (E * cap)
        slot = torch.where(keep, group + expert * cap + pos, torch.full_like(pos, trash)).reshape(-1)

        # Scatter: kept slots are unique, so index_add is a copy; drops pile into the trash row.
        x_rep = x.unsqueeze(1).expand(groups, k, n_tok, hidden).reshape(-1, hidden)
        buf = x.new_zeros(trash + 1, hidden).index_add(0, slot, x_rep)
        # Expert e runs on rows [:, e] of [G, E, C, h]: one unbind feeds them all, so a capture
        # groups the experts in time independent of E (autopar.capture.experts).
        rows = buf[:trash].view(groups, E, cap, hidden).transpose(0, 1).reshape(E, groups * cap, hidden)
        outs = [mlp(r).view(groups, 1, cap, hidden) for r, mlp in zip(rows.unbind(0), self.experts)]
        out = torch.cat([torch.cat(outs, dim=1).reshape(trash, hidden), x.new_zeros(1, hidden)])

        # Gather each choice's result and combine; dropped choices get weight 0.
        kept = (weight * keep.to(weight.dtype)).reshape(-1, 1)
        y = out.index_select(0, slot) * kept
        return y.view(groups, k, n_tok, hidden).sum(1).view(shape)


class MixtralBlock(LlamaBlock):
    """Llama block whose ``mlp`` is a :class:`MoE` layer."""

    def make_mlp(self, cfg: ModelConfig) -> nn.Module:
        """The mixture-of-experts feed-forward sublayer."""
        return MoE(cfg)


class Mixtral(Llama):
    """Mixtral causal language model; ``forward(tokens, labels=None)`` -> logits or loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, block=MixtralBlock)
