"""Models of our own in plain PyTorch, for tests that must not hold on the zoo alone."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))), with its own inner width: stacks of them can be unequal."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, inner)
        self.fc2 = nn.Linear(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))
