"""Tensor parallelism: the TP collectives of one micro-batch left on the critical path.

Each event of the recipe (`cost.step_facts.EventTable`) is priced by `cost.comm` on the TP group
(`axis_group(cluster, tp, 1)`: TP is innermost) at its local size: under sequence parallelism
a reduction is a reduce-scatter and a gather an all-gather; without it a reduction is an
all-reduce and only the gathers a replicated use needs (``always``) remain. Megatron overlaps
two kinds (scaled by `comm_overlap`): the forward SP all-gather with the column matmul it feeds
(the playbook; not the gathers a replicated use needs), and the backward reduction of a column
layer's input gradient with that layer's weight-gradient matmul (Megatron's async TP); per
block, what exceeds the matmuls' time is exposed. The TP ILP (`autopar.strategies.tp_ilp`)
prices its roles with these same functions.
"""

from __future__ import annotations

import numpy as np

from cost.cluster import Cluster
from cost.comm import Group, axis_group, collective_time
from cost.step_facts import StepFacts
from cost.terms.common import comm_overlap
from cost.terms.compute import stage_of
from vocab.layout import Layout


def tp_group(cluster: Cluster, tp: int) -> Group:
    """The TP group: ``tp`` contiguous ranks (innermost in the process grid)."""
    return axis_group(cluster, tp, 1)


def event_collective(is_reduce: bool, always: bool, sp: bool) -> str | None:
    """The collective a TP event runs: RS / AG under SP; AR, AG (``always``) or none without."""
    if sp:
        return "reduce_scatter" if is_reduce else "all_gather"
    if is_reduce:
        return "all_reduce"
    return "all_gather" if always else None


def exposed_after_overlap(fixed: np.ndarray, gather: np.ndarray, reduce: np.ndarray,
                          hide_gather: np.ndarray, hide_reduce: np.ndarray,
                          overlap: float, slowdown: float = 0.0) -> np.ndarray:
    """Exposed seconds per block: the fixed collectives, plus the overlappable gathers and
    reductions beyond ``overlap`` times the matmul seconds that hide them, plus ``slowdown``
    times the seconds they do hide (`CostParams.overlap_slowdown`)."""
    hidden_g = np.minimum(gather, overlap * hide_gather)
    hidden_r = np.minimum(reduce, overlap * hide_reduce)
    return fixed + (gather - hidden_g) + (reduce - hidden_r) + slowdown * (hidden_g + hidden_r)


def hidden_by_overlap(gather: np.ndarray, reduce: np.ndarray, hide_gather: np.ndarray,
                      hide_reduce: np.ndarray, overlap: float) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) seconds of matmul time per block that TP collectives hide behind:
    that compute cannot also hide the data-parallel communication."""
    return np.minimum(gather, overlap * hide_gather), np.minimum(reduce, overlap * hide_reduce)


def tp_exposed(facts: StepFacts, cluster: Cluster, lay: Layout, times: np.ndarray,
               scale: float, n_layers: int, pp: int) -> np.ndarray:
    """Exposed TP seconds per pipeline stage for one micro-batch (memoised; zeros at tp 1).

    times: the nodes' step seconds (`compute.step_node_times`); scale: micro-batch / batch.
    """
    return tp_comm(facts, cluster, lay, times, scale, n_layers, pp)[0]


def tp_comm(facts: StepFacts, cluster: Cluster, lay: Layout, times: np.ndarray,
            scale: float, n_layers: int, pp: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(exposed, forward hidden, backward hidden) TP seconds per pipeline stage for one
    micro-batch, memoised; hidden: the matmul seconds the overlapped collectives occupy."""
    if lay.tp == 1:
        return np.zeros(pp), np.zeros(pp), np.zeros(pp)
    # the TP group never depends on the node count (TP is innermost): one entry serves them all
    key = (cluster.price_key(), lay.tp, lay.cp, lay.sp, lay.microbatch, lay.precision, pp, facts.batch)
    return facts.cache.get("tp_comm", key,
                           lambda: _compute_tp_comm(facts, cluster, lay, times, scale, n_layers, pp))


def _event_costs(facts, cluster, lay, scale) -> np.ndarray:
    """Seconds of every TP event (`EventTable` row) for one micro-batch."""
    ev, group = facts.events, tp_group(cluster, lay.tp)
    ev_bytes = ev.bytes * np.where(ev.batch_dep, scale / lay.cp, 1.0)
    cost = np.zeros(len(ev_bytes))
    # events repeat per block: price each distinct (collective, size) once
    for is_reduce, always in {(bool(a), bool(b)) for a, b in zip(ev.reduce, ev.always)}:
        kind = event_collective(is_reduce, always, lay.sp)
        if kind is None:
            continue
        sel = (ev.reduce == is_reduce) & (ev.always == always)
        sizes, index = np.unique(ev_bytes[sel], return_inverse=True)
        priced = np.array([collective_time(kind, float(nb), group, cluster) for nb in sizes])
        cost[sel] = priced[index]
    return cost


def sp_regather(facts: StepFacts, cluster: Cluster, lay: Layout, scale: float, n_layers: int,
                pp: int) -> np.ndarray:
    """Exposed seconds per stage, for one micro-batch, of the SP all-gathers a recomputing
    backward runs again (passes/recompute.py redoes a block's sequence gather rather than
    keeping its full-sequence output, as Megatron-SP does), hidden as the forward's are (the
    hidden part slowing the compute it hides behind by `CostParams.overlap_slowdown`); 0 where
    the layout keeps them (`Layout.regather` False)."""
    if lay.tp == 1 or not lay.sp or not lay.regather:
        return np.zeros(pp)
    ev = facts.events
    cost = _event_costs(facts, cluster, lay, scale)
    slot_stage = stage_of(facts, ev.layer, cluster, lay)
    return np.bincount(slot_stage, weights=cost * _block_gathers(facts, n_layers) * regather_exposed_share(cluster),
                       minlength=pp)


def regather_exposed_share(cluster: Cluster) -> float:
    """Seconds of step time per second of a regathered SP all-gather: the part that does not
    hide behind the matmuls, and what the hidden part slows them by
    (`CostParams.overlap_slowdown`). 0 only where it hides wholly and hiding is free
    (``overlap_slowdown`` 0): keeping the gathers then only costs memory."""
    overlap = comm_overlap(cluster) * cluster.params.tp_overlap
    return (1.0 - overlap) + overlap * cluster.params.overlap_slowdown


def kept_sp_gathers(facts: StepFacts, cluster: Cluster, lay: Layout, pp: int) -> np.ndarray:
    """Bytes per stage and micro-batch that keeping the SP gathers' outputs holds from the
    forward to the backward of a recomputing block (`Layout.regather` False): every gathered
    matmul input of the blocks whole, its sequence not split over TP. Measured on 2 ranks
    (tests/runtime/test_recompute_memory_tp.py): 16 MiB more than regathering under selective
    recompute, 13 MiB under full, where these bytes are 16 MiB."""
    if lay.tp == 1 or not lay.sp or lay.regather:
        return np.zeros(pp)
    ev = facts.events
    local = ev.bytes * np.where(ev.batch_dep, lay.microbatch / facts.batch / lay.cp, 1.0)
    kept = local * _block_gathers(facts, max(facts.n_layers, 1))
    return (np.bincount(stage_of(facts, ev.layer, cluster, lay), weights=kept, minlength=pp)
            * cluster.params.activation_fragmentation)


def _block_gathers(facts: StepFacts, n_layers: int) -> np.ndarray:
    """The SP gathers of the blocks' column matmul inputs (a recompute pass may redo them)."""
    ev = facts.events
    return ~ev.reduce & ev.forward & ~ev.always & (ev.layer >= 0) & (ev.layer < n_layers)


def _compute_tp_comm(facts, cluster, lay, times, scale, n_layers, pp):
    ev, nodes = facts.events, facts.nodes
    group = tp_group(cluster, lay.tp)
    cost = _event_costs(facts, cluster, lay, scale)
    # per block: overlappable collectives hide behind their matmuls, the rest is exposed
    slots = n_layers + 2  # -1 (before the blocks) .. n_layers (after)
    ev_slot = np.clip(ev.layer, -1, n_layers) + 1
    node_slot = np.clip(nodes.layer, -1, n_layers) + 1
    # only the SP gathers overlap with the column matmul they feed (Megatron splits that
    # all-gather along the sequence and pipelines it with the GEMM); a gather a replicated use
    # needs (``always``: a fallback op, a replicated weight) has nothing to hide behind
    gather_ov, reduce_ov, hides_g, hides_r = _overlapped(facts, lay)
    fixed = np.bincount(ev_slot, weights=cost * ~(gather_ov | reduce_ov), minlength=slots)
    g = np.bincount(ev_slot, weights=cost * gather_ov, minlength=slots)
    r = np.bincount(ev_slot, weights=cost * reduce_ov, minlength=slots)
    hide_g = np.bincount(node_slot, weights=times * hides_g, minlength=slots)
    hide_r = np.bincount(node_slot, weights=times * hides_r, minlength=slots)
    overlap = comm_overlap(cluster) * cluster.params.tp_overlap
    exposed = exposed_after_overlap(fixed, g, r, hide_g, hide_r, overlap,
                                    cluster.params.overlap_slowdown)
    exposed += tp_small_collectives(facts, cluster, lay, scale, n_layers, group)
    hidden_fwd, hidden_bwd = hidden_by_overlap(g, r, hide_g, hide_r, overlap)
    slot_stage = stage_of(facts, np.arange(slots) - 1, cluster, lay)
    return tuple(np.bincount(slot_stage, weights=w, minlength=pp)
                 for w in (exposed, hidden_fwd, hidden_bwd))


def _overlapped(facts: StepFacts, lay: Layout) -> tuple[np.ndarray, ...]:
    """(forward events that overlap, backward events that overlap, nodes hiding the first,
    nodes hiding the second): by default the SP gathers behind the column matmuls they feed
    and the backward reductions behind the weight-gradient matmuls; under
    `StepFacts.tp_overlap_all` with SP (Transformer Engine's userbuffers) every event but a
    replicated use's gather, each behind its direction's TP-sharded matmuls."""
    ev, nodes = facts.events, facts.nodes
    if facts.tp_overlap_all and lay.sp:
        # the linear layers' GEMMs, not the attention kernels (TE overlaps only the former)
        sharded = nodes.is_matmul & nodes.tp_div & (nodes.attention_seq == 0)
        return (ev.forward & ~ev.always, ~ev.forward & ~ev.always,
                sharded & nodes.forward, sharded & ~nodes.forward)
    return (~ev.reduce & ev.forward & ~ev.always, ev.reduce & ~ev.forward,
            nodes.hides_gather, nodes.hides_reduce)


def tp_small_collectives(facts: StepFacts, cluster: Cluster, lay: Layout, scale: float,
                         n_layers: int, group: Group) -> np.ndarray:
    """TP collectives outside the recipe's activation events, per slot (as the TP pass emits
    them): under SP a replicated weight (a norm) sees only its sequence shard, so its gradient
    is all-reduced over TP; a vocabulary-parallel loss all-reduces the logits' max, the sum of
    exponentials and the target logit (one fp32 value per token each). Latency-bound:
    negligible on NVLink, milliseconds on gloo."""
    out = np.zeros(n_layers + 2)
    norms, head_sharded = _small_collective_sites(facts, n_layers)
    if lay.sp:
        for nbytes, slots in norms.items():
            np.add.at(out, slots, collective_time("all_reduce", nbytes, group, cluster))
    if head_sharded:
        token_bytes = 4.0 * facts.batch * facts.seq * scale / lay.cp
        out[n_layers + 1] += 3 * collective_time("all_reduce", token_bytes, group, cluster)
    return out


def _small_collective_sites(facts: StepFacts, n_layers: int) -> tuple[dict[float, np.ndarray], bool]:
    """(gradient bytes -> slots of the replicated block weights SP all-reduces, whether the
    head is TP-sharded), memoised: a property of the graph alone."""

    def build() -> tuple[dict[float, np.ndarray], bool]:
        params = facts.params
        norms: dict[float, list[int]] = {}
        for name, sharded in params.tp_sharded.items():
            layers = params.stages_layer.get(name) or []
            if layers and not sharded and not params.expert.get(name):
                nbytes = float(params.numel[name] * params.dtype_bytes.get(name, 4))
                norms.setdefault(nbytes, []).append(min(max(layers), n_layers) + 1)
        head = [p for p, layers in params.stages_layer.items() if layers and max(layers) >= n_layers]
        return {k: np.array(v) for k, v in norms.items()}, any(params.tp_sharded.get(p) for p in head)
    return facts.cache.get("tp_small_sites", (n_layers,), build)
