"""Check ring attention's CUDA blocks on a real GPU: the ring (runtime/ring_attention.py, its
ranks simulated in one process) against one device's SDPA in fp32, with FlashAttention-2's
kernels and with the plain-matmul blocks, causal and full, contiguous and load-balanced, with
and without grouped-query K/V; then the time of both at 16K tokens.

Run on a machine with a CUDA GPU:  python examples/gpu_ring_check.py
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from runtime import ring_attention as ra  # noqa: E402

FUSED = ra._fused


def PLAIN(q, mask) -> bool:  # noqa: N802  (the blocks' plain-matmul path, for comparison)
    return False


def _reference(q, k, v, causal, dout):
    q, k, v = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out.backward(dout.float())
    return out.detach(), q.grad, k.grad, v.grad


def _split(t, n, balanced):
    if not balanced:
        return list(t.chunk(n, dim=2))
    c = t.chunk(2 * n, dim=2)
    return [torch.cat([c[r], c[2 * n - 1 - r]], dim=2) for r in range(n)]


def _join(parts, n, balanced):
    if not balanced:
        return torch.cat(parts, dim=2)
    h = [p.chunk(2, dim=2) for p in parts]
    return torch.cat([h[r][0] for r in range(n)] + [h[r][1] for r in reversed(range(n))], dim=2)


def _ring(qs, ks, vs, ds, causal, balanced, group=1):
    fw = ra.simulate_ring_forward(qs, ks, vs, causal, balanced=balanced, kv_group=group)
    bw = ra.simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fw], [lse for _, lse in fw], causal,
                                   balanced=balanced, kv_group=group)
    return fw, bw


def accuracy(n: int = 4) -> float:
    """Worst relative error (norm) of O, dQ and the kv heads' dK, dV with the flash blocks."""
    worst = 0.0
    for name, fused in (("flash kernels", FUSED), ("plain matmuls", PLAIN)):
        ra._fused = fused
        for causal in (True, False):
            for balanced in (False, True):
                for g in (1, 4):
                    q = torch.randn(2, 8, 512, 128, device="cuda", dtype=torch.bfloat16)
                    k, v = (torch.randn(2, 8 // g, 512, 128, device="cuda", dtype=torch.bfloat16)
                            .repeat_interleave(g, dim=1) for _ in range(2))
                    dout = torch.randn_like(q)
                    want = _reference(q, k, v, causal, dout)
                    fw, bw = _ring(*(_split(t, n, balanced) for t in (q, k, v, dout)), causal, balanced, g)
                    got = [_join([o for o, _ in fw], n, balanced)] + [_join([b[i] for b in bw], n, balanced)
                                                                    for i in range(3)]
                    got[2:] = [ra._group_sum(t.float(), g) for t in got[2:]]
                    wanted = [*want[:2], *(ra._group_sum(t, g) for t in want[2:])]
                    rel = [((a.float() - b).norm() / b.norm()).item() for a, b in zip(got, wanted)]
                    print(f"{name}: causal={causal} balanced={balanced} kv_group={g}: relative error "
                          f"O, dQ, dK, dV " + ", ".join(f"{r:.2e}" for r in rel), flush=True)
                    if fused is FUSED:
                        worst = max(worst, *rel)
    ra._fused = FUSED
    return worst


def timing(n: int = 4, seq: int = 16384) -> None:
    """Forward + backward seconds of the whole ring (every rank, one process) both ways."""
    q, k, v, d = (torch.randn(1, 32, seq, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    parts = [_split(t, n, True) for t in (q, k, v, d)]
    flops = 3 * 4 * 32 * seq * seq * 128 * 0.5  # the cost model's count: causal, backward 2x
    for name, fused in (("flash kernels", FUSED), ("plain matmuls", PLAIN)):
        ra._fused = fused
        times = []
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            _ring(*parts, True, True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        t = sorted(times[1:])[1]
        print(f"{name}: {n} ranks, {seq} tokens, 32 heads of 128, causal, balanced: {t * 1e3:.1f} ms "
              f"forward+backward, {flops / t / 1e12:.0f} TFLOP/s", flush=True)
    ra._fused = FUSED


if __name__ == "__main__":
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), torch.__version__)
    print(f"worst relative error with the flash blocks: {accuracy():.2e}")
    timing()
