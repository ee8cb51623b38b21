"""Building zoo models and example batches from config names.

Models are always constructed on the meta device first (no memory, no RNG), then, unless
the meta model is wanted, materialised with ``to_empty`` and initialised from a local
``torch.Generator``: normal(0, 0.02) for linear and embedding weights, ones for norm weights,
zeros for biases. Init values are drawn on the CPU, so they are the same on every device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .configs import ModelConfig, config
from .gpt import GPT
from .llama import Llama, RMSNorm
from .moe import Mixtral

__all__ = ["build", "example_inputs", "init_weights"]

_FAMILIES: dict[str, type[nn.Module]] = {"gpt2": GPT, "llama": Llama, "mixtral": Mixtral}


def _resolve(name_or_config: str | ModelConfig) -> ModelConfig:
    return name_or_config if isinstance(name_or_config, ModelConfig) else config(name_or_config)


def build(name_or_config: str | ModelConfig, device: str | torch.device = "cpu",
          dtype: torch.dtype = torch.float32, seed: int | None = None) -> nn.Module:
    """Build a zoo model with parameters of ``dtype`` on ``device``.

    ``device="meta"`` allocates nothing (parameters are meta tensors). Elsewhere parameters are
    initialised deterministically from ``seed`` (0 when None) without touching global RNG.
    """
    cfg = _resolve(name_or_config)
    with torch.device("meta"):
        model = _FAMILIES[cfg.family](cfg)
    model.to(dtype=dtype)
    if torch.device(device).type == "meta":
        return model
    model.to_empty(device=device)  # CausalLM re-ties shared weights after this
    init_weights(model, 0 if seed is None else seed)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Re-initialise ``model`` in place from a local generator seeded ``seed``.

    Linear/Embedding weights ~ normal(0, 0.02); norm weights 1; all biases 0. Values are drawn
    in fp32 on the CPU in module order and copied in, so they are device-independent.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    seen: set[int] = set()  # a tied weight is initialised once

    def normal(p: Tensor) -> None:
        if id(p) not in seen:
            seen.add(id(p))
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, 0.02, generator=gen))

    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            normal(module.weight)
        elif isinstance(module, (nn.LayerNorm, RMSNorm)):
            module.weight.fill_(1.0)
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor):
            bias.zero_()


def example_inputs(name_or_config: str | ModelConfig, batch: int = 2, seq: int | None = None,
                   device: str | torch.device = "cpu") -> tuple[Tensor, Tensor]:
    """A ``(tokens, labels)`` batch: int64 ``[batch, seq]``, values in ``[0, vocab)``.

    ``seq`` defaults to ``min(max_seq, 4096)``. On ``device="meta"`` both are meta tensors;
    elsewhere they are random from a generator seeded 0, so repeated calls agree.
    """
    cfg = _resolve(name_or_config)
    seq = min(cfg.max_seq, 4096) if seq is None else seq
    if not 0 < seq <= cfg.max_seq:
        raise ValueError(f"{cfg.name}: seq must be in 1..{cfg.max_seq}, got {seq}")
    if torch.device(device).type == "meta":
        return (torch.empty(batch, seq, dtype=torch.int64, device="meta"),
                torch.empty(batch, seq, dtype=torch.int64, device="meta"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    labels = torch.randint(0, cfg.vocab, (batch, seq), generator=gen)
    return tokens.to(device), labels.to(device)
