"""`autopar.plan`: the Plan of a training step on a cluster, and how it was reached.

A Plan is inspectable data: the layout (degrees and recipes), the mesh, the placement of every
parameter on every mesh axis (DTensor vocabulary), the pipeline stages, the predicted step time
and memory with their breakdowns, and, when the solver chose it, the alternatives it weighed.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from autopar.analysis import GraphAnalysis, analyze
from autopar.capture import TrainingGraph, capture
from autopar.errors import InputError
from autopar.report import fmt_bytes, fmt_count, fmt_time, table
from autopar.step_model import Prediction, StepFacts, check_layout, predict
from autopar.tp_recipe import COL, ROW, VOCAB
from cost import Cluster, Layout

PLAN_VERSION = 1
MESH_ORDER = ("dp", "pp", "cp", "tp")  # outermost first; TP innermost (playbook rank order)


@dataclass
class Plan:
    """The chosen (or evaluated) parallel layout of one training step on one cluster."""

    layout: Layout
    predicted: Prediction
    cluster: Cluster
    placements: dict[str, dict[str, str]]  # parameter -> mesh axis -> "Shard(d)" | "Replicate()"
    stages: list[tuple[int, int]]  # first and last block of each pipeline stage
    tp_roles: dict[str, str]
    model: str = ""
    fingerprint: str = ""  # parameter names and shapes: a plan belongs to one model
    batch: int = 0
    seq: int = 0
    num_params: int = 0
    solve: dict = field(default_factory=dict)  # how the plan was reached (method, time, counts)
    alternatives: list[tuple[Layout, Prediction]] = field(default_factory=list)
    alternative_labels: list[str] = field(default_factory=list)
    # the captured step's cost facts, so explain() prices other layouts without a new capture
    _facts: StepFacts | None = field(default=None, repr=False, compare=False)

    @property
    def mesh(self) -> dict[str, int]:
        """Mesh axes and sizes, outermost first (only axes of size > 1, dp always)."""
        sizes = {"dp": self.layout.dp, "pp": self.layout.pp, "cp": self.layout.cp, "tp": self.layout.tp}
        return {k: v for k, v in sizes.items() if v > 1 or k == "dp"}

    # ------------------------------------------------------------------ inspection
    def summary(self) -> str:
        """A readable report: degrees, predicted time and memory split by kind, placements."""
        p, lay = self.predicted, self.layout
        tb = p.time_breakdown
        lines = [
            f"autopar plan: {self.model or 'model'} ({fmt_count(self.num_params)} parameters), "
            f"batch {self.batch} x seq {self.seq} on {self.cluster.describe()}",
            f"  layout   {lay.short()}   mesh {' x '.join(f'{k}={v}' for k, v in self.mesh.items())}",
            f"  precision {lay.precision}, recompute {lay.recompute}"
            + (f", schedule {lay.schedule}" if lay.pp > 1 else ""),
        ]
        if self.solve:
            lines.append(
                f"  solver   {self.solve.get('method', '?')}: {self.solve.get('evaluated', 0)} layouts "
                f"evaluated in {self.solve.get('time_s', 0):.2f} s"
            )
        lines.append("")
        lines.append(
            f"predicted step {fmt_time(p.step_time_s)}, {p.tokens_per_s_per_gpu:,.0f} tok/s/GPU, "
            f"MFU {100 * p.mfu:.1f} %, memory {fmt_bytes(p.memory_per_device_bytes)} of "
            f"{fmt_bytes(p.memory_capacity_bytes)} per device ({'fits' if p.fits else 'DOES NOT FIT'})"
        )
        exposed_comm = tb["tp_comm_s"] + tb["cp_comm_exposed_s"] + tb["ep_comm_s"] + tb["dp_comm_exposed_s"] + tb["pp_p2p_s"]
        rows = [
            ["compute", fmt_time(tb["compute_s"])],
            ["recompute", fmt_time(tb["recompute_s"])],
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
        if lay.pp > 1:
            lines.append("pipeline stages: " + ", ".join(
                f"{i}: blocks {a}-{b}" for i, (a, b) in enumerate(self.stages)))
        return "\n".join(lines)

    def _placement_table(self) -> str:
        """Placements grouped by parameter pattern (block indices folded into '*')."""
        import re

        groups: dict[tuple, list[str]] = {}
        for name, placement in self.placements.items():
            pattern = re.sub(r"\.\d+\.", ".*.", name)
            key = (pattern, tuple(sorted(placement.items())), self.tp_roles.get(name, ""))
            groups.setdefault(key, []).append(name)
        rows = []
        for (pattern, placement, role), names in sorted(groups.items()):
            collectives = _collectives_of(role, self.layout)
            rows.append([pattern, f"x{len(names)}", role, ", ".join(f"{a}:{p}" for a, p in placement), collectives])
        return table(["parameter", "count", "tp role", "placement", "collectives it causes"], rows)

    def explain(self, other: Plan | Layout | str | None = None) -> str:
        """Cost of this plan against an alternative, term by term.

        other: a Plan, a Layout (evaluated on the same step), the name of a standard layout
        ("dp", "zero1", "zero3", "tp", "tp+sp", "dp+tp", "pp"), or None for every standard
        manual layout that applies.
        """
        from autopar.manual import standard_layouts

        facts = self._facts
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
            if facts is None:
                raise InputError("explain against a Layout needs the plan's captured step: call it on "
                                 "a plan returned by autopar.plan in this process")
            try:
                pred = predict(facts, self.cluster, cand)
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
            "layout": self.layout.to_dict(),
            "cluster": self.cluster.to_dict(),
            "predicted": self.predicted.as_dict(),
            "placements": self.placements,
            "stages": [list(s) for s in self.stages],
            "tp_roles": self.tp_roles,
            "solve": self.solve,
            "alternatives": [{"layout": lay.to_dict(), "predicted": pred.as_dict(), "label": label}
                             for (lay, pred), label in zip(self.alternatives, self._labels())],
        }
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Inverse of `to_json`."""
        data = json.loads(text)
        if data.get("version") != PLAN_VERSION:
            raise InputError(f"plan JSON version {data.get('version')!r}; this autopar reads {PLAN_VERSION}")
        return cls(
            layout=Layout.from_dict(data["layout"]),
            predicted=Prediction(**data["predicted"]),
            cluster=Cluster.from_dict(data["cluster"]),
            placements=data["placements"],
            stages=[tuple(s) for s in data["stages"]],
            tp_roles=data["tp_roles"],
            model=data.get("model", ""),
            fingerprint=data.get("fingerprint", ""),
            batch=data.get("batch", 0),
            seq=data.get("seq", 0),
            num_params=data.get("num_params", 0),
            solve=data.get("solve", {}),
            alternatives=[(Layout.from_dict(a["layout"]), Prediction(**a["predicted"]))
                          for a in data.get("alternatives", [])],
            alternative_labels=[a.get("label", "") for a in data.get("alternatives", [])],
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


def _collectives_of(role: str, layout: Layout) -> str:
    """The collectives a parameter's placement causes, in words."""
    parts = []
    if layout.dp * layout.cp > 1:
        parts.append({0: "grad all-reduce", 1: "grad reduce-scatter + weight all-gather",
                      2: "grad reduce-scatter + weight all-gather",
                      3: "weight all-gather fwd+bwd, grad reduce-scatter"}[layout.zero])
    if layout.tp > 1:
        if role == COL:
            parts.append("input all-gather (SP)" if layout.sp else "input-grad all-reduce")
        elif role == ROW:
            parts.append("output reduce-scatter (SP)" if layout.sp else "output all-reduce")
        elif role == VOCAB:
            parts.append("output all-reduce")
        elif layout.sp:
            parts.append("grad all-reduce over tp (SP)")
    return "; ".join(parts) or "none"


_STEP_CACHE: dict[tuple, CapturedStep] = {}


@dataclass
class CapturedStep:
    """A captured and analysed training step, and its cost facts per TP recipe (memoised)."""

    graph: TrainingGraph
    analysis: GraphAnalysis
    config: object = None
    fused: bool = True
    _facts: dict = field(default_factory=dict, repr=False)
    _ilp: dict = field(default_factory=dict, repr=False)

    def facts(self, roles: dict[str, str] | None = None) -> StepFacts:
        """Cost facts with Megatron's TP roles, or with ``roles`` where given."""
        key = tuple(sorted((roles or {}).items()))
        if key not in self._facts:
            self._facts[key] = StepFacts.from_graph(self.graph, self.analysis, self.config,
                                                    fused=self.fused, roles=roles)
        return self._facts[key]

    def tp_variants(self, cluster: Cluster, tp: int) -> list[tuple[str, StepFacts]]:
        """The TP recipes worth pricing at degree ``tp``: the ILP's choice and, where its
        heads and dimensions divide, Megatron's (when the two differ)."""
        from autopar.tp_ilp import solve_tp_roles

        key = (cluster.describe(), tp)
        if key not in self._ilp:
            base = self.facts().recipe
            head_dim = getattr(self.config, "head_dim", None)
            self._ilp[key] = solve_tp_roles(self.graph, self.analysis, cluster, tp, sp=True,
                                            head_dim=head_dim, base=base)
        ilp = self._ilp[key]
        base = self.facts()
        variants = []
        megatron_ok = _divides(base, self.graph, tp, self.config)
        if megatron_ok:
            variants.append(("megatron", base))
        if not megatron_ok or any(base.recipe.roles.get(p) != r for p, r in ilp.roles.items()):
            variants.append(("ilp", self.facts(ilp.roles)))
        return variants

    def ilp_stats(self) -> list[dict]:
        """Size and time of every TP ILP solved so far."""
        return [{"tp": k[1], "variables": r.variables, "constraints": r.constraints,
                 "solve_s": r.solve_time_s, "status": r.status} for k, r in self._ilp.items()]


def _divides(facts: StepFacts, graph: TrainingGraph, tp: int, config) -> bool:
    """Megatron's roles are valid at ``tp``: sharded dims and (KV) heads divide by it."""
    if config is not None and getattr(config, "n_kv_heads", None):
        if config.n_heads % tp or config.n_kv_heads % tp:
            return False
    for name in facts.recipe.roles:
        dim = facts.recipe.param_shard_dim(name)
        if dim is not None and graph.param_shapes[name][dim] % tp:
            return False
    return True


def step_facts(model: nn.Module, example_inputs: Sequence, loss_fn: Callable | None,
               dtype: torch.dtype, fused: bool = True) -> tuple[CapturedStep, str]:
    """Capture and analyse the step once per (model, input shapes, dtype); cached."""
    fingerprint = model_fingerprint(model)
    # same class, parameter names and shapes, inputs and loss: the same graph
    key = (type(model).__qualname__, fingerprint, tuple((tuple(x.shape), x.dtype) for x in example_inputs),
           loss_fn, dtype, fused)
    if key not in _STEP_CACHE:
        graph = capture(model, example_inputs, loss_fn=loss_fn, dtype=dtype)
        step = CapturedStep(graph, analyze(graph), getattr(model, "config", None), fused)
        if len(_STEP_CACHE) > 4:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = step
    return _STEP_CACHE[key], fingerprint


def model_fingerprint(model: nn.Module) -> str:
    """A short hash of parameter names and shapes: which model a plan was made for."""
    text = ";".join(f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def make_plan(facts: StepFacts, cluster: Cluster, layout: Layout, model: str = "",
              fingerprint: str = "", prediction: Prediction | None = None) -> Plan:
    """A Plan for ``layout``: placements from the TP recipe and ZeRO stage, stages from PP."""
    pred = prediction or predict(facts, cluster, layout)
    roles = dict(facts.recipe.roles) if facts.recipe else {}
    placements = {}
    for name in facts.param_numel:
        axes = {"dp": "Shard(0)" if layout.zero == 3 and layout.dp * layout.cp > 1 else "Replicate()"}
        if layout.tp > 1:
            dim = facts.recipe.param_shard_dim(name) if facts.recipe else None
            axes["tp"] = f"Shard({dim})" if dim is not None else "Replicate()"
        if layout.ep > 1 and facts.param_expert.get(name):
            axes["ep"] = "Shard(experts)"
        placements[name] = axes
    n = max(facts.n_layers, 1)
    stages = []
    for s in range(layout.pp):
        layers = [i for i in range(n) if min(i * layout.pp // n, layout.pp - 1) == s]
        stages.append((layers[0], layers[-1]) if layers else (0, -1))
    plan = Plan(layout=layout, predicted=pred, cluster=cluster, placements=placements, stages=stages,
                tp_roles=roles, model=model, fingerprint=fingerprint, batch=facts.batch, seq=facts.seq,
                num_params=facts.num_params)
    plan._facts = facts
    return plan


def plan(
    model: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    cluster: Cluster | None = None,
    loss_fn: Callable | None = None,
    layout: Layout | None = None,
    progress: Callable[[str], None] | None = None,
    **search,
) -> Plan:
    """Plan one training step of ``model`` on ``cluster``; nothing runs, nothing is allocated.

    ``example_inputs`` describe the whole step (the global batch, dim 0). With ``layout`` the
    plan evaluates that manual layout (its degrees are constraints); without, the solver
    searches for the fastest layout that fits. ``search`` options go to `autopar.solver.solve`.
    """
    cluster = cluster if cluster is not None else Cluster.local()
    default = "fp32" if cluster.gpu.is_cpu else "bf16"
    fp32 = (layout.precision if layout is not None else search.pop("precision", default)) == "fp32"
    dtype = torch.float32 if fp32 or "bf16" not in cluster.gpu.peak_flops else torch.bfloat16
    t0 = time.perf_counter()
    if progress:
        progress(f"capturing the training step ({dtype}) on fake tensors ...")
    # CPU ranks run eager PyTorch, one kernel per op; GPU plans assume fused element-wise kernels
    fused = not cluster.gpu.is_cpu
    step, fingerprint = step_facts(model, example_inputs, loss_fn, dtype, fused=fused)
    name = getattr(getattr(model, "config", None), "name", type(model).__name__)
    if layout is not None:
        facts = step.facts()
        if layout.tp > 1 and not _divides(facts, step.graph, layout.tp, step.config):
            facts = dict(step.tp_variants(cluster, layout.tp))["ilp"]
        check_layout(facts, cluster, layout)
        result = make_plan(facts, cluster, layout, model=name, fingerprint=fingerprint)
        result.solve = {"method": "manual layout", "evaluated": 1, "time_s": time.perf_counter() - t0}
        return result
    from autopar.solver import solve

    return solve(step, cluster, model=name, fingerprint=fingerprint, progress=progress, **search)
