"""Steps of the collective algorithms NCCL and gloo run (ring, pairwise exchange)."""

from __future__ import annotations


def ring_steps(kind: str, n: int, nodes: int) -> tuple[int, int]:
    """(steps, of which cross nodes) of NCCL's ring for ``kind`` on n ranks over ``nodes``."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (nodes - 1)
    if kind == "send_recv":
        return 1, 1 if nodes > 1 else 0
    # all_gather / reduce_scatter rings; all_to_all as pairwise exchange, n-1 rounds
    # (Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication in MPICH").
    return n - 1, nodes - 1
