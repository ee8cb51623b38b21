"""Pipeline bubble, in-flight micro-batches and step time against hand values."""

from __future__ import annotations

import pytest

from cost.pipeline import bubble_fraction, in_flight_microbatches, pipeline_step_time


def test_bubble_fractions():
    # p = 4, m = 8: (4-1)/8 = 0.375 for AFAB and 1F1B.
    assert bubble_fraction("afab", 4, 8) == pytest.approx(0.375)
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(0.375)
    # interleaved with v = 2: 3 / (2 * 8) = 0.1875.
    assert bubble_fraction("interleaved-1f1b", 4, 8, virtual_stages=2) == pytest.approx(0.1875)
    # ZB-H1: a third of 1F1B: 3 / (3 * 8) = 0.125.
    assert bubble_fraction("zero-bubble", 4, 8) == pytest.approx(0.125)
    assert bubble_fraction("1f1b", 1, 8) == 0.0
    with pytest.raises(ValueError, match="schedule"):
        bubble_fraction("gpipe2", 4, 8)
    with pytest.raises(ValueError):
        bubble_fraction("1f1b", 0, 8)


def test_in_flight():
    assert in_flight_microbatches("afab", 4, 16) == 16
    assert in_flight_microbatches("1f1b", 4, 16, stage=0) == 4
    assert in_flight_microbatches("1f1b", 4, 16, stage=3) == 1
    assert in_flight_microbatches("1f1b", 8, 4, stage=0) == 4  # never more than m
    assert in_flight_microbatches("zero-bubble", 4, 16) == 4
    assert in_flight_microbatches("zero-bubble", 4, 16, stage=3) == 4  # PyTorch's ZB1P order
    # Interleaved, p = 4, v = 2, stage 0: (2*3 + 1*4 + 1) / 2 = 5.5 = 4 * (1 + 3/(4*2)).
    assert in_flight_microbatches("interleaved-1f1b", 4, 16, 0, 2) == pytest.approx(5.5)
    # last stage: (0 + 4 + 1) / 2 = 2.5
    assert in_flight_microbatches("interleaved-1f1b", 4, 16, 3, 2) == pytest.approx(2.5)
    assert in_flight_microbatches("1f1b", 1, 16) == 1
    with pytest.raises(ValueError):
        in_flight_microbatches("1f1b", 4, 16, stage=4)


def test_step_time():
    # 1F1B, p = 4, m = 8, 10 ms per micro-batch, 1 ms per send: slot = 10 + 2 = 12 ms,
    # total = (8 + 3) x 12 = 132 ms, bubble = 3 x 12 = 36 ms.
    total, bubble = pipeline_step_time(0.010, 0.001, 4, 8, "1f1b")
    assert total == pytest.approx(0.132) and bubble == pytest.approx(0.036)
    # Interleaved v = 2: slot = 10 + 2*2*1 = 14 ms, bubble slots 1.5: total (8 + 1.5) x 14 ms.
    total, bubble = pipeline_step_time(0.010, 0.001, 4, 8, "interleaved-1f1b", 2)
    assert total == pytest.approx(0.133) and bubble == pytest.approx(0.021)
    # Zero-bubble: 1 bubble slot of 12 ms: (8 + 1) x 12 = 108 ms.
    assert pipeline_step_time(0.010, 0.001, 4, 8, "zero-bubble")[0] == pytest.approx(0.108)
    # No pipeline: m x compute, no bubble, no sends.
    assert pipeline_step_time(0.010, 0.001, 1, 8, "1f1b") == (pytest.approx(0.08), 0.0)
