"""`bench block-check`'s labels: the GEMMs of the measurement the cost model's GEMM
efficiencies were fitted on are in-sample; another measurement's are held out."""

from __future__ import annotations

import json

from bench.block import (
    DEFAULT_MEASURED,
    HELD_OUT,
    IN_SAMPLE,
    block_check,
    format_block_check,
)


def _one_gemm(path) -> None:
    gemm = {"m": 4096, "k": 2048, "n": 2048, "bf16_s": 5e-5}
    path.write_text(json.dumps({"info": {"device": "test"}, "gemms": [gemm], "blocks": []}))


def test_default_measurement_exists():
    assert DEFAULT_MEASURED.is_file()  # ships with cost's profiles


def test_gemms_of_the_fitted_file_are_in_sample(tmp_path):
    fitted = tmp_path / DEFAULT_MEASURED.name
    _one_gemm(fitted)
    result = block_check(fitted)
    assert result["gemm_sample"] == IN_SAMPLE and result["gemms"][0]["sample"] == IN_SAMPLE
    assert "GEMM_HALF_EFFICIENCY_FLOPS" in result["gemm_fitted_by"]
    assert IN_SAMPLE in format_block_check(result)


def test_gemms_of_another_measurement_are_held_out(tmp_path):
    other = tmp_path / "h200_block_check_other_run.json"
    _one_gemm(other)
    result = block_check(other)
    assert result["gemm_sample"] == HELD_OUT and result["gemm_fitted_by"] is None
    assert result["gemms"][0]["ratio"] > 0
    assert f"({HELD_OUT})" in format_block_check(result)
