"""Pipeline stages as the cost model reads them: slots, the memory a run of blocks holds, and
the stage of every node under a cut.

The step is split into slots: the nodes before the repeated blocks (embedding; slot 0), each
block (slots 1..L) and the nodes after them (final norm, head, loss; slot L+1). A pipeline of p
stages takes contiguous runs of blocks, at least one per stage, the first stage also the slot
before the blocks and the last the slot after. Where the cuts go is the search's choice
(`autopar.search.cuts`); `StageMemory` is what it weighs a cut's memory with.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StageMemory:
    """What a stage of blocks holds on one device, for cuts under the memory: model state
    (``static``: weights, gradients, optimizer state) and one micro-batch's saved activations
    (``act``) per block and for the slots before / after the blocks; each stage holds
    ``flight[k]`` micro-batches of activations under the schedule and may use ``budget`` bytes
    (the device less what every stage holds alike: reserve, communication buffers, the
    backward's transient)."""

    static: np.ndarray
    act: np.ndarray
    static_before: float
    act_before: float
    static_after: float
    act_after: float
    flight: Sequence[float]
    budget: float

    def stage_bytes(self, k: int, first: np.ndarray | int, end: np.ndarray | int, pp: int):
        """Bytes of stage ``k`` (of ``pp``) holding blocks first..end-1 (arrays broadcast)."""
        static = np.concatenate([[0.0], np.cumsum(self.static)])
        act = np.concatenate([[0.0], np.cumsum(self.act)])
        return self._stage_bytes(k, static[end] - static[first], act[end] - act[first], pp)

    def _stage_bytes(self, k: int, s, a, pp: int):
        """`stage_bytes` from the blocks' own model state ``s`` and activations ``a``."""
        if k == 0:
            s, a = s + self.static_before, a + self.act_before
        if k == pp - 1:
            s, a = s + self.static_after, a + self.act_after
        return s + self.flight[k] * a

    def fits(self, stages: np.ndarray, pp: int) -> bool:
        """Whether every stage of the block -> stage map ``stages`` fits its budget."""
        bounds = np.searchsorted(stages, np.arange(pp + 1))
        return all(self.stage_bytes(k, int(bounds[k]), int(bounds[k + 1]), pp) <= self.budget
                   for k in range(pp))


def effective_layers(nodes: Iterable[tuple[str, bool, int | None]], n_layers: int) -> dict[str, int]:
    """The slot of every node of a joint graph, given in execution order as (name, is_backward,
    block index or None): a node inside a block gets its block; a node outside the blocks goes
    to the block last entered in its own pass, so before the first block -1 (the first stage)
    and after the last block ``n_layers`` (the last stage). The backward runs the blocks in
    reverse: its nodes before the last block's backward are the head's and the loss's
    (``n_layers``), those after block 0's backward the embedding's (-1).

    One rule for the cost model (`autopar.search.facts`) and the pipeline split that runs the
    plan (`passes.pipeline_split`), so a node is priced on the stage it runs on.
    """
    out: dict[str, int] = {}
    fwd_current, bwd_current = -1, n_layers
    for name, backward, layer in nodes:
        if layer is not None:
            out[name] = layer
            if backward:
                bwd_current = layer if layer > 0 else -1
            else:
                fwd_current = layer if layer < n_layers - 1 else n_layers
            continue
        out[name] = bwd_current if backward else fwd_current
    return out


def slot_stage_map(stages: Sequence[tuple[int, int]], n_layers: int) -> np.ndarray:
    """Stage of every slot (index = block + 1: 0 before the blocks, ``n_layers`` + 1 after)
    from a plan's stages, (first, last) block of each."""
    out = np.zeros(n_layers + 2, dtype=int)
    for s, (first, last) in enumerate(stages):
        out[first + 1:last + 2] = s
    out[-1] = len(stages) - 1
    return out


def node_stages(nodes: Iterable[tuple[str, bool, int | None]], n_layers: int,
                stages: Sequence[tuple[int, int]]) -> dict[str, int]:
    """The pipeline stage of every node (given as for `effective_layers`) under ``stages``,
    (first, last) block of each: where the pipeline split runs it and the cost model prices it."""
    slot = slot_stage_map(stages, n_layers)
    return {name: int(slot[layer + 1]) for name, layer in effective_layers(nodes, n_layers).items()}
