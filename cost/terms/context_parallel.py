"""Context parallelism: the ring exchange of K/V shards not hidden behind attention."""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.comm import axis_group, collective_time
from cost.compute import MATMUL_OUT_BYTES
from cost.step_facts import StepFacts
from cost.terms.common import exposed_beside
from cost.terms.compute import node_stages
from vocab.layout import Layout

# The backward of attention takes about twice its forward (the 2x of the 6N rule: 2N FLOPs
# forward, 4N backward, Kaplan et al. 2020), so the ring hides behind forward + backward =
# 3 forward attentions of compute.
ATTENTION_FWD_BWD_OVER_FWD = 3


def cp_exposed(facts: StepFacts, cluster: Cluster, lay: Layout, times: np.ndarray,
               scale: float) -> np.ndarray:
    """Exposed CP seconds per pipeline stage for one micro-batch (zeros at cp 1).

    Ring attention (Liu et al. 2023) passes each K/V shard round the cp ranks of its group
    (`axis_group(cluster, cp, tp)`) in cp - 1 point-to-point steps, each transfer overlapped
    with the attention of the block in hand. With the sequence load-balanced (``cp_balance``:
    rank r holds chunks r and 2cp-1-r of 2cp) every step costs every rank the same attention,
    a / cp of the rank's attention time a (forward; 2 a backward). With c one K/V transfer and
    x(c, w) = c - h + s h the part of a transfer left beside w seconds of compute
    (`exposed_beside`), h = min(c, o w) of it hidden (o: `comm_overlap`, 0 on CPU ranks; each
    hidden second costs s = `CostParams.overlap_slowdown`, as every overlapped collective does):

        forward    (cp - 1) x(c, a / cp)
        backward   (cp - 1) x(c, 2 a / cp) + cp g   (dK/dV follow their block, not overlapped)

    with g one dK/dV transfer: the gradients travel the whole ring home (cp hops,
    runtime/ring_attention.py), in autopar's ring as fp32 accumulators (4 / the precision's
    element bytes times c's bytes; Transformer Engine's ring, ``ring_native_attention``, in
    the attention's dtype).

    A transfer is a point-to-point hand-off like a pipeline's: its bytes' ``send_recv`` time
    plus `CostParams.p2p_overhead_s` (the handshake; 2.8 ms on the 2-core box's gloo ranks,
    `autopar calibrate`, 6 us fitted on h100-efa). The pipelines' per-node overhead
    (`p2p_node_overhead_s`) is not added: it was fitted on the playbook's stage hand-offs, and
    the held-out fits drive it to 0.

    The ring sends K and V (and their gradients back) as the kv heads' bytes where it expands
    after the exchange (`StepFacts.cp_kv_heads`: autopar's ring on an expansion
    `passes.kv_expansion` recognises, Transformer Engine's); else the attention's inputs, after
    a grouped-query expansion: heads / kv_heads times those bytes.

    Contiguous blocks (``cp_balance=False``): under a causal mask rank r attends r + 1/2 of
    its cp blocks, the last (2cp - 1) / cp times the average; the others wait for it at the
    ring's transfers, (cp - 1) / cp x 3 a more per attention (forward and backward), added here.
    """
    tp, cp, pp, n = lay.tp, lay.cp, lay.pp, facts.nodes
    exposed_per_stage = np.zeros(pp)
    if cp == 1:
        return exposed_per_stage
    group = axis_group(cluster, cp, tp)
    att = n.is_attention
    # TP beyond the kv heads replicates them, and the TP rank's graph no longer shows the
    # expansion: autopar's ring then sends the expanded K/V (tiny-llama at tp 8 on 4 kv heads)
    heads = facts.cp_kv_heads and (facts.kv_heads is None or tp <= facts.kv_heads)
    kv = n.attention_kv_heads_bytes if heads else n.attention_kv_bytes
    kv_local = kv[att] * scale / cp / np.where(n.tp_div[att], tp, 1)
    grad_scale = 1.0 if facts.ring_native_attention else 4.0 / MATMUL_OUT_BYTES[lay.precision]
    step, grad = (np.array([collective_time("send_recv", float(k) * f, group, cluster)
                            + cluster.params.p2p_overhead_s for k in kv_local])
                  for f in (1.0, grad_scale))
    per_step = times[att] / cp
    exposed = ((cp - 1) * (exposed_beside(step, per_step, cluster)
                           + exposed_beside(step, 2 * per_step, cluster)) + cp * grad)
    if not lay.cp_balance:
        exposed = exposed + (cp - 1) / cp * ATTENTION_FWD_BWD_OVER_FWD * times[att]
    np.add.at(exposed_per_stage, node_stages(facts, cluster, lay)[att], exposed)
    return exposed_per_stage

