"""Expert parallelism: the dispatch and combine all-to-alls of the experts' tokens."""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.step_facts import StepFacts
from cost.terms.compute import stage_of
from vocab.layout import Layout


def ep_comm(facts: StepFacts, cluster: Cluster, lay: Layout, scale: float) -> np.ndarray:
    """EP seconds per pipeline stage for one micro-batch (zeros at ep 1).

    Every block with experts moves the activations entering and leaving them
    (`StepFacts.expert_io_bytes`, local: / cp) through an all-to-all over the ep group
    (`axis_group(cluster, ep, tp)`), in the forward and again in the backward; not overlapped
    (the experts wait for their tokens). Under TP every TP rank dispatches its data-parallel
    rank's tokens whole (passes/expert_parallel.py after TP: the experts' column-parallel
    inputs are gathered over the sequence under SP), to the ep ranks of its own TP index.
    Experts stacked in one parameter (`StepFacts.expert_gather_bytes`) receive the whole ep
    group's routed rows by all-gather and return results by reduce-scatter
    (passes/expert_parallel_stacked.py): ep times an all-to-all's traffic.
    """
    pp = lay.pp
    out = np.zeros(pp)
    if lay.ep == 1:
        return out
    group = axis_group(cluster, lay.ep, lay.tp)
    for layer_index, nb in enumerate(facts.expert_io_bytes):
        if nb > 0:
            local = float(nb) * scale / lay.cp
            t = 2 * collective_time("all_to_all", local, group, cluster)  # fwd + bwd
            out[stage_of(facts, np.array([layer_index - 1]), cluster, lay)[0]] += t
    for layer_index, nb in enumerate(facts.expert_gather_bytes):
        if nb > 0:
            # stacked experts: the routed rows in (X) all-gathered and out (Y) reduce-scattered,
            # K = ep x a rank's rows each (nccl-tests' size: the gathered whole); again for the
            # gradients in the backward. X and Y are priced as halves of the recorded bytes.
            whole = lay.ep * float(nb) * scale / lay.cp / 2
            t = 2 * (collective_time("all_gather", whole, group, cluster)
                     + collective_time("reduce_scatter", whole, group, cluster))
            out[stage_of(facts, np.array([layer_index - 1]), cluster, lay)[0]] += t
    return out
