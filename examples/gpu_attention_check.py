"""Measure on a real GPU the fused attention rate the cost model prices: every SDPA backend
(FlashAttention-2, cuDNN, memory-efficient), causal and not, head dims 64 and 128, 512 to 64K
tokens, forward and forward+backward; and the forward+backward of zoo blocks at long sequences.

Run on a machine with a CUDA GPU:  python examples/gpu_attention_check.py --out attention.json
Compare with the prediction:       python -m autopar bench block-check --measured attention.json
``--held-out``: other head dims (80, 96, 256) and lengths, no blocks: rows the attention
constants of `cost.hardware` were not fitted on.

FLOPs are counted as the cost model counts them (`autopar.analysis.graph`): the forward's two
matmuls 4*b*h*s*s*d, the backward twice that, a causal mask halving both (the kernels skip the
blocks above the diagonal). Timings: CUDA events, median of repeats after warm-up, random data.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, "examples")
from gpu_block_check import blocks, timed  # noqa: E402

SEQS = [512, 1024, 2048, 4096, 8192, 16384, 32768, 65536]
TOKENS = 32768  # batch x seq per measurement (at least one sequence)
HIDDEN = 4096  # heads x head dim
LONG_BLOCKS = [  # (zoo config, micro-batch, seq, compile?): held out against the GEMM fit
    ("playbook-1b", 1, 16384, False), ("playbook-1b", 1, 32768, False),
    ("llama3-8b", 1, 16384, False), ("llama3-8b", 1, 32768, False),
]


def backends() -> dict:
    from torch.nn.attention import SDPBackend
    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
    return {k: getattr(SDPBackend, v) for k, v in names.items() if hasattr(SDPBackend, v)}


def attention_row(backend: str, sdp, seq: int, head_dim: int, causal: bool, kv_heads: int | None) -> dict:
    from torch.nn.attention import sdpa_kernel
    batch, heads = max(1, TOKENS // seq), HIDDEN // head_dim
    kvh = kv_heads or heads
    q = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(batch, kvh, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(batch, kvh, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    extra = {"enable_gqa": True} if kv_heads else {}
    share = 0.5 if causal else 1.0
    fwd_flops = 4.0 * batch * heads * seq * seq * head_dim * share
    row = {"backend": backend, "seq": seq, "batch": batch, "heads": heads, "kv_heads": kvh,
           "head_dim": head_dim, "causal": causal, "fwd_flops": fwd_flops}
    try:
        with sdpa_kernel([sdp]):
            def fwd():
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra)

            def step():
                F.scaled_dot_product_attention(q, k, v, is_causal=causal, **extra).backward(grad)
            repeat = 5 if seq >= 32768 else 10
            row["fwd_s"] = timed(fwd, warmup=2, repeat=repeat)
            row["fwd_bwd_s"] = timed(step, warmup=2, repeat=repeat)
        row["fwd_tflops"] = fwd_flops / row["fwd_s"] / 1e12
        row["fwd_bwd_tflops"] = 3 * fwd_flops / row["fwd_bwd_s"] / 1e12
    except Exception as exc:  # an unsupported shape or backend: report, keep measuring
        row["error"] = repr(exc)[:200]
    print(f"{backend:9s} s{seq:<6d} d{head_dim:<3d} kv{kvh:<3d} causal={causal!s:5s} "
          f"fwd {row.get('fwd_tflops', float('nan')):6.0f} fwd+bwd {row.get('fwd_bwd_tflops', float('nan')):6.0f} TFLOP/s",
          flush=True)
    return row


def attention(head_dims=(128, 64), seqs=SEQS, extra: bool = True) -> list[dict]:
    out = []
    for name, sdp in backends().items():
        for head_dim in head_dims:
            for seq in seqs:
                out.append(attention_row(name, sdp, seq, head_dim, True, None))
                torch.cuda.empty_cache()
        for seq in (2048, 8192) if extra else ():
            out.append(attention_row(name, sdp, seq, 128, False, None))
            out.append(attention_row(name, sdp, seq, 128, True, 8))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_attention_check.json")
    parser.add_argument("--held-out", action="store_true", help="other head dims and lengths only")
    args = parser.parse_args()
    torch.manual_seed(0)
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"),
            "default_backends": {"flash": torch.backends.cuda.flash_sdp_enabled(),
                                 "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
                                 "efficient": torch.backends.cuda.mem_efficient_sdp_enabled()}}
    print(info, flush=True)
    t0 = time.time()
    if args.held_out:
        results = {"info": info, "attention": attention((80, 96, 256), (1536, 3072, 6144, 12288), False)}
    else:
        results = {"info": info, "attention": attention()}
    print(f"attention sweep {time.time() - t0:.0f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    results["blocks"] = [] if args.held_out else blocks(LONG_BLOCKS)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", args.out, f"in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
