"""The plan's vocabulary: the degrees of a layout (`Layout`) and the typed plan every layer
reads (`plan_types`: placements, decisions, the block-name rule). It imports nothing but the
standard library (and torch.fx for type hints), so the passes and the runtime read a plan
without importing the cost model or the solver."""

from vocab.layout import Layout, LayoutError

__all__ = ["Layout", "LayoutError"]
