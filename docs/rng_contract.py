"""What dropout does under autopar's DP and TP: the table of docs/runtime.md, regenerated.

    python docs/rng_contract.py

On 2 gloo ranks, a plain MLP applies dropout (p = 0.5) to a column-parallel (sharded under TP)
activation and to a row-parallel (reduced, replicated) output. Each layout runs one step with
the same seed on every rank and with a seed per rank; the batch's two halves are identical, so
under dp=2 with one seed the loss equals one device's on one half exactly when every rank draws
the same masks for its slice. Prints one line per case: the loss each rank reports.
"""

from __future__ import annotations

import torch

from runtime.launch import spawn

SEED = 5


class MLP(torch.nn.Module):
    """Two linears, dropout after each: the first output is sharded under TP, the second
    replicated."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 64)
        self.fc2 = torch.nn.Linear(64, 16)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.nn.functional.gelu(self.fc1(x)))
        out = self.drop(self.fc2(h))
        return ((out - y) ** 2).mean()


def batch() -> tuple[torch.Tensor, ...]:
    """(x, y) of 8 rows whose two halves are identical, and one half (a, b)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    return torch.cat([a, a]), torch.cat([b, b]), a, b


def one_device(x: torch.Tensor, y: torch.Tensor) -> float:
    torch.manual_seed(0)
    model = MLP()
    torch.manual_seed(SEED)
    return model(x, y).item()


def worker(rank: int, world: int) -> dict:
    import autopar

    x, y, _, _ = batch()
    out = {}
    for name, layout in (("dp=2", autopar.Layout(dp=2)), ("tp=2", autopar.Layout(tp=2))):
        torch.manual_seed(0)
        pm = autopar.parallelize(MLP(), world, example_inputs=(x, y), layout=layout)
        for seeds in ("the same seed on every rank", "a seed per rank"):
            torch.manual_seed(SEED if seeds.startswith("the same") else SEED + rank)
            out[f"{name}, {seeds}"] = pm(x, y).item()
    return out


if __name__ == "__main__":
    x, y, a, b = batch()
    ranks = spawn(worker, 2, timeout_s=900)
    print(f"one device, the global batch: {one_device(x, y):.4f}")
    print(f"one device, one half of it:   {one_device(a, b):.4f}")
    for case in ranks[0]:
        print(f"{case}: rank 0 {ranks[0][case]:.4f}, rank 1 {ranks[1][case]:.4f}")
