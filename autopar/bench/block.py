"""`autopar bench block-check`: the cost model's predicted forward+backward time of single
transformer blocks against times measured on a GPU by examples/gpu_block_check.py."""

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
from cost.step import node_times

DEFAULT_MEASURED = Path(__file__).resolve().parent.parent / "cost" / "profiles" / "h200_block_check_2026-11-29.json"


def predicted_block_time(name: str, batch: int, seq: int, cluster: Cluster, fused: bool) -> float:
    """Predicted seconds of one block's forward+backward (bf16, one device)."""
    cfg = dataclasses.replace(models.config(name), n_layers=2)
    model = models.build(cfg, device="meta", dtype=torch.bfloat16)
    graph = capture(model, models.example_inputs(cfg, batch=batch, seq=seq, device="meta"))
    facts = build_step_facts(graph, analyze(graph), cfg, fused=fused)
    times = node_times(facts, cluster, Layout(microbatch=batch))
    return float(times[facts.layer == 0].sum())


def block_check(measured_path: str | Path = DEFAULT_MEASURED, gpu: str = "h200") -> dict:
    """Rows of predicted against measured block times; eager is priced unfused, compiled fused."""
    measured = json.loads(Path(measured_path).read_text())
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
            })
    gemms = []
    for g in measured.get("gemms", []):
        flops = 2.0 * g["m"] * g["n"] * g["k"]
        for dtype in ("bf16", "fp8"):
            if f"{dtype}_s" in g:
                from cost.compute import gemm_efficiency

                pred = flops / (cluster.gpu.peak(dtype) * gemm_efficiency(flops, cluster.gpu, dtype))
                gemms.append({"m": g["m"], "k": g["k"], "n": g["n"], "dtype": dtype,
                              "measured_s": g[f"{dtype}_s"], "predicted_s": pred,
                              "ratio": pred / g[f"{dtype}_s"]})
    return {"device": measured.get("info", {}), "blocks": rows, "gemms": gemms}


def format_block_check(result: dict) -> str:
    """Tables of the block and GEMM comparisons."""
    blocks = table(
        ["model", "batch", "seq", "mode", "measured ms", "predicted ms", "pred/meas"],
        [[r["model"], r["batch"], r["seq"], r["mode"], f"{r['measured_s'] * 1e3:.2f}",
          f"{r['predicted_s'] * 1e3:.2f}", f"{r['ratio']:.2f}"] for r in result["blocks"]],
        "lrrlrrr",
    )
    g = result["gemms"]
    ratios = np.array([r["ratio"] for r in g]) if g else np.array([1.0])
    gemm_line = f"GEMMs: {len(g)} shapes, predicted/measured mean {ratios.mean():.2f}, " \
                f"min {ratios.min():.2f}, max {ratios.max():.2f}"
    fp8 = {(r["m"], r["k"], r["n"]): r["measured_s"] for r in g if r["dtype"] == "fp8"}
    speedups = [r["measured_s"] / fp8[(r["m"], r["k"], r["n"])] for r in g
                if r["dtype"] == "bf16" and (r["m"], r["k"], r["n"]) in fp8]
    fp8_line = (f"FP8 _scaled_mm over bf16, measured: mean {np.mean(speedups):.2f}x "
                f"(min {min(speedups):.2f}x, max {max(speedups):.2f}x)") if speedups else ""
    head = f"block check on {result['device'].get('device', '?')} ({result['device'].get('date', '')})"
    return "\n".join([head, blocks, gemm_line, fp8_line])
