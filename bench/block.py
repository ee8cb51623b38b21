"""`autopar bench block-check`: the cost model's predicted forward+backward time of single
transformer blocks against times measured on a GPU by examples/gpu_block_check.py.

The default measurement (cost/profiles/h200_block_check.json) is also what the cost
model's GEMM efficiencies were fitted on (cost/compute.py GEMM_HALF_EFFICIENCY_FLOPS, the bf16
and fp8 asymptotes in cost/hardware.py): its GEMM rows are in-sample, its block rows held out
(the blocks were checked, not fitted). A measurement from another run is held out throughout.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from autopar import models
from autopar.analysis.graph import analyze
from autopar.capture.joint import capture
from autopar.report import table
from autopar.search.facts import build_step_facts
from cost import Cluster, Layout
from cost.cluster import PROFILE_DIR
from cost.compute import gemm_efficiency
from cost.step import node_times
from cost.terms.compute import attention_efficiency

# The measurement ships with the cost model's profiles (package data of `cost`).
DEFAULT_MEASURED = PROFILE_DIR / "h200_block_check.json"
# Measurement files whose GEMMs the cost model's GEMM efficiencies were fitted on (by name:
# the file is copied, not regenerated, so its name identifies the run).
GEMM_FIT_FILES = frozenset({DEFAULT_MEASURED.name})
# The measurement `cost.hardware`'s attention constants were fitted on (by name, as above)
ATTENTION_FIT_FILES = frozenset({"h200_attention_check.json"})
GEMM_FITTED_BY = ("GEMM_HALF_EFFICIENCY_FLOPS (cost/compute.py) and the bf16/fp8 efficiency "
                  "asymptotes (cost/hardware.py) were fitted on these GEMMs")
IN_SAMPLE = "in-sample (fitted)"
HELD_OUT = "held out"


def predicted_block_time(name: str, batch: int, seq: int, cluster: Cluster, fused: bool) -> float:
    """Predicted seconds of one block's forward+backward (bf16, one device)."""
    cfg = models.config(name)
    cfg = dataclasses.replace(cfg, n_layers=2, max_seq=max(cfg.max_seq, seq))
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    graph = capture(model, models.example_inputs(cfg, batch=batch, seq=seq, device="meta"))
    facts = build_step_facts(graph, analyze(graph), cfg, fused=fused)
    times = node_times(facts, cluster, Layout(microbatch=batch))
    return float(times[facts.layer == 0].sum())


def block_check(measured_path: str | Path = DEFAULT_MEASURED, gpu: str = "h200") -> dict:
    """Rows of predicted against measured block times; eager is priced unfused, compiled fused."""
    measured = json.loads(Path(measured_path).read_text())
    gemm_sample = IN_SAMPLE if Path(measured_path).name in GEMM_FIT_FILES else HELD_OUT
    cluster = Cluster(gpu, nodes=1, gpus_per_node=1)
    rows = []
    for block in measured["blocks"]:
        for key, fused in (("eager_fwd_bwd_s", False), ("compiled_fwd_bwd_s", True)):
            if key not in block:
                continue
            pred = predicted_block_time(block["model"], block["batch"], block["seq"], cluster, fused)
            rows.append({
                "model": block["model"], "batch": block["batch"], "seq": block["seq"],
                "mode": "compiled (fused)" if fused else "eager",
                "measured_s": block[key], "predicted_s": pred, "ratio": pred / block[key],
                "sample": HELD_OUT,
            })
    gemms = []
    for g in measured.get("gemms", []):
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        for dtype in ("bf16", "fp8"):
            if f"{dtype}_s" in g:
                pred = flops / (cluster.gpu.peak(dtype) * gemm_efficiency(flops, cluster.gpu, dtype))
                gemms.append({"m": g["m"], "k": g["k"], "n": g["n"], "dtype": dtype,
                              "measured_s": g[f"{dtype}_s"], "predicted_s": pred,
                              "ratio": pred / g[f"{dtype}_s"], "sample": gemm_sample})
    return {"device": measured.get("info", {}), "blocks": rows, "gemms": gemms,
            "attention": attention_rows(measured, cluster, Path(measured_path).name in ATTENTION_FIT_FILES),
            "gemm_sample": gemm_sample,
            "gemm_fitted_by": GEMM_FITTED_BY if gemm_sample == IN_SAMPLE else None}


def attention_rows(measured: dict, cluster: Cluster, fitted_file: bool) -> list[dict]:
    """Predicted against measured fused attention (forward + backward) of a measurement's
    "attention" rows: FlashAttention-2 at `CostParams.attention_efficiency` 1 (a kernel run
    alone), cuDNN's as the GPU's native kernel; ``fitted_file``: the measurement whose causal
    rows of equal heads `cost.hardware`'s attention constants were fitted on."""
    gpu, out = cluster.gpu, []
    for r in measured.get("attention", []):
        if r["backend"] not in ("flash", "cudnn") or "fwd_bwd_s" not in r:
            continue
        native = r["backend"] == "cudnn"
        eff = attention_efficiency(gpu, r["seq"], 1.0, native=native, head_dim=r["head_dim"])
        fitted = fitted_file and r["causal"] and r["kv_heads"] == r["heads"]
        kind = ("causal" if r["causal"] else "full") + (" GQA" if r["kv_heads"] != r["heads"] else "")
        predicted = 3 * r["fwd_flops"] / (gpu.peak("bf16") * eff)
        out.append({"backend": r["backend"], "seq": r["seq"], "head_dim": r["head_dim"], "kind": kind,
                    "measured_s": r["fwd_bwd_s"], "predicted_s": predicted, "ratio": predicted / r["fwd_bwd_s"],
                    "sample": IN_SAMPLE if fitted else HELD_OUT})
    return out


def format_block_check(result: dict) -> str:
    """Tables of the block and GEMM comparisons."""
    blocks = table(
        ["model", "batch", "seq", "mode", "measured ms", "predicted ms", "pred/meas", "sample"],
        [[r["model"], r["batch"], r["seq"], r["mode"], f"{r['measured_s'] * 1e3:.2f}",
          f"{r['predicted_s'] * 1e3:.2f}", f"{r['ratio']:.2f}", r.get("sample", HELD_OUT)]
         for r in result["blocks"]],
        "lrrlrrrl",
    )
    g = result["gemms"]
    ratios = np.array([r["ratio"] for r in g]) if g else np.array([1.0])
    gemm_line = f"GEMMs: {len(g)} shapes, predicted/measured mean {ratios.mean():.2f}, " \
                f"min {ratios.min():.2f}, max {ratios.max():.2f}"
    if result.get("gemm_sample"):
        gemm_line += f" ({result['gemm_sample']}" + (
            f": {result['gemm_fitted_by']})" if result.get("gemm_fitted_by") else ")")
    fp8 = {(r["m"], r["k"], r["n"]): r["measured_s"] for r in g if r["dtype"] == "fp8"}
    speedups = [r["measured_s"] / fp8[(r["m"], r["k"], r["n"])] for r in g
                if r["dtype"] == "bf16" and (r["m"], r["k"], r["n"]) in fp8]
    fp8_line = (f"FP8 _scaled_mm over bf16, measured: mean {np.mean(speedups):.2f}x "
                f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x)") if speedups else ""
    head = f"block check on {result['device'].get('device', '?')} ({result['device'].get('date', '')})"
    att = result.get("attention", [])
    attention = table(
        ["kernel", "seq", "head dim", "mask", "measured ms", "predicted ms", "pred/meas", "sample"],
        [[r["backend"], r["seq"], r["head_dim"], r["kind"], f"{r['measured_s'] * 1e3:.3f}",
          f"{r['predicted_s'] * 1e3:.3f}", f"{r['ratio']:.2f}", r["sample"]] for r in att],
        "lrrlrrrl",
    ) if att else ""
    return "\n".join(x for x in [head, blocks, gemm_line, fp8_line, attention] if x)
