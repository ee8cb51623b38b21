"""The collectives a parameter's placement causes, in words (the plan's summary and report)."""

from __future__ import annotations

from autopar.strategies.tp_recipe import COL, ROW, VOCAB
from cost import Layout


def param_collectives(role: str, layout: Layout, zero_sharded: bool) -> str:
    """The collectives a parameter's placement causes, in words."""
    parts = []
    if layout.dp * layout.cp > 1:
        zero = layout.zero if zero_sharded else 0  # a weight ZeRO cannot split stays whole
        parts.append({0: "grad all-reduce", 1: "grad reduce-scatter + weight all-gather",
                      2: "grad reduce-scatter + weight all-gather",
                      3: "weight all-gather fwd+bwd, grad reduce-scatter"}[zero])
    if layout.tp > 1:
        if role == COL:
            parts.append("input all-gather (SP)" if layout.sp else "input-grad all-reduce")
        elif role == ROW:
            parts.append("output reduce-scatter (SP)" if layout.sp else "output all-reduce")
        elif role == VOCAB:
            parts.append("output all-reduce")
        elif layout.sp:
            parts.append("grad all-reduce over tp (SP)")
    return "; ".join(parts) or "none"
