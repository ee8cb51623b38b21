"""The ring's exposed seconds (`cost.terms.context_parallel.cp_exposed`): each transfer is a
point-to-point hand-off that pays the handshake (`CostParams.p2p_overhead_s`); K/V transfers
hide behind the block in hand only where communication can overlap compute (`comm_overlap`:
GPUs, not CPU ranks), each hidden second at `CostParams.overlap_slowdown`; the dK/dV
accumulators travel the whole ring home (cp hops), in fp32 in autopar's ring."""

from __future__ import annotations

import dataclasses

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


def _transfers(facts, cluster, factor: float = 1.0) -> np.ndarray:
    """One K/V block's send/recv seconds per attention node (``factor`` times its bytes),
    without the handshake."""
    att = facts.nodes.is_attention
    group = axis_group(cluster, CP, 1)
    return np.array([collective_time("send_recv", factor * float(b) / CP, group, cluster)
                     for b in facts.nodes.attention_kv_heads_bytes[att]])


@pytest.mark.parametrize("attention_s", [0.0, 10.0])
def test_cpu_ranks_hide_no_ring_transfer_and_pay_each_handshake(llama_step, attention_s):
    facts = llama_step[3].facts()
    cpu = Cluster("cpu", nodes=1, gpus_per_node=CP)
    # K/V forward and backward (cp - 1 each), none hidden; dK/dV cp hops of fp32 (bf16 inputs)
    kv, grad = _transfers(facts, cpu), _transfers(facts, cpu, 2.0)
    bare = _exposed(facts, cpu, attention_s, p2p_overhead_s=0.0, overlap_slowdown=0.5)
    assert bare == pytest.approx(2 * (CP - 1) * kv.sum() + CP * grad.sum())
    shaken = _exposed(facts, cpu, attention_s, p2p_overhead_s=2e-3, overlap_slowdown=0.5)
    assert shaken - bare == pytest.approx((3 * CP - 2) * 2e-3 * kv.size)


def test_gpus_hide_the_kv_transfers_behind_long_blocks_at_the_overlap_price(llama_step):
    facts = llama_step[3].facts()
    gpu = Cluster("h100", nodes=4, gpus_per_node=8)
    kv, grad = _transfers(facts, gpu) + 1e-5, _transfers(facts, gpu, 2.0) + 1e-5
    # blocks far longer than a transfer: K/V hidden, the gradients' cp hops exposed
    free = _exposed(facts, gpu, 10.0, p2p_overhead_s=1e-5, overlap_slowdown=0.0)
    assert free == pytest.approx(CP * grad.sum())
    slowed = _exposed(facts, gpu, 10.0, p2p_overhead_s=1e-5, overlap_slowdown=0.25)
    assert slowed - free == pytest.approx((CP - 1) * 2 * 0.25 * kv.sum())
    # no compute to hide behind: every transfer exposed, as on CPU ranks
    bare = _exposed(facts, gpu, 0.0, p2p_overhead_s=1e-5, overlap_slowdown=0.25)
    assert bare == pytest.approx(2 * (CP - 1) * kv.sum() + CP * grad.sum())
    # Transformer Engine's ring sends its gradients in the attention's dtype
    te = _exposed(dataclasses.replace(facts, ring_native_attention=True), gpu, 0.0,
                  p2p_overhead_s=1e-5, overlap_slowdown=0.25)
    assert te == pytest.approx((3 * CP - 2) * kv.sum())
