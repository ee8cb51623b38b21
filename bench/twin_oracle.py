"""What a runs file allows a cost model to reach: the twin-blind oracle of `bench playbook`.

nanotron's ZeRO-1 reduce-scatters the gradients and all-gathers the updated weights where
ZeRO-0 all-reduces them: the same bytes over the same links. Two runs identical but for
ZeRO-0 against ZeRO-1 ("twins"; a group also holds repeated runs of one layout) measure one
layout twice, and where they differ (on the playbook's runs 31 % of the 166 groups by more
than 25 %, 37 by more than 2x, 7 by more than 15x, one by 41x) the difference is the
cluster's (stalls, stragglers, contention), not the layout's.

The oracle knows every run's measured throughput and whether it trained, but prices a layout
as the geometric mean of its twins' measurements (a run without a trained twin: its own), as a
cost model that prices equal traffic equally at best can. Its scores are about a ceiling for
such a model (ZeRO-1 shards the optimizer step, so a model may price twins a little apart): a
target the oracle misses asks the model to foresee the cluster's noise. Where its
first choice is a pair of twins, the pick is a coin flip: its regret is the twins' mean.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from autopar.calibrate.runs import Run


def _twin_key(run: Run) -> tuple:
    return (run.model, run.nodes, run.seq, dataclasses.replace(run.layout, zero=0))


def twin_oracle(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray]:
    """(predicted tok/s/GPU, predicted to fit) of the oracle for each run: the geometric mean
    of the measured throughput of the run and its trained twins (0 for a run that failed),
    and whether the run trained."""
    logs: dict[tuple, list[float]] = {}
    for run in runs:
        if run.trained and run.layout.zero <= 1:
            logs.setdefault(_twin_key(run), []).append(math.log(run.tok_s_gpu))
    tps = np.zeros(len(runs))
    for i, run in enumerate(runs):
        if run.trained:
            own = logs.get(_twin_key(run)) if run.layout.zero <= 1 else None
            tps[i] = math.exp(sum(own) / len(own)) if own and len(own) > 1 else run.tok_s_gpu
    return tps, np.array([r.trained for r in runs])


def expected_regret(runs: Sequence[Run], tps: np.ndarray) -> float:
    """Mean measured throughput of the runs tied for the oracle's first place over the best
    measured (the oracle's regret when a coin picks among twins)."""
    measured = np.array([r.tok_s_gpu or 0.0 for r in runs])
    trained = measured > 0
    if not trained.any():
        return 0.0  # nothing trained: no pick can (as `cell_scores` scores it)
    top = tps[trained].max()
    tied = trained & np.isclose(tps, top, rtol=1e-9)
    return float(measured[tied].mean() / measured.max())
