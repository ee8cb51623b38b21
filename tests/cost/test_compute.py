"""Roofline op times: hand values, and the GEMM model against H200 measurements."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cost.compute import (
    GEMM_HALF_EFFICIENCY_FLOPS,
    gemm_efficiency,
    matmul_efficiency,
    op_time,
)
from cost.hardware import GPUS
from cost.precision import recipe

H100 = GPUS["h100"]
PROBE = Path(__file__).resolve().parents[2] / "cost" / "profiles" / "h200_probe.json"


def test_compute_bound_matmul():
    flops = 2 * 8192**3
    # 1.1e12 flops at 989.5e12 x 0.725 (the large-GEMM asymptote measured on an H200).
    expected = flops / (989.5e12 * 0.725)
    assert op_time(flops, 3 * 8192**2 * 2, "bf16", H100, is_matmul=True) == pytest.approx(expected)
    # fp8: twice the peak, at the measured fp8 efficiency.
    t8 = op_time(flops, 0, "fp8", H100, is_matmul=True)
    assert t8 == pytest.approx(flops / (1979e12 * H100.efficiency("fp8")))
    assert expected / t8 == pytest.approx(1979 * 0.665 / (989.5 * 0.725), rel=1e-3)


def test_memory_bound_and_vector_ops():
    # 1 GB read+written at 3.35 TB/s x 0.896 -> 0.333 ms.
    assert op_time(1e8, 1e9, "bf16", H100, is_matmul=False) == pytest.approx(
        1e9 / (3.35e12 * 4.3 / 4.8)
    )
    # Pure arithmetic off the tensor cores runs at the 67 TFLOP/s fp32 vector rate.
    assert op_time(67e9, 0, "bf16", H100, is_matmul=False) == pytest.approx(1e-3)


def test_floor_and_zero():
    assert op_time(10, 10, "bf16", H100, is_matmul=False) == H100.kernel_floor_s
    assert op_time(0, 0, "bf16", H100, is_matmul=False) == 0.0


def test_bad_dtype():
    with pytest.raises(ValueError, match="no hardware fp8"):
        op_time(1e9, 1e6, "fp8", GPUS["a100"], is_matmul=True)
    with pytest.raises(ValueError, match="unknown dtype"):
        op_time(1e9, 1e6, "int4", H100, is_matmul=True)
    with pytest.raises(ValueError):
        op_time(-1, 0, "bf16", H100, is_matmul=True)


def test_matmul_efficiency_grows_with_gemm_size():
    # eff(F) = eff_max * F / (F + F_half): half the asymptote at F = F_half, near it for big GEMMs
    half = GEMM_HALF_EFFICIENCY_FLOPS["bf16"]
    assert gemm_efficiency(half, H100) == pytest.approx(0.5 * H100.matmul_efficiency)
    big = matmul_efficiency(8192, 8192, 8192, H100)
    assert 0.98 * H100.matmul_efficiency < big < H100.matmul_efficiency
    assert matmul_efficiency(128, 4096, 4096, H100) < matmul_efficiency(4096, 4096, 4096, H100)
    assert recipe("fp8").matmul_dtype == "fp8"


def test_gemm_curve_against_eager_h200_gemms():
    """The curve against the eager GEMM timings it was fitted to (12 shapes, bf16 and fp8)."""
    data = json.loads((PROBE.parent / "h200_block_check.json").read_text())
    errs = []
    for g in data["gemms"]:
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        for dtype in ("bf16", "fp8"):
            model = flops / (GPUS["h200"].peak(dtype) * gemm_efficiency(flops, GPUS["h200"], dtype))
            errs.append(abs(model / g[f"{dtype}_s"] - 1))
    assert sum(errs) / len(errs) < 0.06 and max(errs) < 0.2


def test_gemm_model_against_h200_probe():
    """The plain roofline against 23 bf16 GEMMs replayed in a CUDA graph (no launch cost).

    Under graph replay the small-GEMM penalty of the eager curve (about 25 us per GEMM) goes
    away, so the roofline at the large-GEMM efficiency alone should hold. The reference
    efficiency is that probe's own 8192^3 rate so that only the shape dependence is tested.
    """
    probe = json.loads(PROBE.read_text())["data"]
    gemms = probe["gemm_bf16"]
    ref = next(g for g in gemms if g["m"] == g["n"] == g["k"] == 8192)
    peak = GPUS["h200"].peak("bf16")
    copy = max(b["copy_TBs"] for b in probe["bandwidth"]) * 1e12
    gpu = dataclasses.replace(
        GPUS["h200"],
        matmul_efficiency=2 * 8192**3 / ref["graph_s"] / peak,
        memory_efficiency=copy / GPUS["h200"].memory_bw,
        kernel_floor_s=probe["floor_graph_s"],
    )
    errs = []
    for g in gemms:
        m, n, k = g["m"], g["n"], g["k"]
        if 2 * m * n * k < 1e9:
            continue  # tiny GEMMs sit on the per-op floor in practice
        t = op_time(2 * m * n * k, 2 * (m * k + k * n + m * n), "bf16", gpu, is_matmul=True)
        errs.append(abs(t / g["graph_s"] - 1))
    mean = sum(errs) / len(errs)
    # worst: 128 x 4096 x 4096 (too few output tiles to fill 132 SMs: wave quantisation)
    assert mean < 0.2 and max(errs) < 0.5
