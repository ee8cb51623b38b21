"""Bytes per parameter and per activation element of each training precision recipe.

Source: the Ultra-Scale Playbook (shared/reference/playbook-facts.md): bf16 mixed precision with
Adam keeps 2 (bf16 weights) + 2 (bf16 grads) + 4 (fp32 master) + 8 (Adam m, v) = 16 bytes per
parameter, + 4 with an fp32 gradient-accumulation buffer = 20 (nanotron's default); full fp32
training 16 (4 weights + 4 grads + 8 Adam, no separate master copy).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

PRECISIONS = ("fp32", "bf16", "fp8")


@dataclass(frozen=True)
class PrecisionRecipe:
    """Bytes per parameter of each piece of training state, and the matmul dtype.

    param_bytes: weights as the forward uses them. grad_bytes: gradients as backward writes them.
    master_bytes: fp32 master weights (0 when the weights are fp32 already).
    optimizer_bytes: Adam's m and v. grad_accum_bytes: fp32 accumulation buffer (0 if off).
    activation_bytes: bytes per saved activation element. matmul_dtype: GEMM compute dtype.
    """

    name: str
    param_bytes: float
    grad_bytes: float
    master_bytes: float
    optimizer_bytes: float
    grad_accum_bytes: float
    activation_bytes: float
    matmul_dtype: str

    @property
    def state_bytes(self) -> float:
        """All bytes per parameter before any sharding (16 or 20 for bf16)."""
        return (
            self.param_bytes
            + self.grad_bytes
            + self.master_bytes
            + self.optimizer_bytes
            + self.grad_accum_bytes
        )


def recipe(precision: str, fp32_grad_accum: bool = True) -> PrecisionRecipe:
    """The recipe of ``precision`` ("fp32", "bf16", "fp8").

    fp8 keeps the bf16 recipe's state (fp32 master, bf16 weights and saved activations) and
    only casts matmul inputs to FP8, as the playbook recommends.
    fp32_grad_accum adds the 4-byte fp32 buffer to bf16 and fp8; fp32 grads need none.
    """
    if precision == "fp32":
        return PrecisionRecipe("fp32", 4, 4, 0, 8, 0, 4, "fp32")
    if precision in ("bf16", "fp8"):
        accum = 4 if fp32_grad_accum else 0
        return PrecisionRecipe(precision, 2, 2, 4, 8, accum, 2, precision)
    raise ValueError(f"unknown precision {precision!r}; use one of {PRECISIONS}")


def fused_accum(rec: PrecisionRecipe) -> PrecisionRecipe:
    """``rec`` as a framework that accumulates gradients straight into the fp32 buffer holds
    it: no low-precision gradient beside the buffer (Megatron-LM's ``main_grad`` with
    gradient-accumulation fusion: 2 + 4 + 12 = 18 bytes per parameter, 6 + 12/d with its
    distributed optimizer, docs/source/api-guide/dist_optimizer.md; FSDP's sharded fp32
    gradient). Unchanged without an fp32 buffer."""
    return dataclasses.replace(rec, grad_bytes=0.0) if rec.grad_accum_bytes else rec
