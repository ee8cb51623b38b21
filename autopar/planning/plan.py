"""`autopar.plan`: the Plan of a training step on a cluster, and how it was reached.

A Plan is inspectable data: the layout (degrees and recipes), the mesh, the placement of every
parameter on every mesh axis (DTensor vocabulary), the pipeline stages, the predicted step time
and memory with their breakdowns, and, when the solver chose it, the alternatives it weighed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from autopar.errors import InputError
from autopar.planning.collectives import param_collectives
from autopar.report import fmt_bytes, fmt_count, fmt_time, json_ready, table
from autopar.search.choices import choose
from autopar.search.decisions import decide
from autopar.search.executable import refusals
from autopar.search.manual import standard_layouts
from autopar.search.step import CapturedStep
from cost import Cluster, Layout
from cost.profile import coverage_notes, coverage_within
from cost.step import Prediction, StepFacts, predict
from vocab.layout import unsupported_decisions
from vocab.plan_types import ExecutionReport, Fallback, PlanDecisions, RecomputeChoice

PLAN_VERSION = 4  # 2: the decisions (vocab.plan_types) travel whole; 3: attention rates per GPU;
# 4: attention rates measured against length and head dim


@dataclass
class Plan:
    """The chosen (or evaluated) parallel layout of one training step on one cluster.

    ``decisions`` holds what runs (`vocab.plan_types.PlanDecisions`, as the solver wrote it);
    ``layout``, ``placements``, ``stages``, ``recompute``, ``fp8`` and ``fallbacks`` read it.
    ``execution``: what the passes found as `autopar.parallelize` ran the plan (`with_execution`;
    ``pm.plan`` carries it): ``recompute`` and ``fallbacks`` then say what ran.
    """

    decisions: PlanDecisions
    predicted: Prediction
    cluster: Cluster
    model: str = ""
    fingerprint: str = ""  # parameter names and shapes: a plan belongs to one model
    batch: int = 0
    seq: int = 0
    num_params: int = 0
    solve: dict = field(default_factory=dict)  # how the plan was reached (method, time, counts)
    alternatives: list[tuple[Layout, Prediction]] = field(default_factory=list)
    alternative_labels: list[str] = field(default_factory=list)
    execution: ExecutionReport | None = None
    # what autopar.parallelize cannot run of this plan on this model (`search.executable`)
    refused: list[str] = field(default_factory=list)
    # the captured step, so explain() prices other layouts without a new capture
    _step: CapturedStep | None = field(default=None, repr=False, compare=False)

    @property
    def layout(self) -> Layout:
        """The degrees and recipes chosen (dp, tp, pp, cp, ep, zero, sp, microbatch, ...)."""
        return self.decisions.layout

    @property
    def placements(self) -> dict[str, dict[str, str]]:
        """parameter -> mesh axis -> "Shard(d)" | "Replicate()" (DTensor's spelling), as it runs."""
        return self.decisions.placement_strings()

    @property
    def tp_roles(self) -> dict[str, str]:
        """parameter -> tensor-parallel role (col, row, vocab, replicated)."""
        return {n: p.tp_role for n, p in self.decisions.params.items()}

    @property
    def stages(self) -> list[tuple[int, int]]:
        """(first block, last block) of each pipeline stage."""
        return self.decisions.stages

    @property
    def recompute(self) -> list[str]:
        """The forward values recomputed in the backward (per block), [] if none: as the
        recompute pass ran them when the plan carries an execution report."""
        if self.execution is not None and self.execution.recompute is not None:
            return self.execution.recompute_lines()
        return self.decisions.recompute

    @property
    def recompute_groups(self) -> list[str]:
        """The matmul outputs a partial recompute can name, tied across blocks
        (``Layout(recompute=(...))``); [] for a plan read from JSON (no captured step)."""
        return list(self._step.facts().recompute_groups) if self._step is not None else []

    @property
    def fp8(self) -> list[str]:
        """The matmuls (by weight name) run in FP8, [] if none."""
        return self.decisions.fp8

    @property
    def fallbacks(self) -> list[Fallback]:
        """Ops that fall back to replication, with the reason: as the passes met them when the
        plan carries an execution report."""
        if self.execution is not None:
            return list(self.execution.fallbacks)
        return self.decisions.fallbacks

    def step_facts(self, layout: Layout | None = None) -> StepFacts:
        """The cost facts of this plan's captured step for ``layout`` (this plan's by default)
        at the plan's global batch (`autopar.parallelize` prices a tp=1 layout on its per-rank
        micro-batch capture: rebatched, activations being linear in the batch)."""
        if self._step is None:
            raise InputError("this plan has no captured step (read from JSON): plan again with "
                             "autopar.plan in this process")
        facts = self._step.facts_for(self.cluster, layout or self.layout)
        return facts.rebatch(self.batch) if self.batch and facts.batch != self.batch else facts

    def with_execution(self, report: ExecutionReport) -> Plan:
        """This plan (decisions shared, never edited) carrying ``report``: what ran."""
        return dataclasses.replace(self, execution=report)

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axes and sizes, outermost first (only axes of size > 1, dp always)."""
        return self.decisions.mesh

    # ------------------------------------------------------------------ inspection
    def summary(self) -> str:
        """A readable report: degrees, predicted time and memory split by kind, placements."""
        p, lay = self.predicted, self.layout
        tb = p.time_breakdown
        lines = [
            f"autopar plan: {self.model or 'model'} ({fmt_count(self.num_params)} parameters), "
            f"batch {self.batch} x seq {self.seq} on {self.cluster.describe()}",
            f"  layout   {lay.short()}   mesh {' x '.join(f'{k}={v}' for k, v in self.mesh.items())}",
            f"  precision {lay.precision}, recompute {self._recompute_words()}"
            + (f", schedule {lay.schedule}" if lay.pp > 1 else ""),
        ]
        if self.solve:
            lines.append(
                f"  solver   {self.solve.get('method', '?')}: {self.solve.get('evaluated', 0)} layouts "
                f"evaluated in {self.solve.get('time_s', 0):.2f} s"
            )
            if self.solve.get("batch_note"):
                lines.append(f"  note     {self.solve['batch_note']}")
        judged = self._as_run()
        source, coverage = f"the {self.cluster.name} cost profile", self.cluster.fit_coverage
        for note in coverage_notes(judged, coverage, source, self.cluster.nodes):
            lines.append(f"  note     {note}")
        within = coverage_within(judged, coverage, source, self.cluster.nodes, self.model)
        if within:
            lines.append(f"  note     {within}")
        missing = self.refused
        if not p.fits:
            runs = "no: it does not fit in memory"
        elif missing:
            runs = "not yet with autopar.parallelize: " + "; ".join(missing) + " (a prediction only)"
        else:
            runs = "with autopar.parallelize"
        lines.append("  runs     " + runs)
        lines.append("")
        lines.append(
            f"predicted step {fmt_time(p.step_time_s)}, {p.tokens_per_s_per_gpu:,.0f} tok/s/GPU, "
            f"MFU {100 * p.mfu:.1f} %, memory {fmt_bytes(p.memory_per_device_bytes)} of "
            f"{fmt_bytes(p.memory_capacity_bytes)} per device ({'fits' if p.fits else 'DOES NOT FIT'})"
        )
        cp, keep = self.cluster.params, p.memory_breakdown.get("headroom", 0.0)
        lines.append(f"headroom kept: {fmt_bytes(keep)} ({keep / p.memory_capacity_bytes:.0%} of the "
                     f"device) left free for the allocator, beside a {fmt_bytes(cp.memory_reserve_bytes)} "
                     f"reserve and activations counted x{cp.activation_fragmentation:.2f} (the profile's "
                     f"{'fitted' if coverage else 'default'} memory parameters); "
                     f"{fmt_bytes(max(p.memory_capacity_bytes - p.memory_per_device_bytes, 0.0))} free beyond")
        exposed_comm = tb["tp_comm_s"] + tb["cp_comm_exposed_s"] + tb["ep_comm_s"] + tb["dp_comm_exposed_s"] + tb["pp_p2p_s"]
        rows = [
            ["compute", fmt_time(tb["compute_s"])],
            ["recompute", fmt_time(tb["recompute_s"])],
            # a launch-bound step: the host's seconds beyond the device's (GPUs overlap the two)
            ["host overhead", fmt_time(tb.get("host_overhead_s", 0.0))],
            ["exposed communication", fmt_time(exposed_comm)],
            ["  tensor parallel", fmt_time(tb["tp_comm_s"])],
            ["  data parallel (exposed / total)", f"{fmt_time(tb['dp_comm_exposed_s'])} / {fmt_time(tb['dp_comm_total_s'])}"],
            ["  context / expert parallel", f"{fmt_time(tb['cp_comm_exposed_s'])} / {fmt_time(tb['ep_comm_s'])}"],
            ["  pipeline point-to-point", fmt_time(tb["pp_p2p_s"])],
            ["pipeline bubble", fmt_time(tb["pp_bubble_s"])],
            ["optimizer step", fmt_time(tb["optimizer_s"])],
        ]
        lines.append(table(["time per step", ""], rows, "lr"))
        lines.append("")
        mem = [[k, fmt_bytes(v)] for k, v in p.memory_breakdown.items()]
        mem.append(["total", fmt_bytes(p.memory_per_device_bytes)])
        lines.append(table(["memory per device", ""], mem, "lr"))
        lines.append("")
        lines.append(self._placement_table())
        lines.append("")
        if lay.pp > 1:
            lines.append("pipeline stages: " + ", ".join(
                f"{i}: blocks {a}-{b}" for i, (a, b) in enumerate(self.stages)))
        ran = " (as run)" if self.execution is not None else ""
        lines.append(f"recompute{ran}: " + (_fold(self.recompute) if self.recompute else "none"))
        lines.append(self._fp8_line())
        lines.append(f"fallbacks{ran}: " + ("; ".join(f"{f.op} ({f.reason})" for f in self.fallbacks)
                                      if self.fallbacks else "none"))
        return "\n".join(lines)

    def _as_run(self) -> Layout:
        """The layout as it runs (what a fit's coverage is compared with): "auto" recompute
        that resolved to one plain mode is that mode, FP8 that chose no matmul is "none"."""
        choice, lay = self.decisions.recompute_choice, self.layout
        if lay.recompute == "auto" and not choice.outputs and not self.decisions.recompute_per_stage:
            lay = dataclasses.replace(lay, recompute=choice.mode)
        if lay.fp8 != "none" and not self.decisions.fp8:
            lay = dataclasses.replace(lay, fp8="none")
        return lay

    def _recompute_words(self) -> str:
        """The layout's recompute and, for "auto" or named groups, what it resolved to."""
        lay, choice = self.layout, self.decisions.recompute_choice
        per_stage = self.decisions.recompute_per_stage
        if isinstance(lay.recompute, str) and lay.recompute == choice.mode and not choice.outputs \
                and not per_stage:
            return lay.recompute
        asked = "+".join(_alike_counted(lay.recompute)) if isinstance(lay.recompute, tuple) else lay.recompute
        if per_stage:  # the pipeline's stages chose apart
            return f"{asked} -> " + "; ".join(f"stage {s}: {_describe(c)}" for s, c in enumerate(per_stage))
        return f"{asked} -> {_describe(choice)}"

    def _fp8_line(self) -> str:
        """Which weight matmuls run in FP8, under which recipe, and which stay high."""
        lay = self.layout
        fused = self.decisions.fp8_fused_high
        fused_line = ("\n  kept in high precision under TP (a fused projection split per part has "
                      "no FP8 matmul rule; FP8 with tp=1 runs them): " + _fold(fused)) if fused else ""
        experts = self.decisions.fp8_expert_high
        if experts:  # the experts' grouped matmuls have no FP8 rewrite
            fused_line += ("\n  kept in high precision (experts run as grouped matmuls, which have no "
                           "FP8 rule: stacked experts always, lists of experts under ep): " + _fold(experts))
        if not self.fp8:
            why = " (none chosen: FP8 would not pay at these shapes)" if lay.uses_fp8 else ""
            return "fp8 matmuls: none" + why + fused_line
        how = {"auto": "chosen per matmul by predicted gain", "all": "every weight matmul"}.get(
            lay.fp8, "as asked") if isinstance(lay.fp8, str) else "as asked"
        line = f"fp8 matmuls ({lay.fp8_recipe} scales, {how}): {_fold(self.fp8)}"
        if self.decisions.fp8_high:
            line += "\n  kept in high precision: " + _fold(self.decisions.fp8_high)
        return line + fused_line

    def _placement_table(self) -> str:
        """Placements grouped by parameter pattern (block indices folded into '*')."""
        groups: dict[tuple, list[str]] = {}
        for name, placement in self.placements.items():
            pattern = re.sub(r"\.\d+\.", ".*.", name)
            role = self.tp_roles.get(name, "") if self.layout.tp > 1 else "-"
            key = (pattern, tuple(sorted(placement.items())), role, self.decisions.params[name].zero_sharded)
            groups.setdefault(key, []).append(name)
        rows = []
        for (pattern, placement, role, zero_sharded), names in sorted(groups.items()):
            collectives = param_collectives(role, self.layout, zero_sharded)
            rows.append([pattern, f"x{len(names)}", role, ", ".join(f"{a}:{p}" for a, p in placement), collectives])
        return table(["parameter", "count", "tp role", "placement", "collectives it causes"], rows)

    def explain(self, other: Plan | Layout | str | None = None) -> str:
        """Cost of this plan against an alternative, term by term.

        other: a Plan, a Layout (evaluated on the same step), the name of a standard layout
        ("dp", "zero1", "zero3", "tp", "tp+sp", "dp+tp", "pp"), or None for every standard
        manual layout that applies.
        """
        step = self._step
        candidates: list[tuple[str, Layout | Plan]] = []
        if other is None:
            candidates = list(standard_layouts(self.cluster, self.batch, self.layout).items())
        elif isinstance(other, str):
            table_ = standard_layouts(self.cluster, self.batch, self.layout)
            if other not in table_:
                raise InputError(f"no standard layout named {other!r}; choose from {sorted(table_)}")
            candidates = [(other, table_[other])]
        else:
            candidates = [("other", other)]
        rows = [self._explain_row("this plan", self.layout, self.predicted)]
        for label, cand in candidates:
            if isinstance(cand, Plan):
                rows.append(self._explain_row(label, cand.layout, cand.predicted))
                continue
            if step is None:
                raise InputError("explain against a Layout needs the plan's captured step: call it on "
                                 "a plan returned by autopar.plan in this process")
            try:
                facts = self.step_facts(cand)
                pred = predict(facts, self.cluster, choose(facts, self.cluster, cand))
            except ValueError as exc:
                rows.append([label, cand.short(), "-", "-", "-", "-", "-", f"invalid: {exc}"[:60]])
                continue
            rows.append(self._explain_row(label, cand, pred))
        head = ["layout", "degrees", "step", "compute", "exposed comm", "bubble", "memory", "vs this plan"]
        return table(head, rows)

    def _explain_row(self, label: str, layout: Layout, pred: Prediction) -> list:
        tb = pred.time_breakdown
        comm = tb["tp_comm_s"] + tb["cp_comm_exposed_s"] + tb["ep_comm_s"] + tb["dp_comm_exposed_s"] + tb["pp_p2p_s"]
        verdict = "fits" if pred.fits else "does not fit"
        ratio = pred.step_time_s / self.predicted.step_time_s
        return [label, layout.short(), fmt_time(pred.step_time_s), fmt_time(tb["compute_s"] + tb["recompute_s"]),
                fmt_time(comm), fmt_time(tb["pp_bubble_s"]),
                f"{fmt_bytes(pred.memory_per_device_bytes)} ({verdict})", f"{ratio:.2f}x time"]

    def trace(self, path) -> Path:
        """Write the predicted step as Chrome trace-event JSON (Perfetto, chrome://tracing):
        one process per pipeline stage, one track per stream (compute, each collective kind,
        point-to-point), micro-batch by micro-batch under the schedule; its span is
        ``predicted.step_time_s`` (`autopar.planning.timeline`). Returns the path."""
        from autopar.planning.timeline import write_trace

        return write_trace(self, path)

    def report(self, path, measured=None) -> Path:
        """Write one self-contained HTML report (`autopar.planning.report_html`): the layout
        against the manual ones, the predicted timeline, memory per stage against capacity, the
        time split, the placements; with ``measured`` (a trace of
        ``ParallelModule.profile_step``), predicted against measured per track."""
        from autopar.planning.report_html import write_report

        return write_report(self, path, measured)

    # ------------------------------------------------------------------ serialisation
    def to_json(self) -> str:
        """JSON text of the whole plan (load with `Plan.from_json`)."""
        data = {
            "version": PLAN_VERSION,
            "model": self.model,
            "fingerprint": self.fingerprint,
            "batch": self.batch,
            "seq": self.seq,
            "num_params": self.num_params,
            "layout": self.layout.to_dict(),  # the decisions' layout, for readers of the file
            "decisions": self.decisions.to_dict(),
            "cluster": self.cluster.to_dict(),
            "predicted": self.predicted.as_dict(),
            "placements": self.placements,  # derived from the decisions, for readers of the file
            "solve": json_ready(self.solve),
            "refused": list(self.refused),
            "alternatives": [{"layout": lay.to_dict(), "predicted": pred.as_dict(), "label": label}
                             for (lay, pred), label in zip(self.alternatives, self._labels())],
        }
        if self.execution is not None:
            data["execution"] = self.execution.to_dict()
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of `to_json`."""
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise InputError(f"plan JSON version {data.get('version')!r}; this autopar reads "
                             f"{PLAN_VERSION}: plan the model again with this version")
        return cls(
            decisions=PlanDecisions.from_dict(data["decisions"]),
            predicted=Prediction(**data["predicted"]),
            cluster=Cluster.from_dict(data["cluster"]),
            model=data.get("model", ""),
            fingerprint=data.get("fingerprint", ""),
            batch=data.get("batch", 0),
            seq=data.get("seq", 0),
            num_params=data.get("num_params", 0),
            solve=data.get("solve", {}),
            alternatives=[(Layout.from_dict(a["layout"]), Prediction(**a["predicted"]))
                          for a in data.get("alternatives", [])],
            alternative_labels=[a.get("label", "") for a in data.get("alternatives", [])],
            execution=ExecutionReport.from_dict(data["execution"]) if "execution" in data else None,
            refused=list(data.get("refused", unsupported_decisions(Layout.from_dict(data["layout"])))),
        )

    def _labels(self) -> list[str]:
        labels = list(self.alternative_labels)
        return labels + [f"alternative {i}" for i in range(len(labels), len(self.alternatives))]

    def compare_manual(self) -> str:
        """This plan against the best hand-written layout of each standard family."""
        p = self.predicted
        rows = [["autopar plan", self.layout.short(), fmt_time(p.step_time_s),
                 f"{p.tokens_per_s_per_gpu:,.0f}", f"{100 * p.mfu:.1f} %",
                 fmt_bytes(p.memory_per_device_bytes), "1.00"]]
        for (lay, pred), label in zip(self.alternatives, self._labels()):
            rows.append([label, lay.short(), fmt_time(pred.step_time_s), f"{pred.tokens_per_s_per_gpu:,.0f}",
                         f"{100 * pred.mfu:.1f} %", fmt_bytes(pred.memory_per_device_bytes),
                         f"{pred.step_time_s / p.step_time_s:.2f}"])
        missing = [k for k, v in self.solve.get("manual_best", {}).items() if v is None]
        head = ["layout", "degrees", "step", "tok/s/GPU", "MFU", "memory", "step / autopar"]
        text = "best manual layouts (grid search on the same cost model):\n" + table(head, rows, "llrrrrr")
        if missing:
            text += "\nno layout of these families fits: " + ", ".join(missing)
        return text

    def __repr__(self) -> str:
        p = self.predicted
        return (f"Plan({self.layout.short()}, step {fmt_time(p.step_time_s)}, "
                f"{p.tokens_per_s_per_gpu:,.0f} tok/s/GPU, {'fits' if p.fits else 'does not fit'})")


def _describe(choice: RecomputeChoice) -> str:
    """`RecomputeChoice.describe` with alike groups of a block folded: the k-th alike matmul of
    a block (``experts.*.up_proj.weight#k``, one per expert) counted, not listed."""
    if choice.mode != "selective" or not choice.outputs:
        return choice.describe()
    return "selective + the outputs of " + ", ".join(_alike_counted(choice.outputs))


def _alike_counted(groups) -> list[str]:
    """Recompute group names, the k-th alike of a block (``name#k``) folded into ``name``."""
    counts: dict[str, int] = {}
    for name in groups:
        base = re.sub(r"#\d+$", "", name)
        counts[base] = counts.get(base, 0) + 1
    return [f"{base} (x{n} per block)" if n > 1 else base for base, n in counts.items()]


def _fold(items: list[str]) -> str:
    """Names with block indices folded into '*', each pattern once, with its count."""
    counts: dict[str, int] = {}
    for item in items:
        key = re.sub(r"(?<=\.)\d+(?=\.)|(?<=block )\d+", "*", item)
        counts[key] = counts.get(key, 0) + 1
    return "; ".join(f"{k} (x{n})" if n > 1 else k for k, n in counts.items())


def make_plan(step: CapturedStep, cluster: Cluster, layout: Layout, model: str = "",
              fingerprint: str = "", prediction: Prediction | None = None,
              facts: StepFacts | None = None) -> Plan:
    """A Plan for ``layout`` on ``step``: its decisions (`search.decisions.decide`) and price.

    facts: the cost facts the layout is priced with (the solver's TP recipe); by default those
    `CapturedStep.facts_for` gives, the same for every caller.
    """
    facts = facts or step.facts_for(cluster, layout)
    pred = prediction or predict(facts, cluster, choose(facts, cluster, layout))
    plan = Plan(decisions=decide(facts, cluster, layout), predicted=pred, cluster=cluster,
                model=model, fingerprint=fingerprint, batch=facts.batch, seq=facts.seq,
                num_params=facts.num_params, refused=refusals(facts, cluster, layout))
    plan._step = step
    return plan
