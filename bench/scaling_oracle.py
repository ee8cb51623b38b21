"""What the published runs allow a ranking to reach: the scaling oracle of `bench published`.

Runs of one source, model and GPU kind that are identical but for their GPU count (and so
their data-parallel degree) do the same work per GPU: together they measure how one layout
scales (`equal_work`, a "chain"). Across more GPUs the same work per GPU costs at least as
much communication (FSDP's gathers and reductions span more ranks), so a model of the step
prices the throughput per GPU non-increasing along a chain, and most of the calibration file's
chains measure it so (`bench published` counts them). A chain whose throughput rises with more
GPUs shows what no such model can price: noise, or a difference the source did not state.

The oracle knows every measurement, but prices each chain at the closest non-increasing
sequence: the least-squares isotonic fit of its measurements in GPU-count order (rising runs
pooled at their mean, repeats of one GPU count alike; a run without a chain: its own
measurement). Its Spearman inside a group of runs is about a ceiling for a model that prices
scaling monotonically: a target it misses asks the model to foresee the measurements' noise
(as `bench.twin_oracle` shows for the playbook's ZeRO twins).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import numpy as np

from autopar.calibrate.runs import Run


def equal_work(run: Run) -> Hashable:
    """What the runs of one chain share: source, GPU kind (where the run has them: a
    `bench.published_runs.PublishedRun`), model, sequence and the layout but for dp."""
    return (getattr(run, "source", ""), getattr(run, "profile", ""), run.model, run.seq,
            dataclasses.replace(run.layout, dp=1))


def non_increasing(values: Sequence[float], weights: Sequence[float] | None = None
                   ) -> list[float]:
    """The (weighted) least-squares non-increasing fit of ``values`` (pool adjacent violators:
    a value above the block before it is pooled with it, at their weighted mean)."""
    weights = [1.0] * len(values) if weights is None else weights
    blocks: list[list] = []  # [weighted sum, weight, number of values pooled]
    for v, w in zip(values, weights, strict=True):
        blocks.append([float(v) * w, float(w), 1])
        while len(blocks) > 1 and blocks[-1][0] / blocks[-1][1] > blocks[-2][0] / blocks[-2][1]:
            s, n, k = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
            blocks[-1][2] += k
    return [s / n for s, n, k in blocks for _ in range(k)]


def chains(runs: Sequence[Run]) -> list[list[int]]:
    """The chains of >= 2 trained runs (indices into ``runs``), each in GPU-count order."""
    by: dict[Hashable, list[int]] = {}
    for i, run in enumerate(runs):
        if run.trained:
            by.setdefault(equal_work(run), []).append(i)
    return [sorted(idx, key=lambda i: runs[i].layout.dp) for idx in by.values() if len(idx) > 1]


def scaling_oracle(runs: Sequence[Run]) -> np.ndarray:
    """The oracle's tok/s/GPU for each run (module docstring; 0 for a run that failed).
    Repeats of one GPU count are priced alike, at their mean, before the chain is fitted."""
    tps = np.array([r.tok_s_gpu or 0.0 for r in runs])
    for idx in chains(runs):
        counts: dict[int, list[int]] = {}
        for i in idx:
            counts.setdefault(runs[i].layout.dp, []).append(i)
        steps = list(counts.values())  # GPU-count order (``idx`` is)
        fit = non_increasing([tps[s].mean() for s in steps], [len(s) for s in steps])
        for s, value in zip(steps, fit, strict=True):
            tps[s] = value
    return tps


def rising_chains(runs: Sequence[Run]) -> list[list[int]]:
    """The chains whose measured throughput per GPU rises somewhere with more GPUs."""
    return [idx for idx in chains(runs)
            if any(runs[b].tok_s_gpu > runs[a].tok_s_gpu for a, b in zip(idx, idx[1:]))]
