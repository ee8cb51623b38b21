"""The predicted step as a timeline: typed spans from the cost model's terms, and Chrome JSON.

`predicted_spans(plan)` lays the terms of ``plan.predicted.time_breakdown`` out in time, one
process per pipeline stage and one track per stream, micro-batch by micro-batch under the
plan's schedule; `chrome_trace(spans)` writes them as Chrome trace-event JSON (Perfetto,
chrome://tracing). The timeline spends exactly the predicted step: its span equals
``plan.predicted.step_time_s``.

How the terms are laid out (the cost model prices the slowest stage for every stage):

* One micro-batch on a stage takes S = (compute + recompute + host overhead + exposed TP, CP
  and EP communication) / m; the forward is a third of it and the backward two thirds (the
  usual 1:2 FLOP ratio of a matmul's forward to its two gradient matmuls), recompute runs in
  the backward. Within a pass the stage computes, then waits on its exposed collectives (a gap
  on the compute track), then sends to the next stage (point-to-point track).
* A pipeline slot is S + 2 v p2p (`cost.pipeline.pipeline_step_time`), so the bubble slots are
  b = pp_bubble_s / slot. The schedule is simulated pass by pass in its order (AFAB: every
  forward first; 1F1B and the others: warm-up forwards, then one forward one backward), and a
  pass may start on the next stage once a fraction f = b / (p - 1) of the previous stage's
  pass is done: f = 1 for AFAB and 1F1B, 1/v for interleaved 1F1B (chunks of 1/v of a stage
  travel on), 1/3 for zero-bubble (the weight-gradient halves fill the rest). The critical
  path is then (m + f (p - 1)) slots = the cost model's (m + b) slots.
* After the micro-batches: the loss broadcast (pipeline only), the exposed data-parallel / ZeRO
  communication, then the optimizer step. The hidden part of the data-parallel communication
  (dp_comm_total_s - dp_comm_exposed_s) is drawn beside the last backwards that hide it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cost.pipeline import bubble_fraction

if TYPE_CHECKING:  # the Plan imports this module
    from autopar.planning.plan import Plan

COMPUTE, TP, CP, EP, DP, P2P = ("compute", "TP collectives", "CP ring exchange",
                                "EP all-to-all", "DP / ZeRO collectives", "pipeline p2p")
TRACKS = (COMPUTE, TP, CP, EP, DP, P2P)
FORWARD_SHARE = 1 / 3  # forward : backward = 1 : 2


@dataclass(frozen=True)
class Span:
    """One interval on one track of one stage: [start_s, start_s + dur_s)."""

    stage: int
    track: str
    name: str
    start_s: float
    dur_s: float
    microbatch: int = -1  # -1: not a micro-batch's (DP sync, optimizer)
    exposed: bool = False  # communication the step waits on (False: hidden behind compute)
    args: dict = field(default_factory=dict)

    @property
    def end_s(self) -> float:
        """start_s + dur_s."""
        return self.start_s + self.dur_s


@dataclass(frozen=True)
class _Pass:
    """The per-micro-batch pieces of one forward or backward pass on a stage."""

    compute: float
    recompute: float
    host: float
    comm: dict  # track -> exposed seconds
    p2p: float

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.host + sum(self.comm.values()) + self.p2p


def _passes(plan: Plan) -> tuple[_Pass, _Pass, float]:
    """(forward, backward, tail p2p) of one micro-batch on the slowest stage, from the terms."""
    tb, lay = plan.predicted.time_breakdown, plan.layout
    m, pp = lay.grad_accum, lay.pp
    per_mb = {k: tb.get(k, 0.0) / m for k in ("compute_s", "recompute_s", "host_overhead_s",
                                              "tp_comm_s", "cp_comm_exposed_s", "ep_comm_s")}
    slot_s = sum(per_mb.values())
    hop = 0.0  # one send: activations forward or gradients back
    if pp > 1 and tb["pp_bubble_s"] > 0:
        b = bubble_fraction(lay.schedule, pp, m, lay.virtual_stages) * m
        hop = max(tb["pp_bubble_s"] / b - slot_s, 0.0) / 2
        tail = tb["pp_p2p_s"] - m * 2 * hop  # the bubble slots' sends count in the bubble
    else:
        tail = tb["pp_p2p_s"]

    def part(share: float) -> _Pass:
        comm = {TP: per_mb["tp_comm_s"] * share, CP: per_mb["cp_comm_exposed_s"] * share,
                EP: per_mb["ep_comm_s"] * share}
        return _Pass(per_mb["compute_s"] * share, 0.0, 0.0, comm, hop)

    fwd, bwd = part(FORWARD_SHARE), part(1 - FORWARD_SHARE)
    fwd = _Pass(fwd.compute, 0.0, per_mb["host_overhead_s"], fwd.comm, hop)
    bwd = _Pass(bwd.compute, per_mb["recompute_s"], 0.0, bwd.comm, hop)
    return fwd, bwd, max(tail, 0.0)


def _order(schedule: str, pp: int, m: int, stage: int) -> list[tuple[str, int]]:
    """The passes ("F" / "B", micro-batch) a stage runs, in its schedule's order."""
    if schedule == "afab" or pp == 1:
        if pp == 1:  # gradient accumulation: each micro-batch's forward then its backward
            return [(k, i) for i in range(m) for k in ("F", "B")]
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(pp - stage - 1, m)
    order = [("F", i) for i in range(warm)]
    f_next = warm
    for i in range(m):
        if f_next < m:
            order.append(("F", f_next))
            f_next += 1
        order.append(("B", i))
    return order


def _schedule_passes(plan: Plan, fwd: _Pass, bwd: _Pass) -> dict[tuple[str, int, int], float]:
    """Start time of every pass (kind, stage, micro-batch), dependency-driven."""
    lay = plan.layout
    pp, m = lay.pp, lay.grad_accum
    schedule = lay.schedule if pp > 1 else "1f1b"
    frac = 1.0
    if pp > 1:
        frac = bubble_fraction(schedule, pp, m, lay.virtual_stages) * m / (pp - 1)
    orders = [_order(schedule, pp, m, s) for s in range(pp)]
    start: dict[tuple[str, int, int], float] = {}
    pos, free = [0] * pp, [0.0] * pp
    while any(pos[s] < len(orders[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):
            while pos[s] < len(orders[s]):
                kind, i = orders[s][pos[s]]
                dur = fwd.total if kind == "F" else bwd.total
                dep = ("F", s - 1, i) if kind == "F" and s > 0 else \
                    ("B", s + 1, i) if kind == "B" and s < pp - 1 else None
                if dep is not None and dep not in start:
                    break
                ready = 0.0 if dep is None else start[dep] + frac * dur
                if kind == "B" and s == pp - 1:
                    ready = max(ready, start[("F", s, i)] + fwd.total)
                start[(kind, s, i)] = max(ready, free[s])
                free[s] = start[(kind, s, i)] + dur
                pos[s] += 1
                progressed = True
        if not progressed:  # cannot happen for the orders above; never loop forever
            raise RuntimeError("pipeline timeline: schedule order deadlocks")
    return start


def _pass_spans(stage: int, kind: str, i: int, t: float, p: _Pass) -> list[Span]:
    """The spans of one pass starting at t: compute, its exposed collectives, its send."""
    word = "forward" if kind == "F" else "backward"
    out = []
    for name, dur in ((f"{word} mb{i}", p.compute), (f"recompute mb{i}", p.recompute),
                      (f"host launch overhead mb{i}", p.host)):
        if dur > 0:
            out.append(Span(stage, COMPUTE, name, t, dur, i))
            t += dur
    for track, dur in p.comm.items():
        if dur > 0:
            out.append(Span(stage, track, f"{track} {word} mb{i} (exposed)", t, dur, i, True))
            t += dur
    if p.p2p > 0:
        what = "send activations" if kind == "F" else "send gradients"
        out.append(Span(stage, P2P, f"{what} mb{i}", t, p.p2p, i, True))
    return out


def predicted_spans(plan: Plan) -> list[Span]:
    """The plan's predicted step as spans; their span (last end - first start) equals
    ``plan.predicted.step_time_s``."""
    tb, lay = plan.predicted.time_breakdown, plan.layout
    fwd, bwd, tail = _passes(plan)
    start = _schedule_passes(plan, fwd, bwd)
    spans: list[Span] = []
    for (kind, s, i), t in start.items():
        spans.extend(_pass_spans(s, kind, i, t, fwd if kind == "F" else bwd))
    t_ops = max(sp.end_s for sp in spans) if spans else 0.0
    hidden = max(tb["dp_comm_total_s"] - tb["dp_comm_exposed_s"], 0.0)
    for s in range(lay.pp):
        t = t_ops
        if tail > 0:
            name = "loss broadcast" if lay.pp > 1 else "point-to-point"
            spans.append(Span(s, P2P, name, t, tail, exposed=True))
            t += tail
        last_b = max((v for (k, st, _), v in start.items() if k == "B" and st == s), default=0.0)
        if hidden > 0:  # overlapped with the backwards that end the stage's work
            h0 = max(min(t_ops, last_b + bwd.total) - hidden, 0.0)
            h_end = min(h0 + hidden, t)
            spans.append(Span(s, DP, "gradient sync (hidden behind backward)", h0, h_end - h0,
                              args={"hidden_s": hidden}))
            t = max(t, h_end)
        if tb["dp_comm_exposed_s"] > 0:
            spans.append(Span(s, DP, "gradient sync / ZeRO gathers (exposed)", t,
                              tb["dp_comm_exposed_s"], exposed=True))
        t_opt = t_ops + tail + tb["dp_comm_exposed_s"]
        if tb["optimizer_s"] > 0:
            spans.append(Span(s, COMPUTE, "optimizer step", t_opt, tb["optimizer_s"]))
    return sorted(spans, key=lambda sp: (sp.stage, sp.track, sp.start_s))


def span_of(spans: list[Span]) -> float:
    """Seconds from the first start to the last end."""
    return max(s.end_s for s in spans) - min(s.start_s for s in spans) if spans else 0.0


def chrome_trace(spans: list[Span], title: str = "autopar predicted step") -> dict:
    """Chrome trace-event JSON (a dict with "traceEvents"): one process per stage, one thread
    per track, complete ("X") events in microseconds, metadata ("M") events naming them."""
    events: list[dict] = []
    stages = sorted({s.stage for s in spans})
    for st in stages:
        events.append({"name": "process_name", "ph": "M", "pid": st, "tid": 0,
                       "args": {"name": f"stage {st}" if len(stages) > 1 else title}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": st, "tid": 0,
                       "args": {"sort_index": st}})
        for tid, track in enumerate(TRACKS):
            if any(s.stage == st and s.track == track for s in spans):
                events.append({"name": "thread_name", "ph": "M", "pid": st, "tid": tid,
                               "args": {"name": track}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": st, "tid": tid,
                               "args": {"sort_index": tid}})
    for s in spans:
        if s.dur_s <= 0:
            continue
        args = {"microbatch": s.microbatch, "exposed": s.exposed, **s.args}
        ev = {"name": s.name, "cat": s.track, "ph": "X", "pid": s.stage,
              "tid": TRACKS.index(s.track), "ts": s.start_s * 1e6, "dur": s.dur_s * 1e6,
              "args": args}
        if s.exposed:
            ev["cname"] = "terrible"  # trace viewers' red: time the step waits on
        events.append(ev)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"title": title, "step_time_s": span_of(spans)}}


def write_trace(plan: Plan, path: str | Path) -> Path:
    """Write the plan's predicted timeline as Chrome trace-event JSON to ``path``."""
    path = Path(path)
    title = f"autopar predicted step: {plan.model or 'model'} {plan.layout.short()}"
    path.write_text(json.dumps(chrome_trace(predicted_spans(plan), title)))
    return path


def spans_as_dicts(spans: list[Span]) -> list[dict]:
    """Plain dicts of the spans (for reports)."""
    return [asdict(s) for s in spans]
