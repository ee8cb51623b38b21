"""GPU specs, cluster profiles and the calibration file."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
from pricing import priced

from cost.calibration import Calibration, load_calibration, save_calibration
from cost.cluster import PROFILES, Cluster, Link
from cost.hardware import GPUS, get_gpu
from cost.params import CostParams


def test_datasheet_peaks():
    h100, h200, a100 = GPUS["h100"], GPUS["h200"], GPUS["a100"]
    assert h100.peak("bf16") == 989.5e12  # the playbook's MFU peak
    assert h100.peak("fp8") == pytest.approx(2 * 989.5e12)  # datasheet 1979 = 2x bf16
    assert h100.memory_bytes == 80e9 and h100.memory_bw == 3.35e12
    assert h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes == 141e9 and h200.memory_bw == 4.8e12
    assert a100.peak("bf16") == 312e12 and a100.memory_bw == 2.039e12
    with pytest.raises(ValueError, match="no hardware fp8"):
        a100.peak("fp8")


def test_efficiencies_are_the_h200_measurements():
    # large-GEMM asymptote fitted to the H200 GEMMs; 4.3 TB/s of 4.8.
    for name in ("h100", "h200", "a100"):
        assert GPUS[name].matmul_efficiency == pytest.approx(0.725, abs=1e-3)
        assert GPUS[name].memory_efficiency == pytest.approx(0.896, abs=1e-3)
    # large-GEMM asymptotes fitted on the H200: fp8 1316 vs bf16 717 TFLOP/s, 1.83x, not 2x.
    h = GPUS["h200"]
    ratio = h.peak("fp8") * h.efficiency("fp8") / (h.peak("bf16") * h.efficiency("bf16"))
    assert ratio == pytest.approx(1979 * 0.665 / (989.5 * 0.725), rel=1e-3)
    for spec in GPUS.values():
        assert spec.source


def test_get_gpu_errors_list_names():
    assert get_gpu("H100") is GPUS["h100"]
    with pytest.raises(ValueError, match="known:.*'h100'.*did you mean 'h100'"):
        get_gpu("h10")


def test_cluster_profiles_and_validation():
    c = Cluster("h100", nodes=4)
    assert c.world_size == 32 and c.gpu is GPUS["h100"]
    assert c.intra.bandwidth == 450e9 and c.inter.bandwidth == 50e9
    assert not c.calibrated
    efa = Cluster("h100-efa", nodes=2)
    assert efa.calibrated and set(efa.busbw_curves) == {
        "all_reduce",
        "all_gather",
        "reduce_scatter",
    }
    assert efa.busbw_curves["all_reduce"][0] == (1.0, 436e9)
    for name in PROFILES:
        cl = Cluster(name)
        assert cl.intra.source and cl.inter.source and cl.source
        assert cl.name in cl.describe()
    with pytest.raises(ValueError, match="did you mean 'h100-efa'|Did you mean 'h100-efa'"):
        Cluster("h100-ef")
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        Cluster("h100", nodes=0)
    with pytest.raises(ValueError, match="gpus_per_node must be an integer >= 1"):
        Cluster("h100", gpus_per_node=0)
    with pytest.raises(ValueError, match="unknown fields"):
        Cluster("h100", bogus=1)


def test_cluster_overrides_and_roundtrip():
    c = Cluster("h100", nodes=2, gpu="h200", inter=Link(25e9, 3e-6, "test"))
    assert c.gpu is GPUS["h200"] and c.inter.bandwidth == 25e9
    for cl in (c, Cluster("h100-efa", nodes=8)):
        data = json.loads(json.dumps(cl.to_dict()))
        assert Cluster.from_dict(data) == cl


def test_local_without_file_warns(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(tmp_path / "missing.json"))
    with pytest.warns(UserWarning, match="autopar calibrate"):
        c = Cluster.local()
    assert c.nodes == 1 and 1 <= c.gpus_per_node <= 4
    assert c.gpu.memory_bytes > 0


def test_local_from_calibration(tmp_path, monkeypatch):
    data = {
        "version": 1,
        "host": "box",
        "date": "2026-11-29",
        "world_size": 4,
        "matmul_flops": {"fp32": 1.5e11, "bf16": 4e10},
        "memory_bw": 1.0e10,
        "kernel_floor_s": 2e-5,
        "collectives": {
            "all_reduce": {"latency_s": 1e-4, "busbw": 1e9},
            "all_gather": {"latency_s": 6e-5, "busbw": 8e8},
        },
        "torch": "2.13.0",  # extra keys `autopar calibrate` writes are kept
        "raw": {"quick": True},
    }
    path = save_calibration(data, tmp_path / "cal.json")
    assert load_calibration(path) == Calibration.from_dict(data)
    assert json.loads(path.read_text()) == data  # round trip, extras included
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = Cluster.local()
    assert c.gpu.name == "cpu-local" and c.gpus_per_node == 4
    assert c.gpu.peak("fp32") == 1.5e11 and c.gpu.kernel_floor_s == 2e-5
    assert c.intra.bandwidth == 1e9
    assert c.intra_efficiency["all_gather"] == pytest.approx(0.8)
    assert Cluster.from_dict(c.to_dict()) == c
    # a file from before the overlap was measured keeps the default slowdown; a measured one
    # is the local cluster's
    assert c.params.overlap_slowdown == CostParams().overlap_slowdown
    path = save_calibration({**data, "overlap": {"slowdown": 0.7},
                             "pipeline": {"overhead_s": 2e-3}}, tmp_path / "cal2.json")
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(path))
    measured = Cluster.local()
    assert measured.params.overlap_slowdown == 0.7 and measured.params.p2p_overhead_s == 2e-3
    for bad in ({"slowdown": 1.5}, {"slowdown": None}, "fast"):
        with pytest.raises(ValueError, match="overlap .* re-run `autopar calibrate`"):
            Calibration.from_dict({**data, "overlap": bad})


def test_local_ranks_share_the_cores(tmp_path, monkeypatch):
    data = {
        "version": 1, "world_size": 2, "matmul_flops": {"fp32": 2e11}, "memory_bw": 2e10,
        "kernel_floor_s": 2e-6, "collectives": {"all_reduce": {"latency_s": 1e-3, "busbw": 1e9}},
        "raw": {"threads": {"intra_op": 2, "cpu_count": 2}},  # measured with 2 threads on 2 cores
    }
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(save_calibration(data, tmp_path / "cal.json")))
    alone = Cluster.local(ranks=1)
    assert alone.gpu.peak("fp32") == 2e11 and alone.gpu.kernel_floor_s == 2e-6
    two = Cluster.local()  # the calibration's 2 ranks, one thread each: one core each
    assert two.gpus_per_node == 2 and two.gpu.peak("fp32") == pytest.approx(1e11)
    four = Cluster.local(ranks=4)  # half a core each; tiny ops wait their turn as well
    assert four.gpus_per_node == 4 and four.gpu.peak("fp32") == pytest.approx(5e10)
    assert four.gpu.memory_bw == pytest.approx(5e9) and four.gpu.kernel_floor_s == pytest.approx(4e-6)
    assert "0.25" in four.gpu.source
    # the fits are re-expressed at 4 ranks: an all-reduce ring has 6 steps there, 2 at 2 ranks
    assert four.collective_fits["all_reduce"].latency_s == pytest.approx(3e-3)
    assert two.collective_fits["all_reduce"].latency_s == pytest.approx(1e-3)
    # with half the ranks busy (a pipeline's bubble) each busy one gets a whole core again
    assert four.host_share.busy_speedup(4, 0.5) == pytest.approx(2.0)
    assert four.host_share.busy_speedup(4, 1.0) == pytest.approx(1.0)
    assert four.host_share.busy_speedup(4, 0.25) == pytest.approx(2.0)  # one thread per rank
    assert Cluster.from_dict(four.to_dict()).host_share == four.host_share
    assert four.params.p2p_overhead_s == 0.0  # the file has no pipeline measurement


def test_local_pipelines_priced_as_they_run(tmp_path, monkeypatch):
    """Local ranks: a pipeline's stages compute faster than with every rank busy, and each
    transfer pays the calibrated overhead."""
    from autopar import models
    from autopar.search.choices import choose
    from autopar.search.step import captured_step
    from cost import Layout
    from cost.terms.compute import compute_per_stage, step_node_times

    data = {
        "version": 1, "world_size": 4, "matmul_flops": {"fp32": 2e11}, "memory_bw": 2e10,
        "kernel_floor_s": 2e-6, "collectives": {"send_recv": {"latency_s": 1e-5, "busbw": 1e9}},
        "pipeline": {"overhead_s": 3e-5},
        "raw": {"threads": {"intra_op": 2, "cpu_count": 2}},
    }
    monkeypatch.setenv("AUTOPAR_CALIBRATION", str(save_calibration(data, tmp_path / "cal.json")))
    four = Cluster.local()
    assert four.params.p2p_overhead_s == 3e-5
    batch = models.example_inputs("tiny-llama", batch=8, seq=16, device="meta")
    facts = captured_step(models.build("tiny-llama", device="meta"), batch, None, None, fused=False).facts()
    lay = Layout(pp=2, dp=2, microbatch=1, grad_accum=4, precision="fp32")
    shared = priced(facts, four, lay)
    alone = Cluster.local()
    alone.host_share = None  # as if each rank had its own core budget
    plain = priced(facts, alone, lay)
    # 1F1B, 2 stages, 4 micro-batches, two pipelines side by side on 4 ranks and 2 cores: the
    # fill (drain) slot runs the first (last) stage's 2 ranks alone, a core each; the 3 full
    # slots share the cores until the lighter stage's ranks finish: with t0 <= t1 (seconds per
    # micro-batch, every rank busy) 2 (t0 + t1) in 5 slots of t1
    lay = choose(facts, alone, lay)
    t = sum(compute_per_stage(facts, alone, lay, step_node_times(facts, alone, lay)))
    assert t.shape == (2,) and 0.5 < t.min() / t.max() < 1.0  # the last stage holds the head
    assert shared.time_breakdown["compute_s"] == pytest.approx(
        plain.time_breakdown["compute_s"] * 2 * t.sum() / (5 * t.max()))
    # two transfers per micro-batch, each 30 us beyond its bytes
    assert shared.time_breakdown["pp_p2p_s"] >= 4 * 2 * 3e-5


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved-1f1b"])
def test_local_pipeline_handoff_waits_never_make_a_step_faster(tmp_path, monkeypatch, schedule):
    """A peer descheduled at each hand-off (`HostShare.wait_per_compute`) waits on the step: the
    price grows with the wait (the core-sharing factor does not depend on it), and the search's
    lower bound (`autopar.search.bound`) stays below the price at every wait."""
    from autopar import models
    from autopar.search.bound import step_time_lower_bound
    from autopar.search.step import captured_step
    from cost import Layout

    cfg = dataclasses.replace(models.config("tiny-llama"), n_layers=4)
    batch = models.example_inputs(cfg, batch=64, seq=64, device="meta")
    facts = captured_step(models.build(cfg, device="meta"), batch, None, None, fused=False).facts()
    lay = Layout(pp=2, dp=2, microbatch=8, grad_accum=4, precision="fp32", schedule=schedule,
                 virtual_stages=2 if schedule == "interleaved-1f1b" else 1)
    steps = []
    for wait in (0.0, 0.05, 0.1, 0.5):
        data = {
            "version": 1, "world_size": 4, "matmul_flops": {"fp32": 2e11}, "memory_bw": 2e10,
            "kernel_floor_s": 2e-6, "collectives": {"send_recv": {"latency_s": 1e-5, "busbw": 1e9}},
            "pipeline": {"overhead_s": 3e-4, "wait_per_compute": wait},
            "raw": {"threads": {"intra_op": 2, "cpu_count": 2}},
        }
        monkeypatch.setenv("AUTOPAR_CALIBRATION", str(save_calibration(data, tmp_path / f"c{wait}.json")))
        four = Cluster.local()
        steps.append(priced(facts, four, lay).step_time_s)
        assert step_time_lower_bound(facts, four, lay) <= steps[-1] * (1 + 1e-9)
    assert steps == sorted(steps) and steps[-1] > steps[0]


def test_calibration_rejects_bad_files(tmp_path):
    with pytest.raises(ValueError, match="version"):
        Calibration.from_dict({"version": 2})
    with pytest.raises(ValueError, match="lacks 'memory_bw'"):
        Calibration.from_dict(
            {
                "version": 1,
                "world_size": 2,
                "matmul_flops": {"fp32": 1.0},
                "kernel_floor_s": 1e-5,
                "collectives": {},
            }
        )
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="autopar calibrate"):
        load_calibration(bad)


def test_detect_without_gpus_names_the_alternatives():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: detect() returns its cluster")
    with pytest.raises(ValueError, match=r"Cluster\.local\(\)"):
        Cluster.detect()
