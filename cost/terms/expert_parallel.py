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
    return out
