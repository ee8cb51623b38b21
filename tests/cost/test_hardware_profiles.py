"""The A100-40GB/80GB, H100, H200 and B200 profiles, the "a100" alias, and part overrides."""

import json

import pytest

from autopar import models
from cost.cluster import PART_OVERRIDES, PROFILES, Cluster
from cost.hardware import GPUS, get_gpu
from vocab.layout import Layout


def test_datasheet_numbers_of_each_part():
    a40, a80, b200 = GPUS["a100-40gb"], GPUS["a100-80gb"], GPUS["b200"]
    assert a40.peak_flops == a80.peak_flops and a40.peak("bf16") == 312e12
    assert a40.memory_bytes == 40e9 and a40.memory_bw == 1.555e12
    assert a80.memory_bytes == 80e9 and a80.memory_bw == 2.039e12
    assert b200.peak("bf16") == 2.25e15 and b200.peak("fp8") == 2 * b200.peak("bf16")
    assert b200.memory_bytes == 180e9 and b200.memory_bw == 8e12
    assert "700 W" in GPUS["h100"].name
    for name in ("a100-40gb", "a100-80gb", "b200", "h100", "h200"):
        assert GPUS[name].source and get_gpu(name.upper()) is GPUS[name]


def test_a100_is_an_alias_of_the_80gb_part():
    assert get_gpu("a100") is GPUS["a100-80gb"]
    old, new = Cluster("a100", nodes=2), Cluster("a100-80gb", nodes=2)
    assert old.name == "a100" and old.gpu is new.gpu and old.intra == new.intra
    assert old.inter == new.inter and old.intra_efficiency == new.intra_efficiency


def test_profiles_carry_their_links():
    b = Cluster("b200", nodes=2)
    assert b.intra.bandwidth == 900e9 and "NVLink5" in b.intra.source
    assert b.intra.bandwidth == 2 * Cluster("h100").intra.bandwidth
    assert Cluster("a100-40gb").intra.bandwidth == 300e9
    assert Cluster("a100-40gb").gpu.memory_bytes == 40e9
    for name in PROFILES:
        c = Cluster(name)
        assert c.source and c.intra.source and c.inter.source
        assert Cluster.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_overrides_change_the_part_and_say_so():
    base = Cluster("h100", nodes=4)
    capped = Cluster("h100", nodes=4, overrides={"flops_scale": 0.5, "memory_bytes": 64e9,
                                                 "inter_bandwidth": 25e9})
    assert capped.gpu.peak("bf16") == 0.5 * base.gpu.peak("bf16")
    assert capped.gpu.peak("fp8") == 0.5 * base.gpu.peak("fp8")
    assert capped.gpu.memory_bytes == 64e9 and capped.inter.bandwidth == 25e9
    assert capped.intra == base.intra and "overrid" in capped.source
    custom = Cluster("a100-40gb", overrides={"peak_flops": {"bf16": 200e12}})
    assert custom.gpu.peak("bf16") == 200e12 and custom.gpu.peak("fp32") == 19.5e12
    assert Cluster.from_dict(json.loads(json.dumps(capped.to_dict()))) == capped


@pytest.mark.parametrize("overrides, match", [
    ({"peak_bf16": 1e15}, "unknown keys \\['peak_bf16'\\]; valid keys: peak_flops"),
    ({"memory_bytes": -1}, "memory_bytes must be a positive number"),
    ({"matmul_efficiency": 1.5}, "is a fraction"),
    ({"peak_flops": 1e15}, "takes a dict"),
    ({"peak_flops": {"int4": 1e15}}, "unknown dtypes"),
])
def test_bad_overrides_name_the_valid_keys(overrides, match):
    with pytest.raises(ValueError, match=match):
        Cluster("h100", overrides=overrides)
    assert set(PART_OVERRIDES) >= {"peak_flops", "memory_bytes", "intra_bandwidth"}


def test_a_power_capped_part_prices_slower_and_a_small_memory_does_not_fit():
    """The planner's own prices for the zoo's tiny model: a quarter of the peak is slower."""
    import autopar

    model = models.build("tiny-llama", device="meta")
    inputs = models.example_inputs("tiny-llama", batch=64, seq=64, device="meta")
    lay = Layout(dp=8, microbatch=8, grad_accum=1)

    def plan(**kw):
        return autopar.plan(model, inputs, cluster=Cluster("h100", **kw), layout=lay).predicted

    full, capped = plan(), plan(overrides={"flops_scale": 0.25})
    assert capped.step_time_s > full.step_time_s and full.fits
    assert not plan(overrides={"memory_bytes": 1e6}).fits
