"""Whether the global batch is large enough to fill the cluster, and the batch that would.

The rule (a bound every layout obeys, not a prediction): a layout splits the world into
dp * (tp * cp * pp) devices, and data parallelism cannot exceed the batch (dp divides the
batch B of sequences). So each model replica spans

    tp * cp * pp = world / dp >= world / B

devices. With B < world / g (g = GPUs per node), every layout must spread one sequence's
model over more than a node: a pipeline (bubble, transfers), context parallelism (ring
exchange) or TP across nodes, whatever the cost model says of them. The batch that fills the
cluster is the smallest at which one node's TP group can hold a whole replica and each replica
still gets a sequence: B_fill = world / g sequences (the number of nodes). A model too large
for one node needs more than that for its own reasons; this rule only says when the batch,
not the model, forces the extra parallelism.
"""

from __future__ import annotations

from cost import Cluster


def filling_batch(cluster: Cluster) -> int:
    """B_fill = world / g sequences: the smallest global batch at which a layout can give every
    replica of one node (TP inside the node, no pipeline or context parallelism) a sequence."""
    gpn = max(1, min(cluster.gpus_per_node, cluster.world_size))
    return max(1, cluster.world_size // gpn)


def small_batch_note(batch: int, seq: int, cluster: Cluster, chosen: str = "",
                     tokens_per_s_per_gpu: float | None = None) -> str | None:
    """One sentence when a global batch of ``batch`` sequences of ``seq`` tokens is too small
    for ``cluster`` (fewer sequences than `filling_batch`), naming the batch that fills it;
    None otherwise. ``chosen``/``tokens_per_s_per_gpu``: the plan's layout and throughput, quoted."""
    fill = filling_batch(cluster)
    if batch >= fill:
        return None
    rate = f" at {tokens_per_s_per_gpu:,.0f} tok/s/GPU" if tokens_per_s_per_gpu else ""
    at = f", here {chosen}{rate}" if chosen else ""
    return (f"the global batch of {batch:,} sequences ({batch * seq:,} tokens) is too small for "
            f"{cluster.world_size:,} devices: with fewer sequences than the {fill:,} node-sized "
            f"replicas, every layout splits a sequence's model over more than one node (pipeline, "
            f"context or cross-node tensor parallelism){at}; a global batch of at least "
            f"{fill:,} sequences ({fill * seq:,} tokens, --global-batch-tokens {fill * seq}) "
            f"fills the cluster")
