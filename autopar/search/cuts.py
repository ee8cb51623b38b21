"""Where the pipeline cuts go: contiguous stages of blocks that balance the work.

A pipeline of p stages takes contiguous runs of blocks (`cost.stages`: slots), at least one per
stage, the first stage also the slot before the blocks and the last the slot after.
`balanced_cuts` finds the cut that minimises the heaviest stage (exact, by dynamic programming
over the blocks); `autopar.search.choices.choose_chunks` weighs each slot by the step's own
seconds for it under the layout, so a large vocabulary gives the last stage fewer blocks, as
nanotron's pipeline engine splits by its blocks' compute costs. Among equally heavy cuts the
even split is kept. Under a memory budget (`cost.stages.StageMemory`) only cuts whose every
stage fits are considered: 1F1B's first stage holds p micro-batches of activations, so a tight
device moves blocks off it.
"""

from __future__ import annotations

import numpy as np

from cost.stages import StageMemory


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
