"""Where the pipeline cuts go: contiguous stages of blocks that balance the work.

The step is split into slots: the nodes before the repeated blocks (embedding; slot 0), each
block (slots 1..L) and the nodes after them (final norm, head, loss; slot L+1). A pipeline of p
stages takes contiguous runs of blocks, at least one per stage, the first stage also the slot
before the blocks and the last the slot after. `balanced_cuts` finds the cut that minimises the
heaviest stage (exact, by dynamic programming over the blocks); `cost.terms.compute.slot_stages`
weighs each slot by the step's own seconds for it under the layout, so a large vocabulary gives
the last stage fewer blocks, as nanotron's pipeline engine splits by its blocks' compute costs.
Among equally heavy cuts the even split is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


def balanced_cuts(block_cost: np.ndarray, pp: int, before: float = 0.0,
                  after: float = 0.0) -> np.ndarray:
    """Stage of each block: the contiguous split into ``pp`` non-empty stages that minimises
    the largest stage cost (``before`` counts on the first stage, ``after`` on the last)."""
    n = len(block_cost)
    if not 1 <= pp <= max(n, 1):
        raise ValueError(f"pp={pp} needs between 1 and {n} blocks per split")
    if n == 0:
        return np.zeros(0, dtype=int)
    even = np.minimum(np.arange(n) * pp // n, pp - 1).astype(int)
    if pp == 1:
        return even
    prefix = np.concatenate([[0.0], np.cumsum(block_cost, dtype=float)])

    inf = float("inf")
    # best[k][j]: the least heaviest stage of blocks 0..j-1 split into k+1 stages
    best = np.full((pp, n + 1), inf)
    cut = np.zeros((pp, n + 1), dtype=int)
    best[0][1:] = prefix[1:] + before + (after if pp == 1 else 0.0)
    for k in range(1, pp):
        extra = (after if k == pp - 1 else 0.0)
        for j in range(k + 1, n + 1):
            i = np.arange(k, j)  # the last stage's first block
            value = np.maximum(best[k - 1][i], prefix[j] - prefix[i] + extra)
            pick = int(np.argmin(value))
            best[k][j], cut[k][j] = value[pick], i[pick]
    stage_cost = np.bincount(even, weights=block_cost, minlength=pp)
    stage_cost[0] += before
    stage_cost[-1] += after
    if stage_cost.max() <= best[pp - 1][n] * (1 + 1e-9):
        return even
    out = np.zeros(n, dtype=int)
    j = n
    for k in range(pp - 1, 0, -1):
        i = cut[k][j]
        out[i:j] = k
        j = i
    return out


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
