"""The solver bench on small inputs: the solver's search covers the hand-written layouts (it is
never slower than the best of them), the checks hold (and fail when they should), the result is
JSON and the report has its sections.

The manual grid is a subset of the solver's search priced by the same cost model, so "never
slower" is coverage: it catches a search that misses a layout, not a wrong cost model. The
ratio is recomputed here from the manual grid (`best_manual`), not read from the bench.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

from autopar import models
from autopar.search.manual import best_manual
from autopar.search.step import step_facts
from bench.solver import (
    AUTOPARALLEL,
    COVERAGE,
    COVERAGE_NOTE,
    RATIO_FLOOR,
    TARGETS,
    TITLES,
    SolverRuns,
    format_solver_bench,
    layers_config,
    run_sections,
    sanity_checks,
    solve_row,
)
from cost import Cluster


@pytest.fixture(scope="module")
def result():
    # playbook-1b on one node, a 2-layer llama3-8b on 8 nodes, a 2-layer llama3-70b on 1 and 8
    return run_sections(("playbook-1b",), (1,), (2,), layers_config("llama3-70b", 2),
                        {1: 256, 8: 256}, quick=True, progress=None)


def _rows(result) -> list[dict]:
    return (result["versus_manual"]["rows"] + result["layers"]["rows"]
            + result["gpus"]["rows"])


def test_search_covers_best_manual(result):
    """Coverage: on every row the solver's step is no slower than the row's fastest manual
    layout (taken from the row's own manual table, not from its ratio)."""
    rows = _rows(result)
    assert len(rows) == 4
    for r in rows:
        assert r["feasible"], r["model"]
        fitting = [v[1] for v in r["manual"].values() if v is not None]
        assert fitting, r["model"]
        ratio = min(fitting) / r["step_s"]
        assert ratio >= RATIO_FLOOR, (r["model"], r["nodes"], ratio)
        assert r["ratio"] == pytest.approx(ratio)
        assert r["ratio_ok"] is True
        assert r["solve_s"] > 0 and r["capture_s"] > 0
        assert r["tokens"] == r["batch"] * 4096


def test_manual_grid_recomputed_independently(result):
    """The row's best manual step is what `best_manual` finds on the same captured step."""
    row = result["versus_manual"]["rows"][0]
    assert (row["name"], row["nodes"], row["batch"]) == ("playbook-1b", 1, 256)
    model = models.build("playbook-1b", device="meta")
    inputs = models.example_inputs("playbook-1b", batch=256, seq=4096, device="meta")
    step, _ = step_facts(model, inputs, None, torch.bfloat16)
    manual = best_manual(step, Cluster("h100", nodes=1, gpus_per_node=8))
    best = min(v[1].step_time_s for v in manual.values() if v is not None)
    assert row["best_manual_step_s"] == pytest.approx(best)
    assert best / row["step_s"] >= RATIO_FLOOR


def test_checks_hold(result):
    checks = {c["check"]: c for c in result["checks"]}
    assert result["all_ok"] is True
    ratio = next(c for k, c in checks.items() if k.startswith("solver never slower"))
    assert ratio["ok"] is True and ratio["rows"] == 4
    dp = next(c for k, c in checks.items() if k.startswith("playbook-1b on 1 node"))
    assert dp["ok"] is True and dp["rows"] == 1
    pb = result["versus_manual"]["rows"][0]["degrees"]
    assert pb["tp"] == 1 and pb["pp"] == 1
    tp = next(c for k, c in checks.items() if k.startswith("TP degree"))
    assert tp["ok"] is True
    assert all(r["degrees"]["tp"] <= 8 for r in _rows(result))
    # llama3-70b at full depth was not run here: that check does not apply
    ll = next(c for k, c in checks.items() if k.startswith("llama3-70b on 8 nodes"))
    assert ll["ok"] is None and ll["rows"] == 0


def test_sanity_checks_fail_on_bad_rows(result):
    rows = copy.deepcopy(_rows(result))
    rows[0]["ratio"] = 0.95  # a hand-written layout 5 % faster than the solver
    rows[0]["degrees"]["tp"] = 16  # and TP across nodes without the solver saying it had to
    rows[0]["cross_node_tp"] = False
    ll = copy.deepcopy(rows[0])
    ll.update(name="llama3-70b", model="llama3-70b", n_layers=80, nodes=8,
              degrees={"dp": 64, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "zero": 3,
                       "microbatch": 1, "grad_accum": 4})
    nofit = copy.deepcopy(rows[1])
    nofit.update(feasible=False, manual_fits=True)
    checks = sanity_checks(rows + [ll, nofit])
    failed = {c["check"].split(" ")[0] for c in checks if c["ok"] is False}
    assert failed == {"solver", "where", "TP", "playbook-1b", "llama3-70b"}


def test_infeasible_row_is_recorded():
    """A 2-layer llama3-405b (~10 B parameters) cannot fit one GPU: 'does not fit', and the
    manual grid finds nothing either."""
    cfg = layers_config("llama3-405b", 2)
    model = SolverRuns().model(cfg)
    inputs = models.example_inputs(cfg, batch=8, seq=4096, device="meta")
    row = solve_row(model, inputs, cfg, Cluster("h100", nodes=1, gpus_per_node=1))
    assert row["feasible"] is False
    assert row["manual_fits"] is False and row["ratio"] is None
    assert all(v is None for v in row["manual"].values())
    assert "short by" in row["message"]
    assert sanity_checks([row])[1]["ok"] is True


def test_coverage_is_labelled_coverage(result):
    """The manual comparison is labelled coverage in the JSON and the report, never evidence."""
    assert result["versus_manual"]["kind"] == COVERAGE
    assert result["versus_manual"]["note"] == COVERAGE_NOTE
    kinds = {c["check"].split(" ")[0]: c["kind"] for c in result["checks"]}
    assert kinds == {"solver": "coverage", "where": "coverage", "TP": "sanity",
                     "playbook-1b": "sanity", "llama3-70b": "sanity"}
    out = format_solver_bench(result)
    assert "coverage: " + COVERAGE_NOTE in out
    assert "evidence" not in out.lower()
    assert "coverage" in TITLES["versus_manual"]


def test_reference_tables_come_from_the_data_file():
    """Targets and AutoParallel's published times (anchors.md: 5.5 s; 15 + 36.5 s on 64 GPUs)."""
    assert TARGETS == (("llama3-8b on 64 GPUs", "llama3-8b", 8, 10.0),
                       ("llama3-70b on 512 GPUs", "llama3-70b", 64, 60.0))
    assert AUTOPARALLEL[0] == ("8B, one mesh", "llama3-8b", 1, 5.5)
    assert AUTOPARALLEL[1][2] == 8 and AUTOPARALLEL[1][3] == pytest.approx(15 + 36.5, abs=0.2)


def test_json_and_format(result):
    text = json.dumps(result)
    assert json.loads(text)["layers"]["rows"][0]["n_layers"] == 2
    out = format_solver_bench(result)
    for key in ("versus_manual", "targets", "checks"):
        assert TITLES[key] in out
    assert "2a. Solve time vs layers" in out and "2b. Solve time vs GPUs" in out
    assert "playbook-1b" in out and "llama3-70b (2 layers)" in out
    assert "!!" not in out and "all checks passed" in out
    bad = copy.deepcopy(result)
    bad["versus_manual"]["rows"][0]["ratio"] = 0.9
    bad["all_ok"] = False
    assert "SOLVER SLOWER" in format_solver_bench(bad)
