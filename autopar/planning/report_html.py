"""`plan.report(path)`: one self-contained HTML page about a plan, charts by plotly.

Sections: the layout and why (predicted tokens/s/GPU of the plan against the best manual layout
of each family, `plan.compare_manual`'s data), the predicted timeline (`planning.timeline`, a
Gantt chart per stage and track), memory per pipeline stage as stacked bars against the
device's capacity, the step's time split, the per-parameter placements, and, given a measured
trace (`ParallelModule.profile_step`), predicted against measured per track. plotly.js is
embedded inline: the page needs no network when it is viewed.
"""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import TYPE_CHECKING

from autopar.errors import InputError
from autopar.planning.collectives import param_collectives
from autopar.planning.measured import read_measured
from autopar.planning.timeline import DP, P2P, TRACKS, predicted_spans
from autopar.report import fmt_bytes, fmt_count, fmt_time

if TYPE_CHECKING:
    from autopar.planning.plan import Plan

MEMORY_KINDS = ("params", "grads", "optimizer", "activations", "buffers", "reserve")
_COLOURS = {"forward": "#4C78A8", "backward": "#72B7B2", "recompute": "#B279A2",
            "host": "#BAB0AC", "optimizer": "#54A24B", "exposed": "#E45756", "hidden": "#F2CF5B",
            "send": "#FF9DA6"}
_STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px auto;
max-width:1200px;color:#222;background:#fafafa}h1{font-size:22px;margin-bottom:4px}
h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd;padding-bottom:4px}
.facts{display:flex;flex-wrap:wrap;gap:10px;margin:12px 0}.fact{background:#fff;border:1px solid
#e3e3e3;border-radius:6px;padding:8px 12px;min-width:140px}.fact b{display:block;font-size:18px}
.fact span{font-size:12px;color:#666}table{border-collapse:collapse;font-size:13px;background:#fff}
td,th{border:1px solid #e3e3e3;padding:4px 8px;text-align:left}th{background:#f0f0f0}
.note{color:#555;font-size:13px}pre{background:#fff;border:1px solid #e3e3e3;padding:8px;
font-size:12px;overflow-x:auto}"""
# a script error anywhere on the page is written into the DOM (the render test reads it)
_ONERROR = ("<script>window.addEventListener('error',function(e){document.documentElement"
            ".setAttribute('data-script-error',String(e.message||e));});</script>")


def _kind(name: str, exposed: bool, track: str) -> str:
    if track == DP and not exposed:
        return "hidden"
    if track == P2P:
        return "send"
    if exposed:
        return "exposed"
    for word in ("forward", "backward", "recompute", "optimizer"):
        if name.startswith(word):
            return word
    return "host"


def _timeline_figure(plan: Plan):
    import plotly.graph_objects as go

    spans = predicted_spans(plan)
    multi = plan.layout.pp > 1
    rows = sorted({(s.stage, TRACKS.index(s.track)) for s in spans}, reverse=True)
    label = {r: (f"stage {r[0]} · " if multi else "") + TRACKS[r[1]] for r in rows}
    fig = go.Figure()
    for kind, colour in _COLOURS.items():
        mine = [s for s in spans if _kind(s.name, s.exposed, s.track) == kind and s.dur_s > 0]
        if not mine:
            continue
        fig.add_trace(go.Bar(
            orientation="h", name=kind, marker_color=colour, marker_line_width=0.5,
            marker_line_color="white", base=[s.start_s * 1e3 for s in mine],
            x=[s.dur_s * 1e3 for s in mine],
            y=[label[(s.stage, TRACKS.index(s.track))] for s in mine],
            hovertext=[f"{s.name}<br>{s.start_s * 1e3:.3f} ms + {s.dur_s * 1e3:.3f} ms" for s in mine],
            hoverinfo="text"))
    fig.update_layout(barmode="overlay", height=max(260, 26 * len(rows) + 120),
                      xaxis_title="ms from the step's start", margin=dict(l=10, r=10, t=30, b=40),
                      legend=dict(orientation="h", y=1.08), plot_bgcolor="white")
    fig.update_yaxes(categoryorder="array", categoryarray=[label[r] for r in rows])
    fig.update_xaxes(range=[0, plan.predicted.step_time_s * 1e3], gridcolor="#eee")
    return fig


def _compare_figure(plan: Plan):
    import plotly.graph_objects as go

    rows = [("autopar plan", plan.layout.short(), plan.predicted)]
    rows += [(label, lay.short(), pred) for (lay, pred), label in zip(plan.alternatives, plan._labels())]
    fig = go.Figure(go.Bar(
        x=[p.tokens_per_s_per_gpu for _, _, p in rows],
        y=[f"{label}<br><sub>{short}</sub>" for label, short, _ in rows], orientation="h",
        marker_color=["#4C78A8"] + ["#E45756" if not p.fits else "#BAB0AC" for _, _, p in rows[1:]],
        text=[f"{p.tokens_per_s_per_gpu:,.0f} tok/s/GPU · {fmt_time(p.step_time_s)}"
              + ("" if p.fits else " · does not fit") for _, _, p in rows],
        textposition="auto"))
    fig.update_layout(height=max(220, 48 * len(rows) + 80), xaxis_title="predicted tokens/s per GPU",
                      margin=dict(l=10, r=10, t=20, b=40), plot_bgcolor="white")
    fig.update_yaxes(autorange="reversed")
    return fig


def stage_memory_rows(plan: Plan) -> list[dict[str, float]]:
    """Memory breakdown of a device of each pipeline stage (the fullest device only for a plan
    read from JSON, which has no captured step to price the others)."""
    if plan._step is None:
        return [dict(plan.predicted.memory_breakdown)]
    from autopar.search.choices import choose
    from cost.step import stage_memory

    facts = plan.step_facts()
    return [b.as_dict() for b in stage_memory(facts, plan.cluster, choose(facts, plan.cluster, plan.layout))]


def _memory_figure(plan: Plan):
    import plotly.graph_objects as go

    stages = stage_memory_rows(plan)
    names = [f"stage {i}" for i in range(len(stages))] if len(stages) > 1 else ["fullest device"]
    gib = 2.0 ** 30
    fig = go.Figure()
    for kind in MEMORY_KINDS:
        fig.add_trace(go.Bar(name=kind, x=names, y=[st.get(kind, 0.0) / gib for st in stages],
                             hovertemplate=f"{kind}: %{{y:.2f}} GiB<extra></extra>"))
    cap = plan.predicted.memory_capacity_bytes / gib
    fig.add_hline(y=cap, line_dash="dash", line_color="#E45756",
                  annotation_text=f"capacity {cap:.0f} GiB", annotation_position="top left")
    top = max(cap, max(sum(st.values()) for st in stages) / gib)
    fig.update_layout(barmode="stack", height=380, yaxis_title="GiB per device",
                      yaxis_range=[0, top * 1.12], margin=dict(l=10, r=10, t=30, b=40),
                      plot_bgcolor="white")
    return fig


def _split_figure(plan: Plan):
    import plotly.graph_objects as go

    tb = plan.predicted.time_breakdown
    parts = [("compute", tb["compute_s"]), ("recompute", tb["recompute_s"]),
             ("host overhead", tb.get("host_overhead_s", 0.0)), ("TP comm", tb["tp_comm_s"]),
             ("CP comm (exposed)", tb["cp_comm_exposed_s"]), ("EP comm", tb["ep_comm_s"]),
             ("pipeline p2p", tb["pp_p2p_s"]), ("pipeline bubble", tb["pp_bubble_s"]),
             ("DP/ZeRO comm (exposed)", tb["dp_comm_exposed_s"]), ("optimizer", tb["optimizer_s"])]
    parts = [(k, v) for k, v in parts if v > 0]
    fig = go.Figure()
    for k, v in parts:
        fig.add_trace(go.Bar(name=k, y=["step"], x=[v * 1e3], orientation="h",
                             hovertemplate=f"{k}: %{{x:.3f}} ms<extra></extra>"))
    fig.update_layout(barmode="stack", height=200, xaxis_title="ms (sums to the predicted step)",
                      margin=dict(l=10, r=10, t=20, b=40), legend=dict(orientation="h", y=-0.6),
                      plot_bgcolor="white")
    return fig


def predicted_per_track(plan: Plan) -> dict[str, float]:
    """Seconds per measured-trace track predicted for one step's forward + backward:
    compute (incl. recompute), communication (exposed TP/CP/EP/DP), pipeline p2p, total."""
    tb = plan.predicted.time_breakdown
    comm = tb["tp_comm_s"] + tb["cp_comm_exposed_s"] + tb["ep_comm_s"] + tb["dp_comm_exposed_s"]
    return {"compute": tb["compute_s"] + tb["recompute_s"] + tb.get("host_overhead_s", 0.0),
            "communication": comm, "pipeline p2p": tb["pp_p2p_s"],
            "total": plan.predicted.step_time_s - tb["optimizer_s"]}


def _measured_figure(plan: Plan, measured: str | Path):
    import plotly.graph_objects as go

    got = read_measured(measured)
    want = predicted_per_track(plan)
    keys = ["compute", "communication", "pipeline p2p", "total"]
    fig = go.Figure([
        go.Bar(name="predicted", x=keys, y=[want.get(k, 0.0) * 1e3 for k in keys]),
        go.Bar(name="measured", x=keys, y=[got.get(k, 0.0) * 1e3 for k in keys])])
    fig.update_layout(barmode="group", height=320, yaxis_title="ms (forward + backward)",
                      margin=dict(l=10, r=10, t=20, b=40), plot_bgcolor="white")
    return fig


def _placements_html(plan: Plan) -> str:
    groups: dict[tuple, int] = {}
    for name, placement in plan.placements.items():
        pattern = re.sub(r"\.\d+\.", ".*.", name)
        role = plan.tp_roles.get(name, "") if plan.layout.tp > 1 else "-"
        zero = plan.decisions.params[name].zero_sharded
        key = (pattern, ", ".join(f"{a}:{p}" for a, p in sorted(placement.items())), role, zero)
        groups[key] = groups.get(key, 0) + 1
    body = "".join(
        f"<tr><td><code>{html.escape(p)}</code></td><td>x{n}</td><td>{html.escape(role)}</td>"
        f"<td>{html.escape(pl)}</td><td>{html.escape(param_collectives(role, plan.layout, z))}</td></tr>"
        for (p, pl, role, z), n in sorted(groups.items()))
    return ("<table><tr><th>parameter</th><th>count</th><th>tp role</th><th>placement</th>"
            f"<th>collectives it causes</th></tr>{body}</table>")


def _facts_html(plan: Plan) -> str:
    p = plan.predicted
    facts = [("step", fmt_time(p.step_time_s)), ("tokens/s/GPU", f"{p.tokens_per_s_per_gpu:,.0f}"),
             ("MFU", f"{100 * p.mfu:.1f} %"),
             ("memory / device", f"{fmt_bytes(p.memory_per_device_bytes)} of "
                                 f"{fmt_bytes(p.memory_capacity_bytes)}"),
             ("fits", "yes" if p.fits else "NO"), ("mesh", " × ".join(f"{k}={v}" for k, v in plan.mesh.items()))]
    return '<div class="facts">' + "".join(
        f'<div class="fact"><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>' for k, v in facts) + "</div>"


def render_report(plan: Plan, measured: str | Path | None = None) -> str:
    """The report's HTML text (see the module docstring)."""
    try:
        import plotly  # noqa: F401
    except ImportError as exc:  # a declared dependency; say how to get it
        raise InputError("plan.report needs plotly: pip install plotly==7.1.0") from exc
    if measured is not None and not Path(measured).is_file():
        raise InputError(f"measured trace {measured}: no such file; write one with "
                         "pm.profile_step(*batch, path=...)")
    lay = plan.layout
    why = ("The solver's layout against the best hand-written layout of each family, on the same "
           "cost model (red: does not fit in memory)." if plan.alternatives else
           "A layout given by hand: no alternatives were weighed (autopar.plan without a layout "
           "compares the solver's choice with the manual families).")
    figs = [("Layout and why", why, _compare_figure(plan)),
            ("Predicted timeline", "One step, micro-batch by micro-batch"
             + (f" under the {lay.schedule} schedule ({lay.grad_accum} micro-batches, {lay.pp} "
                "stages; gaps are the bubble)" if lay.pp > 1 else f" ({lay.grad_accum} micro-batches)")
             + ". Red: communication the step waits on; yellow: communication hidden behind "
             "compute. Drag to zoom, double-click to reset. Also as a Perfetto trace: "
             "plan.trace(path).", _timeline_figure(plan)),
            ("Memory per device", "Per pipeline stage, stacked by kind, against the device's "
             "capacity.", _memory_figure(plan)),
            ("Time split", "The predicted step, term by term.", _split_figure(plan))]
    if measured is not None:
        figs.append(("Predicted against measured", f"Measured trace: {html.escape(str(measured))} "
                     "(one forward + backward of the profiling rank, under the profiler's own overhead; "
                     "predicted: the step without its optimizer).", _measured_figure(plan, measured)))
    parts = []
    for i, (title, note, fig) in enumerate(figs):
        fig.update_layout(font=dict(size=13), paper_bgcolor="#fafafa")
        div = fig.to_html(full_html=False, include_plotlyjs="inline" if i == 0 else False,
                          config={"displaylogo": False, "responsive": True})
        parts.append(f"<h2>{title}</h2><p class='note'>{note}</p>{div}")
    head = (f"{html.escape(plan.model or 'model')} ({fmt_count(plan.num_params)} parameters), batch "
            f"{plan.batch} × seq {plan.seq} on {html.escape(plan.cluster.describe())}")
    solve = plan.solve
    how = (f"{solve.get('method', '?')}: {solve.get('evaluated', 0)} layouts evaluated in "
           f"{solve.get('time_s', 0):.2f} s" if solve else "a manual layout, evaluated")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'>{_ONERROR}"
            f"<title>autopar plan: {html.escape(plan.model or 'model')}</title><style>{_STYLE}</style>"
            f"</head><body><h1>autopar plan: <code>{html.escape(lay.short())}</code></h1>"
            f"<div class='note'>{head}<br>{html.escape(how)}</div>{_facts_html(plan)}"
            + "".join(parts)
            + f"<h2>Placements</h2>{_placements_html(plan)}"
            f"<h2>Summary</h2><pre>{html.escape(plan.summary())}</pre></body></html>")


def write_report(plan: Plan, path: str | Path, measured: str | Path | None = None) -> Path:
    """Write `render_report` to ``path``."""
    path = Path(path)
    path.write_text(render_report(plan, measured), encoding="utf-8")
    return path


def write_plan_outputs(plan: Plan, trace: str | Path | None = None, report: str | Path | None = None,
                       measured: str | Path | None = None) -> list[Path]:
    """What ``autopar plan --trace T --report R`` writes: the predicted timeline's Chrome JSON
    and the HTML report; returns the paths written."""
    out = []
    if trace:
        out.append(plan.trace(trace))
    if report:
        out.append(plan.report(report, measured=measured))
    return out


__all__ = ["render_report", "write_plan_outputs", "write_report"]
