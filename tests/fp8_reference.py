"""An eager FP8 linear, written from the math and independent of passes/fp8.py: the reference
a single device computes when its matmuls run in FP8 (same casts, same scales).

    s = q / max(amax|T|, 1e-12),  T8 = fp8(clamp(T * s, -q, q)),  A B = _scaled_mm(A8, B8, 1/s_A, 1/s_B)

Tensorwise: one amax per tensor; rowwise: one per row of A and per column of B (along K).
"""

from __future__ import annotations

import torch
from torch import nn

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
RECIPES = {  # name: (rowwise, gradient format, weight gradient in FP8)
    "tensorwise": (False, E5M2, True),
    "rowwise": (True, E4M3, True),
    "rowwise_with_gw_hp": (True, E4M3, False),
}


def _cast(t: torch.Tensor, dim: int | None, fmt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    q = torch.finfo(fmt).max
    wide = t.float()
    amax = wide.abs().amax() if dim is None else wide.abs().amax(dim=dim, keepdim=True)
    floor = amax.clamp_min(1e-12)
    return (wide * (floor.reciprocal() * q)).clamp(-q, q).to(fmt), floor / q


def fp8_matmul(a: torch.Tensor, b: torch.Tensor, rowwise: bool, a_fmt: torch.dtype,
               out_dtype: torch.dtype) -> torch.Tensor:
    """A @ B in FP8: A [M, K] scaled along K per row (rowwise), B [K, N] per column (e4m3)."""
    a8, sa = _cast(a, 1 if rowwise else None, a_fmt)
    b8, sb = _cast(b, 0 if rowwise else None, E4M3)
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), sa.contiguous(),
                            sb.contiguous(), out_dtype=out_dtype)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, recipe):
        ctx.save_for_backward(x, weight)
        ctx.recipe = recipe
        ctx.has_bias = bias is not None
        rowwise = RECIPES[recipe][0]
        x2 = x.reshape(-1, x.shape[-1])
        y = fp8_matmul(x2, weight.t(), rowwise, E4M3, x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        rowwise, grad_fmt, wgrad_fp8 = RECIPES[ctx.recipe]
        dy2 = dy.reshape(-1, dy.shape[-1])
        x2 = x.reshape(-1, x.shape[-1])
        dx = fp8_matmul(dy2, weight, rowwise, grad_fmt, dy.dtype).reshape(x.shape)
        dw = fp8_matmul(dy2.t(), x2, rowwise, grad_fmt, dy.dtype) if wgrad_fp8 else dy2.t() @ x2
        db = dy2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class Fp8Linear(nn.Module):
    """Wraps an ``nn.Linear`` (sharing its parameters): the same layer with FP8 matmuls."""

    def __init__(self, linear: nn.Linear, recipe: str) -> None:
        super().__init__()
        self.weight, self.bias, self.recipe = linear.weight, linear.bias, recipe

    def forward(self, x):
        return _Fp8Linear.apply(x, self.weight, self.bias, self.recipe)


class Fp8Conv1D(nn.Module):
    """Wraps a transformers ``Conv1D`` (GPT-2; sharing its parameters) with FP8 matmuls."""

    def __init__(self, conv, recipe: str) -> None:
        super().__init__()
        self.weight, self.bias, self.recipe = conv.weight, conv.bias, recipe

    def forward(self, x):
        # y = x W + b with W stored [in, out]: the FP8 linear of W^T (its gradient comes back
        # through the transpose)
        return _Fp8Linear.apply(x, self.weight.t(), self.bias, self.recipe)


def fp8_layer_weights(model: nn.Module) -> set[str]:
    """Names (as ``named_parameters`` gives them) of the weights `to_fp8` converts."""
    ids = {id(m.weight) for m in model.modules()
           if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"}
    return {n for n, p in model.named_parameters() if id(p) in ids}


def to_fp8(model: nn.Module, recipe: str = "tensorwise", weights: set[str] | None = None) -> nn.Module:
    """``model`` with its ``nn.Linear`` (and transformers ``Conv1D``) layers in FP8, in place:
    all of them, or those whose weight is (or is tied to) one of ``weights`` (``plan.fp8``)."""
    chosen = None if weights is None else {
        id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in weights}
    for _, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if chosen is not None and id(getattr(child, "weight", None)) not in chosen:
                continue
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Fp8Linear(child, recipe))
            elif type(child).__name__ == "Conv1D":
                setattr(module, child_name, Fp8Conv1D(child, recipe))
    return model
