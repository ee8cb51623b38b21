"""Memory formulas against the playbook's hand values."""

from __future__ import annotations

import pytest

from cost.memory import (
    DDP_BUCKET_BYTES,
    RESERVE_BYTES,
    MemoryBreakdown,
    activation_bytes_formula,
    buffer_bytes,
    model_state_bytes,
)
from cost.precision import recipe

GiB = 2**30


def test_recipes_bytes_per_param():
    assert recipe("bf16", fp32_grad_accum=False).state_bytes == 16  # 2 + 2 + 4 + 8
    assert recipe("bf16", fp32_grad_accum=True).state_bytes == 20  # + 4 fp32 accumulation
    assert recipe("fp32", fp32_grad_accum=True).state_bytes == 16  # 4 + 4 + 8, no master
    fp8 = recipe("fp8", fp32_grad_accum=True)
    assert fp8.state_bytes == 20 and fp8.activation_bytes == 2 and fp8.matmul_dtype == "fp8"
    with pytest.raises(ValueError):
        recipe("int8", False)


@pytest.mark.parametrize(("n", "gb"), [(1e9, 16), (7e9, 112), (70e9, 1120), (405e9, 6480)])
def test_playbook_16_bytes_per_param(n, gb):
    state = model_state_bytes(n, recipe("bf16", False), zero=0, dp=1)
    assert sum(state.values()) == pytest.approx(gb * 1e9)


def test_playbook_8b_model():
    # 8.86B at 16 B/param = 141.8 GB; at 20 B/param = 177.2 GB.
    assert sum(model_state_bytes(8.86e9, recipe("bf16", False), 0, 1).values()) == pytest.approx(
        141.76e9
    )
    assert sum(model_state_bytes(8.86e9, recipe("bf16", True), 0, 1).values()) == pytest.approx(
        177.2e9
    )


@pytest.mark.parametrize("nd", [2, 8, 64])
def test_zero_formulas(nd):
    psi, k = 8.86e9, 12
    expected = {
        0: 2 * psi + 2 * psi + k * psi,
        1: 2 * psi + 2 * psi + k * psi / nd,
        2: 2 * psi + (2 * psi + k * psi) / nd,
        3: (2 * psi + 2 * psi + k * psi) / nd,
    }
    for zero, value in expected.items():
        got = sum(model_state_bytes(psi, recipe("bf16", False), zero, nd).values())
        assert got == pytest.approx(value, rel=0.01)
    # The fp32 accumulation buffer counts as gradients: ZeRO-2 shards it, ZeRO-1 does not.
    r = recipe("bf16", True)
    assert model_state_bytes(psi, r, 1, nd)["grads"] == pytest.approx(6 * psi)
    assert model_state_bytes(psi, r, 2, nd)["grads"] == pytest.approx(6 * psi / nd)
    assert model_state_bytes(psi, r, 2, nd)["optimizer"] == pytest.approx(12 * psi / nd)


def test_activations_llama_8b():
    # L=32, h=4096, a=32, s=4096, b=1: s*b*h*L = 2^29 = 0.5 GiB.
    base = dict(L=32, s=4096, b=1, h=4096, a=32)
    # none: 0.5 GiB x (34 + 5*32*4096/4096 = 194) = 97.0 GiB
    assert activation_bytes_formula(**base) / GiB == pytest.approx(97.0)
    # selective: 0.5 x 34 = 17.0 GiB
    assert activation_bytes_formula(**base, recompute="selective") / GiB == pytest.approx(17.0)
    # full: 2 x 0.5 = 1.0 GiB; the playbook prints 1.02 (within 2 %). Logits are excluded from
    # all three; with v = 128256 they add 4*4096*128256 B = 1.96 GiB.
    full = activation_bytes_formula(**base, recompute="full") / GiB
    assert full == pytest.approx(1.02, rel=0.03)
    logits = activation_bytes_formula(**base, recompute="full", v=128256) / GiB - full
    assert logits == pytest.approx(4 * 4096 * 128256 / GiB)


def test_activations_llama_70b_tp8():
    # L=80, h=8192, a=64, s=4096, b=1, t=8: s*b*h*L = 5 * 2^29 = 2.5 GiB. The playbook's figures
    # are Korthikanti's rows without the attention-score term (selective recompute / flash
    # attention): without SP 2.5 x (10 + 24/8) = 32.5 GiB; with SP 2.5 x 34/8 = 10.625 GiB.
    base = dict(L=80, s=4096, b=1, h=8192, a=64, t=8, recompute="selective")
    assert activation_bytes_formula(**base) / GiB == pytest.approx(32.5)
    assert activation_bytes_formula(**base, sp=True) / GiB == pytest.approx(10.6, abs=0.05)
    # The score term with t=8 adds 2.5 x 5*64*4096/(8192*8) = 50 GiB when nothing recomputes.
    none = activation_bytes_formula(**{**base, "recompute": "none"}) / GiB
    assert none == pytest.approx(32.5 + 50.0)
    # Context parallelism divides by cp.
    assert activation_bytes_formula(**base, sp=True, cp=2) / GiB == pytest.approx(10.625 / 2)


def test_buffers_and_breakdown():
    assert buffer_bytes(dp=1, zero=0) == 0
    assert buffer_bytes(dp=8, zero=1) == 2 * 25 * 2**20 == 2 * DDP_BUCKET_BYTES
    # ZeRO-3 adds two gathered layers: 2 x 218M params (an 8B block) x 2 bytes.
    assert buffer_bytes(dp=8, zero=3, largest_layer_params=218e6) == pytest.approx(
        2 * DDP_BUCKET_BYTES + 4 * 218e6
    )
    m = MemoryBreakdown(params=1, grads=2, optimizer=3, activations=4, buffers=5)
    assert m.reserve == RESERVE_BYTES == 1.5e9
    assert m.total == 15 + 1.5e9
    assert list(m.as_dict()) == [
        "params",
        "grads",
        "optimizer",
        "activations",
        "buffers",
        "reserve",
        "headroom",
    ]
