"""The choices a layout leaves open, made: what the search decided and the cost model prices.

A `Layout` names degrees and recipes; three of its decisions depend on the model and the
cluster and are made by the search (autopar/search/choices.py), never by the cost model:

- ``fp8``: the weight groups whose matmuls run in FP8 (``Layout.fp8`` "auto" resolved by the
  predicted gain at the local shape; "all", "none" or a tuple name them directly);
- ``chunks``: the pipeline chunk of every slot (slot 0 before the blocks, slot i + 1 block i,
  the last slot after them): the contiguous cut of the blocks into pp x virtual-stage chunks;
- ``recompute``: what each pipeline stage recomputes (``Layout.recompute`` "auto" resolved
  per stage; a manual mode is the same on every stage).

The search attaches them to the layout it prices (``Layout.choices``); cost/ reads them and
refuses a layout whose open choices are not made (`ChoicesMissingError`); the plan's
`PlanDecisions` carries them to the passes. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RecomputeChoice:
    """What the recompute pass rebuilds (passes/recompute.py): ``mode`` "none", "selective"
    (element-wise values; matmul and attention outputs kept) or "full" (every forward value of
    a block but its output), and under "selective" the heavy groups whose outputs are rebuilt
    as well (``outputs``: names as `passes.recompute.heavy_groups` gives them, tied across
    blocks): a partial choice between selective and full."""

    mode: str = "none"
    outputs: tuple[str, ...] = ()

    def describe(self) -> str:
        """One line: the mode and what a partial choice adds."""
        if self.mode == "selective" and self.outputs:
            return "selective + the outputs of " + ", ".join(self.outputs)
        return self.mode


@dataclass(frozen=True)
class Choices:
    """The open decisions of one layout, made (see the module docstring). A field left None is
    not made yet: the search makes them in this order, each reading the ones before."""

    fp8: tuple[str, ...] | None = None
    chunks: tuple[int, ...] | None = None
    recompute: tuple[RecomputeChoice, ...] | None = None
    # hashed once: layouts carrying choices key the cost model's caches
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.fp8, self.chunks, self.recompute)))

    def __hash__(self) -> int:
        return self._hash


class ChoicesMissingError(ValueError):
    """The cost model was asked to price a layout whose open choices the search has not made."""

    def __init__(self, layout_short: str, what: str):
        super().__init__(
            f"layout {layout_short}: its {what} is a choice the search makes; price "
            "autopar.search.choices.choose(facts, cluster, layout) instead of the bare layout "
            "(cost/ prices layouts whose choices are made)")
