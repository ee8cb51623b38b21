"""`autopar bench playbook`: does the cost model choose the layouts that ran fastest?

The Ultra-Scale Playbook measured every layout of its 1B and 8B models on 1 to 64 nodes of
8xH100 (``shared/reference/playbook-runs-1b-8b.csv``, shipped as ``data/``). A cell is one (model, nodes): the
layouts that compete for one cluster. Per cell, for a set of predictions:

- regret: measured throughput of the layout ranked first among those the planner would pick
  (of the runs that trained), over the cell's best measured throughput (1 = autopar picks the
  best). The planner picks among the layouts predicted to fit with the headroom the cluster
  profile keeps (`cost.params.CostParams.memory_headroom` of device memory free, the shipped
  h100-efa profile's for every row: `planner_fits`); fit and OOM recall judge the memory
  model alone, without it;
- pick_failed: whether the first-ranked layout of all the cell's runs (failed ones included)
  did not train;
- spearman: rank correlation of predicted and measured throughput over the runs that trained;
- best_ratio: predicted / measured throughput of the cell's best run;
- fit_recall: runs that trained predicted to fit; oom_recall: runs that failed predicted not to.

Rows, all in one run:

- ``autopar (leave one cell out)``: the cost model fitted (`autopar.calibrate.fit`) on every
  other cell, then ranking the held-out cell: the out-of-sample figure. Each fold starts from
  the all-cell fit and runs the same bounded least squares to the held-in data (at most
  ``fold_evals`` evaluations).
- ``autopar (leave one model out)``: for each model of the file, the cost model fitted from
  the `CostParams()` defaults (at most ``max_evals`` evaluations, as the all-cell fit) on the
  other models' runs only, then ranking every cell of the held-out model: out of sample on a
  model whose quirks the fit never saw (fit on 1B, rank 8B; fit on 8B, rank 1B). Absent when
  the file holds one model.
- ``autopar (leave one model out, no headroom)``: the same predictions ranked among every
  layout predicted to fit (no headroom kept): what the headroom buys, out of sample.
- ``autopar (fit on all cells)``: the shipped profile's parameters; in-sample.
- ``autopar (unfitted defaults)``: `CostParams()` defaults, the model before calibration.
- ``textbook``: `bench.textbook`, no fitting.
- ``twin-blind oracle``: `bench.twin_oracle`, the measurements themselves, ZeRO-0 and
  ZeRO-1 twins (the same bytes on the wire) priced alike: a ceiling, what the runs allow a
  cost model to reach. The acceptance check says which targets it reaches.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from autopar.calibrate.fit import fit_params
from autopar.calibrate.runs import Priced, Run, RunPricer, read_runs, skipped_note, usable
from bench.textbook import textbook
from bench.twin_oracle import expected_regret, twin_oracle
from cost.params import CostParams

# a copy of shared/reference/playbook-runs-1b-8b.csv, shipped so that the fit can be redone
DEFAULT_RUNS = Path(__file__).parent / "data" / "playbook-runs-1b-8b.csv"
# the acceptance bar of issue 11 (leave-one-cell-out)
TARGETS = {"regret_median": 0.99, "regret_worst": 0.90, "spearman_median": 0.85,
           "fit_recall": 0.97, "best_ratio_median_abs_error": 0.15}
# the acceptance bar of issue 27 (leave-one-model-out); "oracle_ratio_worst": the least, over
# cells, of the cell's regret over the twin-blind oracle's regret for the same cell
MODEL_TARGETS = {"regret_median": 0.99, "oracle_ratio_worst": 0.90, "spearman_median": 0.85,
                 "fit_recall": 0.97}
LOCO = "autopar (leave one cell out)"
LOMO = "autopar (leave one model out)"
LOMO_RAW = "autopar (leave one model out, no headroom)"


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation with average ranks for ties (nan below 3 points)."""
    from scipy.stats import spearmanr

    if len(a) < 3:
        return float("nan")
    value = spearmanr(a, b).statistic
    return float(value) if np.isfinite(value) else float("nan")


def planner_fits(priced: Priced, headroom: float) -> np.ndarray:
    """The runs the planner could pick: predicted to fit with ``headroom`` (a share) of device
    memory left free (`RunPricer` prices the memory model without it)."""
    return priced.fits & (priced.memory_bytes + headroom * priced.capacity_bytes
                          <= priced.capacity_bytes)


def cell_scores(runs: Sequence[Run], tps: np.ndarray, fits: np.ndarray,
                eligible: np.ndarray | None = None) -> dict:
    """The per-cell figures of the module docstring for one cell's runs and predictions;
    ``eligible``: the runs the planner ranks (``fits`` when None)."""
    measured = np.array([r.tok_s_gpu or 0.0 for r in runs])
    trained = np.array([r.trained for r in runs])
    best = float(measured.max())
    eligible = fits if eligible is None else eligible
    ranked = [i for i in np.argsort(-tps, kind="stable") if eligible[i]]
    trained_ranked = [i for i in ranked if trained[i]]
    pick = trained_ranked[0] if trained_ranked else None
    b = int(np.argmax(measured))
    failed = ~trained
    return {
        "runs": len(runs),
        "trained": int(trained.sum()),
        "regret": float(measured[pick] / best) if pick is not None else 0.0,
        "pick": _describe(runs[pick]) if pick is not None else None,
        "pick_failed": bool(ranked and not trained[ranked[0]]),
        "best": _describe(runs[b]),
        "spearman": spearman(tps[trained], measured[trained]),
        "best_ratio": float(tps[b] / best),
        "fit_recall": float(fits[trained].mean()),
        "oom_recall": float((~fits[failed]).mean()) if failed.any() else float("nan"),
    }


def _describe(run: Run) -> str:
    lay = run.layout
    return (f"dp{lay.dp} tp{lay.tp} pp{lay.pp} zero{lay.zero} mb{lay.microbatch} "
            f"ga{lay.grad_accum} ({run.tok_s_gpu or 0:,.0f} tok/s/GPU, row {run.row})")


def summarize(cells: dict[str, dict]) -> dict:
    """Medians and worsts over cells; recalls pooled over runs."""
    vals = list(cells.values())

    def col(k):
        return np.array([c[k] for c in vals], dtype=float)

    trained = sum(c["trained"] for c in vals)
    failed = sum(c["runs"] - c["trained"] for c in vals)
    oom = [c["oom_recall"] * (c["runs"] - c["trained"]) for c in vals
           if not math.isnan(c["oom_recall"])]
    return {
        "regret_median": float(np.median(col("regret"))),
        "regret_worst": float(col("regret").min()),
        "picks_failed": int(sum(c["pick_failed"] for c in vals)),
        "spearman_median": float(np.nanmedian(col("spearman"))),
        "best_ratio_median_abs_error": float(np.median(np.abs(col("best_ratio") - 1))),
        "fit_recall": float(sum(c["fit_recall"] * c["trained"] for c in vals) / trained),
        "oom_recall": float(sum(oom) / failed) if failed else float("nan"),
    }


def _by_cell(runs: Sequence[Run]) -> dict[tuple[str, int], list[int]]:
    cells: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(runs):
        cells.setdefault(r.cell, []).append(i)
    return dict(sorted(cells.items()))


def _score(runs, cells, tps, fits, eligible=None) -> dict[str, dict]:
    eligible = fits if eligible is None else eligible
    return {f"{m} x{n}": cell_scores([runs[i] for i in idx], tps[idx], fits[idx], eligible[idx])
            for (m, n), idx in cells.items()}


ORACLE = "twin-blind oracle (the data)"


def _meets(key: str, value: float, bar: float) -> bool:
    return value <= bar if key == "best_ratio_median_abs_error" else value >= bar


def _oracle_scores(runs: Sequence[Run], cells) -> dict[str, dict]:
    """`cell_scores` of the twin-blind oracle, its regret the expected one over ties."""
    tps, fits = twin_oracle(runs)
    scores = _score(runs, cells, tps, fits)
    for (model, nodes), idx in cells.items():
        scores[f"{model} x{nodes}"]["regret"] = expected_regret([runs[i] for i in idx], tps[idx])
    return scores


def run_playbook_bench(path: str | Path | None = None, fold_evals: int = 60,
                       max_evals: int = 300, quick: bool = False,
                       progress: Callable[[str], None] | None = print) -> dict:
    """Every row of the module docstring on the runs file at ``path`` (the playbook's by
    default). ``quick``: every model's cells on at most 2 nodes, fewer evaluations (a smoke
    run, minutes; leave-one-model-out still has two models to swap)."""
    t0 = time.perf_counter()
    say = progress or (lambda _: None)
    runs, skipped = usable(read_runs(path or DEFAULT_RUNS))
    if skipped:
        say(skipped_note(skipped))
    if quick:
        runs = [r for r in runs if r.nodes <= 2]
        fold_evals, max_evals = min(fold_evals, 15), min(max_evals, 60)
    cells = _by_cell(runs)
    pricer = RunPricer("h100-efa", progress=say)
    # the planner's margin is the cluster profile's (a policy: no fit moves it)
    keep = pricer.cluster(1).params.memory_headroom
    rows: dict[str, dict] = {}

    say(f"{len(runs)} runs in {len(cells)} cells; textbook baseline ...")
    tb = [textbook(r.model, r.nodes, r.layout, r.seq) for r in runs]
    tb_tps = np.array([t for t, _ in tb])
    tb_fits = np.array([m <= 80e9 for _, m in tb])
    rows["textbook"] = _score(runs, cells, tb_tps, tb_fits)

    say("unfitted defaults ...")
    priced = pricer.price(runs, CostParams())
    rows["autopar (unfitted defaults)"] = _score(runs, cells, priced.tps, priced.fits,
                                                 planner_fits(priced, keep))

    say("fit on all cells ...")
    full = fit_params(runs, pricer, start=CostParams(), max_evals=max_evals, progress=say)
    priced = pricer.price(runs, full.params)
    rows["autopar (fit on all cells)"] = _score(runs, cells, priced.tps, priced.fits,
                                                planner_fits(priced, keep))

    loo_tps, loo_fits = np.zeros(len(runs)), np.zeros(len(runs), dtype=bool)
    loo_pick = np.zeros(len(runs), dtype=bool)
    folds = {}
    for k, ((model, nodes), idx) in enumerate(cells.items(), start=1):
        say(f"fold {k}/{len(cells)}: holding out {model} x{nodes} ...")
        held = set(idx)
        train = [r for i, r in enumerate(runs) if i not in held]
        fold = fit_params(train, pricer, start=full.params, max_evals=fold_evals)
        test = [runs[i] for i in idx]
        p = pricer.price(test, fold.params)
        loo_tps[idx], loo_fits[idx] = p.tps, p.fits
        loo_pick[idx] = planner_fits(p, keep)
        folds[f"{model} x{nodes}"] = fold.params.to_dict()
    rows[LOCO] = _score(runs, cells, loo_tps, loo_fits, loo_pick)
    model_fits = _leave_one_model_out(runs, cells, pricer, rows, max_evals, say, keep)

    rows[ORACLE] = _oracle_scores(runs, cells)

    summary = {name: summarize(c) for name, c in rows.items()}
    for name in (LOCO, LOMO, LOMO_RAW, "textbook"):
        if name in rows:
            summary[name]["oracle_ratio_worst"] = oracle_ratio_worst(rows[name], rows[ORACLE])
    loo, base = summary[LOCO], summary["textbook"]
    checks = {k: {"value": loo[k], "target": v, "ok": _meets(k, loo[k], v),
                  "beats_textbook": _meets(k, loo[k], base[k]),
                  "oracle": summary[ORACLE][k], "oracle_ok": _meets(k, summary[ORACLE][k], v)}
              for k, v in TARGETS.items()}
    model_checks = {}
    if LOMO in summary:
        lomo = summary[LOMO]
        model_checks = {k: {"value": lomo[k], "target": v, "ok": _meets(k, lomo[k], v),
                            "beats_textbook": _meets(k, lomo[k], base[k])}
                        for k, v in MODEL_TARGETS.items()}
    return {"runs_file": str(path or DEFAULT_RUNS), "runs": len(runs), "cells": len(cells),
            "skipped_rows": [r.row for r in skipped],
            "quick": quick, "seconds": round(time.perf_counter() - t0, 1),
            "memory_headroom": keep,
            "fit": full.report, "params": full.params.to_dict(), "fold_params": folds,
            "model_fits": model_fits, "rows": rows, "summary": summary, "checks": checks,
            "model_checks": model_checks}


def oracle_ratio_worst(scores: dict[str, dict], oracle: dict[str, dict]) -> float:
    """min over cells of regret / the twin-blind oracle's regret for that cell (nan when no
    cell has an oracle regret above 0)."""
    ratios = [c["regret"] / oracle[cell]["regret"] for cell, c in scores.items()
              if oracle.get(cell, {}).get("regret", 0) > 0]
    return float(min(ratios)) if ratios else float("nan")


def _leave_one_model_out(runs, cells, pricer, rows, max_evals, say, keep: float) -> dict:
    """Fill ``rows[LOMO]`` (see the module docstring); returns each held-out model's fit report
    (the parameters with their bounds). Nothing when the runs hold one model."""
    names = sorted({r.model for r in runs})
    if len(names) < 2:
        say("one model in the runs: no leave-one-model-out row")
        return {}
    tps, fits = np.zeros(len(runs)), np.zeros(len(runs), dtype=bool)
    pick = np.zeros(len(runs), dtype=bool)
    reports = {}
    for k, held in enumerate(names, start=1):
        say(f"model fold {k}/{len(names)}: fitting from the defaults without {held} ...")
        train = [r for r in runs if r.model != held]
        fold = fit_params(train, pricer, start=CostParams(), max_evals=max_evals)
        idx = [i for i, r in enumerate(runs) if r.model == held]
        p = pricer.price([runs[i] for i in idx], fold.params)
        tps[idx], fits[idx], pick[idx] = p.tps, p.fits, planner_fits(p, keep)
        reports[held] = {"fitted_on": sorted(set(names) - {held}), **fold.report}
    rows[LOMO] = _score(runs, cells, tps, fits, pick)
    rows[LOMO_RAW] = _score(runs, cells, tps, fits)
    return reports


def format_playbook_bench(result: dict) -> str:
    """The summary table, per-cell leave-one-out figures, and the acceptance checks."""
    lines = [f"bench playbook: {result['runs']} runs in {result['cells']} cells "
             f"({result['runs_file']}), {result['seconds']:.0f} s; the planner keeps "
             f"{result.get('memory_headroom', 0.0):.0%} of device memory free", ""]
    head = (f"{'predictions':32s} {'regret med':>10s} {'worst':>6s} {'failed picks':>12s} "
            f"{'spearman':>8s} {'best pred/meas err':>18s} {'fit rec':>7s} {'oom rec':>7s}")
    lines += [head, "-" * len(head)]
    for name, s in result["summary"].items():
        lines.append(f"{name:32s} {s['regret_median']:10.3f} {s['regret_worst']:6.3f} "
                     f"{s['picks_failed']:12d} {s['spearman_median']:8.2f} "
                     f"{s['best_ratio_median_abs_error']:18.1%} {s['fit_recall']:7.3f} "
                     f"{s['oom_recall']:7.3f}")
    lines += ["", "leave one cell out, per cell (the twin-blind oracle's regret and spearman "
              "in brackets):"]
    rows = result["rows"]
    loo, tb, orc = rows[LOCO], rows["textbook"], rows.get(ORACLE, {})
    for cell, c in loo.items():
        o = orc.get(cell)
        ceiling = f" [{o['regret']:.3f}, {o['spearman']:+.2f}]" if o else ""
        lines.append(f"  {cell:16s} regret {c['regret']:.3f} (textbook {tb[cell]['regret']:.3f})"
                     f"{ceiling} spearman {c['spearman']:+.2f} best pred/meas "
                     f"{c['best_ratio']:.2f} pick {c['pick']}")
    lines += _model_out_lines(result)
    lines += ["", "fitted parameters (all cells; bounds):"]
    for name, p in result["fit"]["parameters"].items():
        flag = "  at bound" if p["at_bound"] else ""
        lines.append(f"  {name:28s} {p['value']:<12.4g} [{p['lower']:g}, {p['upper']:g}] "
                     f"{p['unit']}{flag}")
    lines += ["", "acceptance (leave one cell out):"]
    for k, c in result["checks"].items():
        allows = "" if "oracle" not in c else (
            f"; the data allows {c['oracle']:.3f} (twin-blind oracle"
            f"{'' if c['oracle_ok'] else ': beyond what the runs allow'})")
        lines.append(f"  {k:30s} {c['value']:.3f} target {c['target']:g}: "
                     f"{'ok' if c['ok'] else 'MISSED'}; "
                     f"{'beats' if c['beats_textbook'] else 'does not beat'} the textbook{allows}")
    return "\n".join(lines)


def _model_out_lines(result: dict) -> list[str]:
    """Per cell: leave-one-model-out regret beside the twin-blind oracle's and their ratio;
    the folds' fitted parameters; the acceptance lines of issue 27."""
    rows = result["rows"]
    if LOMO not in rows:
        return ["", "leave one model out: the runs hold one model, nothing to hold out"]
    lomo, orc, tb = rows[LOMO], rows[ORACLE], rows["textbook"]
    lines = ["", "leave one model out, per cell (fitted on the other model only; out of sample):",
             f"  {'cell':16s} {'regret':>7s} {'oracle':>7s} {'ratio':>6s} {'textbook':>8s} "
             f"{'spearman':>8s} {'fit rec':>7s}  pick"]
    for cell, c in lomo.items():
        o = orc[cell]["regret"]
        ratio = c["regret"] / o if o > 0 else float("nan")
        lines.append(f"  {cell:16s} {c['regret']:7.3f} {o:7.3f} {ratio:6.3f} "
                     f"{tb[cell]['regret']:8.3f} {c['spearman']:+8.2f} {c['fit_recall']:7.3f}  "
                     f"{c['pick']}")
    for held, rep in result.get("model_fits", {}).items():
        lines.append(f"  fitted without {held} (on {', '.join(rep['fitted_on'])}; bounds):")
        for name, p in rep["parameters"].items():
            flag = "  at bound" if p["at_bound"] else ""
            lines.append(f"    {name:28s} {p['value']:<12.4g} [{p['lower']:g}, {p['upper']:g}] "
                         f"{p['unit']}{flag}")
    lines += ["", "acceptance of issue 27 (leave one model out):"]
    for k, c in result.get("model_checks", {}).items():
        lines.append(f"  {k:30s} {c['value']:.3f} target {c['target']:g}: "
                     f"{'met' if c['ok'] else 'NOT MET'}; "
                     f"{'beats' if c['beats_textbook'] else 'does not beat'} the textbook")
    return lines
