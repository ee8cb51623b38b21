"""Collective times against hand values and against the playbook's measured bus bandwidth."""

from __future__ import annotations

import math

import pytest

from cost import comm
from cost.cluster import Cluster
from cost.comm import Group, axis_group, bus_bandwidth, collective_time

TABLE_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


def test_group_and_axis_group():
    c = Cluster("h100", nodes=8)
    assert axis_group(c, 8, 1) == Group(8, 8)  # TP=8 inside a node
    assert axis_group(c, 8, 8).nodes == 8  # DP outside TP=8: one rank per node
    assert axis_group(c, 4, 2) == Group(4, 4)  # stride 2: 4 of them fit on a node
    assert axis_group(c, 16, 2) == Group(16, 4) and Group(16, 4).nodes == 4
    with pytest.raises(ValueError):
        Group(4, 8)


def test_hand_values_inside_a_node():
    c = Cluster("h100")
    g = Group(8, 8)
    k = 1e9
    # all-gather: alpha = 6.6 us base + 7 NVLink hops x 0.6 us = 10.8 us;
    # busbw = 450 GB/s x 250/450 = 250 GB/s; t = 10.8e-6 + 7/8 * 1e9 / 250e9.
    assert collective_time("all_gather", k, g, c) == pytest.approx(10.8e-6 + 0.875 * k / 250e9)
    # all-reduce: 14 hops, NVLS busbw 436 GB/s; t = 6.6 + 14 x 0.6 us + 2*7/8 * K / 436e9.
    assert collective_time("all_reduce", k, g, c) == pytest.approx(15e-6 + 1.75 * k / 436e9)
    # send_recv inside a node: one hop, K / (450 x 250/450 GB/s).
    assert collective_time("send_recv", k, Group(2, 2), c) == pytest.approx(7.2e-6 + k / 250e9)
    assert collective_time("all_reduce", k, Group(1, 1), c) == 0.0
    assert math.isinf(bus_bandwidth("all_reduce", Group(1, 1), c))


def test_hand_values_across_nodes():
    c = Cluster("h100", nodes=4)
    # DP over 4 nodes, one rank per node: busbw = one NIC = 50 GB/s x 0.94 (47 GB/s measured
    # per NDR NIC); ring alpha = 6.6 + 6 x 2.7 us; tree alpha = 6.6 + 2 x (0 + 2 x 2.7) us.
    g = Group(4, 1)
    ring, tree = 6.6e-6 + 6 * 2.7e-6, 6.6e-6 + 2 * 2 * 2.7e-6
    assert comm.latency("all_reduce", g, c) == pytest.approx(min(ring, tree))
    assert comm.large_message_busbw("all_reduce", g, c) == pytest.approx(47e9)
    # Whole nodes: 8 NICs per ring crossing -> 8 x 47 = 376 GB/s, below NVLS's 436.
    assert comm.large_message_busbw("all_reduce", Group(32, 8), c) == pytest.approx(376e9)
    # all-gather stays NVLink-bound at 250 GB/s.
    assert comm.large_message_busbw("all_gather", Group(32, 8), c) == pytest.approx(250e9)
    # all-to-all: 24/32 of the bytes leave the node: busbw = 47 x 31/24 GB/s.
    assert comm.large_message_busbw("all_to_all", Group(32, 8), c) == pytest.approx(47e9 * 31 / 24)


def test_small_messages_fall_off():
    c = Cluster("h100")
    g = Group(8, 8)
    sizes = [2**p for p in range(10, 31, 4)]
    bws = [bus_bandwidth("all_reduce", g, c, s) for s in sizes]
    assert all(a < b for a, b in zip(bws, bws[1:]))
    assert bws[0] < 0.01 * bws[-1]


def test_bad_kind():
    with pytest.raises(ValueError, match="unknown collective"):
        collective_time("broadcast", 1.0, Group(2, 2), Cluster("h100"))


def _table_rows(cluster):
    rows = []
    for kind in TABLE_KINDS:
        for nodes, measured in cluster.busbw_curves[kind]:
            g = Group(int(nodes) * 8, 8)
            pred = bus_bandwidth(kind, g, cluster, comm.DEFAULT_MESSAGE_BYTES)
            rows.append((kind, int(nodes), pred, measured, (pred - measured) / measured))
    return rows


def test_h100_efa_reproduces_playbook_table():
    """Acceptance: 256 MB busbw at 1..64 nodes of 8 GPUs within 15 % of the playbook table."""
    c = Cluster("h100-efa", nodes=64)
    print("\nkind            nodes  predicted  measured  error")
    for kind, nodes, pred, measured, err in _table_rows(c):
        print(f"{kind:15s} {nodes:5d} {pred / 1e9:9.1f} {measured / 1e9:9.1f} {err:+7.1%}")
        assert abs(err) < 0.15, (kind, nodes, err)


def test_h100_efa_leave_one_out():
    """Drop each interior calibration point, predict it from the rest (informative)."""
    full = Cluster("h100-efa", nodes=64)
    errors = []
    print("\nleave-one-out: kind            nodes  predicted  measured  error")
    for kind in TABLE_KINDS:
        points = full.busbw_curves[kind]
        for i in range(1, len(points) - 1):
            nodes, measured = points[i]
            c = Cluster("h100-efa", nodes=64)
            c.busbw_curves = {kind: points[:i] + points[i + 1 :]}
            pred = bus_bandwidth(kind, Group(int(nodes) * 8, 8), c)
            err = (pred - measured) / measured
            errors.append(abs(err))
            print(
                f"               {kind:15s} {int(nodes):5d} {pred / 1e9:9.1f} "
                f"{measured / 1e9:9.1f} {err:+7.1%}"
            )
    mean = sum(errors) / len(errors)
    print(f"mean |LOO error| = {mean:.1%}, max = {max(errors):.1%}")
    assert mean < 0.30


def test_calibration_transfers_to_other_shapes():
    c = Cluster("h100-efa", nodes=64)
    # Between table points the efficiency is interpolated: 3 nodes lies between 2 and 4.
    b2, b3, b4 = (bus_bandwidth("all_gather", Group(8 * n, 8), c) for n in (2, 3, 4))
    assert b4 < b3 < b2
    # Beyond the table the 64-node efficiency is held: 128 nodes no better than 64.
    assert bus_bandwidth("all_gather", Group(1024, 8), c) <= bus_bandwidth(
        "all_gather", Group(512, 8), c
    )
    # One rank per node (DP outside TP=8) is NIC-bound, so slower than the whole-node ring.
    assert bus_bandwidth("all_reduce", Group(8, 1), c) < bus_bandwidth(
        "all_reduce", Group(64, 8), c
    )
    # No curve for all_to_all: derived from the links, still finite and positive.
    assert 0 < bus_bandwidth("all_to_all", Group(64, 8), c) < 450e9


def test_local_fits_used_inside_the_node(tmp_path, monkeypatch):
    from cost.calibration import save_calibration

    path = save_calibration(
        {
            "version": 1,
            "world_size": 4,
            "matmul_flops": {"fp32": 1e11},
            "memory_bw": 1e10,
            "kernel_floor_s": 2e-5,
            "collectives": {"all_reduce": {"latency_s": 1.2e-4, "busbw": 2e9}},
        },
        tmp_path / "c.json",
    )
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(path))
    c = Cluster.local()
    # At the calibrated size the fit is reproduced: t = 1.2e-4 + 2*3/4 * K / 2e9.
    assert collective_time("all_reduce", 1e6, Group(4, 4), c) == pytest.approx(1.2e-4 + 1.5e6 / 2e9)
    # Two ranks: 2 ring steps instead of 6 -> a third of the latency; traffic 1 * K.
    assert collective_time("all_reduce", 1e6, Group(2, 2), c) == pytest.approx(0.4e-4 + 1e6 / 2e9)
