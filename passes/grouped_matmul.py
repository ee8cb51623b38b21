"""Grouped (per-expert) matmuls of MoE layers: which ops they are, their work, their TP shards.

A grouped matmul multiplies each group of rows of X (the tokens routed to expert e, rows
offs[e-1]:offs[e] once X is sorted by expert) by that expert's weight:

    Y[g_e] = X[g_e] W_e,   X [S, in],  W [E, in, out],  Y [S, out]

Under tensor parallelism every expert's weight splits as Megatron's linear layers do, all
experts alike (the same rows of the routing, the same offsets on every rank):

    column  W_e = [W_e,1 .. W_e,t] (out):  Y_i = X W_:,:,i     X replicated, Y sharded
    row     W_e = [W_e,1; ..; W_e,t] (in): Y = sum_i X_i W_i   X sharded,    Y partial

and the backward dX = dY W^T, dW_e = X[g_e]^T dY[g_e] follows: under a column weight dX is
partial and dW sharded like W; under a row weight dX is sharded and dW sharded like W.

The ops: transformers' `grouped_mm_fallback` and its backward (what its MoE experts run in
fp32 and under tracing) and aten's `_grouped_mm` (bf16 on GPU; its backward is two more
`_grouped_mm`, the weight's gradient the 2-D x 2-D form with a 3-D output).
"""

from __future__ import annotations

import torch
from torch import fx

aten = torch.ops.aten

_FALLBACK = "transformers.grouped_mm_fallback.default"
_FALLBACK_BACKWARD = "transformers.grouped_mm_fallback_backward.default"


def _ndims(node: fx.Node) -> tuple[int, ...]:
    return tuple(getattr(a.meta.get("val"), "ndim", 0) if isinstance(a, fx.Node) else 0
                 for a in node.args[:2])


def is_grouped_forward(node: fx.Node) -> bool:
    """Y = grouped(X [S, in], W [E, in, out], offs): the forward form of either op (under
    aten, the input gradient dX = grouped(dY, W^T) has this form too)."""
    if node.op != "call_function":
        return False
    if str(node.target) == _FALLBACK:
        return True
    return node.target == aten._grouped_mm.default and _ndims(node) == (2, 3)


def is_grouped_weight_grad(node: fx.Node) -> bool:
    """aten's dW = grouped(X^T [in, S], dY [S, out], offs) -> [E, in, out]."""
    return (node.op == "call_function" and node.target == aten._grouped_mm.default
            and _ndims(node) == (2, 2))


def is_grouped_backward(node: fx.Node) -> bool:
    """transformers' backward op: (X, W, offs, dY) -> (dX, dW)."""
    return node.op == "call_function" and str(node.target) == _FALLBACK_BACKWARD


def is_grouped(node: fx.Node) -> bool:
    """Any grouped matmul (forward, backward, or aten's weight-gradient form)."""
    return is_grouped_forward(node) or is_grouped_backward(node) or (
        node.op == "call_function" and node.target == aten._grouped_mm.default)


def grouped_flops(node: fx.Node) -> float:
    """Tensor-core FLOPs of a grouped matmul: 2 S in out for the forward (every row meets
    one expert), twice that for transformers' backward (dX and dW); 0 for other nodes."""
    if not is_grouped(node):
        return 0.0
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else None for a in node.args[:2]]
    a, b = vals
    if a is None or b is None:
        return 0.0
    if is_grouped_backward(node):  # (X [S, in], W [E, in, out])
        return 4.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.ndim == 2 and b.ndim == 3:  # X [S, in] @ W [E, in, out]
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.ndim == 2 and b.ndim == 2:  # dW: X^T [in, S] @ dY [S, out], grouped over S
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    if a.ndim == 3 and b.ndim == 2:  # [E, M, K] @ [K, N], grouped over N
        return 2.0 * a.shape[1] * a.shape[2] * b.shape[1]
    return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]  # batched [E, M, K] @ [E, K, N]
