"""Context parallelism: the ring exchange of K/V shards not hidden behind attention."""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.layout import Layout
from cost.step_facts import StepFacts
from cost.terms.compute import node_stages

# The backward of attention takes about twice its forward (the 2x of the 6N rule: 2N FLOPs
# forward, 4N backward, Kaplan et al. 2020), so the ring hides behind forward + backward =
# 3 forward attentions of compute.
ATTENTION_FWD_BWD_OVER_FWD = 3


def cp_exposed(facts: StepFacts, cluster: Cluster, lay: Layout, times: np.ndarray,
               scale: float) -> np.ndarray:
    """Exposed CP seconds per pipeline stage for one micro-batch (zeros at cp 1).

    Ring attention (Liu et al. 2023) sends each K/V shard around the cp ranks of its group
    (`axis_group(cluster, cp, tp)`): cp-1 point-to-point steps of K and V in the forward, K, V
    and their gradients again in the backward (3 (cp-1) steps), overlapped with the attention
    they feed; what exceeds that attention's time is exposed.
    """
    tp, cp, pp, n = lay.tp, lay.cp, lay.pp, facts.nodes
    exposed_per_stage = np.zeros(pp)
    if cp == 1:
        return exposed_per_stage
    group = axis_group(cluster, cp, tp)
    att = n.is_attention
    kv_local = n.attention_kv_bytes[att] * scale / cp / np.where(n.tp_div[att], tp, 1)
    step = np.array([collective_time("send_recv", float(k), group, cluster) for k in kv_local])
    comm = 3 * (cp - 1) * step  # forward: cp-1 steps of K,V; backward: K,V again plus dK,dV
    att_time = times[att] * ATTENTION_FWD_BWD_OVER_FWD
    exposed = np.maximum(0.0, comm - att_time)
    np.add.at(exposed_per_stage, node_stages(facts, cluster, lay)[att], exposed)
    return exposed_per_stage
