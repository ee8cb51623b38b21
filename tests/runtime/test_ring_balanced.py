"""Load-balanced ring attention (rank r holds sequence chunks r and 2n-1-r of 2n) against one
device's SDPA, simulated in one process: outputs and the gradients of q, k, v, causal or not,
under an explicit mask; and the balance itself (every rank attends the same chunk pairs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from runtime import ring_attention as ra


def _inputs(seed: int, seq: int = 24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, seq, 8, generator=g) for _ in range(4)]  # q, k, v, dout


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _deal(x: torch.Tensor, n: int) -> list[torch.Tensor]:
    """Each rank's chunks r and 2n-1-r of x's sequence (dim 2)."""
    parts = x.chunk(2 * n, dim=2)
    return [torch.cat([parts[r], parts[2 * n - 1 - r]], dim=2) for r in range(n)]


def _undeal(xs: list[torch.Tensor], n: int) -> torch.Tensor:
    chunks = [None] * (2 * n)
    for r, x in enumerate(xs):
        chunks[r], chunks[2 * n - 1 - r] = x.chunk(2, dim=2)
    return torch.cat(chunks, dim=2)


def _mask(seq: int, dtype):
    """A causal mask with a padded start in batch 1 (every query keeps a key)."""
    allowed = torch.ones(2, 1, seq, seq, dtype=torch.bool).tril()
    allowed[1, :, :, :3] = False
    allowed[1, :, :, 0] = True
    return allowed if dtype == torch.bool else torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("how", ["causal", "full", "mask-bool", "mask-float"])
def test_balanced_ring_matches_sdpa(n, how):
    q, k, v, dout = _inputs(n + 7 * len(how))
    causal = how == "causal"
    mask = _mask(q.shape[2], torch.bool if how == "mask-bool" else torch.float32) if how.startswith("mask") else None
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, attn_mask=mask, is_causal=causal)
    want.backward(dout)
    qs, ks, vs, ds = (_deal(t, n) for t in (q, k, v, dout))
    fwd = ra.simulate_ring_forward(qs, ks, vs, causal, mask=mask, balanced=True)
    assert _close(_undeal([o for o, _ in fwd], n), want.detach())
    bwd = ra.simulate_ring_backward(ds, qs, ks, vs, [o for o, _ in fwd], [lse for _, lse in fwd], causal,
                                    mask=mask, balanced=True)
    for i, leaf in enumerate(leaves):
        assert _close(_undeal([b[i] for b in bwd], n), leaf.grad), i


def _causal_pairs(rank: int, n: int, balanced: bool) -> float:
    """(query chunk, key chunk) pairs rank ``rank`` attends over the ring (a diagonal: 1/2),
    in pairs of chunks of S / 2n either way; each ring step is one attention call."""
    total = 0.0
    for source in range(n):
        calls = ra._groups(ra.rank_chunks(rank, n, balanced), ra.rank_chunks(source, n, balanced), True)
        assert len(calls) <= 1, calls
        for qs, bs, causal in calls:
            total += len(qs) ** 2 / 2 if causal else len(qs) * len(bs)
    return total * (1 if balanced else 4)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_balanced_ranks_attend_equal_work(n):
    balanced = [_causal_pairs(r, n, True) for r in range(n)]
    assert len(set(balanced)) == 1 and balanced[0] == 2 * n  # (2n)^2 / 2 pairs over n ranks
    # contiguous blocks: rank r attends r + 1/2 blocks, the last (2n - 1) / n times the average
    contiguous = [_causal_pairs(r, n, False) for r in range(n)]
    assert contiguous[-1] / (sum(contiguous) / n) == pytest.approx((2 * n - 1) / n)
