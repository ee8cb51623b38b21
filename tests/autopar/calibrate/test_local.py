"""Tests for autopar.calibrate.local: a quick run writes the JSON contract that cost.Cluster reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from autopar.calibrate import local as cal


def _positive_finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_quick_calibration_writes_complete_json(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "c.json"  # parent dirs are created
    lines: list[str] = []
    data = cal.calibrate(world_sizes=(2,), path=path, quick=True, progress=lines.append)

    loaded = json.loads(path.read_text())
    assert loaded == json.loads(json.dumps(data))  # the file is exactly what was returned

    assert set(loaded) == {
        "version",
        "host",
        "date",
        "torch",
        "world_size",
        "matmul_flops",
        "memory_bw",
        "kernel_floor_s",
        "collectives",
        "pipeline",
        "overlap",
        "raw",
    }
    assert loaded["version"] == 1
    assert loaded["world_size"] == 2
    assert isinstance(loaded["host"], str) and loaded["host"]
    assert isinstance(loaded["torch"], str) and loaded["torch"]
    assert isinstance(loaded["date"], str) and loaded["date"][:2] == "20"

    assert set(loaded["matmul_flops"]) == {"fp32", "bf16"}
    assert all(_positive_finite(v) for v in loaded["matmul_flops"].values())
    assert _positive_finite(loaded["memory_bw"])
    assert _positive_finite(loaded["kernel_floor_s"])
    assert loaded["kernel_floor_s"] < 1e-2  # a 16-element add is microseconds, not more

    assert set(loaded["collectives"]) == set(cal.COLLECTIVES)
    for kind, c in loaded["collectives"].items():
        assert set(c) == {"latency_s", "busbw"}, kind
        assert _positive_finite(c["latency_s"]) and _positive_finite(c["busbw"]), (kind, c)

    raw = loaded["raw"]
    assert raw["threads"]["intra_op"] >= 1
    assert raw["collectives"]["all_reduce"]["factor"] == pytest.approx(1.0)  # 2(n-1)/n, n=2
    assert raw["collectives"]["send_recv"]["factor"] == 1.0
    assert any(line.startswith("matmul fp32") for line in lines)
    assert any(line.startswith("all_reduce") for line in lines)
    # a 2-stage 1F1B pipeline: each transfer costs something, and not seconds
    assert 0.0 <= loaded["pipeline"]["overhead_s"] < 0.1
    assert 0.0 <= loaded["pipeline"]["wait_per_compute"] < 1.0  # s of waiting per s of compute
    light, heavy = raw["pipeline"]["points"]  # two stage weights
    assert heavy["compute_s"] > light["compute_s"]
    for point in (light, heavy):
        assert point["transfer_s"] >= point["send_recv_s"] or point["overhead_s"] == 0
        assert 0 < point["busy_s"] < point["step_s"]
    assert any(line.startswith("pipeline x2") for line in lines)
    # an all-reduce issued beside a matmul loop about four times its length: the slowdown is
    # what it adds to the loop per second it takes alone, clamped to [0, 1]
    ov = raw["overlap"]
    assert loaded["overlap"]["slowdown"] == pytest.approx(
        min(1.0, max(0.0, (ov["both_s"] - ov["compute_s"]) / ov["all_reduce_s"])))
    assert ov["compute_s"] > ov["all_reduce_s"] > 0
    assert ov["both_s"] > 0 and any(line.startswith("overlap x2") for line in lines)

    table = cal.format_calibration(loaded)
    for word in ("matmul fp32", "memory bandwidth", "kernel floor", "pipeline transfer",
                 "overlap slowdown", *cal.COLLECTIVES):
        assert word in table


def test_default_path_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "x.json"))
    assert cal.default_calibration_path() == tmp_path / "x.json"
    monkeypatch.delenv("AUTOPAR_CALIBRATION")
    assert cal.default_calibration_path().parts[-3:] == (".cache", "autopar", "calibration.json")


def test_fit_recovers_latency_and_busbw() -> None:
    latency, busbw = 50e-6, 2e9
    xs = [4096.0, 1.0 * 2**20, 4.0 * 2**20, 16.0 * 2**20]
    ts = [latency + x / busbw for x in xs]
    fl, fb = cal._fit_latency_busbw(xs, ts)
    assert fl == pytest.approx(latency, rel=1e-6)
    assert fb == pytest.approx(busbw, rel=1e-6)


def test_fit_clamps_negative_latency() -> None:
    # Times that extrapolate to a negative intercept: the latency is clamped, busbw stays sane.
    xs = [1e6, 2e6, 4e6]
    ts = [0.4e-3, 1.0e-3, 2.2e-3]
    fl, fb = cal._fit_latency_busbw(xs, ts)
    assert fl == 0.0
    assert 1e9 < fb < 4e9


def test_bus_factors() -> None:
    assert cal._bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert cal._bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert cal._bus_factor("reduce_scatter", 4) == pytest.approx(0.75)
    assert cal._bus_factor("all_to_all", 4) == pytest.approx(0.75)
    assert cal._bus_factor("send_recv", 4) == 1.0


def test_memory_bandwidth_is_the_fastest_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Copies slowed by another process (a run's ranks still exiting) do not halve the rate:
    the fastest of the repeats counts, as STREAM reports it."""
    slowed = [0.044, 0.059, 0.020, 0.076, 0.027, 0.021, 0.050]
    monkeypatch.setattr(cal, "_timed", lambda fn, warmup, repeats, inner=1: slowed[:repeats])
    bw, raw = cal._measure_memory_bw(quick=False, say=lambda _: None)
    assert bw == pytest.approx(2 * raw["bytes_copied"] / 0.020)
    assert raw["best_s"] == 0.020 and raw["median_s"] == 0.044
