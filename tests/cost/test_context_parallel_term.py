"""The ring's exposed seconds (`cost.terms.context_parallel.cp_exposed`): each transfer is a
point-to-point hand-off that pays the handshake (`CostParams.p2p_overhead_s`), hides behind the
block in hand only where communication can overlap compute (`comm_overlap`: GPUs, not CPU
ranks), and each hidden second costs `CostParams.overlap_slowdown`."""

from __future__ import annotations

import numpy as np
import pytest

from cost import Cluster, Layout
from cost.comm import axis_group, collective_time
from cost.terms.context_parallel import cp_exposed

CP = 4
LAYOUT = Layout(cp=CP, microbatch=1, grad_accum=16)


def _exposed(facts, cluster, attention_s: float, **params) -> float:
    """The ring's seconds (one stage) with every attention node taking ``attention_s``."""
    cluster.params = cluster.params.replace(**params)
    times = np.where(facts.nodes.is_attention, attention_s, 0.0)
    return float(cp_exposed(facts, cluster, LAYOUT.resolve(facts.batch, "bf16"), times, 1.0).sum())


def _transfers(facts, cluster) -> np.ndarray:
    """One K/V block's send/recv seconds per attention node, without the handshake."""
    att = facts.nodes.is_attention
    group = axis_group(cluster, CP, 1)
    return np.array([collective_time("send_recv", float(b) / CP, group, cluster)
                     for b in facts.nodes.attention_kv_heads_bytes[att]])


@pytest.mark.parametrize("attention_s", [0.0, 10.0])
def test_cpu_ranks_hide_no_ring_transfer_and_pay_each_handshake(llama_step, attention_s):
    facts = llama_step[3].facts()
    cpu = Cluster("cpu", nodes=1, gpus_per_node=CP)
    c = _transfers(facts, cpu)
    # 3 (cp - 1) transfers per attention: K/V forward, K/V and dK/dV backward, none hidden
    bare = _exposed(facts, cpu, attention_s, p2p_overhead_s=0.0, overlap_slowdown=0.5)
    assert bare == pytest.approx(3 * (CP - 1) * c.sum())
    shaken = _exposed(facts, cpu, attention_s, p2p_overhead_s=2e-3, overlap_slowdown=0.5)
    assert shaken - bare == pytest.approx(3 * (CP - 1) * 2e-3 * c.size)


def test_gpus_hide_the_kv_transfers_behind_long_blocks_at_the_overlap_price(llama_step):
    facts = llama_step[3].facts()
    gpu = Cluster("h100", nodes=4, gpus_per_node=8)
    c = _transfers(facts, gpu) + 1e-5
    # blocks far longer than a transfer: forward and backward K/V hidden, dK/dV exposed
    free = _exposed(facts, gpu, 10.0, p2p_overhead_s=1e-5, overlap_slowdown=0.0)
    assert free == pytest.approx((CP - 1) * c.sum())
    slowed = _exposed(facts, gpu, 10.0, p2p_overhead_s=1e-5, overlap_slowdown=0.25)
    assert slowed - free == pytest.approx((CP - 1) * 2 * 0.25 * c.sum())
    # no compute to hide behind: every transfer exposed, as on CPU ranks
    bare = _exposed(facts, gpu, 0.0, p2p_overhead_s=1e-5, overlap_slowdown=0.25)
    assert bare == pytest.approx(3 * (CP - 1) * c.sum())
