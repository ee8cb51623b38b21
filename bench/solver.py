"""`autopar bench solver`: the solver against the best hand-written layouts, and its solve time.

Sections (each a table; the returned dict holds every number and is JSON-ready):

1. solver vs best manual layout: the standard models on 1, 8 and 64 h100 nodes (seq 4096,
   global batch 256 sequences = 1M tokens, 1024 = 4M tokens on 64 nodes so data parallelism has
   room); the solver's plan against the best layout of every hand-written family
   (`autopar.search.manual.best_manual`, a grid search on the same cost model). That grid is a
   subset of the solver's search priced by the same model, so manual/solver >= 0.999 holds by
   construction: the table shows coverage (the search reaches every hand-written layout), not
   that the cost model is right.
2. solve-time scaling: (a) with the number of layers (llama3-8b shape on 64 GPUs), capture and
   solve timed separately; (b) with the number of GPUs (llama3-70b on 8 to 4096 GPUs), against
   the targets (8B on 64 GPUs < 10 s, 70B on 512 GPUs < 60 s) and PyTorch AutoParallel's
   published solve times.
3. checks over every row: two coverage checks (the ratio above; no manual layout fits where the
   solver found none), then sanity checks of the choices: TP stays inside a node unless
   cross-node TP was needed, playbook-1b on one node is data parallel, llama3-70b on eight nodes
   is not.

Reference data (the solve-time targets, AutoParallel's published solve times): data/solver.json.

Every model is built once on the meta device and captured once per global batch
(`planner.step_facts`, timed on its own); `autopar.plan` then finds the capture in its cache, so
``plan.solve["time_s"]`` is the solve alone (search, TP ILPs, and the manual grid it reports).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

import autopar
from autopar import models
from autopar.models import ModelConfig
from autopar.report import fmt_count, fmt_time, json_ready, table
from autopar.search.manual import best_manual
from autopar.search.solver import NoFeasiblePlanError
from autopar.search.step import step_facts
from bench.reference import reference_table
from cost import Cluster

SEQ = 4096
GPUS_PER_NODE = 8
GPU = "h100"
RATIO_FLOOR = 0.999  # best manual / solver below this: the solver lost to a hand-written layout

MODELS = ("llama3-8b", "llama3-70b", "llama3-405b", "playbook-1b", "playbook-3b", "playbook-8b",
          "playbook-80b", "mixtral-8x7b")
NODES = (1, 8, 64)
LAYERS = (8, 16, 32, 64, 126)  # llama3-8b shape, section 2a
LAYERS_NODES = 8
GPU_SWEEP_MODEL = "llama3-70b"
# Global batch (sequences of 4096) per node count in the GPU sweep: 1M tokens up to 64 GPUs,
# 4M at 512 (as in section 1), 8M at 4096 GPUs (tp 8 x dp 512 x 4 sequences; Llama 3 405B
# trained at up to 16M tokens per step).
GPU_SWEEP_BATCH = {1: 256, 8: 256, 64: 1024, 512: 2048}

QUICK_MODELS = ("playbook-1b",)
QUICK_NODES = (1, 8)
QUICK_LAYERS = (2, 4)
QUICK_GPU_LAYERS = 4  # quick mode sweeps GPUs on a 4-layer llama3-70b (a full capture is ~50 s)
QUICK_GPU_BATCH = {1: 256, 8: 256}


def _reference_rows(table: str, fields: tuple[str, ...]) -> tuple[tuple, ...]:
    """The rows of one table of data/solver.json as tuples of ``fields``."""
    return tuple(tuple(row[f] for f in fields)
                 for row in reference_table("solver", table)["rows"])


# Solve-time targets (seconds, solve only; capture reported separately):
# (label, model, nodes, limit_s).
TARGETS = _reference_rows("targets", ("label", "model", "nodes", "limit_s"))
# PyTorch AutoParallel's published solve times (seconds), for scale: a different search (per-op
# sharding ILP over the whole graph), so set beside ours, not compared as equals:
# (label, model, nodes, published_s).
AUTOPARALLEL = _reference_rows("autoparallel", ("label", "model", "nodes", "published_s"))

# The manual grid (search/manual.py) is a subset of the solver's search and is priced by the
# same cost model, so the solver cannot lose to it unless the search is broken: the comparison
# is reported as coverage, and must not be read as evidence that the cost model is right.
COVERAGE = "coverage"
SANITY = "sanity"
COVERAGE_NOTE = ("the manual grid is a subset of the search priced by the same model: this "
                 "shows coverage, not that the cost model is right")

TITLES = {
    "versus_manual": "1. Solver vs best manual layout, coverage (h100 x8 per node, seq 4096; "
                     "batch in sequences: 256 = 1M tokens, 1024 = 4M tokens on 64 nodes)",
    "layers": "2a. Solve time vs layers: llama3-8b shape on {nodes} nodes ({gpus} GPUs), "
              "batch {batch} x 4096",
    "gpus": "2b. Solve time vs GPUs: {model}, batch scaled with the GPUs",
    "targets": "2c. Solve-time targets (solve only; capture separately)",
    "checks": "3. Coverage and sanity checks",
}


def _say(progress: Callable[[str], None] | None) -> Callable[[str], None]:
    return progress or (lambda _msg: None)


def model_label(cfg: ModelConfig) -> str:
    """The config's name, with its layer count where it differs from the published shape."""
    try:
        base = models.config(cfg.name)
    except KeyError:
        return cfg.name
    return cfg.name if base.n_layers == cfg.n_layers else f"{cfg.name} ({cfg.n_layers} layers)"


def layers_config(name: str, n_layers: int) -> ModelConfig:
    """A zoo config with ``n_layers`` blocks."""
    return dataclasses.replace(models.config(name), n_layers=n_layers)


@dataclass
class _Capture:
    inputs: tuple
    capture_s: float
    used: int = 0


class SolverRuns:
    """Models built once per config, steps captured once per (config, batch), plans memoised per
    (config, nodes, batch) so sections share rows instead of re-solving (a second solve on the
    same cluster would reuse the TP ILPs and look faster than it is)."""

    def __init__(self, progress: Callable[[str], None] | None = None):
        self.say = _say(progress)
        self._models: dict[ModelConfig, torch.nn.Module] = {}
        self._captures: dict[tuple[ModelConfig, int], _Capture] = {}
        self._rows: dict[tuple[ModelConfig, int, int], dict] = {}
        self.warmup_s = 0.0

    def warm_up(self) -> float:
        """Capture a tiny model once, so the first real capture is not charged for imports."""
        t0 = time.perf_counter()
        tiny = models.build("tiny-llama", device="meta")
        step_facts(tiny, models.example_inputs("tiny-llama", batch=2, device="meta"), None,
                   torch.bfloat16)
        self.warmup_s = time.perf_counter() - t0
        return self.warmup_s

    def model(self, cfg: ModelConfig) -> torch.nn.Module:
        """The meta-device model of ``cfg`` (one object per config: captures key on it)."""
        if cfg not in self._models:
            self._models[cfg] = models.build(cfg, device="meta")
        return self._models[cfg]

    def capture(self, cfg: ModelConfig, batch: int) -> tuple[tuple, float, bool]:
        """Inputs of (cfg, batch), the capture's seconds, and whether an earlier row captured it."""
        key = (cfg, batch)
        if key not in self._captures:
            model = self.model(cfg)
            inputs = models.example_inputs(cfg, batch=batch, seq=SEQ, device="meta")
            self.say(f"capturing {model_label(cfg)} (batch {batch} x {SEQ}) ...")
            t0 = time.perf_counter()
            step_facts(model, inputs, None, torch.bfloat16)
            self._captures[key] = _Capture(inputs, time.perf_counter() - t0)
            self.say(f"  captured in {self._captures[key].capture_s:.1f} s")
        cap = self._captures[key]
        cap.used += 1
        return cap.inputs, cap.capture_s, cap.used > 1

    def row(self, cfg: ModelConfig, nodes: int, batch: int) -> dict:
        """The solver's plan of (cfg, nodes, batch) against the manual families (memoised)."""
        key = (cfg, nodes, batch)
        if key in self._rows:
            self._rows[key]["shared"] = True
            return self._rows[key]
        inputs, capture_s, reused = self.capture(cfg, batch)
        row = solve_row(self.model(cfg), inputs, cfg, _cluster(nodes))
        row.update(capture_s=capture_s, capture_reused=reused, shared=False)
        self.say("  " + _progress_line(row))
        self._rows[key] = row
        return row

    def capture_times(self) -> dict[str, float]:
        """Seconds of every capture, by model and batch."""
        return {f"{model_label(cfg)} batch {batch}": cap.capture_s
                for (cfg, batch), cap in self._captures.items()}

    def rows(self) -> list[dict]:
        """Every row solved so far, in order."""
        return list(self._rows.values())


def _cluster(nodes: int) -> Cluster:
    return Cluster(GPU, nodes=nodes, gpus_per_node=GPUS_PER_NODE)


def solve_row(model: torch.nn.Module, inputs: Sequence[torch.Tensor], cfg: ModelConfig,
              cluster: Cluster) -> dict:
    """Plan one step with `autopar.plan` on ``cluster`` and compare it with the best manual
    layouts. Capture first (`step_facts`) if the timings should exclude it. A JSON-ready row."""
    nodes, batch = cluster.nodes, int(inputs[0].shape[0])
    step, _ = step_facts(model, inputs, None, torch.bfloat16)
    n_ilp = len(step.ilp_stats())
    row: dict = {
        "model": model_label(cfg), "name": cfg.name, "n_layers": cfg.n_layers,
        "num_params": int(sum(p.numel() for p in model.parameters())),
        "nodes": nodes, "gpus": cluster.world_size, "batch": batch, "tokens": batch * SEQ,
    }
    t0 = time.perf_counter()
    try:
        plan = autopar.plan(model, inputs, cluster=cluster)
    except NoFeasiblePlanError as exc:
        wall = time.perf_counter() - t0
        t1 = time.perf_counter()
        manual = best_manual(step, cluster)
        manual_s = time.perf_counter() - t1
        fits = {k: v[0].short() for k, v in manual.items() if v is not None}
        row.update(
            feasible=False, solve_s=wall, plan_wall_s=wall, manual_grid_s=manual_s,
            ilp_s=sum(s["solve_s"] for s in step.ilp_stats()[n_ilp:]),
            ilp=step.ilp_stats()[n_ilp:], message=str(exc), manual={k: None for k in manual}, manual_fits=bool(fits),
            manual_fitting=fits, ratio=None, ratio_ok=None,
        )
        return row
    wall = time.perf_counter() - t0
    pred, lay = plan.predicted, plan.layout
    manual = {k: (list(v) if v else None) for k, v in plan.solve["manual_best"].items()}
    fitting = {k: v for k, v in manual.items() if v is not None}
    best = min(fitting.items(), key=lambda kv: kv[1][1]) if fitting else None
    # the manual grid alone, timed again (it is part of solve_s; cheap next to the search)
    t1 = time.perf_counter()
    best_manual(step, cluster)
    manual_s = time.perf_counter() - t1
    ratio = best[1][1] / pred.step_time_s if best else None
    row.update(
        feasible=True, layout=lay.short(),
        degrees={"dp": lay.dp, "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep,
                 "zero": lay.zero, "microbatch": lay.microbatch, "grad_accum": lay.grad_accum},
        step_s=pred.step_time_s, tok_s_gpu=pred.tokens_per_s_per_gpu, mfu=pred.mfu,
        memory_bytes=pred.memory_per_device_bytes, time_breakdown=dict(pred.time_breakdown),
        solve_s=plan.solve["time_s"], plan_wall_s=wall, manual_grid_s=manual_s,
        ilp_s=sum(s["solve_s"] for s in step.ilp_stats()[n_ilp:]),
        ilp=step.ilp_stats()[n_ilp:], considered=plan.solve["considered"], evaluated=plan.solve["evaluated"],
        cross_node_tp=bool(plan.solve["cross_node_tp"]), tp_recipe=plan.solve.get("tp_recipe"),
        manual=manual, manual_fits=bool(fitting),
        best_manual_family=best[0] if best else None,
        best_manual_layout=best[1][0] if best else None,
        best_manual_step_s=best[1][1] if best else None,
        ratio=ratio, ratio_ok=None if ratio is None else ratio >= RATIO_FLOOR,
    )
    return row


def _progress_line(row: dict) -> str:
    head = f"{row['model']} on {row['nodes']} node(s), batch {row['batch']}: "
    if not row["feasible"]:
        return head + f"does not fit (searched in {row['solve_s']:.1f} s)" + (
            "; !! A MANUAL LAYOUT FITS" if row["manual_fits"] else "")
    ratio = f"{row['ratio']:.3f}" if row["ratio"] is not None else "-"
    if row["ratio"] is not None and row["ratio"] < RATIO_FLOOR:
        ratio += " !! SOLVER SLOWER THAN A MANUAL LAYOUT"
    return head + (f"{row['layout']}, {fmt_time(row['step_s'])}/step, solve "
                   f"{row['solve_s']:.1f} s, best manual / solver {ratio}")


# --------------------------------------------------------------------------------------------
# sections


def versus_manual_section(runs: SolverRuns, names: Iterable[str] = MODELS,
                          nodes: Iterable[int] = NODES) -> dict:
    """Section 1: every (model, nodes) row; batch 256 sequences, 1024 from 64 nodes up."""
    rows = []
    for name in names:
        cfg = models.config(name)
        for n in nodes:
            runs.say(f"[1] {name} on {n} node(s) ...")
            rows.append(runs.row(cfg, n, section1_batch(n)))
    return {"seq": SEQ, "gpus_per_node": GPUS_PER_NODE, "rows": rows, "kind": COVERAGE,
            "note": COVERAGE_NOTE}


def section1_batch(nodes: int) -> int:
    """Global batch (sequences) of section 1: 1M tokens, 4M from 64 nodes (512 GPUs) up."""
    return 1024 if nodes >= 64 else 256


def layers_section(runs: SolverRuns, layers: Iterable[int] = LAYERS, nodes: int = LAYERS_NODES,
                   batch: int = 256, name: str = "llama3-8b") -> dict:
    """Section 2a: capture and solve time of ``name`` with each number of layers."""
    rows = []
    for n_layers in layers:
        runs.say(f"[2a] {name} with {n_layers} layers on {nodes} nodes ...")
        rows.append(runs.row(layers_config(name, n_layers), nodes, batch))
    return {"model": name, "nodes": nodes, "gpus": nodes * GPUS_PER_NODE, "batch": batch,
            "rows": rows, "capture_s_per_layer": _per_layer(rows)}


def _per_layer(rows: list[dict]) -> float | None:
    """Slope of capture seconds against layers (least squares), where there are two points."""
    pts = [(r["n_layers"], r["capture_s"]) for r in rows]
    if len({x for x, _ in pts}) < 2:
        return None
    x, y = np.array(pts, dtype=float).T
    return float(np.polyfit(x, y, 1)[0])


def gpus_section(runs: SolverRuns, batches: dict[int, int] = GPU_SWEEP_BATCH,
                 cfg: ModelConfig | None = None) -> dict:
    """Section 2b: solve time of ``cfg`` (llama3-70b) on each node count, batch per node count."""
    cfg = cfg or models.config(GPU_SWEEP_MODEL)
    rows = []
    for n, batch in batches.items():
        runs.say(f"[2b] {model_label(cfg)} on {n} node(s) ({n * GPUS_PER_NODE} GPUs) ...")
        rows.append(runs.row(cfg, n, batch))
    return {"model": model_label(cfg), "batches": {str(k): v for k, v in batches.items()},
            "rows": rows}


def targets_section(rows: list[dict]) -> dict:
    """Solve times against the targets and AutoParallel's published times (where run)."""

    def find(name: str, nodes: int) -> dict | None:
        full = models.config(name).n_layers
        return next((r for r in rows if r["name"] == name and r["n_layers"] == full
                     and r["nodes"] == nodes), None)

    targets = []
    for label, name, nodes, limit in TARGETS:
        r = find(name, nodes)
        solve = r["solve_s"] if r else None
        targets.append({"target": label, "limit_s": limit, "model": name, "nodes": nodes,
                        "solve_s": solve, "capture_s": r["capture_s"] if r else None,
                        "met": None if solve is None else solve < limit})
    autoparallel = []
    for label, name, nodes, published in AUTOPARALLEL:
        r = find(name, nodes)
        autoparallel.append({"autoparallel": label, "published_s": published, "model": name,
                             "nodes": nodes, "gpus": nodes * GPUS_PER_NODE,
                             "solve_s": r["solve_s"] if r else None,
                             "speedup": published / r["solve_s"] if r else None})
    return {"targets": targets, "autoparallel": autoparallel}


def sanity_checks(rows: list[dict]) -> list[dict]:
    """The checks of section 3 over ``rows``; ``ok`` is None where no row applies.

    ``kind`` is "coverage" for the two checks that hold by construction while the search
    includes the manual grid (they catch a broken search, not a wrong cost model), "sanity"
    for the checks of what the solver chose.
    """
    feasible = [r for r in rows if r["feasible"]]
    checks = []

    def add(name: str, applies: list[dict], bad: list[dict], detail: str,
            kind: str = SANITY) -> None:
        checks.append({"check": name, "kind": kind, "rows": len(applies),
                       "ok": None if not applies else not bad,
                       "failures": [f"{r['model']} {r['nodes']} node(s) batch {r['batch']}"
                                    for r in bad], "detail": detail,
                       "note": COVERAGE_NOTE if kind == COVERAGE else ""})

    with_ratio = [r for r in feasible if r["ratio"] is not None]
    bad = [r for r in with_ratio if r["ratio"] < RATIO_FLOOR]
    worst = min((r["ratio"] for r in with_ratio), default=None)
    add("solver never slower than the best manual layout (manual/solver >= 0.999)",
        with_ratio, bad, "" if worst is None else f"lowest ratio {worst:.4f}", COVERAGE)
    infeasible = [r for r in rows if not r["feasible"]]
    add("where the solver finds nothing, no manual layout fits either", infeasible,
        [r for r in infeasible if r["manual_fits"]], f"{len(infeasible)} row(s) do not fit",
        COVERAGE)
    add("TP degree <= 8 (one node) unless cross-node TP was needed", feasible,
        [r for r in feasible if r["degrees"]["tp"] > GPUS_PER_NODE and not r["cross_node_tp"]],
        f"TP degrees used: {sorted({r['degrees']['tp'] for r in feasible})}")

    def full(name: str, nodes: int) -> list[dict]:
        n = models.config(name).n_layers
        return [r for r in rows if r["name"] == name and r["n_layers"] == n and r["nodes"] == nodes]

    pb = full("playbook-1b", 1)
    add("playbook-1b on 1 node is data parallel (tp = pp = 1)", pb,
        [r for r in pb if not r["feasible"] or r["degrees"]["tp"] != 1 or r["degrees"]["pp"] != 1],
        ", ".join(r.get("layout", "does not fit") for r in pb))
    ll = full("llama3-70b", 8)
    add("llama3-70b on 8 nodes is not pure data parallel (tp, pp or cp > 1)", ll,
        [r for r in ll if not r["feasible"]
         or max(r["degrees"]["tp"], r["degrees"]["pp"], r["degrees"]["cp"]) == 1],
        ", ".join(r.get("layout", "does not fit") for r in ll))
    return checks


# --------------------------------------------------------------------------------------------
# the bench


def run_solver_bench(quick: bool = False, progress: Callable[[str], None] | None = print) -> dict:
    """Run every section. ``quick``: playbook-1b on 1 and 8 nodes, 2- and 4-layer llama3-8b, and
    a 4-layer llama3-70b on 8 and 64 GPUs (< 90 s on two cores); the full run takes minutes.

    Returns a JSON-ready dict: ``versus_manual``, ``layers``, ``gpus``, ``targets``, ``checks``,
    ``all_ok``, ``capture_s`` (per model and batch), ``warmup_s`` and ``time_s``.
    """
    if quick:
        return run_sections(QUICK_MODELS, QUICK_NODES, QUICK_LAYERS,
                            layers_config(GPU_SWEEP_MODEL, QUICK_GPU_LAYERS), QUICK_GPU_BATCH,
                            quick=True, progress=progress)
    return run_sections(MODELS, NODES, LAYERS, models.config(GPU_SWEEP_MODEL), GPU_SWEEP_BATCH,
                        quick=False, progress=progress)


def run_sections(names: Iterable[str], nodes: Iterable[int], layers: Iterable[int],
                 gpu_cfg: ModelConfig, gpu_batches: dict[int, int], quick: bool = False,
                 progress: Callable[[str], None] | None = print) -> dict:
    """The bench on the given models, node counts, layer counts and GPU sweep (see
    `run_solver_bench` for the standard choices and the returned dict)."""
    t0 = time.perf_counter()
    runs = SolverRuns(progress)
    runs.say("warming up (capturing tiny-llama) ...")
    runs.warm_up()
    result: dict = {"quick": quick, "seq": SEQ, "gpu": GPU, "gpus_per_node": GPUS_PER_NODE,
                    "ratio_floor": RATIO_FLOOR, "warmup_s": runs.warmup_s}
    result["versus_manual"] = versus_manual_section(runs, names, nodes)
    result["layers"] = layers_section(runs, layers)
    result["gpus"] = gpus_section(runs, gpu_batches, gpu_cfg)
    rows = runs.rows()
    result["targets"] = targets_section(rows)
    result["checks"] = sanity_checks(rows)
    result["all_ok"] = all(c["ok"] is not False for c in result["checks"])
    result["capture_s"] = runs.capture_times()
    result["time_s"] = time.perf_counter() - t0
    return json_ready(result)


# --------------------------------------------------------------------------------------------
# formatting


def _s(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _capture_cell(r: dict) -> str:
    return f"{r['capture_s']:.1f}" + (" (cached)" if r["capture_reused"] else "")


def _format_versus_manual(sec: dict) -> str:
    plan_rows, manual_rows, notes = [], [], []
    for r in sec["rows"]:
        head = [r["model"], r["nodes"], r["gpus"], r["batch"]]
        if not r["feasible"]:
            plan_rows.append(head + ["does not fit", "-", "-", "-", "-", _s(r["solve_s"]),
                                     _capture_cell(r)])
            verdict = ("none fits (grid checked)" if not r["manual_fits"]
                       else "!! MANUAL FITS: " + "; ".join(r["manual_fitting"].values()))
            manual_rows.append(head[:2] + [verdict, "", "-", "-", ""])
            lines = r["message"].splitlines()
            notes.append(f"  {r['model']} on {r['nodes']} node(s): "
                         + (lines[1].strip() if len(lines) > 1 else lines[0]))
            continue
        tp_flag = "" if r["degrees"]["tp"] <= GPUS_PER_NODE or r["cross_node_tp"] else " !!"
        plan_rows.append(head + [r["layout"] + tp_flag, fmt_time(r["step_s"]),
                                 f"{r['tok_s_gpu']:,.0f}", f"{100 * r['mfu']:.1f} %",
                                 f"{r['memory_bytes'] / 2**30:.1f}", _s(r["solve_s"]),
                                 _capture_cell(r)])
        ratio = r["ratio"]
        flag = "" if ratio is None or ratio >= RATIO_FLOOR else "!! SOLVER SLOWER"
        if not r["manual_fits"]:
            flag = "only the solver's layout fits"
        manual_rows.append(head[:2] + [r["best_manual_family"] or "none fits",
                                       r["best_manual_layout"] or "",
                                       fmt_time(r["best_manual_step_s"]) if ratio else "-",
                                       _s(ratio, 3), flag])
    t1 = table(["model", "nodes", "GPUs", "batch", "solver layout", "step", "tok/s/GPU", "MFU",
                "mem GiB", "solve s", "capture s"], plan_rows, "lrrrlrrrrrl")
    t2 = table(["model", "nodes", "best manual family", "its layout", "step", "manual/solver",
                "note"], manual_rows, "lrllrrl")
    out = [t1, "", t2, f"coverage: {sec.get('note', COVERAGE_NOTE)}"]
    if notes:
        out += ["", "does not fit (closest miss):", *notes]
    return "\n".join(out)


def _format_layers(sec: dict) -> str:
    rows = []
    for r in sec["rows"]:
        rows.append([r["n_layers"], fmt_count(r["num_params"]), _capture_cell(r), _s(r["solve_s"], 2),
                     _s(r["ilp_s"], 2), _ilp_size(r), _s(r["manual_grid_s"], 2),
                     f"{r.get('considered', 0):,}", f"{r.get('evaluated', 0):,}",
                     r.get("layout", "does not fit"),
                     fmt_time(r["step_s"]) if r["feasible"] else "-"])
    slope = sec["capture_s_per_layer"]
    foot = "" if slope is None else f"capture grows by {slope:.2f} s per layer (least squares)"
    return "\n".join([
        table(["layers", "params", "capture s", "solve s", "of which ILP s", "ILP vars x cons",
               "manual grid s", "considered", "fit", "solver layout", "step"], rows,
              "rrlrrrrrrlr"),
        "(solve s = plan.solve['time_s']: layout search + TP ILPs (one per TP degree) + the "
        "manual grid; ILP size: the largest of them; 'fit' = layouts priced)",
        foot,
    ])


def _ilp_size(r: dict) -> str:
    ilps = r.get("ilp") or []
    if not ilps:
        return "-"
    big = max(ilps, key=lambda i: i["variables"])
    return f"{big['variables']:,} x {big['constraints']:,}"


def _format_gpus(sec: dict) -> str:
    rows = []
    for r in sec["rows"]:
        rows.append([r["nodes"], r["gpus"], r["batch"], _capture_cell(r), _s(r["solve_s"], 2),
                     _s(r["ilp_s"], 2), _s(r["manual_grid_s"], 2), f"{r.get('considered', 0):,}",
                     f"{r.get('evaluated', 0):,}", r.get("layout", "does not fit"),
                     fmt_time(r["step_s"]) if r["feasible"] else "-",
                     f"{100 * r['mfu']:.1f} %" if r["feasible"] else "-"])
    return "\n".join([
        table(["nodes", "GPUs", "batch", "capture s", "solve s", "of which ILP s",
               "manual grid s", "considered", "fit", "solver layout", "step", "MFU"], rows,
              "rrrlrrrrrlrr"),
        "(batch in sequences of 4096; rows marked (cached) reuse a capture of an earlier row)",
    ])


def _format_targets(sec: dict) -> str:
    rows = [[t["target"], f"< {t['limit_s']:.0f}", _s(t["solve_s"], 2), _s(t["capture_s"]),
             {None: "not run", True: "met", False: "!! MISSED"}[t["met"]]] for t in sec["targets"]]
    ap = [[a["autoparallel"], f"{a['published_s']:.1f}",
           f"{a['model']} on {a['gpus']} GPUs", _s(a["solve_s"], 2),
           "not run" if a["speedup"] is None else f"{a['speedup']:.1f}x"]
          for a in sec["autoparallel"]]
    return "\n".join([
        table(["target", "limit s", "solve s", "capture s", "verdict"], rows, "lrrrl"),
        "",
        "PyTorch AutoParallel's published solve times, beside ours (a different search: a "
        "per-op sharding ILP on the whole graph; other hardware; for scale only):",
        table(["AutoParallel", "published s", "ours on", "our solve s", "published / ours"], ap,
              "lrlrr"),
    ])


def _format_checks(checks: list[dict]) -> str:
    rows = []
    for c in checks:
        state = {None: "n/a", True: "ok", False: "!! FAILED"}[c["ok"]]
        detail = c["detail"] + ("; failing: " + ", ".join(c["failures"]) if c["failures"] else "")
        rows.append([state, c.get("kind", SANITY), c["check"], c["rows"], detail])
    return "\n".join([
        table(["", "kind", "check", "rows", "detail"], rows, "lllrl"),
        f"(coverage: {COVERAGE_NOTE}; sanity: the choices the playbook's procedure predicts)",
    ])


def format_solver_bench(result: dict) -> str:
    """The tables of every section, titled as in ``TITLES``."""
    lay, gpus = result["layers"], result["gpus"]
    out = [
        f"autopar solver bench ({'quick' if result['quick'] else 'full'}): "
        f"{result['time_s']:.0f} s (warm-up {result['warmup_s']:.1f} s)",
        "",
        TITLES["versus_manual"],
        _format_versus_manual(result["versus_manual"]),
        "",
        TITLES["layers"].format(nodes=lay["nodes"], gpus=lay["gpus"], batch=lay["batch"]),
        _format_layers(lay),
        "",
        TITLES["gpus"].format(model=gpus["model"]),
        _format_gpus(gpus),
        "",
        TITLES["targets"],
        _format_targets(result["targets"]),
        "",
        TITLES["checks"],
        _format_checks(result["checks"]),
        "",
        "all checks passed" if result["all_ok"] else "!! SOME CHECKS FAILED",
    ]
    return "\n".join(out)
