"""Benchmarks (`python -m autopar bench ...`): tables, JSON, ratios measured in one run.

`BENCHES` is the registry the CLI dispatches on: a benchmark is a module with a function that
runs it (taking the CLI's parsed arguments it needs) and one that formats its result as a table.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    """One benchmark: ``module.run(**arguments(args))`` then ``module.format(result)``."""

    module: str
    run: str
    format: str
    arguments: Callable[[argparse.Namespace], dict]
    help: str = ""

    def __call__(self, args: argparse.Namespace):
        """Run it; returns (result, its table as text)."""
        module = importlib.import_module(self.module)
        result = getattr(module, self.run)(**self.arguments(args))
        return result, getattr(module, self.format)(result)


def _quick(args: argparse.Namespace) -> dict:
    return {"quick": args.quick}


BENCHES: dict[str, Bench] = {
    "cost-model": Bench("bench.cost_model", "run_cost_model_bench",
                        "format_cost_model_bench", _quick),
    "block-check": Bench("bench.block", "block_check", "format_block_check",
                         lambda a: {"measured_path": a.measured} if a.measured else {}),
    "solver": Bench("bench.solver", "run_solver_bench", "format_solver_bench", _quick),
    "runtime": Bench("bench.runtime", "run_runtime_bench", "format_runtime_bench",
                     lambda a: {"quick": a.quick, "calibration": a.calibration}),
    "playbook": Bench("bench.playbook", "run_playbook_bench", "format_playbook_bench",
                      lambda a: {"path": a.runs, "quick": a.quick}),
    "fp8": Bench("bench.fp8", "run_fp8_bench", "format_fp8_bench", _quick),
    "published": Bench("bench.published", "run_published_bench",
                       "format_published_bench", lambda a: {"path": a.runs, "quick": a.quick}),
    "recompute": Bench("bench.recompute", "run_recompute_bench",
                       "format_recompute_bench", _quick),
    "overlap-probe": Bench("bench.overlap_probe", "run_overlap_probe", "format_overlap_probe",
                           _quick, "whether this machine's ranks hide an all-reduce behind matmuls"),
}
