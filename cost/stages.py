"""Where the pipeline cuts go: contiguous stages of blocks that balance the work.

The step is split into slots: the nodes before the repeated blocks (embedding; slot 0), each
block (slots 1..L) and the nodes after them (final norm, head, loss; slot L+1). A pipeline of p
stages takes contiguous runs of blocks, at least one per stage, the first stage also the slot
before the blocks and the last the slot after. `balanced_cuts` finds the cut that minimises the
heaviest stage (exact, by dynamic programming over the blocks); `cost.terms.compute.slot_stages`
weighs each slot by the step's own seconds for it under the layout, so a large vocabulary gives
the last stage fewer blocks, as nanotron's pipeline engine splits by its blocks' compute costs.
Among equally heavy cuts the even split is kept. Under a memory budget (`StageMemory`) only cuts
whose every stage fits are considered: 1F1B's first stage holds p micro-batches of activations,
so a tight device moves blocks off it.
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


def balanced_cuts(block_cost: np.ndarray, pp: int, before: float = 0.0,
                  after: float = 0.0, memory: StageMemory | None = None) -> np.ndarray:
    """Stage of each block: the contiguous split into ``pp`` non-empty stages that minimises
    the largest stage cost (``before`` counts on the first stage, ``after`` on the last),
    among the splits whose every stage fits ``memory`` when given (the unconstrained split
    when none does: the layout does not fit, whatever the cut)."""
    found = fitting_cuts(block_cost, pp, before, after, memory)
    return found if found is not None else balanced_cuts(block_cost, pp, before, after)


def fitting_cuts(block_cost: np.ndarray, pp: int, before: float = 0.0,
                 after: float = 0.0, memory: StageMemory | None = None) -> np.ndarray | None:
    """`balanced_cuts`, or None where no split fits ``memory``."""
    n = len(block_cost)
    if not 1 <= pp <= max(n, 1):
        raise ValueError(f"pp={pp} needs between 1 and {n} blocks per split")
    if n == 0:
        return np.zeros(0, dtype=int)
    even = np.minimum(np.arange(n) * pp // n, pp - 1).astype(int)
    if pp == 1:
        return even
    prefix = np.concatenate([[0.0], np.cumsum(block_cost, dtype=float)])
    found = _minimax_split(prefix, pp, before, after, memory)
    if found is None:
        return None
    out, heaviest = found
    stage_cost = np.bincount(even, weights=block_cost, minlength=pp)
    stage_cost[0] += before
    stage_cost[-1] += after
    if stage_cost.max() <= heaviest * (1 + 1e-9) and (memory is None or memory.fits(even, pp)):
        return even
    return out


def _minimax_split(prefix: np.ndarray, pp: int, before: float, after: float,
                   memory: StageMemory | None) -> tuple[np.ndarray, float] | None:
    """The dynamic program of `balanced_cuts`: (stage of each block, heaviest stage), or None
    when no split fits ``memory``. best[k][j] is the least heaviest stage of blocks 0..j-1 in
    k+1 stages, over the first block i of stage k: max(best[k-1][i], cost of i..j-1).

    Only the band that can end in a full split is computed: stage k starts at block i >= k
    and ends before block j <= n - (pp - 1 - k) (one block for each stage after it)."""
    n = len(prefix) - 1
    inf = float("inf")
    span = prefix[None, :] - prefix[:, None]  # [i, j]: cost of blocks i..j-1
    ahead = np.arange(n + 1)[:, None] < np.arange(n + 1)[None, :]  # i < j
    if memory is not None:
        static = np.concatenate([[0.0], np.cumsum(memory.static)])
        act = np.concatenate([[0.0], np.cumsum(memory.act)])
        own_static = static[None, :] - static[:, None]
        own_act = act[None, :] - act[:, None]

    def allowed(k: int, rows: slice, cols: slice) -> np.ndarray:
        ok = ahead[rows, cols]
        if memory is None:
            return ok
        held = memory._stage_bytes(k, own_static[rows, cols], own_act[rows, cols], pp)
        return ok & (held <= memory.budget)

    best = np.full((pp, n + 1), inf)
    cut = np.zeros((pp, n + 1), dtype=int)
    cols = slice(1, n - pp + 2)
    best[0, cols] = np.where(allowed(0, slice(0, 1), cols), span[0:1, cols] + before, inf)[0]
    for k in range(1, pp):
        extra = after if k == pp - 1 else 0.0
        last = n - (pp - 1 - k)  # the last end of stage k
        rows, cols = slice(k, last), slice(k + 1, last + 1)
        value = np.maximum(best[k - 1, rows][:, None], span[rows, cols] + extra)
        value = np.where(allowed(k, rows, cols), value, inf)
        first = np.argmin(value, axis=0)  # the first i among equals, as a loop over i would
        cut[k, cols] = first + k
        best[k, cols] = value[first, np.arange(value.shape[1])]
    if not np.isfinite(best[pp - 1][n]):
        return None
    out = np.zeros(n, dtype=int)
    j = n
    for k in range(pp - 1, 0, -1):
        i = cut[k][j]
        out[i:j] = k
        j = i
    return out, float(best[pp - 1][n])


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
