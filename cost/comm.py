"""Time of collectives on a process group of a cluster (alpha-beta model, nccl-tests conventions).

K = bytes of the full tensor: the all-reduce operand, the all-gather OUTPUT, the reduce-scatter
INPUT, an all-to-all rank's whole buffer, a point-to-point message. Bus bandwidth (busbw)
relates to time as nccl-tests defines it::

    all_reduce                               t = 2(n-1)/n * K / busbw
    all_gather, reduce_scatter, all_to_all   t =  (n-1)/n * K / busbw
    send_recv                                t =            K / bw

Model: ``time = alpha + traffic(K) / busbw_large`` where

* alpha is NCCL's own latency model (src/graph/tuning.cc): a base cost per call plus one hop
  latency per ring step, NVLink hops for steps inside a node and network hops for the steps
  that cross nodes; all-reduce across nodes may use NCCL's tree, whose latency grows with
  log2(nodes), and takes whichever is smaller. So small messages see busbw fall off.
* busbw_large is the bandwidth of the bottleneck: NVLink inside a node (times a per-kind
  achieved fraction, which for all-reduce includes NVSwitch in-network reduction) and, across
  nodes, the NICs of the group's ranks on one node (rail-optimised rings: each of those ranks'
  NIC carries one ring's node crossing, so a ring's busbw is ranks_per_node x NIC bandwidth).
* Calibrated profiles (``cluster.busbw_curves``) carry busbw measured at one message size for
  groups spanning whole nodes; a group is read at its size in whole nodes' worth of ranks. Each point is turned into an efficiency, measured / modelled
  (after removing alpha at that size, so the measured point is reproduced exactly at its own
  size), and log(efficiency) is interpolated linearly in log2(nodes) between points, held
  constant beyond the first and last. The points are calibration data, not answers: the model
  applies the interpolated efficiency to any group shape and message size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .calibration import COLLECTIVES
from .cluster import Cluster
from .rings import ring_steps

DEFAULT_MESSAGE_BYTES = 256 * 2**20  # the size the playbook's table (and nccl-tests) report


@dataclass(frozen=True)
class Group:
    """A process group: ``size`` ranks, ``ranks_per_node`` of them on each node it touches."""

    size: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"Group.size={self.size} must be >= 1")
        if not 1 <= self.ranks_per_node <= self.size:
            raise ValueError(
                f"Group.ranks_per_node={self.ranks_per_node} must be between 1 and size={self.size}"
            )

    @property
    def nodes(self) -> int:
        """Nodes the group spans: ceil(size / ranks_per_node)."""
        return -(-self.size // self.ranks_per_node)


def axis_group(cluster: Cluster, size: int, stride: int = 1) -> Group:
    """The group of one mesh axis of ``size`` ranks spaced ``stride`` ranks apart.

    Ranks are numbered node by node, so an axis with stride s has gpus_per_node // s of its
    ranks on each node (at least 1, at most ``size``): TP innermost has stride 1; DP outside
    TP=8 on 8-GPU nodes has stride 8 and one rank per node.
    """
    if size < 1 or stride < 1:
        raise ValueError(f"axis_group(size={size}, stride={stride}): both must be >= 1")
    return Group(size, min(size, max(1, cluster.gpus_per_node // stride)))


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; use one of {COLLECTIVES}")


def traffic_factor(kind: str, n: int) -> float:
    """Bytes each rank moves per byte of K (the nccl-tests busbw factor)."""
    _check_kind(kind)
    if kind == "send_recv":
        return 1.0
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    return 2 * share if kind == "all_reduce" else share


def latency(kind: str, group: Group, cluster: Cluster) -> float:
    """Alpha: the time of a zero-byte ``kind`` on ``group`` (NCCL's latency model)."""
    _check_kind(kind)
    n, nodes = group.size, group.nodes
    if n == 1:
        return 0.0
    fits = cluster.collective_fits
    if fits and kind in fits and nodes == 1:
        # Measured at the calibration's world size; scale by ring steps to other group sizes.
        ref_steps, _ = ring_steps(kind, cluster.gpus_per_node, 1)
        steps, _ = ring_steps(kind, n, 1)
        return fits[kind].latency_s * steps / max(1, ref_steps)
    intra, inter = cluster.intra.latency, cluster.inter.latency
    steps, inter_steps = ring_steps(kind, n, nodes)
    alpha = cluster.base_latency + (steps - inter_steps) * intra + inter_steps * inter
    if kind == "all_reduce" and nodes > 1:
        # NCCL's tree: up and down a chain inside the node and a binary tree across nodes.
        depth = math.ceil(math.log2(nodes))
        tree = cluster.base_latency + 2 * ((group.ranks_per_node - 1) * intra + depth * inter)
        alpha = min(alpha, tree)
    return alpha


def link_busbw(kind: str, group: Group, cluster: Cluster) -> float:
    """Large-message busbw that the links allow (B/s), before any measured correction."""
    _check_kind(kind)
    nvlink = cluster.intra.bandwidth * cluster.intra_efficiency[kind]
    if group.nodes == 1:
        return nvlink
    nic = cluster.inter.bandwidth * cluster.inter_efficiency
    rpn, n = group.ranks_per_node, group.size
    if kind == "send_recv":
        return nic
    if kind == "all_to_all":
        # Of the (n-1)/n*K a rank sends, (n-rpn)/n*K leaves the node through its own NIC.
        network = nic * (n - 1) / (n - rpn)
    else:
        network = rpn * nic
    # A group with one rank per node moves nothing over NVLink.
    return network if rpn == 1 else min(nvlink, network)


def _curve_efficiency(kind: str, nodes: int, cluster: Cluster) -> float | None:
    """Measured / modelled busbw interpolated at ``nodes``; None when no curve covers ``kind``."""
    curves = cluster.busbw_curves or {}
    points = curves.get(kind)
    if not points:
        return None
    xs, ys = _curve_points(kind, points, cluster)
    # Log-log interpolation: between two measured node counts the efficiency follows a power law
    # (in a leave-one-out test it predicts dropped points better than linear, 14 % vs 15 %).
    return math.exp(_interp(xs, ys, math.log2(nodes)))


# The solver asks for the same curve many times: cache the converted points on everything
# they depend on (the cluster is mutable, so the key is built from its relevant fields).
_CURVE_CACHE: dict[tuple, tuple[list[float], list[float]]] = {}


def _curve_points(
    kind: str, points: list[tuple[float, float]], cluster: Cluster
) -> tuple[list[float], list[float]]:
    """(log2 nodes, log efficiency) of each calibration point of ``kind``."""
    gpn = cluster.curve_gpus_per_node or cluster.gpus_per_node
    size = cluster.curve_message_bytes or DEFAULT_MESSAGE_BYTES
    key = (
        kind,
        tuple(points),
        gpn,
        size,
        cluster.intra,
        cluster.inter,
        cluster.base_latency,
        cluster.intra_efficiency[kind],
        cluster.inter_efficiency,
    )
    hit = _CURVE_CACHE.get(key)
    if hit is not None:
        return hit
    xs, ys = [], []
    for point_nodes, measured in sorted(points):
        ref = Group(int(point_nodes) * gpn, gpn)
        corrected = _large_message_busbw(kind, ref, cluster, measured, size)
        xs.append(math.log2(point_nodes))
        ys.append(math.log(corrected / link_busbw(kind, ref, cluster)))
    if len(_CURVE_CACHE) > 256:
        _CURVE_CACHE.clear()
    _CURVE_CACHE[key] = (xs, ys)
    return xs, ys


def _large_message_busbw(
    kind: str, group: Group, cluster: Cluster, measured: float, size: float
) -> float:
    """Remove alpha from a busbw measured at ``size``: the bandwidth the bytes themselves saw."""
    t = traffic_factor(kind, group.size) * size / measured
    alpha = latency(kind, group, cluster)
    # Guard: never let alpha claim more than half of the measured time.
    return traffic_factor(kind, group.size) * size / max(t - alpha, 0.5 * t)


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, constant beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + w * (ys[i] - ys[i - 1])
    return ys[-1]


def large_message_busbw(kind: str, group: Group, cluster: Cluster, in_step: bool = True) -> float:
    """The bandwidth term's busbw (B/s): links, measured fits or calibrated curves; ``in_step``:
    times what a training step reaches of it (`CostParams.intra_bw_scale` inside a node,
    `inter_bw_scale` across nodes), else what nccl-tests would measure."""
    _check_kind(kind)
    params = cluster.params
    scale = 1.0 if not in_step else (params.intra_bw_scale if group.nodes == 1
                                     else params.inter_bw_scale)
    fits = cluster.collective_fits
    if fits and kind in fits and group.nodes == 1:
        return fits[kind].busbw * scale
    busbw = link_busbw(kind, group, cluster)
    # the measured falloff is read at the group's size in whole nodes' worth of ranks: a
    # group of fewer ranks per node (DP outside TP) runs shorter rings over the same nodes
    # (fitting the playbook's runs: dp128 x tp4 on 64 nodes ran at 3x the busbw the 64-node
    # point gives its 2 NICs per node)
    whole_nodes = max(1, group.size // (cluster.curve_gpus_per_node or cluster.gpus_per_node))
    efficiency = _curve_efficiency(kind, whole_nodes, cluster)
    return scale * (busbw * efficiency if efficiency is not None else busbw)


def collective_time(kind: str, nbytes: float, group: Group, cluster: Cluster,
                    in_step: bool = True) -> float:
    """Seconds for one ``kind`` of K = ``nbytes`` on ``group`` (0 for a group of one rank).

    in_step: as a training step sees it (the cluster's `CostParams`: a per-call overhead and
    the share of the bus bandwidth the step reaches); False: as nccl-tests would time it."""
    _check_kind(kind)
    if nbytes < 0:
        raise ValueError(f"collective_time: nbytes={nbytes} must be >= 0")
    if group.size == 1 or nbytes == 0:
        return 0.0
    traffic = traffic_factor(kind, group.size) * nbytes
    params = cluster.params
    overhead = 0.0 if not in_step else (params.collective_overhead_s if group.nodes == 1
                                        else params.inter_collective_overhead_s)
    return (latency(kind, group, cluster) + overhead
            + traffic / large_message_busbw(kind, group, cluster, in_step))


def bus_bandwidth(
    kind: str, group: Group, cluster: Cluster, nbytes: float = DEFAULT_MESSAGE_BYTES
) -> float:
    """Predicted nccl-tests busbw (B/s) of ``kind`` at K = ``nbytes``; inf for one rank."""
    t = collective_time(kind, nbytes, group, cluster, in_step=False)
    if t == 0.0:
        return math.inf
    return traffic_factor(kind, group.size) * nbytes / t
