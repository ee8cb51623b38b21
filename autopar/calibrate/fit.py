"""Fit the cost model's free parameters (`cost.params.CostParams`) to measured runs.

Two least-squares problems, both bounded (every parameter inside `cost.params.PARAMETERS`'
bounds), deterministic (trust-region reflective from the profile's current values, finite
differences with a fixed step, no random start):

- time: for every run that trained, r = log(predicted tok/s/GPU) - log(measured), over the
  parameters that move the step time (`TIME_PARAMETERS`), weighted by the run's relevance to
  a planner (`relevance_weights`: its throughput over its cell's best), with a soft-L1 loss so
  that the runs the model cannot explain (stalls, crashes that still logged a throughput,
  stragglers) pull less on the rest; plus, for a parameter with a published measurement
  (`cost.params.ParamSpec.prior`: the slowdown overlapped communication costs compute, the
  GEMM size curve), a weak pull toward it (`prior_residuals`), which decides it only where
  the runs do not;
- memory: for every run with a measured peak, log(predicted / measured) (the prediction less
  the reserve, which no allocator counts), plus the outcome:
  a run that trained but is predicted not to fit costs log(predicted / capacity), a run that
  failed but is predicted to fit costs ``FAILED_WEIGHT`` * log(capacity / predicted) (failed
  runs are mostly out of memory, not all: they weigh less), over `MEMORY_PARAMETERS`.

Predictions come from `cost.step.predict` itself (`autopar.calibrate.runs.RunPricer`): the fit
moves the numbers the planner prices with, nothing else.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from autopar.calibrate.runs import Priced, Run, RunPricer, read_runs, skipped_note, usable
from cost.params import MEMORY_PARAMETERS, SPECS, TIME_PARAMETERS, CostParams
from cost.profile import COVERAGE_FIELDS, CostProfile, save_profile

FAILED_WEIGHT = 0.3  # a failed run predicted to fit: weaker evidence than a measured peak
# a parameter with a published measurement (`cost.params.ParamSpec.prior`) adds the residual
# PRIOR_WEIGHT * (value - prior) (log(value / prior) for one fitted in log space): 0.1 away
# from it costs what one run at its cell's best predicted 10 % off does, so a thousand runs
# override it wherever they constrain the parameter at all
PRIOR_WEIGHT = 1.0
# soft-L1 loss: a residual beyond 0.1 (10 % in throughput) weighs linearly, not squared, so a
# cell's pathological runs (1.3 s stalls per micro-batch) pull less on the rest. A Cauchy loss
# with weights favouring each cell's fast runs gave the same regret and Spearman; the weights
# below pay off on a model whose compute terms the stalls no longer hide
TIME_LOSS = "soft_l1"
# A planner's errors matter on the layouts it could choose: a run's time residual is multiplied
# by (its throughput / its cell's best)^RELEVANCE_POWER, so a run that measured a tenth of its
# cell's best (a stalled pipeline, mostly: the playbook's ZeRO-0/1 twins of such runs often ran
# 2-41x faster) pulls 0.32 as hard as the best (its residual is in soft-L1's linear part),
# and its loss turns linear only beyond 0.1 / 0.32 in log throughput. On the playbook's runs
# (in-sample all-cell fits): unweighted (power 0) regret median 0.970, Spearman
# 0.83, best run's error 15.1 %, llama3-8b on 8 nodes at MFU 48.6 % (above every measured 8B
# run); 0.25: 0.999, 0.854, 13.9 %; 0.5: 0.999, 0.859, 10.7 %, MFU 40.8 %; 1: 0.999, 0.81,
# 7.8 %, 41.3 %; 2 (without the gemm prior): 0.997, 0.71, 4.4 %, the pipelines' stalls
# fitted away (regret worst 0.06).
# 0.5 is the largest power that keeps the ranking of the slow runs (Spearman >= 0.85).
RELEVANCE_POWER = 0.5
# finite-difference step in the fitted (scaled) coordinates: large enough to see past the
# model's kinks (max() of overlaps, micro-batch rounding), small enough to stay local
DIFF_STEP = 1e-2


@dataclass
class FitResult:
    """Fitted parameters and how well they explain the runs they were fitted on."""

    params: CostParams
    report: dict


def _to_x(params: CostParams, names: Sequence[str]) -> np.ndarray:
    return np.array([math.log(getattr(params, n)) if SPECS[n].log_scale else getattr(params, n)
                     for n in names])


def _from_x(x: np.ndarray, base: CostParams, names: Sequence[str]) -> CostParams:
    values = {}
    for n, v in zip(names, x):
        spec = SPECS[n]
        v = math.exp(v) if spec.log_scale else float(v)
        values[n] = min(max(v, spec.lower), spec.upper)
    return base.replace(**values)


def _bounds(names: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    lo = [math.log(SPECS[n].lower) if SPECS[n].log_scale else SPECS[n].lower for n in names]
    hi = [math.log(SPECS[n].upper) if SPECS[n].log_scale else SPECS[n].upper for n in names]
    return np.array(lo), np.array(hi)


def _clip_inside(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    span = hi - lo
    return np.clip(x, lo + 1e-6 * span, hi - 1e-6 * span)


def time_residuals(runs: Sequence[Run], priced: Priced) -> np.ndarray:
    """log(predicted / measured) tok/s/GPU of the runs that trained (a rejected layout that
    trained counts as predicted 1000x too slow)."""
    out = []
    for run, tps, valid in zip(runs, priced.tps, priced.valid):
        if run.trained:
            out.append(math.log(tps / run.tok_s_gpu) if valid and tps > 0 else math.log(1e-3))
    return np.array(out)


def relevance_weights(runs: Sequence[Run]) -> np.ndarray:
    """(measured / best measured in the run's cell) ** ``RELEVANCE_POWER`` of each run that
    trained, in the order of `time_residuals` (a cell: the runs of one model on one cluster
    size, `Run.cell`; a cell's best weighs 1)."""
    best: dict[tuple, float] = {}
    for r in runs:
        if r.trained:
            best[r.cell] = max(best.get(r.cell, 0.0), r.tok_s_gpu)
    return np.array([(r.tok_s_gpu / best[r.cell]) ** RELEVANCE_POWER for r in runs if r.trained])


def prior_residuals(params: CostParams, names: Sequence[str]) -> np.ndarray:
    """``PRIOR_WEIGHT`` * (value - prior) of each parameter in ``names`` that has a prior
    (log(value / prior) for one fitted in log space: 2x off weighs what 1/2 off does)."""
    out = []
    for n in names:
        spec = SPECS[n]
        if spec.prior is not None:
            value = getattr(params, n)
            out.append(PRIOR_WEIGHT * (math.log(value / spec.prior) if spec.log_scale
                                       else value - spec.prior))
    return np.array(out)


def memory_residuals(runs: Sequence[Run], priced: Priced, reserve_bytes: float) -> np.ndarray:
    """Measured peaks (log predicted / measured) and outcomes (see the module docstring).

    A measured peak counts the tensors the allocator handed out (the training framework's
    max_memory_allocated), not the reserve: it is compared with the prediction less
    ``reserve_bytes``; the outcome compares the whole prediction with the capacity."""
    out = []
    for run, mem, cap, valid in zip(runs, priced.memory_bytes, priced.capacity_bytes,
                                    priced.valid):
        if not valid:
            continue  # the layout cannot run at all: no memory to compare
        if run.gpu_mem_gb:
            out.append(math.log(max(mem - reserve_bytes, 1.0) / (run.gpu_mem_gb * 1e9)))
        if run.trained:
            out.append(max(0.0, math.log(mem / cap)))
        else:
            out.append(FAILED_WEIGHT * max(0.0, math.log(cap / mem)))
    return np.array(out)


def fit_params(runs: Sequence[Run], pricer: RunPricer, start: CostParams | None = None,
               max_evals: int = 200, progress: Callable[[str], None] | None = None) -> FitResult:
    """Fit `CostParams` to ``runs`` (see the module docstring); ``start``: where the search
    begins (the cluster profile's parameters by default)."""
    from scipy.optimize import least_squares

    t0 = time.perf_counter()
    base = start or pricer.cluster(1).params
    trained = [r for r in runs if r.trained]
    weights = relevance_weights(trained)
    evals = {"time": 0, "memory": 0}

    def solve(names, fun, loss, what):
        lo, hi = _bounds(names)
        x0 = _clip_inside(_to_x(base, names), lo, hi)
        # scipy counts iterations, not the finite-difference evaluations of each Jacobian
        iterations = max(1, max_evals // (len(names) + 1))
        res = least_squares(fun, x0, bounds=(lo, hi), method="trf", loss=loss, f_scale=0.1,
                            diff_step=DIFF_STEP, max_nfev=iterations,
                            x_scale=np.maximum(hi - lo, 1e-9))
        if progress:
            progress(f"  {what}: {evals[what]} evaluations, cost {res.cost:.4f} "
                     f"({time.perf_counter() - t0:.0f} s)")
        return res.x

    def time_fun(x):
        evals["time"] += 1
        params = _from_x(x, memory_params, TIME_PARAMETERS)
        return np.concatenate([weights * time_residuals(trained, pricer.price(trained, params)),
                               prior_residuals(params, TIME_PARAMETERS)])

    def memory_fun(x):
        evals["memory"] += 1
        params = _from_x(x, base, MEMORY_PARAMETERS)
        return memory_residuals(runs, pricer.price(runs, params, memory_only=True),
                                params.memory_reserve_bytes)

    if progress:
        progress(f"fitting {len(MEMORY_PARAMETERS)} memory parameters on {len(runs)} runs ...")
    memory_params = _from_x(solve(MEMORY_PARAMETERS, memory_fun, "soft_l1", "memory"), base,
                            MEMORY_PARAMETERS)
    if progress:
        progress(f"fitting {len(TIME_PARAMETERS)} time parameters on {len(trained)} runs that "
                 "trained ...")
    params = _from_x(solve(TIME_PARAMETERS, time_fun, TIME_LOSS, "time"), memory_params,
                     TIME_PARAMETERS)
    priced = pricer.price(runs, params)
    r_time = time_residuals(trained, priced.select([r.trained for r in runs]))
    fits, was_trained = priced.fits, np.array([r.trained for r in runs])
    report = {
        "runs": len(runs),
        "trained": len(trained),
        "evaluations": dict(evals),
        "relevance_power": RELEVANCE_POWER,
        "seconds": round(time.perf_counter() - t0, 1),
        "in_sample_log_throughput_rms": float(np.sqrt(np.mean(r_time ** 2))),
        "in_sample_median_abs_throughput_error": float(np.median(np.abs(np.expm1(r_time)))),
        "in_sample_fit_recall": float(fits[was_trained].mean()),
        "in_sample_oom_recall": float((~fits[~was_trained]).mean()) if (~was_trained).any()
        else None,
        "parameters": {s: {"value": getattr(params, s), "lower": SPECS[s].lower,
                           "upper": SPECS[s].upper, "unit": SPECS[s].unit,
                           "at_bound": _at_bound(getattr(params, s), s)}
                       for s in (*TIME_PARAMETERS, *MEMORY_PARAMETERS)},
    }
    return FitResult(params=params, report=report)


def _at_bound(value: float, name: str) -> bool:
    spec = SPECS[name]
    span = spec.upper - spec.lower
    return value <= spec.lower + 1e-3 * span or value >= spec.upper - 1e-3 * span


def fit_profile(runs_path: str | os.PathLike, cluster: str, out: str | os.PathLike,
                gpus_per_node: int = 8, max_evals: int = 600,
                progress: Callable[[str], None] | None = None) -> CostProfile:
    """Read a runs file, fit the parameters from the defaults, write the profile to ``out``."""
    runs, skipped = usable(read_runs(runs_path, gpus_per_node))
    if progress and skipped:
        progress(skipped_note(skipped))
    pricer = RunPricer(cluster, gpus_per_node, progress=progress)
    result = fit_params(runs, pricer, start=CostParams(), max_evals=max_evals, progress=progress)
    # the planner's margin is a policy no residual sees: the profile keeps its own
    keep = pricer.cluster(1).params.memory_headroom
    result = FitResult(result.params.replace(memory_headroom=keep), result.report)
    fit = {"runs_file": str(runs_path), "cluster": cluster, "gpus_per_node": gpus_per_node,
           "sample": "in-sample: every usable run of the file",
           "skipped_rows": [r.row for r in skipped],
           "coverage": coverage(runs),
           **result.report}
    profile = CostProfile(base=cluster, params=result.params, fit=fit)
    save_profile(profile, out)
    return profile


def coverage(runs: Sequence[Run]) -> dict:
    """The values each `cost.profile.COVERAGE_FIELDS` field took in ``runs`` (and the models and
    node counts): what the fit can judge."""
    out = {name: sorted({getattr(r.layout, name) for r in runs}, key=str)
           for name in COVERAGE_FIELDS}
    out["schedule"] = sorted({r.layout.schedule for r in runs if r.layout.pp > 1}) or ["1f1b"]
    out["models"] = sorted({r.model for r in runs})
    out["nodes"] = sorted({r.nodes for r in runs})
    return out


def format_fit(profile: CostProfile) -> str:
    """The fitted parameters with their bounds, and how well they explain the runs."""
    fit = profile.fit
    lines = [f"fitted {len(fit['parameters'])} cost parameters of {profile.base} to "
             f"{fit['runs']} runs ({fit['trained']} trained) in {fit['seconds']:.0f} s",
             f"  in-sample: throughput rms {fit['in_sample_log_throughput_rms']:.3f} in log, "
             f"median |error| {fit['in_sample_median_abs_throughput_error']:.1%}; fit recall "
             f"{fit['in_sample_fit_recall']:.3f}"
             + (f", out-of-memory recall {fit['in_sample_oom_recall']:.3f}"
                if fit.get("in_sample_oom_recall") is not None else ""),
             f"  {'parameter':28s} {'value':>12s}  bounds"]
    for name, p in fit["parameters"].items():
        lines.append(f"  {name:28s} {p['value']:12.4g}  [{p['lower']:g}, {p['upper']:g}] "
                     f"{p['unit']}{'  (at a bound)' if p['at_bound'] else ''}")
    return "\n".join(lines)
