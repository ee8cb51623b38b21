"""Measure on a real GPU what the cost model predicts: GEMM rates, FP8 against bf16, and the
forward+backward time of transformer blocks of the zoo (eager and torch.compile).

Run on a machine with a CUDA GPU:  python examples/gpu_block_check.py --out results.json
Compare with the prediction:       python -m autopar bench block-check --measured results.json

Needs only torch and autopar.models; timings use CUDA events, median of repeats after warm-up,
on random data (zeros run faster on tensor cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from autopar.models import build, config  # noqa: E402

GEMM_SHAPES = [  # (M tokens, K in, N out): projections of 2048..8192-wide models at 4k..16k tokens
    (4096, 2048, 2048), (4096, 2048, 8192), (4096, 8192, 2048), (4096, 4096, 4096),
    (4096, 4096, 14336), (4096, 14336, 4096), (16384, 4096, 4096), (16384, 4096, 14336),
    (16384, 14336, 4096), (8192, 8192, 8192), (16384, 8192, 28672), (4096, 3072, 8192),
]
BLOCKS = [  # (zoo config, micro-batch, seq, compile?)
    ("playbook-1b", 1, 4096, True), ("playbook-1b", 4, 4096, False),
    ("playbook-3b", 2, 4096, False), ("llama3-8b", 1, 4096, True), ("llama3-8b", 2, 4096, False),
]


def timed(fn, warmup: int = 3, repeat: int = 10) -> float:
    """Median seconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def gemms() -> list[dict]:
    out = []
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        t_bf16 = timed(lambda a=a, b=b: a @ b.t(), repeat=20)
        row = {"m": m, "k": k, "n": n, "bf16_s": t_bf16, "bf16_tflops": 2 * m * n * k / t_bf16 / 1e12}
        try:
            a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
            one = torch.tensor(1.0, device="cuda")
            t_fp8 = timed(lambda a8=a8, b8=b8, one=one: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one,
                                                   out_dtype=torch.bfloat16), repeat=20)
            row.update(fp8_s=t_fp8, fp8_tflops=2 * m * n * k / t_fp8 / 1e12)
            sa = torch.ones(m, 1, device="cuda")
            sb = torch.ones(1, n, device="cuda")
            t_row = timed(lambda a8=a8, b8=b8, sa=sa, sb=sb: torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb,
                                                   out_dtype=torch.bfloat16), repeat=20)
            row.update(fp8_rowwise_s=t_row, fp8_rowwise_tflops=2 * m * n * k / t_row / 1e12)
        except Exception as exc:  # report, keep measuring
            row["fp8_error"] = repr(exc)[:200]
        print(f"gemm {m}x{k}x{n}: bf16 {row['bf16_tflops']:.0f} TFLOP/s, "
              f"fp8 {row.get('fp8_tflops', float('nan')):.0f}, rowwise {row.get('fp8_rowwise_tflops', float('nan')):.0f}",
              flush=True)
        out.append(row)
    return out


def blocks(shapes: list[tuple] = BLOCKS) -> list[dict]:
    """Forward+backward seconds of one block of each (zoo config, micro-batch, seq, compile?)."""
    out = []
    for name, batch, seq, use_compile in shapes:
        cfg = dataclasses.replace(config(name), n_layers=1)
        model = build(cfg, device="cuda", dtype=torch.bfloat16)
        block = model.layers[0]
        x = torch.randn(batch, seq, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn_like(x)

        def step(fn, x=x, grad=grad):
            def run():
                fn(x).backward(grad)
            return run

        def fwd(fn, x=x):
            def run():
                with torch.no_grad():
                    fn(x)
            return run

        row = {"model": name, "batch": batch, "seq": seq,
               "eager_fwd_bwd_s": timed(step(block)), "eager_fwd_s": timed(fwd(block))}
        if use_compile:
            t0 = time.time()
            compiled = torch.compile(block)
            row["compiled_fwd_bwd_s"] = timed(step(compiled))
            row["compile_s"] = time.time() - t0
        print(f"block {name} b{batch} s{seq}: " + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                           if isinstance(v, float)), flush=True)
        out.append(row)
        del model, block, x, grad
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_block_check.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    print(info, flush=True)
    results = {"info": info, "gemms": gemms(), "blocks": blocks()}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
