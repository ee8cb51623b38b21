"""`autopar inspect`: capture a model's training step and report what it costs.

Everything runs on fake tensors: inspecting a 405B model allocates no weight memory.
"""

from __future__ import annotations

import resource
import time
from dataclasses import asdict, dataclass, field

import torch

from autopar import models
from autopar.analysis.graph import GraphAnalysis, analyze
from autopar.capture.joint import TrainingGraph, capture
from autopar.report import fmt_bytes, fmt_count, fmt_flops, table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class InspectReport:
    """The numbers `autopar inspect` prints (all plain data, JSON-ready)."""

    model: str
    batch: int
    seq: int
    dtype: str
    params: int
    published_params: float | None
    forward_flops: float
    backward_flops: float
    flops_per_token: float
    flops_per_token_formula: float  # 6·N' + 12·L·h·s (N' without an untied input embedding)
    saved_bytes: int
    saved_bytes_per_block: float
    saved_bytes_outside_blocks: int
    blocks_prefix: str | None
    blocks: int
    block_classes: int
    nodes: int
    forward_nodes: int
    backward_nodes: int
    top_ops: list[tuple[str, int]] = field(default_factory=list)
    preflight_s: float = 0.0
    capture_s: float = 0.0
    analysis_s: float = 0.0
    peak_rss_bytes: int = 0

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        return asdict(self)


def inspect_model(name: str, batch: int = 1, seq: int = 4096, dtype: str = "bf16") -> tuple[
    InspectReport, TrainingGraph, GraphAnalysis
]:
    """Build a zoo model on the meta device, capture its training step, analyse it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    cfg = models.config(name)
    model = models.build(name, device="meta", dtype=DTYPES[dtype])
    inputs = models.example_inputs(name, batch=batch, seq=seq, device="meta")
    graph = capture(model, inputs)
    t0 = time.perf_counter()
    analysis = analyze(graph)
    analysis_s = time.perf_counter() - t0
    tokens = batch * seq
    n_prime = graph.num_params - (0 if cfg.tied else cfg.vocab * cfg.hidden)
    formula = 6.0 * n_prime + 12.0 * cfg.n_layers * cfg.hidden * seq
    per_layer = analysis.saved_bytes_by_layer()
    outside = per_layer.pop(None, 0)
    phases = [n.phase for n in analysis.nodes.values()]
    top = analysis.op_counts.most_common(8)
    report = InspectReport(
        model=name,
        batch=batch,
        seq=seq,
        dtype=dtype,
        params=graph.num_params,
        published_params=cfg.published_params,
        forward_flops=analysis.forward_flops,
        backward_flops=analysis.backward_flops,
        flops_per_token=(analysis.forward_flops + analysis.backward_flops) / tokens,
        flops_per_token_formula=formula,
        saved_bytes=analysis.saved_bytes,
        saved_bytes_per_block=(sum(per_layer.values()) / len(per_layer)) if per_layer else 0.0,
        saved_bytes_outside_blocks=outside,
        blocks_prefix=analysis.blocks.prefix if analysis.blocks else None,
        blocks=analysis.blocks.count if analysis.blocks else 0,
        block_classes=len(analysis.blocks.classes) if analysis.blocks else 0,
        nodes=len(analysis.nodes),
        forward_nodes=phases.count("forward"),
        backward_nodes=phases.count("backward"),
        top_ops=[(op.replace("aten.", ""), n) for op, n in top],
        preflight_s=graph.preflight_time_s,
        capture_s=graph.capture_time_s,
        analysis_s=analysis_s,
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    return report, graph, analysis


def format_report(r: InspectReport) -> str:
    """The human-readable table of `autopar inspect`."""
    pub = ""
    if r.published_params:
        pub = f"  (published {fmt_count(r.published_params)}, {100 * (r.params / r.published_params - 1):+.2f} %)"
    ratio = r.flops_per_token / r.flops_per_token_formula
    blocks = (
        f"{r.blocks} x {r.blocks_prefix}.*"
        + (" (identical)" if r.block_classes == 1 else f" ({r.block_classes} kinds)")
        if r.blocks
        else "none found"
    )
    rows = [
        ("parameters", fmt_count(r.params) + pub),
        ("forward FLOPs / step", fmt_flops(r.forward_flops)),
        ("backward FLOPs / step", fmt_flops(r.backward_flops)),
        (
            "FLOPs / token",
            f"{fmt_flops(r.flops_per_token)}  (6N'+12Lhs = {fmt_flops(r.flops_per_token_formula)}, "
            f"ratio {ratio:.4f})",
        ),
        ("activations saved", f"{fmt_bytes(r.saved_bytes)} per step"),
        ("  per block", fmt_bytes(r.saved_bytes_per_block)),
        ("  outside blocks", fmt_bytes(r.saved_bytes_outside_blocks) + "  (embeddings, head, loss)"),
        ("repeated blocks", blocks),
        ("graph nodes", f"{r.nodes:,}  (forward {r.forward_nodes:,}, backward {r.backward_nodes:,})"),
        ("most frequent ops", ", ".join(f"{op} {n}" for op, n in r.top_ops[:6])),
        (
            "capture time",
            f"{r.capture_s:.1f} s  (fake forward {r.preflight_s:.1f} s, joint trace "
            f"{r.capture_s - r.preflight_s:.1f} s); "
            f"analysis {r.analysis_s:.1f} s",
        ),
        ("peak RSS", fmt_bytes(r.peak_rss_bytes)),
    ]
    head = f"autopar inspect: {r.model}, batch {r.batch} x seq {r.seq} = {r.batch * r.seq:,} tokens, {r.dtype}"
    return head + "\n" + table(["quantity", "value"], rows)
